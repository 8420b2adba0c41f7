"""toyterm: a generated pool of small SETA-like terminal tasks in Harbor format.

The embedded default trains and evaluates on terminal tasks that must run offline on two
CPU cores. toyterm makes them: the families of ``toyterm_families.FAMILIES`` cover files
to create, text transforms (sort/uniq/sed/tr/cut), counting, search across nested folders,
tar/gzip archives, JSON and CSV, renaming many files, permissions, scripts checked on hidden
inputs, and running programs (with short sleeps, so episode times vary). Difficulty ranges
from one short command (``oneliner``: ``echo``, ``wc -l``, ``head``, a policy of a few
million parameters can learn some) to multi-step scripts.

A task folder ``<out_dir>/toyterm-<family>-<nnnn>/`` holds ``task.toml``, ``instruction.md``,
``environment/`` (a Dockerfile FROM python:3.11-slim that COPYs the input files, and the
files), ``solution/solve.sh`` (the reference, run with bash in /app) and ``tests/``:
``test.sh`` runs ``python3 -I -S test_outputs.py`` and then, last, replaces
/logs/verifier with a fresh folder holding reward.txt: 1 if the checks passed, else 0.
``-I`` keeps files the agent left in /app or $HOME (a ``sitecustomize``, a user
site-packages) out of the verifier's interpreter; ``-S`` skips site-packages altogether
(the checks use the standard library only, and start faster without them). The checks and
every expected value live in ``test_outputs.py`` (see ``verifier_runtime.py``).

Determinism: task ``n`` of a family draws its parameters from ``random.Random`` seeded with
the string ``toyterm:<seed>:<family>:<n>`` (string seeds are hashed with SHA-512, not with
Python's per-process hash); files are written with fixed modes, archives with fixed times.
The same ``(n_tasks, seed)`` gives byte-identical folders, and a larger ``n_tasks`` only
adds tasks. A draw whose instruction repeats an earlier task's is drawn again.

A scripting task runs the agent's script inside the verifier, with the verifier's rights.
So each run gets its own session, killed when the run ends; before exiting, the checks
kill every process started since ``test.sh`` began that is not one of their ancestors (a
daemon that left the session); the reward is written after that; and a verifier killed
by a signal (the script killing ``test.sh``) earns 0 from the grader. ``task.toml`` says
``[verifier] workdir_only = true``: every check reads /app, so the grader may verify in a
fresh environment holding only the workdir (on Docker, away from an interpreter the agent
replaced as root).
"""

from __future__ import annotations

import argparse
import json
import os
import pprint
import random
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from data_prep.generators.toyterm_families import FAMILIES, TaskSpec
from data_prep.generators.toyterm_families.verifier_runtime import PROGRAM_TIMEOUT_S

__all__ = ["TASK_PREFIX", "generate", "main", "write_task"]

TASK_PREFIX = "toyterm"
_BASE_IMAGE = "python:3.11-slim"
_AGENT_TIMEOUT_S = {"easy": 120.0, "medium": 300.0, "hard": 600.0}
_VERIFIER_TIMEOUT_S = 60.0
# Every family draws distinct instructions in a handful of tries; far more means a bug.
_MAX_DRAWS = 50
_RUNTIME_SOURCE = Path(__file__).with_name("toyterm_families") / "verifier_runtime.py"

TEST_SH = """\
#!/bin/bash
# Verifier: reward 1 iff every check in test_outputs.py passes on the files in /app.
# The reward is written once, last, over whatever the checked programs left in
# /logs/verifier (the checks kill those programs before they return: every process that
# started after this shell and is not among their ancestors).
export TOYTERM_VERIFIER_PID=$$
reward=0
if cd /app && python3 -I -S /tests/test_outputs.py; then
  reward=1
fi
rm -rf /logs/verifier
mkdir -p /logs/verifier
echo "$reward" > /logs/verifier/reward.txt
"""


# Instructions name files as the commands that solve them do (``tango.txt``, not
# ``/app/tango.txt``), so a policy copies a name token for token; this line says where.
WORKDIR_NOTE = "Paths are relative to /app, where every command runs."


def generate(
    out_dir: Path, *, n_tasks: int = 240, seed: int = 0, families: Sequence[str] = ()
) -> list[Path]:
    """Write ``n_tasks`` task folders under ``out_dir``, families in turn; returns them sorted.

    ``families`` keeps to those families (empty: all). A task folder that already exists is
    replaced; nothing else in ``out_dir`` is touched.
    """
    if n_tasks < 1:
        raise ValueError(f"toyterm: n_tasks must be >= 1, got {n_tasks}")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"toyterm: unknown families {unknown}; known: {sorted(FAMILIES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [f for f in FAMILIES if not families or f in families]
    seen: set[str] = set()
    written = []
    for index in range(n_tasks):
        family, number = names[index % len(names)], index // len(names)
        spec = _draw(family, number, seed, seen)
        seen.add(spec.instruction)
        task_id = f"{TASK_PREFIX}-{family}-{number:04d}"
        written.append(write_task(out_dir / task_id, spec, family=family, seed=seed))
    return sorted(written)


