"""Trajectories as the learner sees them, and the logged-batch file format.

A trajectory is a prompt followed by segments: ``action`` segments (tokens the policy
sampled, scored unless a mask says otherwise) and ``observation`` segments (tool output,
never scored). Trajectories of one group share their prompt. This module imports neither
torch nor any engine, so rollout workers and orchestration can use it freely.

Batch file (JSONL), one trajectory per line::

    {"group_id": str, "trajectory_id": str, "prompt_ids": [int],
     "segments": [{"kind": "action"|"observation", "ids": [int], "scored": [bool]}],
     "reward": float, "policy_version": int, "teacher_logprobs": [float],
     "behaviour_logprobs": [float], "teacher_top_ids": [int], "teacher_top_logprobs": [float]}

``scored``, ``policy_version``, ``teacher_logprobs``, ``behaviour_logprobs`` (the sampling
policy's log-prob of each scored token, for off-policy correction), ``teacher_top_ids`` and
``teacher_top_logprobs`` (the teacher's k most likely tokens at each scored position and
their log-probs, k per token in order, for OPD over the vocabulary) and ``metadata``
(rollout facts the learner ignores) are optional. ``policy_version`` is the version that sampled the
trajectory's first token; with in-flight weight updates later turns may be newer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_N = TypeVar("_N", int, float)


class BatchFormatError(ValueError):
    """A logged batch is malformed; the message names the line and field."""


@dataclass(frozen=True)
class Segment:
    kind: Literal["action", "observation"]
    ids: tuple[int, ...]
    scored: tuple[bool, ...]

    @staticmethod
    def action(ids: Sequence[int], scored: Sequence[bool] | None = None) -> Segment:
        mask = tuple(scored) if scored is not None else (True,) * len(ids)
        return Segment("action", tuple(ids), mask)

    @staticmethod
    def observation(ids: Sequence[int]) -> Segment:
        return Segment("observation", tuple(ids), (False,) * len(ids))


@dataclass(frozen=True)
class Trajectory:
    group_id: str
    trajectory_id: str
    prompt_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    reward: float
    policy_version: int = 0
    teacher_logprobs: tuple[float, ...] | None = field(default=None, compare=False)
    #: Rollout facts the learner ignores (events, finish reason, turn versions, ...).
    metadata: Mapping[str, Any] | None = field(default=None, compare=False)
    #: The sampling policy's log-prob of each scored token, in order (off-policy correction).
    behaviour_logprobs: tuple[float, ...] | None = field(default=None, compare=False)
    #: The teacher's top-k token ids and log-probs at each scored position, k per token.
    teacher_top_ids: tuple[int, ...] | None = field(default=None, compare=False)
    teacher_top_logprobs: tuple[float, ...] | None = field(default=None, compare=False)

    @property
    def response_ids(self) -> tuple[int, ...]:
        return tuple(i for s in self.segments for i in s.ids)

    @property
    def response_scored(self) -> tuple[bool, ...]:
        return tuple(b for s in self.segments for b in s.scored)

    @property
    def n_scored_tokens(self) -> int:
        return sum(self.response_scored)


@dataclass(frozen=True)
class Turn:
    """One action turn, released to the learner when the teacher has scored it.

    ``segments`` is the trajectory so far, ending with this turn's action (or, for a
    trajectory with no action at all, a closing turn whose segments hold no action).
    ``teacher_logprobs`` has one entry per scored token of the action.
    """

    group_id: str
    trajectory_id: str
    prompt_ids: tuple[int, ...]
    index: int
    segments: tuple[Segment, ...]
    teacher_logprobs: tuple[float, ...]
    last: bool
    policy_version: int = 0
    #: The sampling policy's log-prob of each scored action token (off-policy correction).
    behaviour_logprobs: tuple[float, ...] | None = field(default=None, compare=False)
    #: The teacher's top-k token ids and log-probs at each scored action token, k per token.
    teacher_top_ids: tuple[int, ...] | None = field(default=None, compare=False)
    teacher_top_logprobs: tuple[float, ...] | None = field(default=None, compare=False)

    @property
    def action(self) -> Segment | None:
        if self.segments and self.segments[-1].kind == "action":
            return self.segments[-1]
        return None


def turns_of(traj: Trajectory, teacher_by_turn: Sequence[tuple[float, ...]]) -> list[Turn]:
    """The trajectory's action turns in order; the last one closes the trajectory.

    Each turn carries its share of ``behaviour_logprobs`` and of the teacher's top-k, and,
    when the rollout recorded them (``metadata["turn_versions"]``), the policy version that
    sampled it.
    """
    action_at = [i for i, s in enumerate(traj.segments) if s.kind == "action"]
    versions = (traj.metadata or {}).get("turn_versions") or []
    behaviour = _split_by_action(traj, traj.behaviour_logprobs, action_at)
    k = top_k_of(traj)
    top_ids = _split_by_action(traj, traj.teacher_top_ids, action_at, k, "teacher_top_ids")
    top_lp = _split_by_action(traj, traj.teacher_top_logprobs, action_at, k, "teacher_top_logprobs")

    def turn(index: int, segments: tuple[Segment, ...], teacher: tuple[float, ...]) -> Turn:
        return Turn(
            group_id=traj.group_id,
            trajectory_id=traj.trajectory_id,
            prompt_ids=traj.prompt_ids,
            index=index,
            segments=segments,
            teacher_logprobs=teacher,
            last=index == max(len(action_at) - 1, 0),
            policy_version=int(versions[index]) if index < len(versions) else traj.policy_version,
            behaviour_logprobs=behaviour[index] if behaviour is not None else None,
            teacher_top_ids=top_ids[index] if top_ids is not None else None,
            teacher_top_logprobs=top_lp[index] if top_lp is not None else None,
        )

    if not action_at:
        return [turn(0, (), ())]
    return [
        turn(k, traj.segments[: i + 1], tuple(teacher_by_turn[k])) for k, i in enumerate(action_at)
    ]


def top_k_of(traj: Trajectory) -> int:
    """k of the trajectory's teacher top-k (0: none); refuses mismatched or ragged fields."""
    ids, logprobs = traj.teacher_top_ids, traj.teacher_top_logprobs
    if ids is None and logprobs is None:
        return 0
    where = f"trajectory {traj.trajectory_id!r}"
    if ids is None or logprobs is None or len(ids) != len(logprobs):
        raise BatchFormatError(
            f"{where}: fields teacher_top_ids and teacher_top_logprobs must come together "
            "with one log-prob per id"
        )
    n = traj.n_scored_tokens
    if n == 0 and not ids:
        return 0
    if n == 0 or len(ids) % n or not ids:
        raise BatchFormatError(
            f"{where}: field teacher_top_ids: {len(ids)} values are not k per scored token "
            f"for {n} scored tokens"
        )
    return len(ids) // n


