"""The sandbox contract shared by the local (bubblewrap) and Docker backends.

One sandbox serves one trajectory: a private writable workdir (``/app`` inside) that
persists across ``exec`` calls, a writable ``/logs`` (Harbor verifiers write
``/logs/verifier/reward.txt``), a private ``/tmp`` and a ``/tests`` directory that only the
host side fills (graders install verifier files there). Every ``exec`` runs under
``SandboxLimits``: a wall-clock timeout that kills everything the command started, memory,
CPU, process and file-size limits, and output bounded while it is read.

Paths given to ``write_file``/``read_file``/``copy_in`` are relative to the workdir;
absolute paths and ``..`` are refused, so a caller bug cannot write outside it.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxPathError",
    "SandboxUnavailable",
    "classify_exit",
    "relative_parts",
]

# Where graders install verifier files and where Harbor task scripts expect them.
TESTS_DIR = "/tests"
LOGS_DIR = "/logs"


class SandboxUnavailable(RuntimeError):
    """The backend cannot run here (bubblewrap missing, no Docker daemon answering)."""


class SandboxError(RuntimeError):
    """A sandbox operation failed for a reason other than the command's own exit status."""


class SandboxPathError(SandboxError, ValueError):
    """A path given to the sandbox is malformed or would leave the sandbox's directories."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 30.0
    memory_mb: int = 1024
    cpu_s: int = 60
    max_processes: int = 256
    max_file_mb: int = 256
    output_bytes: int = 64 * 1024
    # Docker only (nano_cpus): the local backend has no CPU-share control without cgroups.
    cpus: float = 1.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "cpu_s", "max_processes", "max_file_mb", "cpus"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.output_bytes < 0:
            raise ValueError(f"SandboxLimits.output_bytes must be >= 0, got {self.output_bytes}")


@dataclass(frozen=True)
class ExecResult:
    """What one command did. ``exit_code`` is None when the sandbox killed it on timeout."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    duration_s: float
    output_truncated: bool
    stdout_bytes: int
    stderr_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# Exit statuses 128+N mean "died of signal N" for bwrap, bash and Docker alike. A command
# can also exit with such a number on purpose; the reason is then a best guess.
_SIGNAL_REASONS: dict[int, str] = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}
# Messages that runtimes print when an allocation is refused under an address-space limit.
_MEMORY_MESSAGES = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


def classify_exit(exit_code: int | None, *, timed_out: bool, stderr_tail: str) -> str | None:
    """One word for why a command stopped abnormally, or None if it simply exited.

    "memory" is inferred from the command's own error text: under RLIMIT_AS an allocation
    fails inside the process instead of the kernel killing it, so no status reports it.
    """
    if timed_out:
        return "timeout"
    if exit_code is None or exit_code == 0:
        return None
    if any(message in stderr_tail for message in _MEMORY_MESSAGES):
        return "memory"
    if 128 < exit_code < 128 + 65:
        return _SIGNAL_REASONS.get(exit_code - 128, "signal")
    return None


def relative_parts(relpath: str) -> tuple[str, ...]:
    """The components of a workdir-relative path; refuses absolute paths and ``..``."""
    path = PurePosixPath(relpath)
    if path.is_absolute():
        raise SandboxPathError(f"{relpath!r}: sandbox paths are relative to the workdir")
    if ".." in path.parts:
        raise SandboxPathError(f"{relpath!r}: '..' is not allowed in sandbox paths")
    return tuple(part for part in path.parts if part != ".")


class Sandbox(ABC):
    """One sandbox per trajectory: a private writable workdir that persists across exec calls.

    ``host_workdir`` is where the workdir lives on the host for the local backend; for
    Docker it is a host staging folder that ``DockerSandbox.pull_workdir`` fills on demand.
    """

    workdir: str
    host_workdir: Path
    limits: SandboxLimits
    # The interpreter graders run, as an absolute path inside the sandbox: one the agent
    # cannot replace (the host's venv bound read-only; the image's own python3).
    python: str

    @abstractmethod
    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
    ) -> ExecResult:
        """Run ``command`` in the workdir: a string through ``bash -c``, a sequence as argv."""

    @abstractmethod
    def write_file(self, relpath: str, data: str | bytes) -> None:
        """Create or replace a file in the workdir, creating parent folders."""

    @abstractmethod
    def read_file(self, relpath: str) -> bytes:
        """A regular file's bytes from the workdir; FileNotFoundError if it is absent."""

    @abstractmethod
    def copy_in(self, src: Path, dest_rel: str = ".") -> None:
        """Copy a host file or folder in, like ``cp -r``.

        A folder's contents are merged into ``dest_rel`` (created if needed). A file is
        copied to ``dest_rel``, or into it as ``dest_rel/<name>`` when ``dest_rel`` is the
        workdir itself or an existing folder.
        """

    @abstractmethod
    def read_log(self, relpath: str) -> bytes:
        """A regular file's bytes from ``/logs``; FileNotFoundError if it is absent."""

    @abstractmethod
    def clear_logs(self, subdir: str) -> None:
        """Replace ``/logs/<subdir>`` with an empty folder the sandboxed command can write."""

    @abstractmethod
    def install_tests(self, src: Path) -> str:
        """Replace ``/tests`` with a copy of the host folder ``src``; returns ``/tests``."""

    @abstractmethod
    def begin_verification(self, *, fresh: bool) -> None:
        """End the agent's phase: afterwards no process the agent started is alive.

        ``/tmp`` and ``/logs`` are emptied (``/logs/verifier`` recreated) and ``/tests`` is
        empty. ``fresh`` carries only the workdir over and drops whatever else the agent
        changed (Docker: a new container from the image); SWE grading needs only the
        repository. Without it the rest of the filesystem stays, for terminal tasks whose
        checks look at system state.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop everything and remove the sandbox's files; safe to call twice."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
