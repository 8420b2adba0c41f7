"""Record schemas of the task pools, and the quarantine every malformed record goes to.

SWE-smith instances (and the SWE-bench records used for separation and evaluation) store
FAIL_TO_PASS / PASS_TO_PASS either as lists or as JSON strings depending on the release;
both are accepted and normalised to lists. Terminal tasks are folders (Harbor format, or
the older Terminal-Bench layout) described by a ``TerminalTaskRecord``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


def test_list(value: Any) -> list[str]:
    """A list of test ids from a list or a JSON-encoded list."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list of test ids ({exc.msg})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be a list of test ids (strings)")
    return list(value)


class SWESmithRecord(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    patch: str = Field(min_length=1)
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    image_name: str = ""
    base_commit: str = ""
    problem_statement: str = ""
    created_at: str = ""

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _tests(cls, value: Any) -> list[str]:
        return test_list(value)

    @field_validator("created_at", "image_name", "base_commit", mode="before")
    @classmethod
    def _text(cls, value: Any) -> str:
        return "" if value is None else str(value)


class SWEBenchRecord(BaseModel):
    """The fields of a SWE-bench (Verified) record that separation and evaluation use."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    instance_id: str
    repo: str
    base_commit: str
    patch: str = ""
    test_patch: str = ""
    problem_statement: str = ""
    FAIL_TO_PASS: list[str] = Field(default_factory=list)
    PASS_TO_PASS: list[str] = Field(default_factory=list)

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _tests(cls, value: Any) -> list[str]:
        return test_list(value)


@dataclass(frozen=True)
class TerminalTaskRecord:
    task_id: str
    source: str
    family: str
    layout: str  # "harbor" or "terminal-bench"
    instruction: str
    path: str  # the task folder
    difficulty: str = ""
    content_digest: str = ""  # over the task's files: exact-duplicate detection
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Quarantined:
    source: str
    record_id: str
    reason: str


def first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "record"
    return f"field {where}: {first['msg']}"
