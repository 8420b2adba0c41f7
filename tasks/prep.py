"""The prep stage as a Prefect task, reused whenever its inputs are the same.

The output folder is named by a key over the resolved prep config and the data_prep
sources (``<out_root>/prep-<key>``), so two flows asking for the same pools share one
folder, and a changed config or generator gets a new one. Prefect's cache uses the same
key (``data_prep_flow`` refreshes a cached result whose folder was deleted since). Prep
writes into a temporary sibling and renames it when done, so an interrupted prep leaves
nothing that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from tasks import tracking
from tasks.common import IO_RETRY

__all__ = ["PREP_PACKAGE", "log_prep_run", "prep_key", "prep_output_dir", "prepare_pools"]

PREP_PACKAGE = Path(__file__).resolve().parent.parent / "data_prep"


def prep_key(prep_config: Path) -> str:
    """sha256 over the resolved config and the data_prep sources that turn it into pools."""
    from data_prep.config import load_prep_config  # noqa: PLC0415

    digest = hashlib.sha256(load_prep_config(prep_config).model_dump_json().encode())
    for source in sorted(PREP_PACKAGE.rglob("*.py")):
        digest.update(str(source.relative_to(PREP_PACKAGE)).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def prep_output_dir(prep_config: Path, out_root: Path) -> Path:
    return Path(out_root).resolve() / f"prep-{prep_key(prep_config)[:16]}"


def _cache_key(_: TaskRunContext, parameters: dict[str, Any]) -> str:
    return f"prep-{prep_output_dir(parameters['prep_config'], parameters['out_root'])}"


@task(cache_key_fn=_cache_key, persist_result=True, retries=0)
def prepare_pools(prep_config: Path, out_root: Path) -> dict[str, Any]:
    """Run (or reuse) ``thundersync prep``; returns the folder, manifest hash and splits."""
    from data_prep.config import load_prep_config  # noqa: PLC0415
    from data_prep.pipeline import prepare  # noqa: PLC0415

    out = prep_output_dir(prep_config, out_root)
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        prepare(load_prep_config(prep_config), partial)
        partial.rename(out)
    manifest = json.loads(manifest_path.read_text())
    return {
        "prep_dir": str(out),
        "manifest_sha256": hashlib.sha256(manifest_path.read_bytes()).hexdigest(),
        "splits": manifest["splits"],
    }


@task(**IO_RETRY)
def log_prep_run(tracking_uri: str, run_id: str, prep_dir: Path) -> list[str]:
    """The prep run's record: dataset inputs, manifest and quarantine files, dataset tags."""
    client = tracking.connect(tracking_uri)
    sha256 = tracking.dataset_digest(prep_dir)
    client.set_tag(run_id, "dataset_sha256", sha256)
    client.set_tag(run_id, "dataset_digest", sha256[:32])
    names = tracking.log_prep_datasets(client, run_id, prep_dir)
    for name in ("manifest.json", "quarantine.jsonl", "filtered.jsonl"):
        if (Path(prep_dir) / name).is_file():
            client.log_artifact(run_id, str(Path(prep_dir) / name), "prep")
    return names
