"""Retry policy shared by the I/O tasks (MLflow, Prefect artifacts).

I/O is retried only for causes a second try can fix: a missing file, a bad value or a
conflicting param is the input's fault and fails at once, with its message. (Training has
its own retry, which resumes from the checkpoint: ``tasks.train.run_training``.)
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import get_run_logger
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

__all__ = ["IO_RETRY", "retry_is_useful", "task_logger"]

_INPUT_ERRORS = (FileNotFoundError, FileExistsError, ValueError, KeyError, TypeError)


def retry_is_useful(_task: Any, _task_run: Any, state: Any) -> bool:
    """Retry unless the failure is an input error (see the module docstring)."""
    return not isinstance(state.data, _INPUT_ERRORS)


#: Task options for idempotent I/O: three retries with backoff, no result caching.
IO_RETRY: dict[str, Any] = {
    "retries": 3,
    "retry_delay_seconds": [1, 4, 10],
    "retry_condition_fn": retry_is_useful,
    "cache_policy": NO_CACHE,
}


def task_logger() -> Any:
    """The Prefect run logger inside a run; a plain logger for a task's ``.fn()``."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("thundersync.tasks")
