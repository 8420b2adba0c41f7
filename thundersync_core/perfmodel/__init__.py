"""Schedule performance model: analytic bounds, trace predictor, simulator, planner.

- ``analytic``: closed-form sync vs overlapped (thundersync) step times and tail bounds.
- ``trace``: predicted steps of every schedule from a recorded release trace
  (``predict_from_trace`` is what the training benchmark logs beside its measurement).
- ``simulate``: discrete-event simulation of whole runs under the four schedules.
- ``planner``: rollout/learner(/teacher) device splits ranked by throughput.

Pure Python and numpy; nothing here imports torch or ray. Importing the package loads only
the analytic and trace modules (standard library).
"""

from thundersync_core.perfmodel.analytic import finite_sources, predict, speedup_bound, tail_bounds
from thundersync_core.perfmodel.trace import TraceFormatError, predict_from_trace, validate_trace

__all__ = [
    "TraceFormatError",
    "finite_sources",
    "predict",
    "predict_from_trace",
    "speedup_bound",
    "tail_bounds",
    "validate_trace",
]
