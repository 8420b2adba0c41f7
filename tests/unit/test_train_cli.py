from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from thundersync_core.cli import main

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "configs" / "train_embedded.yaml"


def _dry_run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main(["train", "--config", str(EMBEDDED), "--out", "unused", "--dry-run", *argv])
    assert code == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_set_overrides_any_key_with_a_yaml_value(capsys: pytest.CaptureFixture[str]) -> None:
    before = _dry_run(capsys)
    after = _dry_run(
        capsys,
        "--set", "resources.learner.cores=[0, 1]",
        "--set", "tasks.dev_tasks=0",
        "--set", "tasks.prep_dir=some/pools",
        "--schedule", "sync",
    )  # fmt: skip
    assert before["resources"]["learner"]["cores"] == [1]
    assert after["resources"]["learner"]["cores"] == [0, 1]
    assert after["tasks"]["dev_tasks"] == 0
    # A path given here is relative to where the command runs, not to the config file.
    assert after["tasks"]["prep_dir"] == "some/pools"
    assert after["schedule"] == "sync"
    # Nothing else moved.
    for config in (before, after):
        del config["resources"]["learner"]["cores"], config["schedule"]
        del config["tasks"]["dev_tasks"], config["tasks"]["prep_dir"]
    assert after == before


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("resources.learner.cores", "--set 'resources.learner.cores': expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("tasks..dev_tasks=3", "expected KEY=VALUE"),
        ("tasks.dev_tasks=[1", "--set 'tasks.dev_tasks=[1': VALUE is not YAML"),
        ("resources.learner.corez=[1]", "field resources.learner.corez"),
        ("schedule.name=sync", "override schedule.name: schedule is a value, not a section"),
    ],
)
def test_a_bad_set_is_refused_naming_it(
    item: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", "--config", str(EMBEDDED), "--out", "unused", "--dry-run", "--set", item])
    assert code == 2
    assert message in capsys.readouterr().err
