"""CPU-heavy jobs in a child process: tcmalloc preloaded where the system has it, the child
tied to its parent's life, its output relayed line by line.

The warm start's fine-tuning is many small, differently shaped allocations from two
threads. Under glibc's malloc its step slows as the run goes (0.42 s to 0.49 s a step over
500 steps of the embedded warm start; 0.64 s by step 1,500 inside the long-lived experiment
process); under tcmalloc it holds at 0.33 s. ``LD_PRELOAD`` only takes effect when a
process starts, hence a child. Without the library (Debian: ``libtcmalloc-minimal4``) the
child runs on glibc's malloc and computes the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

__all__ = ["ChildFailed", "die_with_parent", "run_child", "tcmalloc"]

#: Set in a child's environment to its parent's pid; ``die_with_parent`` reads it.
PARENT_PID_ENV = "THUNDERSYNC_PARENT_PID"
_PR_SET_PDEATHSIG = 1


class ChildFailed(RuntimeError):
    """A child process exited with an error; the message names it and ends with its output."""


@cache
def tcmalloc() -> str | None:
    """The tcmalloc library the dynamic loader finds here (its file name), or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with tcmalloc first in ``LD_PRELOAD`` where
    the system has it, and this process's pid for ``die_with_parent``."""
    env = dict(os.environ if base is None else base)
    env[PARENT_PID_ENV] = str(os.getpid())
    library = tcmalloc()
    preload = env.get("LD_PRELOAD", "").split()
    if library is not None and not any("tcmalloc" in Path(p).name for p in preload):
        env["LD_PRELOAD"] = " ".join([library, *preload])
    return env


def die_with_parent() -> None:
    """In a child started by ``run_child``: be killed when the parent dies (Linux), and
    exit now if it is gone already. Anywhere else, nothing."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(parent):
        raise SystemExit(f"the parent process {parent} is gone")


def run_child(what: str, argv: Sequence[str], *, tail_lines: int = 40) -> None:
    """Run ``argv`` with ``child_env()``, printing each line it writes (stdout and stderr)
    as it comes. A child that fails raises ``ChildFailed`` naming ``what``, with the
    child's last lines; one still running when this returns early (an exception here,
    ``KeyboardInterrupt``) is killed."""
    tail: deque[str] = deque(maxlen=tail_lines)
    with subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        env=child_env(),
    ) as proc:
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                tail.append(line)
                print(line, flush=True)
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        cause = f"signal {-code}" if code < 0 else f"exit {code}"
        last = "\n".join(tail)
        raise ChildFailed(f"{what} failed ({cause}); its last output:\n{last}")
