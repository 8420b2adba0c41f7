"""Families that reorganise files: renaming and moving many files, and permissions.

Input files start with mode 0644 (folders 0755), as the local sandbox and a Dockerfile COPY
of the generated files both give them; permission tasks ask for something else.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from data_prep.generators.toyterm_families import checks
from data_prep.generators.toyterm_families.spec import (
    WORDS,
    Difficulty,
    TaskSpec,
    pick,
    sentence,
    solution,
)


def _contents(rng: random.Random, names: list[str]) -> dict[str, str]:
    return {name: sentence(rng, WORDS, 2, 6) + "\n" for name in names}


def _rename_task(
    instruction: str,
    commands: list[str],
    task_checks: tuple[checks.Check, ...],
    files: dict[str, str],
    *,
    difficulty: Difficulty,
    tag: str,
) -> TaskSpec:
    return TaskSpec(
        instruction=instruction,
        solution=solution(*commands),
        checks=task_checks,
        difficulty=difficulty,
        category="files",
        tags=("mv", tag),
        files=files,
    )


# -- rename ----------------------------------------------------------------------------------


def build_rename(rng: random.Random) -> TaskSpec:
    return rng.choice(_RENAMES)(rng)


def _change_extension(rng: random.Random) -> TaskSpec:
    folder = rng.choice(WORDS)
    old, new = rng.sample(("txt", "md", "log", "dat", "bak"), 2)
    names = pick(rng, rng.randint(5, 40))
    moved = _contents(rng, names[: max(2, len(names) * 2 // 3)])
    kept = _contents(rng, [f"{n}.cfg" for n in names[len(moved) :]])
    files = {f"{folder}/{n}.{old}": t for n, t in moved.items()}
    files |= {f"{folder}/{n}": t for n, t in kept.items()}
    after = {f"{n}.{new}": t for n, t in moved.items()} | kept
    return _rename_task(
        f"In {folder}, rename every file ending in `.{old}` so that it ends in `.{new}` "
        f"instead (same name otherwise, same content). Leave all other files alone.",
        [f'for f in {folder}/*.{old}; do mv -- "$f" "${{f%.{old}}}.{new}"; done'],
        (checks.tree(folder, after),),
        files,
        difficulty="medium",
        tag="rename",
    )


def _add_prefix(rng: random.Random) -> TaskSpec:
    folder, prefix = pick(rng, 2)
    names = [f"{n}.jpg" for n in pick(rng, rng.randint(4, 40))]
    contents = _contents(rng, names)
    return _rename_task(
        f"Rename every file in {folder} by putting `{prefix}_` in front of its name "
        f"(for example `a.jpg` becomes `{prefix}_a.jpg`).",
        [f'for f in {folder}/*; do mv -- "$f" "{folder}/{prefix}_$(basename "$f")"; done'],
        (checks.tree(folder, {f"{prefix}_{n}": t for n, t in contents.items()}),),
        {f"{folder}/{n}": t for n, t in contents.items()},
        difficulty="medium",
        tag="rename",
    )


def _move_by_year(rng: random.Random) -> TaskSpec:
    folder = rng.choice(WORDS)
    year = rng.choice(("2021", "2022", "2023", "2024"))
    names = [
        f"{word}-{rng.choice((year, '2019', '2020', '2025'))}-{rng.randint(1, 12):02d}.csv"
        for word in pick(rng, rng.randint(4, 30))
    ]
    names.append(f"extra-{year}-01.csv")
    contents = _contents(rng, names)
    after = {(f"{year}/{n}" if f"-{year}-" in n else n): t for n, t in contents.items()}
    return _rename_task(
        f"The directory {folder} holds files named `<name>-<year>-<month>.csv`. Move every file "
        f"of the year {year} into the new directory {folder}/{year}; leave the others in place.",
        [f"mkdir -p {folder}/{year}", f"mv {folder}/*-{year}-*.csv {folder}/{year}/"],
        (checks.tree(folder, after),),
        {f"{folder}/{n}": t for n, t in contents.items()},
        difficulty="medium",
        tag="move",
    )


def _lowercase(rng: random.Random) -> TaskSpec:
    folder = rng.choice(WORDS)
    names = []
    for word in pick(rng, rng.randint(4, 30)):
        style = rng.choice((str.upper, str.capitalize, str.lower))
        names.append(style(word) + rng.choice((".TXT", ".txt", ".Md")))
    names[0] = names[0].upper()
    contents = _contents(rng, names)
    return _rename_task(
        f"Rename every file in {folder} to the same name in lower case (for example "
        f"`Notes.TXT` becomes `notes.txt`); contents stay the same.",
        [
            f"for f in {folder}/*; do",
            '  b=$(basename "$f"); l=$(printf %s "$b" | tr "A-Z" "a-z")',
            f'  [ "$b" = "$l" ] || mv -- "$f" "{folder}/$l"',
            "done",
        ],
        (checks.tree(folder, {n.lower(): t for n, t in contents.items()}),),
        {f"{folder}/{n}": t for n, t in contents.items()},
        difficulty="hard",
        tag="rename",
    )


def _flatten(rng: random.Random) -> TaskSpec:
    source, dest = pick(rng, 2)
    names = [f"{n}.txt" for n in pick(rng, rng.randint(4, 30))]
    subdirs = pick(rng, 3)
    contents = _contents(rng, names)
    files = {
        f"{source}/{'/'.join(subdirs[: rng.randint(1, 3)])}/{n}": t for n, t in contents.items()
    }
    return _rename_task(
        f"Move every file found below {source} (at any depth) directly into the new "
        f"directory {dest} (no subdirectories there). File names are unique. Afterwards "
        f"no file may remain below {source} (its empty directories may stay or go).",
        [f"mkdir -p {dest}", f"find {source} -type f -exec mv {{}} {dest}/ \\;"],
        (checks.tree(dest, contents), checks.tree(source, {}, missing_ok=True)),
        files,
        difficulty="hard",
        tag="move",
    )


def _number_files(rng: random.Random) -> TaskSpec:
    folder = rng.choice(WORDS)
    names = sorted(f"{n}.txt" for n in pick(rng, rng.randint(3, 30)))
    contents = _contents(rng, names)
    after = {f"{i:03d}.txt": contents[n] for i, n in enumerate(names, 1)}
    return _rename_task(
        f"Rename the files of {folder} to 001.txt, 002.txt, ... in alphabetical order "
        f"of their current names (the alphabetically first becomes 001.txt).",
        [
            "i=1",
            f"for f in {folder}/*.txt; do",
            f'  mv -- "$f" "{folder}/$(printf %03d "$i").txt"; i=$((i + 1))',
            "done",
        ],
        (checks.tree(folder, after),),
        {f"{folder}/{n}": t for n, t in contents.items()},
        difficulty="hard",
        tag="rename",
    )


_RENAMES: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _change_extension,
    _add_prefix,
    _move_by_year,
    _lowercase,
    _flatten,
    _number_files,
)


# -- perms -----------------------------------------------------------------------------------


def build_perms(rng: random.Random) -> TaskSpec:
    return rng.choice(_PERMS)(rng)


def _perms_task(
    instruction: str,
    commands: list[str],
    modes: dict[str, int],
    files: dict[str, str],
    difficulty: Difficulty,
) -> TaskSpec:
    return TaskSpec(
        instruction=instruction,
        solution=solution(*commands),
        checks=tuple(checks.mode(path, bits) for path, bits in sorted(modes.items())),
        difficulty=difficulty,
        category="permissions",
        tags=("chmod", "permissions"),
        files=files,
    )


def _executable_scripts(rng: random.Random) -> TaskSpec:
    folder = rng.choice(WORDS)
    names = pick(rng, rng.randint(3, 15))
    scripts = [f"{folder}/{n}.sh" for n in names[: max(1, len(names) // 2)]]
    others = [f"{folder}/{n}.txt" for n in names[len(scripts) :]]
    files = dict.fromkeys(scripts, "#!/bin/bash\necho hello\n") | dict.fromkeys(others, "notes\n")
    return _perms_task(
        f"Make every `.sh` file in {folder} executable by everyone: mode 755. Every "
        f"other file there must keep mode 644.",
        [f"chmod 755 {folder}/*.sh"],
        {path: 0o755 if path.endswith(".sh") else 0o644 for path in files},
        files,
        "easy",
    )


def _private_folder(rng: random.Random) -> TaskSpec:
    folder = f"{rng.choice(WORDS)}_keys"
    files = {f"{folder}/{n}.key": f"{rng.getrandbits(64):016x}\n" for n in pick(rng, 4)}
    modes = dict.fromkeys(files, 0o600) | {folder: 0o700}
    return _perms_task(
        f"Make {folder} private to its owner: the directory must have mode 700 and "
        f"every file in it mode 600.",
        [f"chmod 700 {folder}", f"chmod 600 {folder}/*"],
        modes,
        files,
        "medium",
    )


def _read_only(rng: random.Random) -> TaskSpec:
    names = [f"{n}.{rng.choice(('txt', 'csv', 'cfg'))}" for n in pick(rng, rng.randint(2, 8))]
    frozen = names[: max(1, len(names) // 2)]
    files = _contents(rng, names)
    listing = ", ".join(frozen)
    return _perms_task(
        f"Make these files read-only for everyone (mode 444): {listing}. The other files "
        f"in /app keep mode 644.",
        [f"chmod 444 {' '.join(frozen)}"],
        {n: 0o444 if n in frozen else 0o644 for n in names},
        files,
        "easy",
    )


def _by_extension(rng: random.Random) -> TaskSpec:
    folder = rng.choice(WORDS)
    wanted = {"key": 0o600, "sh": 0o755, "pub": 0o644, "txt": 0o640}
    files = {}
    for ext in wanted:
        for depth in range(rng.randint(1, 3)):
            sub = "/".join([folder, *pick(rng, depth)])
            files[f"{sub}/{rng.choice(WORDS)}.{ext}"] = f"{ext} file\n"
    return _perms_task(
        f"Below {folder} (at any depth), set the mode of every file by its extension: "
        f"`.key` 600, `.sh` 755, `.pub` 644, `.txt` 640.",
        [
            f"find {folder} -type f -name '*.key' -exec chmod 600 {{}} +",
            f"find {folder} -type f -name '*.sh' -exec chmod 755 {{}} +",
            f"find {folder} -type f -name '*.txt' -exec chmod 640 {{}} +",
        ],
        {path: wanted[path.rsplit(".", 1)[1]] for path in files},
        files,
        "hard",
    )


def _no_others(rng: random.Random) -> TaskSpec:
    folder = rng.choice(WORDS)
    names = [f"{folder}/{n}.dat" for n in pick(rng, rng.randint(2, 10))]
    files = _contents(rng, names)
    return _perms_task(
        f"Remove every permission of `others` from the files in {folder}, leaving the "
        f"owner's and the group's permissions unchanged.",
        [f"chmod o-rwx {folder}/*"],
        dict.fromkeys(names, 0o640),
        files,
        "medium",
    )


_PERMS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _executable_scripts,
    _private_folder,
    _read_only,
    _by_extension,
    _no_others,
)