def _split_by_action(
    traj: Trajectory,
    flat: tuple[_N, ...] | None,
    action_at: list[int],
    per_token: int = 1,
    name: str = "behaviour_logprobs",
) -> list[tuple[_N, ...]] | None:
    if flat is None:
        return None
    counts = [sum(traj.segments[i].scored) * per_token for i in action_at]
    if len(flat) != sum(counts):
        raise BatchFormatError(
            f"trajectory {traj.trajectory_id!r}: field {name}: {len(flat)} values "
            f"for {sum(counts) // max(per_token, 1)} scored tokens"
        )
    out, start = [], 0
    for n in counts:
        out.append(flat[start : start + n])
        start += n
    return out or [()]


class _SegmentRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["action", "observation"]
    ids: list[int] = Field(default_factory=list)
    scored: list[bool] | None = None

    @model_validator(mode="after")
    def _mask_matches(self) -> _SegmentRecord:
        if any(i < 0 for i in self.ids):
            raise ValueError("token ids must be non-negative")
        if self.scored is None:
            return self
        if len(self.scored) != len(self.ids):
            raise ValueError(f"scored has {len(self.scored)} entries for {len(self.ids)} ids")
        if self.kind == "observation" and any(self.scored):
            raise ValueError("observation tokens are never scored")
        return self