def _draw(family: str, number: int, seed: int, seen: set[str]) -> TaskSpec:
    rng = random.Random(f"{TASK_PREFIX}:{seed}:{family}:{number}")
    for _ in range(_MAX_DRAWS):
        spec = FAMILIES[family](rng)
        if spec.instruction not in seen:
            return spec
    raise RuntimeError(
        f"toyterm family {family!r}, task {number}: no new instruction in {_MAX_DRAWS} draws"
    )


def write_task(task_dir: Path, spec: TaskSpec, *, family: str, seed: int) -> Path:
    """Write one Harbor task folder for ``spec``; returns ``task_dir``."""
    if task_dir.exists():
        shutil.rmtree(task_dir)
    files: dict[str, tuple[bytes, int]] = {
        "task.toml": (_task_toml(spec, family, seed).encode(), 0o644),
        "instruction.md": (f"{spec.instruction.rstrip()}\n\n{WORKDIR_NOTE}\n".encode(), 0o644),
        "environment/Dockerfile": (_dockerfile(spec).encode(), 0o644),
        "solution/solve.sh": (spec.solution.encode(), 0o755),
        "tests/test.sh": (TEST_SH.encode(), 0o755),
        "tests/test_outputs.py": (_test_outputs(spec).encode(), 0o644),
    }
    for rel, content in spec.files.items():
        data = content.encode() if isinstance(content, str) else content
        files[f"environment/{rel}"] = (data, 0o755 if rel in spec.executables else 0o644)
    for rel in sorted(files):
        data, mode = files[rel]
        target = task_dir.joinpath(*PurePosixPath(rel).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.chmod(target, mode)
    # Folder modes would otherwise follow the caller's umask.
    for folder in [task_dir, *(path for path in task_dir.rglob("*") if path.is_dir())]:
        os.chmod(folder, 0o755)
    return task_dir


def _toml_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def _task_toml(spec: TaskSpec, family: str, seed: int) -> str:
    agent_timeout_s = _AGENT_TIMEOUT_S[spec.difficulty] + 10 * spec.run_time_s
    program_cases = sum(len(c["cases"]) for c in spec.checks if c["kind"] == "program")
    verifier_timeout_s = _VERIFIER_TIMEOUT_S + PROGRAM_TIMEOUT_S * program_cases
    return (
        'version = "1.0"\n\n'
        "[metadata]\n"
        f"family = {json.dumps(family)}\n"
        f"difficulty = {json.dumps(spec.difficulty)}\n"
        f"category = {json.dumps(spec.category)}\n"
        f"tags = {_toml_list(spec.tags)}\n"
        f'generator = "{TASK_PREFIX}"\n'
        f"seed = {seed}\n\n"
        "[verifier]\n"
        f"timeout_sec = {verifier_timeout_s:.1f}\n"
        # Every check reads /app: the verifier needs nothing else the agent could change.
        "workdir_only = true\n\n"
        "[agent]\n"
        f"timeout_sec = {agent_timeout_s:.1f}\n"
    )


def _dockerfile(spec: TaskSpec) -> str:
    lines = [f"FROM {_BASE_IMAGE}", "WORKDIR /app"]
    tops = sorted({PurePosixPath(rel).parts[0] for rel in spec.files})
    nested = {
        PurePosixPath(rel).parts[0] for rel in spec.files if len(PurePosixPath(rel).parts) > 1
    }
    lines.extend(f"COPY {t}/ /app/{t}/" if t in nested else f"COPY {t} /app/{t}" for t in tops)
    return "\n".join(lines) + "\n"


def _test_outputs(spec: TaskSpec) -> str:
    checks_literal = pprint.pformat(list(spec.checks), width=96, sort_dicts=True)
    return (
        _RUNTIME_SOURCE.read_text()
        + "\n\n# This task's checks. Every expected value lives here, in /tests.\n"
        + f"CHECKS = {checks_literal}\n\n"
        + 'if __name__ == "__main__":\n    main(CHECKS)\n'
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.generators.toyterm",
        description="Write a pool of toyterm terminal tasks (Harbor format).",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--n-tasks", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = generate(args.out_dir, n_tasks=args.n_tasks, seed=args.seed)
    families = Counter(
        path.name.rsplit("-", 1)[0].removeprefix(f"{TASK_PREFIX}-") for path in paths
    )
    print(json.dumps({"tasks": len(paths), "out_dir": str(args.out_dir), "families": families}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
