"""Terminal tasks in Harbor format, as the agent loop consumes them.

A task folder holds ``instruction.md``, ``task.toml``, ``environment/`` (a Dockerfile and the
files it copies), ``solution/solve.sh`` and ``tests/test.sh``. With the Docker backend the
environment is the image; with the local backend the files of ``environment/`` other than
the Dockerfile are copied into the workdir, which is what the Dockerfile's COPY lines do
for the tasks this project generates. Grading runs the pristine ``tests/`` (see grading.py).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from thundersync_core.rollout.grading import GradeResult, grade_terminal
from thundersync_core.rollout.sandbox.base import Sandbox


class TaskFormatError(ValueError):
    """A task folder is malformed; the message names the folder and the missing part."""


@dataclass(frozen=True)
class TerminalTask:
    task_id: str
    root: Path
    instruction: str
    agent_timeout_s: float

    def setup(self, sandbox: Sandbox) -> None:
        environment = self.root / "environment"
        if not environment.is_dir():
            return
        for item in sorted(environment.iterdir()):
            if item.name != "Dockerfile":
                sandbox.copy_in(item, item.name)

    def grade(self, sandbox: Sandbox) -> GradeResult:
        return grade_terminal(sandbox, self.root)


def load_terminal_task(root: Path) -> TerminalTask:
    root = Path(root)
    for part in ("instruction.md", "tests/test.sh"):
        if not (root / part).is_file():
            raise TaskFormatError(f"task {root}: missing {part}")
    config = {}
    if (root / "task.toml").is_file():
        try:
            config = tomllib.loads((root / "task.toml").read_text())
        except tomllib.TOMLDecodeError as exc:
            raise TaskFormatError(f"task {root}: task.toml is not TOML ({exc})") from None
    agent = config.get("agent", {}) if isinstance(config.get("agent"), dict) else {}
    return TerminalTask(
        task_id=root.name,
        root=root,
        instruction=(root / "instruction.md").read_text().strip(),
        agent_timeout_s=float(agent.get("timeout_sec", 600.0)),
    )


def load_terminal_tasks(directory: Path) -> list[TerminalTask]:
    """Every task folder directly under ``directory``, sorted by id."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TaskFormatError(f"--tasks {directory}: not a directory")
    tasks = [load_terminal_task(d) for d in sorted(directory.iterdir()) if d.is_dir()]
    if not tasks:
        raise TaskFormatError(f"--tasks {directory}: no task folders")
    return tasks
