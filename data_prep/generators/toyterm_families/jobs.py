"""The ``jobs`` family: run a provided program correctly (environment, arguments, stdin,
exit status). Each program sleeps one to three seconds first, so that episode run times
vary the way real tool calls do (a build, a download) and rollouts finish out of order.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from data_prep.generators.toyterm_families import checks
from data_prep.generators.toyterm_families.spec import (
    WORDS,
    Difficulty,
    TaskSpec,
    as_lines,
    pick,
    q,
    sentence,
    solution,
)


def build_jobs(rng: random.Random) -> TaskSpec:
    return rng.choice(_JOBS)(rng)


def _job_task(
    rng: random.Random,
    *,
    how: str,
    script_body: str,
    command: str,
    check: checks.Check,
    difficulty: Difficulty = "easy",
    files: dict[str, str] | None = None,
) -> TaskSpec:
    """``command`` and ``how`` may use ``{job}`` (the program's path relative to /app)."""
    job, delay_s = f"bin/{rng.choice(WORDS)}.sh", rng.randint(1, 3)
    script = (
        f"#!/bin/bash\n# Takes a while, like a real build step.\nsleep {delay_s}\n{script_body}"
    )
    return TaskSpec(
        instruction=f"The program {job} takes about {delay_s} second"
        f"{'s' if delay_s > 1 else ''} to run. " + how.format(job=job),
        solution=solution(command.format(job=f"./{job}")),
        checks=(check,),
        difficulty=difficulty,
        category="process",
        tags=("process", "sleep"),
        files={job: script, **(files or {})},
        executables=frozenset({job}),
        run_time_s=float(delay_s),
    )


def _with_env(rng: random.Random) -> TaskSpec:
    variable = f"{rng.choice(WORDS).upper()}_TOKEN"
    value = f"{rng.choice(WORDS)}{rng.randint(10, 999)}"
    items = rng.randint(1, 99)
    body = (
        f'if [ -z "${{{variable}:-}}" ]; then echo "{variable} is not set" >&2; exit 2; fi\n'
        f'echo "report for ${variable}"\necho "items: {items}"\n'
    )
    out = f"{rng.choice(WORDS)}.out"
    return _job_task(
        rng,
        how=f"Run it with the environment variable {variable} set to `{value}` and save "
        f"everything it prints on standard output to {out}",
        script_body=body,
        command=f"{variable}={q(value)} {{job}} > {out}",
        check=checks.text(out, f"report for {value}\nitems: {items}\n"),
    )


def _with_args(rng: random.Random) -> TaskSpec:
    source, target = pick(rng, 2)
    count = rng.randint(1, 9)
    body = (
        'if [ "$#" -ne 3 ]; then echo "usage: job FROM TO COUNT" >&2; exit 2; fi\n'
        'for i in $(seq 1 "$3"); do echo "$i: $1 -> $2"; done\n'
    )
    out = f"{rng.choice(WORDS)}.out"
    return _job_task(
        rng,
        how=f"Run it with the three arguments `{source}`, `{target}` and `{count}` (in that "
        f"order) and save its standard output to {out}",
        script_body=body,
        command=f"{{job}} {source} {target} {count} > {out}",
        check=checks.text(
            out, as_lines([f"{i}: {source} -> {target}" for i in range(1, count + 1)])
        ),
    )


def _exit_status(rng: random.Random) -> TaskSpec:
    status = rng.randint(2, 9)
    body = f'echo "checking {rng.choice(WORDS)}..."\necho "failed" >&2\nexit {status}\n'
    out = f"{rng.choice(WORDS)}_status.txt"
    return _job_task(
        rng,
        how=f"Run it and write its exit status (only the number) to {out}",
        script_body=body,
        command=f"{{job}} > /dev/null 2>&1; echo $? > {out}",
        check=checks.number(out, status),
        difficulty="medium",
    )


def _with_stdin(rng: random.Random) -> TaskSpec:
    lines = [sentence(rng, WORDS, 1, 4) for _ in range(rng.randint(1, 12))]
    source, out = f"{rng.choice(WORDS)}.txt", f"{rng.choice(WORDS)}.out"
    body = 'n=0\nwhile IFS= read -r line; do n=$((n + 1)); echo "$n ${line^^}"; done\n'
    return _job_task(
        rng,
        how=f"Run it with {source} as its standard input and save its standard output to {out}",
        script_body=body,
        command=f"{{job}} < {source} > {out}",
        check=checks.text(out, as_lines([f"{n} {ln.upper()}" for n, ln in enumerate(lines, 1)])),
        difficulty="medium",
        files={source: as_lines(lines)},
    )


_JOBS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _with_env,
    _with_args,
    _exit_status,
    _with_stdin,
)