class _TrajectoryRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group_id: str = Field(min_length=1)
    trajectory_id: str = Field(min_length=1)
    prompt_ids: list[int] = Field(min_length=1)
    segments: list[_SegmentRecord]
    reward: float = Field(allow_inf_nan=False)
    policy_version: int = 0
    teacher_logprobs: list[float] | None = None
    behaviour_logprobs: list[float] | None = None
    teacher_top_ids: list[int] | None = None
    teacher_top_logprobs: list[float] | None = None
    metadata: dict[str, Any] | None = None

    def to_trajectory(self) -> Trajectory:
        segments = tuple(
            Segment.action(s.ids, s.scored) if s.kind == "action" else Segment.observation(s.ids)
            for s in self.segments
        )
        teacher = tuple(self.teacher_logprobs) if self.teacher_logprobs is not None else None
        return Trajectory(
            group_id=self.group_id,
            trajectory_id=self.trajectory_id,
            prompt_ids=tuple(self.prompt_ids),
            segments=segments,
            reward=self.reward,
            policy_version=self.policy_version,
            teacher_logprobs=teacher,
            metadata=self.metadata,
            behaviour_logprobs=_tuple_or_none(self.behaviour_logprobs),
            teacher_top_ids=_tuple_or_none(self.teacher_top_ids),
            teacher_top_logprobs=_tuple_or_none(self.teacher_top_logprobs),
        )


def _tuple_or_none(values: list[_N] | None) -> tuple[_N, ...] | None:
    return tuple(values) if values is not None else None


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "record"
    return f"field {where}: {first['msg']}"


def parse_batch_lines(lines: Iterable[str], source: str = "batch") -> list[Trajectory]:
    """Parse JSONL lines; refuse the first malformed line, naming line number and field."""
    trajectories: list[Trajectory] = []
    seen_ids: dict[str, int] = {}
    group_prompt: dict[str, tuple[tuple[int, ...], int]] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BatchFormatError(f"{source} line {lineno}: not JSON ({exc.msg})") from None
        try:
            traj = _TrajectoryRecord.model_validate(raw).to_trajectory()
        except ValidationError as exc:
            raise BatchFormatError(f"{source} line {lineno}: {_first_error(exc)}") from None
        if traj.trajectory_id in seen_ids:
            raise BatchFormatError(
                f"{source} line {lineno}: field trajectory_id: {traj.trajectory_id!r} "
                f"already used on line {seen_ids[traj.trajectory_id]}"
            )
        seen_ids[traj.trajectory_id] = lineno
        prompt, first_line = group_prompt.setdefault(traj.group_id, (traj.prompt_ids, lineno))
        if prompt != traj.prompt_ids:
            raise BatchFormatError(
                f"{source} line {lineno}: field prompt_ids: differs from group "
                f"{traj.group_id!r}'s prompt on line {first_line}"
            )
        trajectories.append(traj)
    if not trajectories:
        raise BatchFormatError(f"{source}: no trajectories")
    return trajectories


def read_batch(path: Path | str) -> list[Trajectory]:
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        return parse_batch_lines(handle, source=str(path))


def check_token_range(trajectories: Sequence[Trajectory], vocab_size: int) -> None:
    """Refuse token ids outside the model's vocabulary, naming the trajectory."""
    for traj in trajectories:
        for where, ids in [("prompt_ids", traj.prompt_ids), ("segments", traj.response_ids)]:
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise BatchFormatError(
                    f"trajectory {traj.trajectory_id!r}: field {where}: token id {bad[0]} "
                    f"out of range for vocabulary of {vocab_size}"
                )


def trajectory_to_json(traj: Trajectory) -> str:
    record: dict[str, object] = {
        "group_id": traj.group_id,
        "trajectory_id": traj.trajectory_id,
        "prompt_ids": list(traj.prompt_ids),
        "segments": [
            {"kind": s.kind, "ids": list(s.ids), "scored": list(s.scored)} for s in traj.segments
        ],
        "reward": traj.reward,
        "policy_version": traj.policy_version,
    }
    if traj.teacher_logprobs is not None:
        record["teacher_logprobs"] = list(traj.teacher_logprobs)
    if traj.behaviour_logprobs is not None:
        record["behaviour_logprobs"] = list(traj.behaviour_logprobs)
    if traj.teacher_top_ids is not None:
        record["teacher_top_ids"] = list(traj.teacher_top_ids)
    if traj.teacher_top_logprobs is not None:
        record["teacher_top_logprobs"] = list(traj.teacher_top_logprobs)
    if traj.metadata is not None:
        record["metadata"] = dict(traj.metadata)
    return json.dumps(record)
