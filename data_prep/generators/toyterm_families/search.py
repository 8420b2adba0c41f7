"""Families that search: grep through files and nested folders, find by name, size, kind."""

from __future__ import annotations

import random
from collections.abc import Callable

from data_prep.generators.toyterm_families import checks
from data_prep.generators.toyterm_families.spec import (
    WORDS,
    TaskSpec,
    as_lines,
    random_tree,
    sentence,
    solution,
)

_LEVELS = ("INFO", "DEBUG", "NOTICE")


def _paths_task(
    rng: random.Random,
    *,
    root: str,
    question: str,
    command: str,
    paths: list[str],
    files: dict[str, str],
) -> TaskSpec:
    """Write the matching paths, relative to /app, one per line in any order."""
    out = f"{rng.choice(WORDS)}_paths.txt"
    return TaskSpec(
        instruction=f"{question} Write their paths relative to /app (like `{root}/dir/name`), "
        f"one per line in any order, to {out}",
        solution=solution(f"{command} > {out}"),
        checks=(checks.lines(out, sorted(paths), unordered=True, paths=True),),
        difficulty="medium",
        category="search",
        tags=("find", "grep", "paths"),
        files=files,
    )


# -- grep ------------------------------------------------------------------------------------


def build_grep(rng: random.Random) -> TaskSpec:
    return rng.choice(_GREPS)(rng)


def _log_line(rng: random.Random) -> str:
    return f"{rng.choice(_LEVELS)} {sentence(rng, WORDS, 2, 6)}"


