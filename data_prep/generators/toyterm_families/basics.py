"""Families of first steps: one short command, counting, creating files.

``oneliner`` tasks are each solvable by one short command (``echo``, ``wc -l``, ``head``,
``mkdir -p``), so that a policy of a few million parameters can learn some of them after
a short warm start on reference solutions.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from data_prep.generators.toyterm_families import checks
from data_prep.generators.toyterm_families.spec import (
    WORDS,
    TaskSpec,
    as_lines,
    pick,
    q,
    random_tree,
    sentence,
    solution,
    standalone_words,
)


def build_oneliner(rng: random.Random) -> TaskSpec:
    return rng.choice(_ONELINERS)(rng)


def _short(instruction: str, command: str, check: checks.Check, tag: str) -> TaskSpec:
    return TaskSpec(
        instruction=instruction,
        solution=solution(command),
        checks=(check,),
        difficulty="easy",
        category="files",
        tags=(tag, "short-command"),
    )


def _echo(rng: random.Random) -> TaskSpec:
    name = f"{rng.choice(WORDS)}.txt"
    phrase = " ".join(pick(rng, rng.randint(2, 4)))
    return _short(
        f"Create the file {name} containing exactly one line: {phrase}",
        f"echo {q(phrase)} > {name}",
        checks.text(name, phrase + "\n"),
        "echo",
    )


def _count_lines(rng: random.Random) -> TaskSpec:
    source, out = pick(rng, 2)
    lines = [sentence(rng, WORDS, 1, 5) for _ in range(rng.randint(3, 60))]
    spec = _short(
        f"How many lines does {source}.txt have? Write only the number to {out}.txt",
        f"wc -l < {source}.txt > {out}.txt",
        checks.number(f"{out}.txt", len(lines)),
        "wc",
    )
    return _with_files(spec, {f"{source}.txt": as_lines(lines)})


def _head(rng: random.Random) -> TaskSpec:
    source, out = pick(rng, 2)
    lines = [sentence(rng, WORDS, 2, 5) for _ in range(rng.randint(3, 30))]
    count = rng.randint(1, 3)
    plural = "line" if count == 1 else f"{count} lines"
    spec = _short(
        f"Write the first {plural} of {source}.txt to {out}.txt",
        f"head -n {count} {source}.txt > {out}.txt",
        checks.text(f"{out}.txt", as_lines(lines[:count])),
        "head",
    )
    return _with_files(spec, {f"{source}.txt": as_lines(lines)})


def _tail(rng: random.Random) -> TaskSpec:
    source, out = pick(rng, 2)
    lines = [sentence(rng, WORDS, 2, 5) for _ in range(rng.randint(4, 30))]
    count = rng.randint(1, 3)
    plural = "line" if count == 1 else f"{count} lines"
    spec = _short(
        f"Write the last {plural} of {source}.txt to {out}.txt",
        f"tail -n {count} {source}.txt > {out}.txt",
        checks.text(f"{out}.txt", as_lines(lines[-count:])),
        "tail",
    )
    return _with_files(spec, {f"{source}.txt": as_lines(lines)})


def _mkdir(rng: random.Random) -> TaskSpec:
    path = "/".join(pick(rng, rng.randint(2, 4)))
    return _short(
        f"Create the directory {path} (with any missing parent directories).",
        f"mkdir -p {path}",
        checks.isdir(path),
        "mkdir",
    )


def _touch(rng: random.Random) -> TaskSpec:
    name = f"{rng.choice(WORDS)}.{rng.choice(('log', 'lock', 'done', 'flag'))}"
    return _short(
        f"Create an empty file named {name} in /app.",
        f"touch {name}",
        checks.text(name, ""),
        "touch",
    )


def _with_files(spec: TaskSpec, files: dict[str, str]) -> TaskSpec:
    return dataclasses.replace(spec, files=files)


_ONELINERS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _echo,
    _count_lines,
    _head,
    _tail,
    _mkdir,
    _touch,
)


# -- count -----------------------------------------------------------------------------------


def build_count(rng: random.Random) -> TaskSpec:
    return rng.choice(_COUNTS)(rng)


def _word_file(rng: random.Random) -> tuple[list[str], list[str]]:
    """A small vocabulary (so words repeat) and lines drawn from it."""
    pool = pick(rng, rng.randint(6, 14))
    return pool, [sentence(rng, pool, 1, 9) for _ in range(rng.randint(5, 400))]


def _counted(
    rng: random.Random, question: str, command: str, answer: int, files: dict[str, str]
) -> TaskSpec:
    out = f"{rng.choice(WORDS)}_count.txt"
    return TaskSpec(
        instruction=f"{question} Write only the number to {out}",
        solution=solution(f"{command} > {out}"),
        checks=(checks.number(out, answer),),
        difficulty="easy" if command.startswith("wc") else "medium",
        category="count",
        tags=("count", command.split(maxsplit=1)[0]),
        files=files,
    )


def _count_words(rng: random.Random) -> TaskSpec:
    _pool, lines = _word_file(rng)
    name = f"{rng.choice(WORDS)}.txt"
    answer = sum(len(line.split()) for line in lines)
    return _counted(
        rng,
        f"How many words (whitespace-separated) does {name} contain?",
        f"wc -w < {name}",
        answer,
        {name: as_lines(lines)},
    )


def _count_bytes(rng: random.Random) -> TaskSpec:
    _pool, lines = _word_file(rng)
    name = f"{rng.choice(WORDS)}.txt"
    content = as_lines(lines)
    return _counted(
        rng,
        f"What is the size of {name} in bytes?",
        f"wc -c < {name}",
        len(content.encode()),
        {name: content},
    )


def _count_matching_lines(rng: random.Random) -> TaskSpec:
    pool, lines = _word_file(rng)
    word = rng.choice(standalone_words(pool))
    name = f"{rng.choice(WORDS)}.txt"
    if not any(word in line.split() for line in lines):
        lines.append(word)
    return _counted(
        rng,
        f"How many lines of {name} contain the word {word}?",
        f"grep -cw {word} {name}",
        sum(word in line.split() for line in lines),
        {name: as_lines(lines)},
    )


def _count_occurrences(rng: random.Random) -> TaskSpec:
    pool, lines = _word_file(rng)
    word = rng.choice(standalone_words(pool))
    name = f"{rng.choice(WORDS)}.txt"
    lines.append(f"{word} {word}")
    answer = sum(line.split().count(word) for line in lines)
    return _counted(
        rng,
        f"How many times in total does the word {word} occur in {name}?",
        f"grep -ow {word} {name} | wc -l",
        answer,
        {name: as_lines(lines)},
    )


def _count_files(rng: random.Random) -> TaskSpec:
    root = rng.choice(WORDS)
    files = random_tree(rng, root, rng.randint(3, 40), ("txt", "log", "md", "csv"))
    return _counted(
        rng,
        f"How many regular files are there in {root}, including all its subdirectories?",
        f"find {root} -type f | wc -l",
        len(files),
        files,
    )


def _count_log_lines(rng: random.Random) -> TaskSpec:
    root = rng.choice(WORDS)
    names = pick(rng, rng.randint(3, 9))
    files = {}
    total = 0
    for index, name in enumerate(names):
        ext = "log" if index % 3 != 2 else "txt"
        lines = [sentence(rng, WORDS, 2, 6) for _ in range(rng.randint(1, 50))]
        files[f"{root}/{name}.{ext}"] = as_lines(lines)
        total += len(lines) if ext == "log" else 0
    return _counted(
        rng,
        f"What is the total number of lines in all files ending in .log directly inside {root}?",
        f"cat {root}/*.log | wc -l",
        total,
        files,
    )


_COUNTS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _count_words,
    _count_bytes,
    _count_matching_lines,
    _count_occurrences,
    _count_files,
    _count_log_lines,
)


# -- mkfiles ---------------------------------------------------------------------------------


def build_mkfiles(rng: random.Random) -> TaskSpec:
    """Create several files in nested folders, each holding one given line."""
    root = rng.choice(WORDS)
    count = rng.randint(2, 6)
    files: dict[str, str] = {}
    while len(files) < count:
        depth = rng.randint(0, 2)
        # Folder names have no dot, so a file path never collides with a folder.
        path = "/".join([*pick(rng, depth), f"{rng.choice(WORDS)}.txt"])
        files[path] = " ".join(pick(rng, rng.randint(2, 5))) + "\n"
    listing = "\n".join(f"- {root}/{path}: {text.strip()}" for path, text in files.items())
    commands = []
    for path, text in files.items():
        parent = f"{root}/{path}".rsplit("/", 1)[0]
        commands.append(f"mkdir -p {parent} && echo {q(text.strip())} > {root}/{path}")
    return TaskSpec(
        instruction=(
            f"Create these files (and the directories they need), each containing exactly "
            f"the given line and nothing else; {root} must hold no other files.\n\n"
            f"{listing}"
        ),
        solution=solution(*commands),
        checks=(checks.tree(root, files, exact=False),),
        difficulty="easy" if count <= 3 else "medium",
        category="files",
        tags=("mkdir", "echo", "create"),
    )
