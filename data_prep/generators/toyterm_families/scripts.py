"""Families where the agent writes a script that the verifier runs on hidden inputs.

The instruction shows one example; the verifier runs the script on three other inputs,
drawn from the same generator, that exist only in ``/tests``. A script that merely prints
the example's answer therefore fails.
"""

from __future__ import annotations

import random
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from data_prep.generators.toyterm_families import checks
from data_prep.generators.toyterm_families.spec import (
    WORDS,
    Difficulty,
    TaskSpec,
    as_lines,
    pick,
    random_tree,
    sentence,
    solution,
)

_HIDDEN_CASES = 3
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Problem:
    """What the script must do, an example, and the hidden cases."""

    description: str
    example: str
    reference: str
    cases: list[dict[str, object]]
    difficulty: Difficulty


def _script_task(
    rng: random.Random, problem: _Problem, language: str, argv_head: str, tag: str
) -> TaskSpec:
    ext = "sh" if language == "bash" else "py"
    script = f"{rng.choice(WORDS)}_{tag}.{ext}"
    marker = "SH" if language == "bash" else "PY"
    return TaskSpec(
        instruction=f"Write a {language} script /app/{script}. {problem.description}\n\n"
        f"It will be run as `{argv_head} /app/{script}` (see below), also on inputs you have "
        f"not seen.\n\n{problem.example.replace('SCRIPT', f'/app/{script}')}",
        solution=solution(f"cat > {script} <<'{marker}'\n{problem.reference}{marker}"),
        checks=(checks.program(script, [argv_head, f"/app/{script}"], problem.cases),),
        difficulty=problem.difficulty,
        category="scripting",
        tags=(language, "script", tag, "hidden-tests"),
    )


def _file_case(content: str, expected: str, *extra: str) -> dict[str, object]:
    return checks.case(expected, args=["{dir}/input.txt", *extra], files={"input.txt": content})


def _example(command: str, given: str, output: str) -> str:
    """An example run; ``SCRIPT`` in ``command`` becomes the script's path."""
    return (
        f"Example: for an input file containing\n\n```\n{given}```\n\n"
        f"`{command}` prints\n\n```\n{output}```"
    )


# -- bashscript ------------------------------------------------------------------------------


def build_bashscript(rng: random.Random) -> TaskSpec:
    problem, tag = rng.choice(_BASH_PROBLEMS)(rng)
    return _script_task(rng, problem, "bash", "bash", tag)


def _stats(rng: random.Random) -> tuple[_Problem, str]:
    fmt = rng.choice(
        ("min={min} max={max} sum={sum}", "{min} {max} {sum}", "sum={sum} min={min} max={max}")
    )

    def solve(numbers: list[int]) -> str:
        return fmt.format(min=min(numbers), max=max(numbers), sum=sum(numbers)) + "\n"

    def draw() -> list[int]:
        return [rng.randint(-1000, 1000) for _ in range(rng.randint(1, 30))]

    example = draw()
    shown = fmt.replace("{", "<").replace("}", ">")
    reference = (
        "#!/bin/bash\n"
        "read -r mn mx s < <(awk 'NR == 1 {mn = $1; mx = $1} "
        '{if ($1 < mn) mn = $1; if ($1 > mx) mx = $1; s += $1} END {print mn, mx, s}\' "$1")\n'
        f'echo "{fmt.format(min="$mn", max="$mx", sum="$s")}"\n'
    )
    cases = [_file_case(as_lines([str(n) for n in nums]), solve(nums)) for nums in _draws(draw)]
    return _Problem(
        description="It takes the path of a file holding one integer per line (possibly "
        f"negative) and prints one line in the format `{shown}` with the smallest value, the "
        "largest value and the sum.",
        example=_example("bash SCRIPT FILE", as_lines([str(n) for n in example]), solve(example)),
        reference=reference,
        cases=cases,
        difficulty="hard",
    ), "stats"


def _top_words(rng: random.Random) -> tuple[_Problem, str]:
    def draw() -> tuple[str, int]:
        pool = pick(rng, rng.randint(3, 9))
        lines = [sentence(rng, pool, 1, 8) for _ in range(rng.randint(2, 20))]
        return as_lines(lines), rng.randint(1, 3)

    def solve(text: str, k: int) -> str:
        ranked = sorted(Counter(text.split()).items(), key=lambda item: (-item[1], item[0]))
        return as_lines([f"{count} {word}" for word, count in ranked[:k]])

    (example, k), hidden = draw(), _draws(draw)
    reference = (
        "#!/bin/bash\nexport LC_ALL=C\n"
        "tr -s ' \\n' '\\n' < \"$1\" | grep -v '^$' | sort | uniq -c | awk '{print $1, $2}' \\\n"
        '  | sort -k1,1nr -k2,2 | head -n "$2"\n'
    )
    return _Problem(
        description="It takes the path of a text file and a number K, and prints the K most "
        "frequent words of the file (words are separated by spaces and newlines), one per "
        "line as `<count> <word>`: most frequent first, ties in alphabetical order.",
        example=_example(f"bash SCRIPT FILE {k}", example, solve(example, k)),
        reference=reference,
        cases=[_file_case(text, solve(text, n), str(n)) for text, n in hidden],
        difficulty="hard",
    ), "topwords"


