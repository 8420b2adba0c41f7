"""SWE-bench Verified records: the repositories and tasks training data must stay away from."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
from pydantic import ValidationError

from data_prep.schema import Quarantined, SWEBenchRecord, first_error


def load_swe_bench(
    path: Path, source: str = "swe-bench-verified"
) -> tuple[list[SWEBenchRecord], list[Quarantined]]:
    """Valid records and the quarantined rest (a malformed record is named, never dropped)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"SWE-bench records {path}: no such file")
    records, quarantined = [], []
    for index, row in enumerate(pq.read_table(path).to_pylist()):
        try:
            records.append(SWEBenchRecord.model_validate(row))
        except ValidationError as exc:
            record_id = str(row.get("instance_id") or f"row {index}")
            quarantined.append(Quarantined(source, record_id, first_error(exc)))
    return records, quarantined


def normalise_repo(repo: str) -> str:
    """``owner/name`` from SWE-bench (``astropy/astropy``) or SWE-smith
    (``swesmith/astropy__astropy.26d14786``) spellings, lower-cased."""
    name = repo.split("/", 1)[1] if repo.startswith("swesmith/") else repo
    if "__" in name and "/" not in name:
        owner, rest = name.split("__", 1)
        name = f"{owner}/{rest.split('.', 1)[0]}"
    return name.lower()
