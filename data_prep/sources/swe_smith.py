"""SWE-smith instances from the hub (``datasets.load_dataset``) or local parquet/jsonl/json.

Hub loading is the real code path used when a network exists; here pools come from local
files or from the offline ``minismith`` generator. A malformed record is quarantined with
its source, id (or row number) and reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from pydantic import ValidationError

from data_prep.schema import Quarantined, SWESmithRecord, first_error


def rows_from_file(path: Path) -> Iterator[Mapping[str, Any]]:
    """Rows of a parquet, jsonl or json (list of objects) file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from pq.read_table(path).to_pylist()
    elif suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        yield {"__error__": f"line {lineno}: not JSON ({exc.msg})"}
    elif suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        yield from data if isinstance(data, list) else [data]
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r} (parquet, jsonl or json)")


def rows_from_hub(name: str, split: str = "train", revision: str | None = None) -> Iterator[Any]:
    """Rows of a hub dataset; needs network access (or a warm local cache)."""
    import datasets  # noqa: PLC0415 - heavy, and only needed for hub sources

    yield from datasets.load_dataset(name, split=split, revision=revision)


def parse_rows(
    rows: Iterable[Mapping[str, Any]], source: str
) -> tuple[list[SWESmithRecord], list[Quarantined]]:
    records, quarantined = [], []
    for index, row in enumerate(rows):
        record_id = str(row.get("instance_id") or f"row {index}")
        if "__error__" in row:
            quarantined.append(Quarantined(source, record_id, str(row["__error__"])))
            continue
        try:
            records.append(SWESmithRecord.model_validate(row))
        except ValidationError as exc:
            quarantined.append(Quarantined(source, record_id, first_error(exc)))
    return records, quarantined