def _log_tree(rng: random.Random, root: str, code: str) -> tuple[dict[str, str], list[str]]:
    """Log files below ``root``; some contain ``code``, others near misses of it."""
    tree = random_tree(rng, root, rng.randint(4, 30), ("log",))
    paths = sorted(tree)
    hits = rng.sample(paths, rng.randint(1, max(1, len(paths) // 3)))
    files: dict[str, str] = {}
    for path in paths:
        lines = [_log_line(rng) for _ in range(rng.randint(1, 25))]
        if path in hits:
            lines.insert(rng.randrange(len(lines) + 1), f"ERROR {code} {rng.choice(WORDS)}")
        elif rng.random() < 0.5:
            near = f"ERR-{(int(code[4:]) + rng.randint(1, 999)) % 10000:04d}"
            lines.append(f"ERROR {near} {rng.choice(WORDS)}")
        files[path] = as_lines(lines)
    return files, sorted(hits)


def _grep_files(rng: random.Random) -> TaskSpec:
    root, code = rng.choice(WORDS), f"ERR-{rng.randint(0, 9999):04d}"
    files, hits = _log_tree(rng, root, code)
    return _paths_task(
        rng,
        root=root,
        question=f"Find every file below {root} (at any depth) containing the string {code}.",
        command=f"grep -rl {code} {root}",
        paths=hits,
        files=files,
    )


def _grep_count(rng: random.Random) -> TaskSpec:
    root, code = rng.choice(WORDS), f"ERR-{rng.randint(0, 9999):04d}"
    files, _hits = _log_tree(rng, root, code)
    total = sum(code in line for text in files.values() for line in text.splitlines())
    out = f"{rng.choice(WORDS)}_total.txt"
    return TaskSpec(
        instruction=f"How many lines, across all files below {root} (at any depth), "
        f"contain the string {code}? Write only the number to {out}",
        solution=solution(f"grep -rh {code} {root} | wc -l > {out}"),
        checks=(checks.number(out, total),),
        difficulty="medium",
        category="search",
        tags=("grep", "count"),
        files=files,
    )


def _grep_ignore_case(rng: random.Random) -> TaskSpec:
    word = rng.choice(("warning", "timeout", "denied", "retry"))
    lines = []
    for _ in range(rng.randint(8, 80)):
        line = _log_line(rng)
        if rng.random() < 0.3:
            spelled = rng.choice((word, word.upper(), word.capitalize()))
            line = f"{line} {spelled}"
        lines.append(line)
    lines.append(f"{word.upper()} {sentence(rng, WORDS, 1, 3)}")
    name, out = f"{rng.choice(WORDS)}.log", f"{rng.choice(WORDS)}_{word}.txt"
    return TaskSpec(
        instruction=f"Write every line of {name} that contains `{word}` in any mix of "
        f"upper and lower case, in their original order, to {out}",
        solution=solution(f"grep -i {word} {name} > {out}"),
        checks=(checks.text(out, as_lines([ln for ln in lines if word in ln.lower()])),),
        difficulty="easy",
        category="search",
        tags=("grep", "ignore-case"),
        files={name: as_lines(lines)},
    )


def _grep_regex(rng: random.Random) -> TaskSpec:
    prefix = rng.choice(("user", "host", "job", "node"))
    lines = []
    for _ in range(rng.randint(8, 60)):
        tail = sentence(rng, WORDS, 1, 4)
        lines.append(
            rng.choice(
                (
                    f"{prefix}{rng.randint(0, 9999)}: {tail}",
                    f"{prefix}: {tail}",
                    f"x{prefix}{rng.randint(0, 99)}: {tail}",
                    f"{prefix}{rng.randint(0, 99)} {tail}",
                    f"{tail} {prefix}{rng.randint(0, 99)}:",
                )
            )
        )
    lines.append(f"{prefix}{rng.randint(0, 99)}: {rng.choice(WORDS)}")

    def matches(line: str) -> bool:
        head, colon, _rest = line.partition(":")
        return bool(colon) and head.startswith(prefix) and head[len(prefix) :].isdigit()

    name, out = f"{rng.choice(WORDS)}.txt", f"{rng.choice(WORDS)}_{prefix}s.txt"
    return TaskSpec(
        instruction=f"Write to {out}, in their original order, the lines of {name} "
        f"that start with `{prefix}`, immediately followed by one or more digits and a colon "
        f"(like `{prefix}12:`).",
        solution=solution(f"grep -E '^{prefix}[0-9]+:' {name} > {out}"),
        checks=(checks.text(out, as_lines([line for line in lines if matches(line)])),),
        difficulty="hard",
        category="search",
        tags=("grep", "regex"),
        files={name: as_lines(lines)},
    )


_GREPS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _grep_files,
    _grep_count,
    _grep_ignore_case,
    _grep_regex,
)


# -- find ------------------------------------------------------------------------------------

_EXTENSIONS = ("txt", "cfg", "log", "json", "py", "md", "tmp")


def build_find(rng: random.Random) -> TaskSpec:
    return rng.choice(_FINDS)(rng)


def _sized_tree(rng: random.Random, root: str) -> dict[str, str]:
    """Nested files of varied sizes (some empty), every extension at least once."""
    paths = set(random_tree(rng, root, rng.randint(4, 36), _EXTENSIONS))
    # Names outside WORDS, so they cannot collide with the random tree's.
    paths |= {f"{root}/{rng.choice(WORDS)}_{ext}.{ext}" for ext in _EXTENSIONS}
    files = {}
    for path in sorted(paths):
        repeats = rng.choice((0, 1, rng.randint(2, 100)))
        files[path] = (sentence(rng, WORDS, 3, 8) + "\n") * repeats
    return files


def _find_extension(rng: random.Random) -> TaskSpec:
    root = rng.choice(WORDS)
    files = _sized_tree(rng, root)
    ext = rng.choice(_EXTENSIONS)
    hits = [path for path in files if path.endswith(f".{ext}")]
    return _paths_task(
        rng,
        root=root,
        question=f"Find every file whose name ends in `.{ext}` below {root} (at any depth).",
        command=f"find {root} -type f -name '*.{ext}'",
        paths=hits,
        files=files,
    )


def _find_empty(rng: random.Random) -> TaskSpec:
    root = rng.choice(WORDS)
    files = _sized_tree(rng, root)
    first = sorted(files)[0]
    files[first] = ""
    hits = [path for path, text in files.items() if not text]
    return _paths_task(
        rng,
        root=root,
        question=f"Find every empty regular file below {root} (at any depth).",
        command=f"find {root} -type f -empty",
        paths=hits,
        files=files,
    )


def _find_larger(rng: random.Random) -> TaskSpec:
    root = rng.choice(WORDS)
    files = _sized_tree(rng, root)
    sizes = sorted(len(text.encode()) for text in files.values())
    limit = rng.choice(sizes[: len(sizes) - 1])
    out = f"{rng.choice(WORDS)}_big.txt"
    return TaskSpec(
        instruction=f"How many regular files below {root} (at any depth) are larger "
        f"than {limit} bytes? Write only the number to {out}",
        solution=solution(f"find {root} -type f -size +{limit}c | wc -l > {out}"),
        checks=(checks.number(out, sum(size > limit for size in sizes)),),
        difficulty="medium",
        category="search",
        tags=("find", "size", "count"),
        files=files,
    )


def _find_delete(rng: random.Random) -> TaskSpec:
    root = rng.choice(WORDS)
    files = _sized_tree(rng, root)
    kept = {path.removeprefix(f"{root}/"): text for path, text in files.items()}
    kept = {path: text for path, text in kept.items() if not path.endswith(".tmp")}
    return TaskSpec(
        instruction=f"Delete every file whose name ends in `.tmp` below {root} (at any "
        "depth). Leave every other file as it is.",
        solution=solution(f"find {root} -type f -name '*.tmp' -delete"),
        checks=(checks.tree(root, kept),),
        difficulty="medium",
        category="search",
        tags=("find", "delete"),
        files=files,
    )


def _find_largest(rng: random.Random) -> TaskSpec:
    root = rng.choice(WORDS)
    files = _sized_tree(rng, root)
    largest = rng.choice(sorted(files))
    files[largest] = files[largest] + "x" * (max(len(t) for t in files.values()) + 1)
    out = f"{rng.choice(WORDS)}_largest.txt"
    return TaskSpec(
        instruction=f"Which file below {root} (at any depth) is the largest? Write its "
        f"path relative to /app (like `{sorted(files)[0]}`) to {out}",
        solution=solution(
            f"find {root} -type f -printf '%s %p\\n' | sort -n | tail -n 1 | cut -d' ' -f2- > {out}"
        ),
        checks=(checks.lines(out, [largest], paths=True),),
        difficulty="hard",
        category="search",
        tags=("find", "size", "sort"),
        files=files,
    )


_FINDS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _find_extension,
    _find_empty,
    _find_larger,
    _find_delete,
    _find_largest,
)
