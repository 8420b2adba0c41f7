"""The OPD teacher role: a frozen model that scores action tokens, turn by turn or whole."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from thundersync_core.batch import Trajectory, Turn, turns_of
from thundersync_core.policy.io import checkpoint_dtype, load_model
from thundersync_core.runtime.placement import pin_to_cores
from thundersync_core.teacher import Teacher, TurnScores


class TeacherWorker:
    """The frozen teacher, in its checkpoint's dtype, on the GPU when the role holds one."""

    def __init__(
        self,
        model_dir: Path,
        *,
        cores: tuple[int, ...] = (),
        top_k: int = 0,
        num_gpus: float = 0.0,
    ) -> None:
        pin_to_cores(cores)
        device = "cpu"
        if num_gpus > 0:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"teacher: resources.teacher.num_gpus is {num_gpus} but no CUDA device is "
                    f"visible to it (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r})"
                )
            device = "cuda"
        model = load_model(model_dir, dtype=checkpoint_dtype(model_dir)).to(device)  # type: ignore[arg-type]
        for p in model.parameters():
            p.requires_grad_(False)
        self.teacher = Teacher(model, top_k=top_k)

    def pid(self) -> int:
        """This role's process id (roles.json in the run folder lists them)."""
        return os.getpid()

    def ready(self) -> bool:
        return True

    @torch.no_grad()
    def score_turn(self, turn: Turn) -> tuple[Turn, float]:
        """The turn with its teacher scores, and the time they were fixed (its release)."""
        scores = self.teacher.score_turn(turn)
        return dataclasses.replace(turn, **self._fields([scores])), time.time()

    @torch.no_grad()
    def score_trajectory(self, traj: Trajectory) -> tuple[Trajectory, float]:
        """Every action turn of a finished trajectory, scored in order."""
        actions = sum(1 for s in traj.segments if s.kind == "action")
        turns = turns_of(traj, [()] * max(actions, 1))
        scores = [self.teacher.score_turn(turn) for turn in turns]
        return dataclasses.replace(traj, **self._fields(scores)), time.time()

    def _fields(self, scores: list[TurnScores]) -> dict[str, Any]:
        """The record fields of these turns' scores, in turn order."""
        fields: dict[str, Any] = {"teacher_logprobs": tuple(q for s in scores for q in s.logprobs)}
        if self.teacher.top_k:
            fields["teacher_top_ids"] = tuple(i for s in scores for i in s.top_ids)
            fields["teacher_top_logprobs"] = tuple(q for s in scores for q in s.top_logprobs)
        return fields
