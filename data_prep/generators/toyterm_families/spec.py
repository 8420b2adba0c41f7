"""What a toyterm family builds for one task (``TaskSpec``) and the helpers families share.

A family is a function ``build_<family>(rng) -> TaskSpec``: it draws every parameter from
``rng`` and returns the instruction, the input files, a bash reference solution and the
checks the verifier runs. Expected values are computed here in Python, independently of
the shell commands of the reference solution, so that validation (no-op scores 0,
reference scores 1) tests both against each other.
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Literal

from data_prep.generators.toyterm_families.checks import Check

Difficulty = Literal["easy", "medium", "hard"]
DIFFICULTIES: tuple[Difficulty, ...] = ("easy", "medium", "hard")

# Plain lowercase ASCII words, so that every collation sorts them alike. A few contain
# others; families that grep for a word pick one with ``standalone_words``.
_WORD_TEXT = """
    acorn amber anchor apple arrow aspen badge bamboo banjo barley basil beacon birch
    bison blossom bolt bramble breeze brick bridge bronze cabin cactus camel canyon
    carbon cedar chalk cherry cinder citrus clover cobalt comet copper coral cotton
    crane crater cricket crystal cypress dahlia delta denim desert dingo dolphin dune
    eagle ember falcon fennel fern fiddle fig flint forest fossil fox galaxy garnet
    geyser ginger glacier granite gravel grove harbor hazel heron hickory honey horizon
    iris island ivory jade jasmine juniper kayak kelp kestrel kiwi lagoon lantern larch
    lava lemon lichen lilac linen lotus lynx magnet maple marble meadow mesa
    meteor mint mango moss nectar nickel nutmeg oasis ocean olive onyx opal orbit orchid
    otter oyster paddle panda pebble pepper pine plume pollen poplar prairie puffin
    quartz quill raven reef ridge river robin saffron sage salmon sapphire satin
    sequoia shale sierra silver slate sparrow spruce squid summit swallow tango thistle
    thunder tide timber topaz tulip tundra umber valley velvet violet walnut willow
    wombat yarrow zephyr zinc
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

SOLUTION_HEADER = "#!/bin/bash\n# Reference solution; runs in /app.\ncd /app || exit 1\n"
# The verifier's expected orders are codepoint orders; C collation makes sort agree.
SOLUTION_HEADER += "export LC_ALL=C\n"


@dataclass(frozen=True)
class TaskSpec:
    """One task before it is written out. ``files`` and check paths are relative to /app.

    ``run_time_s`` is how long the task's own programs sleep; it is added to the agent's
    time budget so that slow tasks are not judged by the fast tasks' timeout.
    """

    instruction: str
    solution: str
    checks: tuple[Check, ...]
    difficulty: Difficulty
    category: str
    tags: tuple[str, ...]
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    executables: frozenset[str] = frozenset()
    run_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.checks:
            raise ValueError(f"task spec {self.instruction[:60]!r}: no checks")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"task spec: difficulty {self.difficulty!r} not in {DIFFICULTIES}")
        for path in self.files:
            pure = PurePosixPath(path)
            if pure.is_absolute() or ".." in pure.parts or not pure.parts:
                raise ValueError(f"task spec: input path {path!r} must be relative, no '..'")
        if not self.executables <= set(self.files):
            missing = sorted(self.executables - set(self.files))
            raise ValueError(f"task spec: executables {missing} are not input files")


def pick(rng: random.Random, count: int, pool: Sequence[str] = WORDS) -> list[str]:
    """``count`` distinct items of ``pool`` in random order."""
    return rng.sample(list(pool), count)


def standalone_words(pool: Sequence[str]) -> list[str]:
    """Words of ``pool`` that occur in no other word of it (grep -w and grep agree)."""
    return [w for w in pool if not any(w != other and w in other for other in pool)]


def as_lines(lines: Sequence[str]) -> str:
    """Lines joined with a newline after each, as text files end."""
    return "".join(f"{line}\n" for line in lines)


def q(text: str) -> str:
    return shlex.quote(text)


def solution(*commands: str) -> str:
    return SOLUTION_HEADER + "".join(f"{command}\n" for command in commands)


def sentence(rng: random.Random, pool: Sequence[str], low: int, high: int) -> str:
    return " ".join(rng.choice(pool) for _ in range(rng.randint(low, high)))


def random_dirs(rng: random.Random, root: str, count: int, max_depth: int = 3) -> list[str]:
    """``root`` and up to ``count - 1`` distinct folders below it, at most ``max_depth`` deep."""
    dirs = [root]
    for _ in range(count * 20):
        if len(dirs) >= count:
            break
        parent = rng.choice(dirs)
        child = f"{parent}/{rng.choice(WORDS)}"
        if child.count("/") - root.count("/") <= max_depth and child not in dirs:
            dirs.append(child)
    return dirs


def random_tree(
    rng: random.Random, root: str, n_files: int, extensions: Sequence[str]
) -> dict[str, str]:
    """Path -> one-line content for ``n_files`` files in nested folders below ``root``."""
    dirs = random_dirs(rng, root, max(2, n_files // 3))
    files: dict[str, str] = {}
    for _ in range(n_files * 20):
        if len(files) >= n_files:
            break
        # Folder names have no dot, so a file path never collides with a folder.
        path = f"{rng.choice(dirs)}/{rng.choice(WORDS)}.{rng.choice(extensions)}"
        if path not in files:
            files[path] = sentence(rng, WORDS, 2, 6) + "\n"
    return files


def relative_to(root: str, files: Mapping[str, str]) -> dict[str, str]:
    """``files`` with the ``root/`` prefix removed from every key."""
    return {path.removeprefix(root + "/"): text for path, text in files.items()}
