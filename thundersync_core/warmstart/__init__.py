"""The supervised warm start: reference solutions as agent episodes, then SFT.

``warm_start`` turns the reference solutions of terminal tasks into solved episodes in the
bash agent's exact token format (see ``examples.py``) and fine-tunes a policy on their
action tokens (see ``sft.py``), so that RL starts from a policy whose rewards are not all
zero. The same entry point, run longer, makes the teacher for on-policy distillation::

    from thundersync_core.warmstart import EMBEDDED_FAMILIES, TEACHER_STEPS, warm_start

    student = warm_start(roots, out / "student", families=EMBEDDED_FAMILIES)
    teacher = warm_start(roots, out / "teacher", families=EMBEDDED_FAMILIES,
                         steps=TEACHER_STEPS, tokenizer_from=out / "student")

The teacher scores the student's token ids, so it must share the student's tokenizer
(``tokenizer_from``; the offline tokenizer is also deterministic for a given vocabulary).

What the tiny preset learns in this budget is the training tasks themselves: it reproduces
the reference command of a task it saw, but does not yet copy new file names from an
unseen instruction, so tasks outside the training set (other families, or new tasks of the
same families) stay unsolved after it.

The names below load their module on first use, so ``thundersync --help`` (which imports
the ``warm-start`` command from ``cli.py`` inside this package) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thundersync_core.warmstart.examples import AgentFormat, SolvedEpisode, solve_task
    from thundersync_core.warmstart.sft import (
        EMBEDDED_FAMILIES,
        STUDENT_STEPS,
        TEACHER_STEPS,
        SFTConfig,
        train_sft,
        warm_start,
    )
    from thundersync_core.warmstart.tasks import collect_tasks

_HOMES = {
    "AgentFormat": "examples",
    "SolvedEpisode": "examples",
    "solve_task": "examples",
    "EMBEDDED_FAMILIES": "sft",
    "STUDENT_STEPS": "sft",
    "TEACHER_STEPS": "sft",
    "SFTConfig": "sft",
    "train_sft": "sft",
    "warm_start": "sft",
    "collect_tasks": "tasks",
}
__all__ = [
    "EMBEDDED_FAMILIES",
    "STUDENT_STEPS",
    "TEACHER_STEPS",
    "AgentFormat",
    "SFTConfig",
    "SolvedEpisode",
    "collect_tasks",
    "solve_task",
    "train_sft",
    "warm_start",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
