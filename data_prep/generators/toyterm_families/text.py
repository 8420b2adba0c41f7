"""Families that transform text files: sorting and de-duplication, sed/tr edits, columns."""

from __future__ import annotations

import random
import re
from collections import Counter
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
    standalone_words,
)


def _transform(
    rng: random.Random,
    *,
    task: str,
    source_lines: list[str],
    command: str,
    expected: list[str],
    difficulty: Difficulty,
    tags: tuple[str, ...],
    suffix: str = "txt",
) -> TaskSpec:
    """Read <source>, write the transformed lines to <out> (both in /app)."""
    words = pick(rng, 2)
    source, out = f"{words[0]}.{suffix}", f"{words[1]}.txt"
    return TaskSpec(
        instruction=task.format(source=source, out=out),
        solution=solution(command.format(source=source, out=out)),
        checks=(checks.text(out, as_lines(expected)),),
        difficulty=difficulty,
        category="transform",
        tags=tags,
        files={source: as_lines(source_lines)},
    )


# -- sortuniq --------------------------------------------------------------------------------


def build_sortuniq(rng: random.Random) -> TaskSpec:
    return rng.choice(_SORTS)(rng)


def _repeated_words(rng: random.Random) -> list[str]:
    pool = pick(rng, rng.randint(4, 20))
    return [rng.choice(pool) for _ in range(rng.randint(8, 80))]


def _sort_alpha(rng: random.Random) -> TaskSpec:
    lines = _repeated_words(rng)
    reverse = rng.random() < 0.3
    order = "reverse alphabetical order" if reverse else "alphabetical order"
    return _transform(
        rng,
        task=f"Sort the lines of {{source}} in {order} and write them to {{out}}.",
        source_lines=lines,
        command=f"sort {'-r ' if reverse else ''}{{source}} > {{out}}",
        expected=sorted(lines, reverse=reverse),
        difficulty="easy",
        tags=("sort",),
    )


def _sort_unique(rng: random.Random) -> TaskSpec:
    lines = _repeated_words(rng)
    return _transform(
        rng,
        task="Write the distinct lines of {source}, sorted alphabetically, one each, to {out}.",
        source_lines=lines,
        command="sort -u {source} > {out}",
        expected=sorted(set(lines)),
        difficulty="easy",
        tags=("sort", "uniq"),
    )


def _sort_numeric(rng: random.Random) -> TaskSpec:
    numbers = [rng.randint(-500, 5000) for _ in range(rng.randint(5, 60))]
    return _transform(
        rng,
        task="{source} holds one integer per line. Write them to {out} sorted numerically, "
        "largest first.",
        source_lines=[str(n) for n in numbers],
        command="sort -nr {source} > {out}",
        expected=[str(n) for n in sorted(numbers, reverse=True)],
        difficulty="easy",
        tags=("sort", "numeric"),
    )


def _frequencies(rng: random.Random) -> TaskSpec:
    lines = _repeated_words(rng)
    counts = Counter(lines)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return _transform(
        rng,
        task="For every distinct line of {source}, write a line `<line> <count>` to {out}: "
        "most frequent first, ties in alphabetical order.",
        source_lines=lines,
        command="sort {source} | uniq -c | awk '{{print $2, $1}}' | sort -k2,2nr -k1,1 > {out}",
        expected=[f"{word} {count}" for word, count in ranked],
        difficulty="hard",
        tags=("sort", "uniq", "awk"),
    )


def _first_seen(rng: random.Random) -> TaskSpec:
    lines = _repeated_words(rng)
    return _transform(
        rng,
        task="Write the lines of {source} to {out} without duplicates: keep the first "
        "occurrence of each line, in the original order.",
        source_lines=lines,
        command="awk '!seen[$0]++' {source} > {out}",
        expected=list(dict.fromkeys(lines)),
        difficulty="medium",
        tags=("uniq", "awk"),
    )


_SORTS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _sort_alpha,
    _sort_unique,
    _sort_numeric,
    _frequencies,
    _first_seen,
)


# -- sedit -----------------------------------------------------------------------------------


def build_sedit(rng: random.Random) -> TaskSpec:
    return rng.choice(_EDITS)(rng)


