"""The supervised warm start: reference solutions as agent episodes, then SFT.

``warm_start`` turns the reference solutions of terminal tasks into solved episodes in the
bash agent's exact token format (see ``examples.py``) and fine-tunes a policy on their
action tokens (see ``sft.py``), so that RL starts from a policy whose rewards are not all
zero. The same entry point, run longer, makes the teacher for on-policy distillation.
"""

from thundersync_core.warmstart.examples import AgentFormat, SolvedEpisode, solve_task
from thundersync_core.warmstart.sft import SFTConfig, train_sft, warm_start
from thundersync_core.warmstart.tasks import collect_tasks

__all__ = [
    "AgentFormat",
    "SFTConfig",
    "SolvedEpisode",
    "collect_tasks",
    "solve_task",
    "train_sft",
    "warm_start",
]
