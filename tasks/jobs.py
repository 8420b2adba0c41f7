"""Launchers for the training stage: a Ray job on a cluster, or a local thread or process.

Each returns a job with ``poll()`` ("running", "succeeded" or "failed") and ``failure()``
(the cause, once failed). The flow follows any of them the same way: it tails the run's
``metrics.jsonl``, which the trainer appends one line per step, so the run folder must be
visible to the flow (shared storage on a cluster).

- ``inprocess``: ``train()`` on a thread of this process; it joins the Ray instance this
  process already holds (tests share one), else starts a local one.
- ``subprocess``: ``thundersync train`` as a child process with its own local Ray.
- ``ray-job``: ``thundersync train`` submitted with ``JobSubmissionClient`` to the
  cluster's job server (``http://head:8265``); the entrypoint joins that cluster.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Literal, Protocol

__all__ = ["InProcessJob", "JobStatus", "RayJob", "SubprocessJob", "TrainingJob", "launch"]

JobStatus = Literal["running", "succeeded", "failed"]
#: ``thundersync``'s exit code for input it refuses (a bad flag or config).
INPUT_ERROR_EXIT = 2
#: What ``train()`` raises for input it refuses (as the CLI's exit code 2).
INPUT_ERRORS = (FileNotFoundError, FileExistsError, ValueError, KeyError)
Launcher = Literal["auto", "inprocess", "subprocess", "ray-job"]


class TrainingJob(Protocol):
    run_dir: Path
    description: str

    def poll(self) -> JobStatus: ...

    def failure(self) -> str: ...

    def retryable(self) -> bool:
        """Whether a failed job could succeed when started again (resumed): False for input
        the trainer refuses. The run's summary.json says it for a failed step."""
        ...


def _train_argv(config_path: Path, run_dir: Path, resume: bool) -> list[str]:
    argv = ["thundersync", "train", "--config", str(config_path), "--out", str(run_dir)]
    return [*argv, "--resume"] if resume else argv


class InProcessJob:
    """``train()`` on a daemon thread; its exception, if any, is the failure."""

    def __init__(self, config_path: Path, run_dir: Path, *, resume: bool = False) -> None:
        from thundersync_core.config import load_config  # noqa: PLC0415
        from thundersync_core.runtime.placement import start_ray  # noqa: PLC0415

        self.run_dir = Path(run_dir)
        self.description = f"in-process train() into {self.run_dir}"
        self._config = load_config(config_path)
        self._resume = resume
        self._error: str | None = None
        self._input_error = False
        # Ray is started from the launching thread, not the worker thread.
        start_ray(self._config.resources)
        self._thread = threading.Thread(target=self._run, name=f"train-{run_dir}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from thundersync_core.train import train  # noqa: PLC0415

        try:
            train(self._config, self.run_dir, resume=self._resume)
        except Exception as exc:  # reported through poll()/failure(), not swallowed
            self._error = f"{type(exc).__name__}: {exc}"
            self._input_error = isinstance(exc, INPUT_ERRORS)

    def poll(self) -> JobStatus:
        if self._thread.is_alive():
            return "running"
        return "failed" if self._error is not None else "succeeded"

    def failure(self) -> str:
        return self._error or ""

    def retryable(self) -> bool:
        return not self._input_error


def _tail(path: Path, lines: int = 20) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])


def _cause(log: str) -> str:
    """The line of a ``thundersync train`` log that says why it stopped, else its end."""
    for line in reversed(log.splitlines()):
        if "thundersync train:" in line or "Error" in line:
            return line.strip()
    return log.strip().splitlines()[-1] if log.strip() else "no output"


class SubprocessJob:
    """``thundersync train`` as a child process in its own session (so it and the local Ray
    it starts can be stopped together); its output goes to ``<run_dir>.log``, appended to
    by a resumed attempt."""

    def __init__(self, config_path: Path, run_dir: Path, *, resume: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.log_path = self.run_dir.with_name(self.run_dir.name + ".log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cli = [sys.executable, "-m", "thundersync_core.cli"]
        argv = cli + _train_argv(config_path, run_dir, resume)[1:]
        self.description = " ".join(argv)
        with self.log_path.open("a" if resume else "w") as log:
            self._process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid = self._process.pid

    def poll(self) -> JobStatus:
        code = self._process.poll()
        if code is None:
            return "running"
        return "succeeded" if code == 0 else "failed"

    def failure(self) -> str:
        return f"exit code {self._process.returncode}: {_cause(_tail(self.log_path))}"

    def retryable(self) -> bool:
        """False when the trainer refused its input (exit code 2): a retry would too."""
        return self._process.returncode != INPUT_ERROR_EXIT


class RayJob:
    """``thundersync train`` submitted to a Ray cluster's job server."""

    _RUNNING = frozenset({"PENDING", "RUNNING"})

    def __init__(
        self,
        config_path: Path,
        run_dir: Path,
        *,
        address: str,
        submission_id: str,
        client: Any = None,
        resume: bool = False,
    ) -> None:
        if client is None:
            from ray.job_submission import JobSubmissionClient  # noqa: PLC0415

            client = JobSubmissionClient(address)
        self.run_dir = Path(run_dir)
        self._client = client
        entrypoint = " ".join(_train_argv(config_path, run_dir, resume))
        self.job_id = client.submit_job(entrypoint=entrypoint, submission_id=submission_id)
        self.description = f"Ray job {self.job_id} on {address}: {entrypoint}"

    def poll(self) -> JobStatus:
        status = self._client.get_job_status(self.job_id)
        status = str(getattr(status, "value", status))
        if status in self._RUNNING:
            return "running"
        return "succeeded" if status == "SUCCEEDED" else "failed"

    def failure(self) -> str:
        info = self._client.get_job_info(self.job_id)
        logs = self._client.get_job_logs(self.job_id)
        return f"Ray job {self.job_id}: {info.message or ''} {_cause(logs)}".strip()

    def retryable(self) -> bool:
        # The job server reports no exit code; the run's summary.json tells a refused step.
        return True


def launch(
    launcher: Launcher,
    config_path: Path,
    run_dir: Path,
    *,
    ray_address: str | None = None,
    submission_id: str = "",
    resume: bool = False,
) -> TrainingJob:
    """Start the training stage (``resume``: from the run folder's latest checkpoint);
    ``auto`` is ``ray-job`` with an address, else ``inprocess``."""
    if launcher == "auto":
        launcher = "ray-job" if ray_address else "inprocess"
    if launcher == "ray-job":
        if not ray_address:
            raise ValueError(
                "launcher ray-job needs ray_address (the job server, http://HEAD:8265)"
            )
        return RayJob(
            config_path, run_dir, address=ray_address, submission_id=submission_id, resume=resume
        )
    if launcher == "subprocess":
        return SubprocessJob(config_path, run_dir, resume=resume)
    return InProcessJob(config_path, run_dir, resume=resume)
