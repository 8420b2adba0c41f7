"""Screenshots of the Prefect UI (an experiment flow run) and the MLflow compare view.

    python scripts/ui_screenshots.py --config configs/experiment_embedded.yaml
    python scripts/ui_screenshots.py --reuse            # screenshot an earlier run again

Runs ``thundersync experiment`` into ``--work`` (Prefect in ephemeral mode with its own
PREFECT_HOME there, MLflow on SQLite there), starts a Prefect server and an MLflow server
on those stores, and takes headless Chromium screenshots through selenium and
chromedriver (Debian packages ``chromium`` and ``chromium-driver``) into ``--out``:

- ``prefect_flow_run.png``: the experiment's flow run with its subflows and tasks;
- ``prefect_artifact.png``: the experiment report artifact with its MLflow links;
- ``mlflow_compare.png``: MLflow's compare view of the training runs, one per schedule;
- ``mlflow_charts.png``: the experiment's chart view, the schedules' curves side by side.

It stops the servers it started when done.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(work: Path) -> dict[str, str]:
    env = os.environ | {
        "PREFECT_HOME": str(work / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    return env


def run_experiment(work: Path, config: Path, schedules: str, steps: int | None) -> None:
    argv = [str(BIN / "thundersync"), "experiment", "--config", str(config)]
    argv += ["--out", str(work), "--schedules", schedules]
    argv += ["--steps", str(steps)] if steps else []
    print("running:", " ".join(argv), flush=True)
    subprocess.run(argv, env=_env(work), cwd=ROOT, check=True)


def _get(url: str, data: dict | None = None) -> object:
    body = json.dumps(data).encode() if data is not None else None
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"null")


def _wait(url: str, process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


@contextmanager
def servers(work: Path) -> Iterator[tuple[str, str]]:
    """A Prefect server on the work folder's PREFECT_HOME and an MLflow server on its
    SQLite store; yields their base URLs and stops both on exit."""
    prefect_port, mlflow_port = _free_port(), _free_port()
    logs = work / "server-logs"
    logs.mkdir(parents=True, exist_ok=True)
    database = f"sqlite:///{(work / 'mlflow.db').resolve()}"
    commands = {
        "prefect": [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port"],
        "mlflow": [str(BIN / "mlflow"), "server", "--workers", "1", "--host", "127.0.0.1"],
    }
    commands["prefect"].append(str(prefect_port))
    commands["mlflow"] += ["--port", str(mlflow_port), "--backend-store-uri", database]
    started = {}
    try:
        for name, argv in commands.items():
            log = (logs / f"{name}.log").open("w")
            # The Prefect UI asks the API where this setting says (default port 4200).
            env = _env(work) | {"PREFECT_UI_API_URL": f"http://127.0.0.1:{prefect_port}/api"}
            started[name] = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
            )
        prefect, mlflow = f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}"
        _wait(f"{prefect}/api/health", started["prefect"])
        _wait(f"{mlflow}/health", started["mlflow"])
        yield prefect, mlflow
    finally:
        for process in started.values():
            process.terminate()
        for process in started.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def latest_experiment_run(prefect: str) -> dict:
    runs = _get(
        f"{prefect}/api/flow_runs/filter",
        {
            "flows": {"name": {"any_": ["experiment"]}},
            "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}},
            "sort": "START_TIME_DESC",
            "limit": 1,
        },
    )
    if not runs:
        raise LookupError("the Prefect database holds no completed experiment flow run")
    return runs[0]  # type: ignore[index]


def report_artifact(prefect: str, flow_run_id: str) -> str:
    artifacts = _get(
        f"{prefect}/api/artifacts/filter",
        {"artifacts": {"key": {"any_": ["experiment"]}, "flow_run_id": {"any_": [flow_run_id]}}},
    )
    if not artifacts:
        raise LookupError(f"flow run {flow_run_id} published no experiment artifact")
    return artifacts[0]["id"]  # type: ignore[index]


def training_runs(mlflow: str, flow_run_id: str) -> tuple[str, str, list[str]]:
    """(experiment id, parent run name, training run ids) of the experiment flow run."""
    parents = _get(
        f"{mlflow}/api/2.0/mlflow/runs/search",
        {
            "experiment_ids": [e["experiment_id"] for e in _experiments(mlflow)],
            "filter": f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.stage = 'experiment'",
        },
    )["runs"]  # type: ignore[index]
    parent = parents[0]["info"]
    children = _get(
        f"{mlflow}/api/2.0/mlflow/runs/search",
        {
            "experiment_ids": [parent["experiment_id"]],
            "filter": f"tags.mlflow.parentRunId = '{parent['run_id']}' and tags.stage = 'train'",
            "order_by": ["attributes.run_name ASC"],
        },
    )["runs"]  # type: ignore[index]
    ids = [c["info"]["run_id"] for c in children]
    return parent["experiment_id"], parent["run_name"], ids


def _experiments(mlflow: str) -> list[dict]:
    return _get(f"{mlflow}/api/2.0/mlflow/experiments/search", {"max_results": 1000})["experiments"]  # type: ignore[index]


#: localStorage of the MLflow UI (``<key>_v<version>``, JSON): the training-runs views,
#: and its assistant panel closed so it does not cover the page.
MLFLOW_UI_STATE = {
    "mlflow.workflowType_v1": "machine_learning",
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True,
    "mlflow.assistant.panelOpen_v1": False,
}
#: The charts shown side by side: the step timeline of each schedule, then its scores.
CHARTS = "step_wall_s|learner_idle_fraction|learner_tail_s|reward_mean|eval_pass_at_1$"


def browser(width: int = 1600, height: int = 1000) -> Any:
    """Headless Chromium driven by chromedriver (Debian packages chromium, chromium-driver)."""
    from selenium import webdriver  # noqa: PLC0415
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        raise FileNotFoundError("install chromium and chromium-driver (apt-get install -y ...)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # --no-sandbox: root in a container has no user-namespace sandbox.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def _wait_for_text(driver: Any, text: str, timeout_s: float = 60) -> None:
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    WebDriverWait(driver, timeout_s).until(lambda d: text in d.page_source)
    time.sleep(2)  # let the charts finish drawing


def _save(driver: Any, path: Path, height: int) -> Path:
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    driver.set_window_size(driver.get_window_size()["width"], height)
    # MLflow's assistant panel can open by itself and cover a third of the page.
    for close in driver.find_elements(
        By.CSS_SELECTOR, "[data-component-id='mlflow.assistant.chat_panel.close']"
    ):
        close.click()
        time.sleep(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
    print(f"{path}: {driver.current_url}", flush=True)
    return path


def prefect_shots(driver: Any, prefect: str, out: Path) -> list[Path]:
    flow_run = latest_experiment_run(prefect)
    driver.get(f"{prefect}/runs/flow-run/{flow_run['id']}")
    _wait_for_text(driver, "Task runs")
    shots = [_save(driver, out / "prefect_flow_run.png", 1000)]
    driver.get(f"{prefect}/artifacts/artifact/{report_artifact(prefect, flow_run['id'])}")
    _wait_for_text(driver, "matched device-hours")
    shots.append(_save(driver, out / "prefect_artifact.png", 1300))
    return shots


def mlflow_shots(driver: Any, mlflow: str, flow_run_id: str, out: Path) -> list[Path]:
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    experiment_id, parent_name, run_ids = training_runs(mlflow, flow_run_id)
    driver.get(f"{mlflow}/")
    for key, value in MLFLOW_UI_STATE.items():
        driver.execute_script(
            "localStorage.setItem(arguments[0], arguments[1])", key, json.dumps(value)
        )
    driver.get(
        f"{mlflow}/#/compare-runs?runs={quote(json.dumps(run_ids))}"
        f"&experiments={quote(json.dumps([experiment_id]))}"
    )
    _wait_for_text(driver, f"Comparing {len(run_ids)} Runs")
    shots = [_save(driver, out / "mlflow_compare.png", 1400)]
    # The runs' chart view: the training runs of this experiment, under their parent run.
    search = quote("tags.stage = 'train'")
    driver.get(
        f"{mlflow}/#/experiments/{experiment_id}/runs?compareRunsMode=CHART&searchFilter={search}"
    )
    _wait_for_text(driver, "matching runs")
    # The expander of the parent run's row (MLflow 3.17's run name cell).
    for button in driver.find_elements(
        By.CSS_SELECTOR, "button[data-component-id$='runnamecellrenderer.tsx_46']"
    ):
        button.click()
    # Hide the parent run (it has no step metrics) so the legends name the schedules' runs.
    driver.find_element(
        By.XPATH,
        f"//div[@role='row'][.//a[normalize-space()='{parent_name}']]"
        "//label[input[contains(@class, 'is-visibility-toggle-checkbox')]]",
    ).click()
    driver.find_element(By.CSS_SELECTOR, "input[placeholder='Search metric charts']").send_keys(
        CHARTS
    )
    _wait_for_text(driver, "learner_idle_fraction")
    shots.append(_save(driver, out / "mlflow_charts.png", 1300))
    return shots


def take_all(prefect: str, mlflow: str, out: Path) -> list[Path]:
    driver = browser()
    try:
        shots = prefect_shots(driver, prefect, out)
        flow_run_id = latest_experiment_run(prefect)["id"]
        return shots + mlflow_shots(driver, mlflow, flow_run_id, out)
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/experiment_embedded.yaml")
    parser.add_argument("--schedules", default="sync,thundersync")
    parser.add_argument("--steps", type=int, help="steps of every run (default: the config's)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs/ui-demo")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/screenshots")
    parser.add_argument("--reuse", action="store_true", help="skip the experiment run")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    (work / "prefect-home").mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        run_experiment(work, args.config, args.schedules, args.steps)
    with servers(work) as (prefect, mlflow):
        take_all(prefect, mlflow, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