def _column_sum(rng: random.Random) -> tuple[_Problem, str]:
    def draw() -> tuple[str, str, int]:
        header = pick(rng, rng.randint(2, 5))
        rows = [[rng.randint(0, 500) for _ in header] for _ in range(rng.randint(1, 20))]
        column = rng.randrange(len(header))
        text = as_lines([",".join(header)] + [",".join(map(str, row)) for row in rows])
        return text, header[column], sum(row[column] for row in rows)

    (example, column, total), hidden = draw(), _draws(draw)
    reference = (
        "#!/bin/bash\n"
        'awk -F, -v c="$2" \'NR == 1 {for (i = 1; i <= NF; i++) if ($i == c) k = i; next} '
        '{s += $k} END {print s + 0}\' "$1"\n'
    )
    return _Problem(
        description="It takes the path of a comma-separated file with a header line and a "
        "column name, and prints the sum of the integers in that column.",
        example=_example(f"bash SCRIPT FILE {column}", example, f"{total}\n"),
        reference=reference,
        cases=[_file_case(text, f"{value}\n", name) for text, name, value in hidden],
        difficulty="hard",
    ), "colsum"


def _extension_counts(rng: random.Random) -> tuple[_Problem, str]:
    def draw() -> dict[str, str]:
        extensions = rng.sample(("txt", "md", "log", "csv", "py", "json"), rng.randint(1, 4))
        return random_tree(rng, "tree", rng.randint(1, 15), extensions)

    def solve(files: dict[str, str]) -> str:
        counts = Counter(path.rsplit(".", 1)[1] for path in files)
        return as_lines([f"{ext} {counts[ext]}" for ext in sorted(counts)])

    example, hidden = draw(), _draws(draw)
    reference = (
        "#!/bin/bash\nexport LC_ALL=C\n"
        "find \"$1\" -type f -name '*.*' | sed 's/.*\\.//' | sort | uniq -c "
        "| awk '{print $2, $1}'\n"
    )
    shown = as_lines(sorted(path.removeprefix("tree/") for path in example))
    return _Problem(
        description="It takes the path of a directory and prints, for each file extension "
        "among the regular files below it (at any depth), a line `<extension> <count>`, "
        "sorted by extension.",
        example=_example("bash SCRIPT DIR", shown, solve(example)).replace(
            "an input file containing", "a directory holding the files"
        ),
        reference=reference,
        cases=[checks.case(solve(files), args=["{dir}/tree"], files=files) for files in hidden],
        difficulty="hard",
    ), "extcount"


def _duplicates(rng: random.Random) -> tuple[_Problem, str]:
    def draw() -> str:
        pool = pick(rng, rng.randint(3, 12))
        lines = [rng.choice(pool) for _ in range(rng.randint(2, 30))]
        return as_lines([*lines, lines[0]])

    def solve(text: str) -> str:
        counts = Counter(text.splitlines())
        return as_lines(sorted(line for line, count in counts.items() if count > 1))

    example, hidden = draw(), _draws(draw)
    return _Problem(
        description="It takes the path of a text file and prints each line that occurs more "
        "than once in it, once, in alphabetical order.",
        example=_example("bash SCRIPT FILE", example, solve(example)),
        reference='#!/bin/bash\nexport LC_ALL=C\nsort "$1" | uniq -d\n',
        cases=[_file_case(text, solve(text)) for text in hidden],
        difficulty="medium",
    ), "dupes"


def _draws(draw: Callable[[], _T]) -> list[_T]:
    return [draw() for _ in range(_HIDDEN_CASES)]


_BASH_PROBLEMS: tuple[Callable[[random.Random], tuple[_Problem, str]], ...] = (
    _stats,
    _top_words,
    _column_sum,
    _extension_counts,
    _duplicates,
)


# -- pyscript --------------------------------------------------------------------------------


def build_pyscript(rng: random.Random) -> TaskSpec:
    problem, tag = rng.choice(_PYTHON_PROBLEMS)(rng)
    return _script_task(rng, problem, "python", "python3", tag)


def _stdin_problem(
    draw: Callable[[], str],
    solve: Callable[[str], str],
    description: str,
    reference: str,
    difficulty: Difficulty,
) -> _Problem:
    example = draw()
    return _Problem(
        description="It reads text from standard input and writes to standard output. "
        + description,
        example=_example("python3 SCRIPT < FILE", example, solve(example)),
        reference=reference,
        cases=[checks.case(solve(text), stdin=text) for text in _draws(draw)],
        difficulty=difficulty,
    )


