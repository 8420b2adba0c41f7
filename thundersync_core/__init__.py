"""ThunderSync core: the RL math and runtime of the pipeline.

The core imports neither Prefect nor MLflow: it emits events and metric records that the
orchestration layer (``tasks/``, ``flows/``) logs.
"""

__version__ = "0.1.0"