def _replace_in_place(rng: random.Random) -> TaskSpec:
    old = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randint(1, 99)}"
    new = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randint(100, 999)}"
    keys = pick(rng, rng.randint(4, 12))
    lines = [f"{key} = {rng.choice((old, rng.choice(WORDS)))}" for key in keys]
    lines += [f"backup_of_{keys[0]} = {old}", f"mirror = {old},{old}"]
    rng.shuffle(lines)
    name = f"{rng.choice(WORDS)}.conf"
    before = as_lines(lines)
    return TaskSpec(
        instruction=f"In {name}, replace every occurrence of `{old}` with `{new}`. "
        "Edit the file in place; change nothing else.",
        solution=solution(f"sed -i 's/{old}/{new}/g' {name}"),
        checks=(checks.text(name, before.replace(old, new)),),
        difficulty="medium",
        category="transform",
        tags=("sed", "in-place"),
        files={name: before},
    )


def _upper(rng: random.Random) -> TaskSpec:
    lines = [sentence(rng, WORDS, 2, 7) for _ in range(rng.randint(3, 30))]
    return _transform(
        rng,
        task="Write {source} converted to upper case to {out}.",
        source_lines=lines,
        command="tr 'a-z' 'A-Z' < {source} > {out}",
        expected=[line.upper() for line in lines],
        difficulty="easy",
        tags=("tr",),
    )


def _delete_lines(rng: random.Random) -> TaskSpec:
    pool = pick(rng, rng.randint(6, 12))
    lines = [sentence(rng, pool, 2, 6) for _ in range(rng.randint(6, 60))]
    word = rng.choice(standalone_words(pool))
    lines.append(f"{word} {rng.choice(pool)}")
    return _transform(
        rng,
        task=f"Write to {{out}} every line of {{source}} except those containing the word "
        f"{word}, keeping their order.",
        source_lines=lines,
        command=f"grep -vw {word} {{source}} > {{out}}",
        expected=[line for line in lines if word not in line.split()],
        difficulty="medium",
        tags=("grep", "sed", "filter"),
    )


def _squeeze(rng: random.Random) -> TaskSpec:
    lines = [
        (" " * rng.randint(1, 4)).join(pick(rng, rng.randint(2, 6)))
        for _ in range(rng.randint(3, 40))
    ]
    lines[0] = lines[0].replace(" ", "   ", 1)
    return _transform(
        rng,
        task="In {source}, words are separated by runs of spaces. Write it to {out} with "
        "every run of spaces replaced by a single space.",
        source_lines=lines,
        command="tr -s ' ' < {source} > {out}",
        expected=[re.sub(" +", " ", line) for line in lines],
        difficulty="medium",
        tags=("tr", "squeeze"),
    )


def _strip_digits(rng: random.Random) -> TaskSpec:
    lines = [
        " ".join(f"{w}{rng.randint(0, 999)}" if rng.random() < 0.5 else w for w in pick(rng, 4))
        for _ in range(rng.randint(3, 30))
    ]
    lines[0] += " 42"
    return _transform(
        rng,
        task="Write {source} to {out} with every digit removed (all other characters kept).",
        source_lines=lines,
        command="tr -d '0-9' < {source} > {out}",
        expected=[re.sub("[0-9]", "", line) for line in lines],
        difficulty="medium",
        tags=("tr", "delete"),
    )


def _number_lines(rng: random.Random) -> TaskSpec:
    lines = [sentence(rng, WORDS, 1, 5) for _ in range(rng.randint(3, 40))]
    sep = rng.choice((": ", ") ", " - "))
    return _transform(
        rng,
        task=f"Write {{source}} to {{out}} with each line prefixed by its line number "
        f"(starting at 1) and the separator `{sep}`: a first line `abc` becomes `1{sep}abc`.",
        source_lines=lines,
        command=f"awk -v s={q(sep)} '{{{{print NR s $0}}}}' {{source}} > {{out}}",
        expected=[f"{n}{sep}{line}" for n, line in enumerate(lines, 1)],
        difficulty="medium",
        tags=("awk", "nl"),
    )


_EDITS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _replace_in_place,
    _upper,
    _delete_lines,
    _squeeze,
    _strip_digits,
    _number_lines,
)


# -- columns ---------------------------------------------------------------------------------

_COLUMNS = ("id", "name", "city", "team", "age", "score", "level")


def build_columns(rng: random.Random) -> TaskSpec:
    return rng.choice(_COLUMN_TASKS)(rng)


