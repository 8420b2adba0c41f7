"""The prep configuration: one YAML file, paths relative to it.

Example::

    seed: 0
    dev_fraction: 0.05
    swe_bench_verified: ../data/swe-bench-verified/test.parquet
    swe_sources:
      - {kind: minismith, name: minismith, max_per_project: 20}
      - {kind: file, name: swe-smith-sample, path: pools/swe_smith.jsonl}
      - {kind: hub, name: SWE-bench/SWE-smith, split: train}      # needs a network
    terminal_sources:
      - {kind: toyterm, name: toyterm, n_tasks: 240}
      - {kind: dir, name: seta-env, path: pools/seta}
    terminal_eval_dir: pools/terminal-bench-2
    validation: {enabled: true, workers: 2, timeout_s: 120}
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SWESource(_Strict):
    kind: Literal["hub", "file", "minismith"]
    name: str = Field(min_length=1)
    path: Path | None = None
    split: str = "train"
    revision: str | None = None
    projects: list[Path] | None = None  # minismith: None = the projects shipped in the repo
    max_per_project: int = Field(20, ge=1)

    @model_validator(mode="after")
    def _path_for_files(self) -> SWESource:
        if self.kind == "file" and self.path is None:
            raise ValueError(f"swe source {self.name!r}: kind 'file' needs a path")
        return self


class TerminalSource(_Strict):
    kind: Literal["dir", "toyterm"]
    name: str = Field(min_length=1)
    path: Path | None = None
    n_tasks: int = Field(240, ge=1)
    #: toyterm families to generate (empty: all).
    families: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _path_for_dirs(self) -> TerminalSource:
        if self.kind == "dir" and self.path is None:
            raise ValueError(f"terminal source {self.name!r}: kind 'dir' needs a path")
        if self.kind == "dir" and self.families:
            raise ValueError(f"terminal source {self.name!r}: families is for kind 'toyterm'")
        _known_families(self.families, f"terminal source {self.name!r}")
        return self


class Filters(_Strict):
    max_patch_chars: int = 20_000
    max_problem_chars: int = 10_000
    min_instruction_chars: int = 10
    max_instruction_chars: int = 4_000


class Validation(_Strict):
    enabled: bool = True
    workers: int = Field(2, ge=1)
    timeout_s: float = Field(120.0, gt=0)


class WarmStartPool(_Strict):
    """Generated terminal tasks for the supervised warm start only: never trained on with RL
    and never evaluated. A task whose instruction equals a train, dev or evaluation task's
    is dropped, so the warm start cannot see a dev instance."""

    n_tasks: int = Field(ge=1)
    #: toyterm families to generate (empty: all).
    families: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _families(self) -> WarmStartPool:
        _known_families(self.families, "warm_start_pool")
        return self


def _known_families(families: list[str], where: str) -> None:
    from data_prep.generators.toyterm_families import FAMILIES  # noqa: PLC0415

    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"{where}: unknown toyterm families {unknown}; known: {sorted(FAMILIES)}")


class PrepConfig(_Strict):
    seed: int = 0
    dev_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    #: What a terminal dev split holds out: whole families (generalisation to unseen kinds
    #: of task) or single tasks (unseen instances of the kinds trained on).
    terminal_dev_group: Literal["family", "task"] = "family"
    swe_sources: list[SWESource] = Field(default_factory=list)
    terminal_sources: list[TerminalSource] = Field(default_factory=list)
    swe_bench_verified: Path | None = None
    terminal_eval_dir: Path | None = None
    filters: Filters = Field(default_factory=Filters)
    validation: Validation = Field(default_factory=Validation)
    warm_start_pool: WarmStartPool | None = None


def _resolve(path: Path | None, base: Path) -> Path | None:
    return None if path is None or path.is_absolute() else (base / path).resolve()


def load_prep_config(path: Path) -> PrepConfig:
    """Parse and validate a YAML config; relative paths resolve against its folder."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    raw = yaml.safe_load(path.read_text()) or {}
    try:
        config = PrepConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"--config {path}: field {where}: {first['msg']}") from None
    base = path.parent.resolve()
    for source in config.swe_sources:
        source.path = _resolve(source.path, base) or source.path
        if source.projects is not None:
            source.projects = [_resolve(p, base) or p for p in source.projects]
    for term in config.terminal_sources:
        term.path = _resolve(term.path, base) or term.path
    config.swe_bench_verified = (
        _resolve(config.swe_bench_verified, base) or config.swe_bench_verified
    )
    config.terminal_eval_dir = _resolve(config.terminal_eval_dir, base) or config.terminal_eval_dir
    return config
