"""Weight publication: after the optimizer step, the new policy goes to every engine.

The learner's parameters are written once to a safetensors file (under /dev/shm where it
exists, so the copy stays in memory) and each engine loads it in place and reports the new
version on every turn it generates afterwards. Publication is refused while the learner is
between ``begin_batch`` and its barrier: a half-applied batch is never published.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from thundersync_core.rollout.engine import RolloutEngine
from thundersync_core.streaming.base import LearnerBase, LearnerRefusal


@dataclass(frozen=True)
class Publication:
    version: int
    seconds: float
    bytes: int


# A run's publication folder: <scratch>/thundersync-publish-<host>-<pid>-<label>-<ns>.
_PUBLISH_PREFIX = "thundersync-publish-"


def _scratch_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def publication_root() -> Path:
    """Where publication folders go: /dev/shm where it is writable, else the temp folder."""
    return _scratch_dir()


def publication_dir(label: str) -> Path:
    """A new folder name for one run's published weight files (under /dev/shm where it can
    be); first removes the folders that this host's runs which died (SIGKILL, a crash)
    left behind. The caller removes its own at the end (``shutil.rmtree``)."""
    root = publication_root()
    remove_abandoned_publications(root)
    name = f"{_PUBLISH_PREFIX}{socket.gethostname()}-{os.getpid()}-{label}-{time.time_ns()}"
    return root / name


def remove_abandoned_publications(root: Path) -> list[Path]:
    """Removes this host's publication folders under ``root`` whose process is gone; a live
    process's, or another host's (a shared folder), are left alone. Returns those removed."""
    prefix = f"{_PUBLISH_PREFIX}{socket.gethostname()}-"
    removed = []
    for folder in sorted(Path(root).glob(f"{prefix}*")):
        pid = folder.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class WeightPublisher:
    def __init__(self, learner: LearnerBase, engines: Sequence[RolloutEngine]) -> None:
        self.learner = learner
        self.engines = list(engines)
        self.published_version: int | None = None

    def publish(self) -> Publication | None:
        """Publish the learner's current version; None when that version is already live."""
        if self.learner.in_batch:
            raise LearnerRefusal(
                "refusing to publish weights: a batch is in progress (between begin_batch "
                "and the barrier), so the parameters may be half-applied"
            )
        version = self.learner.policy_version
        if version == self.published_version:
            return None
        start = time.perf_counter()
        tensors = {
            name: p.detach().contiguous() for name, p in self.learner.model.named_parameters()
        }
        fd, name = tempfile.mkstemp(
            prefix="thundersync-weights-", suffix=".safetensors", dir=_scratch_dir()
        )
        os.close(fd)
        path = Path(name)
        try:
            save_file(tensors, str(path))
            size = path.stat().st_size
            for engine in self.engines:
                engine.load_weights(path, version)
        finally:
            path.unlink(missing_ok=True)
        self.published_version = version
        return Publication(version, time.perf_counter() - start, size)
