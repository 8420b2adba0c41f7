"""The OPD teacher role: a frozen model that scores action tokens, turn by turn or whole."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from thundersync_core.batch import Trajectory, Turn, turns_of
from thundersync_core.policy.io import load_model
from thundersync_core.runtime.placement import pin_to_cores
from thundersync_core.teacher import Teacher


class TeacherWorker:
    def __init__(self, model_dir: Path, *, cores: tuple[int, ...] = ()) -> None:
        pin_to_cores(cores)
        model = load_model(model_dir)
        for p in model.parameters():
            p.requires_grad_(False)
        self.teacher = Teacher(model)

    def ready(self) -> bool:
        return True

    @torch.no_grad()
    def score_turn(self, turn: Turn) -> tuple[Turn, float]:
        """The turn with its teacher log-probs, and the time they were fixed (its release)."""
        scores = self.teacher.score(turn)
        return dataclasses.replace(turn, teacher_logprobs=scores), time.time()

    @torch.no_grad()
    def score_trajectory(self, traj: Trajectory) -> tuple[Trajectory, float]:
        """Every action turn of a finished trajectory, scored in order."""
        actions = sum(1 for s in traj.segments if s.kind == "action")
        turns = turns_of(traj, [()] * max(actions, 1))
        scores = tuple(q for turn in turns for q in self.teacher.score(turn))
        return dataclasses.replace(traj, teacher_logprobs=scores), time.time()
