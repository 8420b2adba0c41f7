"""What the console shows while a flow runs: one line per stage, the full logs in a file.

``quiet_console(log_file)`` (the CLI calls it) sends every INFO record (Prefect's task and
flow lines, printed output of the stages, vLLM's engine lines) to ``log_file`` and leaves
the console only warnings and errors, plus the progress lines: ``progress`` writes a
stamped line to the terminal and to the run's Prefect log (so the UI has it too). Without
``quiet_console`` (tests, a deployment on a worker) ``progress`` only logs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.common import task_logger

__all__ = ["eta_line", "progress", "quiet_console", "restore_console", "step_line"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_console: list[Any] = []


def quiet_console(log_file: Path) -> Path:
    """INFO and below to ``log_file`` (appended), warnings to the console; returns the file.

    Whatever the stages write to standard output or error goes to the file too, until
    ``restore_console``: Python's streams and the file descriptors under them, so child
    processes (vLLM's engine core, progress bars) land there as well."""
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    # vLLM then logs through the standard loggers (its own handler would print INFO).
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    import mlflow  # noqa: F401, PLC0415 - its logger's console handler is made on import
    from prefect.logging.configuration import setup_logging  # noqa: PLC0415

    setup_logging()
    for handle in (sys.stdout, sys.stderr):
        handle.flush()
    console_out = os.fdopen(os.dup(1), "w", buffering=1)
    console_err = os.fdopen(os.dup(2), "w", buffering=1)
    stream = log_file.open("a", buffering=1)
    to_file = logging.StreamHandler(stream)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter(_FORMAT))
    warnings = logging.StreamHandler(console_err)
    warnings.setLevel(logging.WARNING)
    warnings.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    # vLLM's start-up warnings (CPU backend, eager mode) say nothing about the run.
    warnings.addFilter(lambda r: r.levelno >= logging.ERROR or not r.name.startswith("vllm"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    # One line per request to Prefect's API: nothing a reader of the log wants.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler):
            root.removeHandler(handler)
    root.addHandler(to_file)
    root.addHandler(warnings)
    for name in list(logging.root.manager.loggerDict):
        logger = logging.getLogger(name)
        if logger.propagate or not logger.handlers:
            continue
        # A library logger with its own console handler (MLflow's): warnings only there.
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setLevel(max(handler.level, logging.WARNING))
                # Some (logging's own stderr handler) follow sys.stderr and cannot be moved.
                with contextlib.suppress(AttributeError):
                    handler.setStream(console_err)
        logger.addHandler(to_file)
    # Last, so that a failure above leaves the console as it was.
    _console[:] = [console_out, console_err, sys.stdout, sys.stderr]
    os.dup2(stream.fileno(), 1)
    os.dup2(stream.fileno(), 2)
    sys.stdout = sys.stderr = stream
    return log_file


def restore_console() -> None:
    """The console's own streams back (after ``quiet_console``)."""
    if _console:
        console_out, console_err, sys.stdout, sys.stderr = _console
        for handle in (sys.stdout, sys.stderr):
            handle.flush()
        os.dup2(console_out.fileno(), 1)
        os.dup2(console_err.fileno(), 2)
        _console.clear()


def progress(stage: str, text: str) -> None:
    """One progress line: ``HH:MM:SS stage: text`` on the console (when quiet) and logged."""
    line = f"{time.strftime('%H:%M:%S')} {stage}: {text}"
    if _console:
        # Written, not printed: Prefect's print (log_prints) would send it to the log.
        _console[0].write(line + "\n")
        _console[0].flush()
    task_logger().info("%s: %s", stage, text)


def eta_line(done: int, total: int, seconds_per_step: float) -> str:
    """``3/20, ETA 4 min 10 s`` at ``seconds_per_step`` for the steps left."""
    if done <= 0 or total <= done:
        return f"{done}/{total}"
    left = round(seconds_per_step * (total - done))
    return f"{done}/{total}, ETA {left // 60} min {left % 60:02d} s"


def step_line(record: Mapping[str, Any]) -> str:
    """The step figures of a ``metrics.jsonl`` record, in a few words."""
    figures = [
        f"step {record.get('step_wall_s', float('nan')):.1f} s",
        f"tail {record.get('learner_tail_s', float('nan')):.1f} s",
        f"reward {record.get('reward_mean', float('nan')):.2f}",
    ]
    stale = record.get("staleness_tokens") or {}
    total = sum(stale.values())
    if total and any(int(lag) > 0 and n for lag, n in stale.items()):
        old = sum(n for lag, n in stale.items() if int(lag) > 0)
        figures.append(f"stale tokens {old / total:.0%}")
    if record.get("inflight_swaps"):
        figures.append(f"in-flight swaps {record['inflight_swaps']}")
    return ", ".join(figures)
