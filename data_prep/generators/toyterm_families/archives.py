"""Families with archives: extracting tar/gzip inputs and creating archives of folders.

Input archives are built byte-for-byte reproducibly (fixed member order, times, owners and
modes; no name or time in the gzip header), so that generation is deterministic.
"""

from __future__ import annotations

import gzip
import io
import random
import tarfile
from collections.abc import Callable, Mapping

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

# 2024-01-01T00:00:00Z: member times are fixed so that archives are reproducible.
_MEMBER_MTIME = 1_704_067_200


def targz_bytes(files: Mapping[str, str]) -> bytes:
    """A gzip-compressed tar of ``files`` (path -> text), reproducible byte for byte."""
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as compressed,
        tarfile.open(fileobj=compressed, mode="w", format=tarfile.GNU_FORMAT) as archive,
    ):
        for name in sorted(files):
            data = files[name].encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), _MEMBER_MTIME, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def gzip_bytes(text: str) -> bytes:
    return gzip.compress(text.encode(), mtime=0)


def _members(rng: random.Random, top: str) -> dict[str, str]:
    return {
        path: as_lines([sentence(rng, WORDS, 2, 7) for _ in range(rng.randint(1, 20))])
        for path in random_tree(rng, top, rng.randint(2, 15), ("txt", "md", "csv", "cfg"))
    }


def _archive_task(
    instruction: str,
    command: str,
    task_checks: tuple[checks.Check, ...],
    files: Mapping[str, str | bytes],
    *,
    tag: str,
    difficulty: Difficulty = "medium",
) -> TaskSpec:
    return TaskSpec(
        instruction=instruction,
        solution=solution(command),
        checks=task_checks,
        difficulty=difficulty,
        category="archive",
        tags=("tar", "gzip", tag),
        files=files,
    )


# -- untar -----------------------------------------------------------------------------------


def build_untar(rng: random.Random) -> TaskSpec:
    return rng.choice(_UNTARS)(rng)


def _extract_into(rng: random.Random) -> TaskSpec:
    archive, dest, top = f"{rng.choice(WORDS)}.tar.gz", *pick(rng, 2)
    members = _members(rng, top)
    return _archive_task(
        f"Extract the archive {archive} into the directory {dest} (create it), so "
        f"that its member `{sorted(members)[0]}` ends up at {dest}/{sorted(members)[0]}.",
        f"mkdir -p {dest} && tar -xzf {archive} -C {dest}",
        (checks.tree(dest, members),),
        {archive: targz_bytes(members)},
        difficulty="easy",
        tag="extract",
    )


def _extract_secret(rng: random.Random) -> TaskSpec:
    archive, top, out = f"{rng.choice(WORDS)}.tar.gz", *pick(rng, 2)
    members = _members(rng, top)
    folder = rng.choice(sorted({path.rsplit("/", 1)[0] for path in members}))
    code = f"{rng.choice(WORDS)}-{rng.randint(1000, 9999)}"
    members[f"{folder}/secret.key"] = code + "\n"
    return _archive_task(
        f"Somewhere inside the archive {archive} is a file named secret.key. Write its "
        f"content to {out}.txt",
        f"tar -xzOf {archive} {folder}/secret.key > {out}.txt",
        (checks.text(f"{out}.txt", code + "\n"),),
        {archive: targz_bytes(members)},
        tag="extract",
    )


def _list_members(rng: random.Random) -> TaskSpec:
    archive, top, out = f"{rng.choice(WORDS)}.tar.gz", *pick(rng, 2)
    members = _members(rng, top)
    return _archive_task(
        f"Write the paths of all files stored in the archive {archive}, exactly as "
        f"stored, one per line in any order, to {out}.txt",
        f"tar -tzf {archive} > {out}.txt",
        (checks.lines(f"{out}.txt", sorted(members), unordered=True),),
        {archive: targz_bytes(members)},
        difficulty="easy",
        tag="list",
    )


