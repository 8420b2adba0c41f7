"""The console of a flow run: progress lines shown, INFO lines and stray output in a file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tasks.progress import eta_line, step_line

SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    import flows.experiment  # what the CLI has imported (loggers with their own handlers)
    from tasks.progress import progress, quiet_console, restore_console

    quiet_console(Path(sys.argv[1]))
    logging.getLogger("prefect.flow_runs").info("flow info line")
    logging.getLogger("vllm.engine").info("engine info line")
    logging.getLogger("mlflow.store").info("mlflow info line")
    logging.getLogger("mlflow.store").warning("mlflow warning line")
    logging.getLogger("thundersync").warning("a warning that matters")
    print("a stray print")
    import subprocess
    subprocess.run([sys.executable, "-c", "import os; os.write(2, b'a child process line')"])
    logging.getLogger("vllm.config").warning("a vllm start-up warning")
    sys.stderr.write("a progress bar\\r")
    progress("train sync-seed0", "3/12: step 18.1 s")

    from prefect import flow

    @flow(log_prints=True)
    def stage():  # Prefect's print goes to the run logger; progress must not
        print("a flow print")
        progress("eval sync-seed0", "3 checkpoints in 20 s")

    stage()
    restore_console()
    print("the final report")
    """
)


def test_quiet_console_shows_progress_and_warnings_and_files_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "experiment.log"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    shown = done.stdout + done.stderr
    kept = ("train sync-seed0: 3/12: step 18.1 s", "eval sync-seed0: 3 checkpoints in 20 s",
            "the final report", "a warning that matters")  # fmt: skip
    for line in (*kept, "mlflow warning line"):
        assert line in shown, shown
    for line in ("flow info line", "engine info line", "mlflow info line", "a stray print",
                 "a progress bar", "a flow print", "a child process line",
                 "a vllm start-up warning"):  # fmt: skip
        assert line not in shown, shown
        assert line in log.read_text()
    assert "train sync-seed0: 3/12" in log.read_text()


def test_eta_and_step_lines() -> None:
    assert eta_line(3, 12, 10.0) == "3/12, ETA 1 min 30 s"
    assert eta_line(12, 12, 10.0) == "12/12"
    record = {"step_wall_s": 9.04, "learner_tail_s": 0.5, "reward_mean": 0.6,
              "staleness_tokens": {"0": 30, "1": 10}, "inflight_swaps": 4}  # fmt: skip
    assert step_line(record) == (
        "step 9.0 s, tail 0.5 s, reward 0.60, stale tokens 25%, in-flight swaps 4"
    )
    assert "stale" not in step_line(record | {"staleness_tokens": {"0": 40}})
