"""SWE-bench Verified records: the repositories and tasks training data must stay away from."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from data_prep.schema import SWEBenchRecord


def load_swe_bench(path: Path) -> list[SWEBenchRecord]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"SWE-bench records {path}: no such file")
    rows = pq.read_table(path).to_pylist()
    return [SWEBenchRecord.model_validate(row) for row in rows]


def normalise_repo(repo: str) -> str:
    """``owner/name`` from SWE-bench (``astropy/astropy``) or SWE-smith
    (``swesmith/astropy__astropy.26d14786``) spellings, lower-cased."""
    name = repo.split("/", 1)[1] if repo.startswith("swesmith/") else repo
    if "__" in name and "/" not in name:
        owner, rest = name.split("__", 1)
        name = f"{owner}/{rest.split('.', 1)[0]}"
    return name.lower()