def _table(rng: random.Random) -> tuple[list[str], list[list[str]]]:
    header = rng.sample(_COLUMNS, rng.randint(3, 6))
    rows = []
    for index in range(rng.randint(4, 40)):
        row = []
        for column in header:
            if column == "id":
                row.append(str(index + 1))
            elif column in ("age", "score", "level"):
                row.append(str(rng.randint(1, 99)))
            else:
                row.append(rng.choice(WORDS))
        rows.append(row)
    return header, rows


def _cut_column(rng: random.Random) -> TaskSpec:
    header, rows = _table(rng)
    index = rng.randrange(len(header))
    return _transform(
        rng,
        task=f"The file {{source}} is a comma-separated table with a header line. Write the values "
        f"of its `{header[index]}` column, without the header, one per line, to {{out}}.",
        source_lines=[",".join(row) for row in [header, *rows]],
        command=f"cut -d, -f{index + 1} {{source}} | tail -n +2 > {{out}}",
        expected=[row[index] for row in rows],
        difficulty="medium",
        tags=("cut", "csv"),
        suffix="csv",
    )


def _cut_tsv(rng: random.Random) -> TaskSpec:
    header, rows = _table(rng)
    index = rng.randrange(len(header))
    return _transform(
        rng,
        task=f"The file {{source}} is a tab-separated table. Write its column number {index + 1} "
        f"(header line included), one value per line, to {{out}}.",
        source_lines=["\t".join(row) for row in [header, *rows]],
        command=f"cut -f{index + 1} {{source}} > {{out}}",
        expected=[row[index] for row in [header, *rows]],
        difficulty="easy",
        tags=("cut", "tsv"),
        suffix="tsv",
    )


def _reorder(rng: random.Random) -> TaskSpec:
    header, rows = _table(rng)
    first, second = rng.sample(range(len(header)), 2)
    return _transform(
        rng,
        task=f"The file {{source}} is a comma-separated table with a header. Write to {{out}} a "
        f"comma-separated table of only its `{header[first]}` and `{header[second]}` "
        f"columns, in that order, header included.",
        source_lines=[",".join(row) for row in [header, *rows]],
        command=f"awk -F, -v OFS=, '{{{{print ${first + 1}, ${second + 1}}}}}' "
        f"{{source}} > {{out}}",
        expected=[f"{row[first]},{row[second]}" for row in [header, *rows]],
        difficulty="medium",
        tags=("awk", "csv"),
        suffix="csv",
    )


def _paste(rng: random.Random) -> TaskSpec:
    names = pick(rng, rng.randint(3, 25))
    scores = [str(rng.randint(0, 100)) for _ in names]
    left, right, out = pick(rng, 3)
    sep = rng.choice((":", ",", "="))
    pasted = [f"{a}{sep}{b}" for a, b in zip(names, scores, strict=True)]
    return TaskSpec(
        instruction=f"The files {left}.txt and {right}.txt have the same number of lines. "
        f"Write to {out}.txt, for each line number, the line of {left}.txt, then "
        f"`{sep}`, then the line of {right}.txt.",
        solution=solution(f"paste -d{q(sep)} {left}.txt {right}.txt > {out}.txt"),
        checks=(checks.text(f"{out}.txt", as_lines(pasted)),),
        difficulty="easy",
        category="transform",
        tags=("paste",),
        files={f"{left}.txt": as_lines(names), f"{right}.txt": as_lines(scores)},
    )


def _distinct_values(rng: random.Random) -> TaskSpec:
    header, rows = _table(rng)
    index = rng.randrange(len(header))
    return _transform(
        rng,
        task=f"The file {{source}} is a comma-separated table with a header line. Write the "
        f"distinct values of its `{header[index]}` column, sorted as text, one per line, "
        f"to {{out}}.",
        source_lines=[",".join(row) for row in [header, *rows]],
        command=f"tail -n +2 {{source}} | cut -d, -f{index + 1} | sort -u > {{out}}",
        expected=sorted({row[index] for row in rows}),
        difficulty="medium",
        tags=("cut", "sort", "csv"),
        suffix="csv",
    )


_COLUMN_TASKS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _cut_column,
    _cut_tsv,
    _reorder,
    _paste,
    _distinct_values,
)