def _mixed_text(rng: random.Random) -> str:
    """Lines of words in mixed case with digits and punctuation."""
    lines = []
    for _ in range(rng.randint(1, 8)):
        words = [rng.choice((str.lower, str.upper, str.capitalize))(w) for w in pick(rng, 4)]
        words.append(rng.choice(("42", "7!", "x-1", "ok?", "a,b")))
        rng.shuffle(words)
        lines.append(" ".join(words))
    return as_lines(lines)


def _caesar(rng: random.Random) -> tuple[_Problem, str]:
    shift = rng.randint(1, 25)

    def solve(text: str) -> str:
        lower, upper = string.ascii_lowercase, string.ascii_uppercase
        table = str.maketrans(
            lower + upper, lower[shift:] + lower[:shift] + upper[shift:] + upper[:shift]
        )
        return text.translate(table)

    reference = (
        "import string\nimport sys\n\n"
        f"SHIFT = {shift}\nlow, up = string.ascii_lowercase, string.ascii_uppercase\n"
        "table = str.maketrans(low + up, low[SHIFT:] + low[:SHIFT] + up[SHIFT:] + up[:SHIFT])\n"
        "sys.stdout.write(sys.stdin.read().translate(table))\n"
    )
    return _stdin_problem(
        lambda: _mixed_text(rng),
        solve,
        f"It shifts every ASCII letter {shift} places forward in the alphabet, wrapping "
        "around from z to a and keeping upper and lower case; everything else is unchanged.",
        reference,
        "hard",
    ), "caesar"


def _dedupe(rng: random.Random) -> tuple[_Problem, str]:
    def draw() -> str:
        pool = pick(rng, rng.randint(2, 8))
        return as_lines([rng.choice(pool) for _ in range(rng.randint(2, 20))])

    return _stdin_problem(
        draw,
        lambda text: as_lines(list(dict.fromkeys(text.splitlines()))),
        "It prints each distinct input line once, in the order of first appearance.",
        "import sys\n\nseen = set()\nfor line in sys.stdin.read().splitlines():\n"
        "    if line not in seen:\n        seen.add(line)\n        print(line)\n",
        "medium",
    ), "dedupe"


def _run_length(rng: random.Random) -> tuple[_Problem, str]:
    def draw() -> str:
        letters = rng.sample(string.ascii_lowercase, rng.randint(2, 5))
        lines = [
            "".join(rng.choice(letters) * rng.randint(1, 12) for _ in range(rng.randint(1, 6)))
            for _ in range(rng.randint(1, 6))
        ]
        return as_lines(lines)

    def encode(line: str) -> str:
        pieces, start = [], 0
        while start < len(line):
            end = start
            while end < len(line) and line[end] == line[start]:
                end += 1
            pieces.append(f"{line[start]}{end - start}")
            start = end
        return "".join(pieces)

    reference = (
        "import itertools\nimport sys\n\nfor line in sys.stdin.read().splitlines():\n"
        "    print(''.join(f'{c}{len(list(g))}' for c, g in itertools.groupby(line)))\n"
    )
    return _stdin_problem(
        draw,
        lambda text: as_lines([encode(line) for line in text.splitlines()]),
        "For each input line it prints the line run-length encoded: every run of the same "
        "character becomes the character followed by the run's length (`aaab` becomes "
        "`a3b1`).",
        reference,
        "hard",
    ), "rle"


def _vowel_counts(rng: random.Random) -> tuple[_Problem, str]:
    return _stdin_problem(
        lambda: _mixed_text(rng),
        lambda text: as_lines(
            [str(sum(c in "aeiouAEIOU" for c in ln)) for ln in text.splitlines()]
        ),
        "For each input line it prints the number of vowels (a, e, i, o, u, in either case) "
        "in that line.",
        "import sys\n\nfor line in sys.stdin.read().splitlines():\n"
        "    print(sum(c in 'aeiouAEIOU' for c in line))\n",
        "medium",
    ), "vowels"


def _reverse_words(rng: random.Random) -> tuple[_Problem, str]:
    def draw() -> str:
        return as_lines([sentence(rng, WORDS, 1, 7) for _ in range(rng.randint(1, 8))])

    return _stdin_problem(
        draw,
        lambda text: as_lines([" ".join(ln.split()[::-1]) for ln in text.splitlines()]),
        "For each input line it prints the line's words (separated by single spaces) in "
        "reverse order.",
        "import sys\n\nfor line in sys.stdin.read().splitlines():\n"
        "    print(' '.join(reversed(line.split())))\n",
        "medium",
    ), "reverse"


_PYTHON_PROBLEMS: tuple[Callable[[random.Random], tuple[_Problem, str]], ...] = (
    _caesar,
    _dedupe,
    _run_length,
    _vowel_counts,
    _reverse_words,
)