def _gunzip(rng: random.Random) -> TaskSpec:
    name = f"{rng.choice(WORDS)}.{rng.choice(('txt', 'log', 'csv'))}"
    text = as_lines([sentence(rng, WORDS, 2, 9) for _ in range(rng.randint(2, 200))])
    return _archive_task(
        f"Decompress the gzip file {name}.gz into {name}",
        f"gzip -dc {name}.gz > {name}",
        (checks.text(name, text),),
        {f"{name}.gz": gzip_bytes(text)},
        difficulty="easy",
        tag="gunzip",
    )


def _member_lines(rng: random.Random) -> TaskSpec:
    archive, top, out = f"{rng.choice(WORDS)}.tar.gz", *pick(rng, 2)
    members = _members(rng, top)
    member = rng.choice(sorted(members))
    return _archive_task(
        f"How many lines does the file {member} inside the archive {archive} have? "
        f"Write only the number to {out}.txt",
        f"tar -xzOf {archive} {member} | wc -l > {out}.txt",
        (checks.number(f"{out}.txt", members[member].count("\n")),),
        {archive: targz_bytes(members)},
        tag="extract",
    )


_UNTARS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _extract_into,
    _extract_secret,
    _list_members,
    _gunzip,
    _member_lines,
)


# -- mktar -----------------------------------------------------------------------------------


def build_mktar(rng: random.Random) -> TaskSpec:
    return rng.choice(_MKTARS)(rng)


def _tar_folder(rng: random.Random) -> TaskSpec:
    top, name = pick(rng, 2)
    members = _members(rng, top)
    return _archive_task(
        f"Create the gzip-compressed tar archive {name}.tar.gz holding the directory "
        f"{top} and everything in it; member paths must start with `{top}/`.",
        f"tar -czf {name}.tar.gz {top}",
        (checks.tar(f"{name}.tar.gz", members),),
        dict(members),
        tag="create",
    )


def _tar_plain(rng: random.Random) -> TaskSpec:
    top, name = pick(rng, 2)
    members = _members(rng, top)
    return _archive_task(
        f"Create an uncompressed tar archive {name}.tar of the directory {top}; "
        f"member paths must start with `{top}/`.",
        f"tar -cf {name}.tar {top}",
        (checks.tar(f"{name}.tar", members, gzipped=False),),
        dict(members),
        tag="create",
    )


def _tar_selected(rng: random.Random) -> TaskSpec:
    top, name = pick(rng, 2)
    members = _members(rng, top)
    members[f"{top}/{rng.choice(WORDS)}_notes.md"] = "# notes\n"
    members[f"{top}/{rng.choice(WORDS)}_data.csv"] = "a,b\n1,2\n"
    chosen = {path: text for path, text in members.items() if path.endswith(".md")}
    return _archive_task(
        f"Create the gzip-compressed tar archive {name}.tar.gz holding only the files "
        f"ending in `.md` found below {top} (at any depth), stored with their paths "
        f"relative to /app (starting with `{top}/`). No other files may be in it.",
        f"find {top} -type f -name '*.md' | tar -czf {name}.tar.gz -T -",
        (checks.tar(f"{name}.tar.gz", chosen),),
        dict(members),
        difficulty="hard",
        tag="create",
    )


def _gzip_keep(rng: random.Random) -> TaskSpec:
    name = f"{rng.choice(WORDS)}.{rng.choice(('txt', 'log', 'csv'))}"
    text = as_lines([sentence(rng, WORDS, 2, 9) for _ in range(rng.randint(2, 200))])
    return _archive_task(
        f"Compress {name} with gzip into {name}.gz, keeping the original file.",
        f"gzip -k {name}",
        (checks.gzip_text(f"{name}.gz", text), checks.text(name, text)),
        {name: text},
        difficulty="easy",
        tag="gzip",
    )


_MKTARS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _tar_folder,
    _tar_plain,
    _tar_selected,
    _gzip_keep,
)
