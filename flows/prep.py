"""``data_prep_flow``: validated, benchmark-separated task pools, reused when unchanged.

Load, filter, validate and split happen inside ``data_prep.pipeline.prepare``; the task
caches on the prep config's content (tasks/prep.py). The pools are logged to MLflow as
dataset inputs of a ``prep`` run whose digest is the prep manifest's hash.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.params import PrepParams, TrackingParams
from tasks import tracking
from tasks.prep import log_prep_run, prepare_pools
from tasks.progress import progress
from tasks.report import publish_report
from tasks.runs import close_run, open_run

__all__ = ["data_prep_flow"]


@flow(name="data-prep", log_prints=True)
def data_prep_flow(
    params: PrepParams = PrepParams(config="configs/prep_embedded.yaml"),  # noqa: B008
    tracking_params: TrackingParams | None = None,
    parent_run_id: str | None = None,
) -> dict[str, Any]:
    """Prepare (or reuse) the pools of ``params.config``; returns folder, hash, splits."""
    if not params.config:
        raise ValueError("prep.config: give a prep YAML (e.g. configs/prep_embedded.yaml)")
    started = time.monotonic()
    result = prepare_pools(Path(params.config), Path(params.out_root))
    if not (Path(result["prep_dir"]) / "manifest.json").is_file():
        # A cached result whose folder was deleted since: prepare again.
        result = prepare_pools.with_options(refresh_cache=True)(
            Path(params.config), Path(params.out_root)
        )
    settings = (tracking_params or TrackingParams()).resolved(Path(params.out_root), "data-prep")
    uri, study = str(settings.tracking_uri), str(settings.study)
    run = open_run(
        uri,
        study,
        name="prep",
        key_tags={"stage": "prep", "prep_dir": result["prep_dir"]},
        tags={"prefect.flow_run_id": str(flow_run.id or "")},
        params={"prep_config": str(Path(params.config).resolve())},
        parent_run_id=parent_run_id,
    )
    log_prep_run(uri, run["run_id"], Path(result["prep_dir"]))
    close_run(uri, run["run_id"])
    url = tracking.run_url(settings.ui_url, run["experiment_id"], run["run_id"])
    publish_report(
        "data-prep",
        f"# Task pools\n\nFolder: `{result['prep_dir']}`\n\nManifest sha256: "
        f"`{result['manifest_sha256']}`\n\nSplits: `{json.dumps(result['splits'])}`\n\n"
        f"MLflow run: [prep]({url})\n",
        description=f"prep of {params.config}",
    )
    splits = "; ".join(
        f"{pool}: " + ", ".join(f"{n} {split}" for split, n in counts.items())
        for pool, counts in result["splits"].items()
    )
    progress("prep", f"pools ready in {time.monotonic() - started:.0f} s ({splits})")
    return result | {"mlflow_run_id": run["run_id"]}
