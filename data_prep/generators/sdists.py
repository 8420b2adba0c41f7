"""Pinned PyPI source distributions that minismith can mutate: real code with real tests.

Each entry is a small pure-Python package whose sdist ships its test suite, in a flat layout
(``python -m pytest`` from the unpacked folder imports the package from there), and whose
tests pass with plain pytest, no plugins and no other dependency, in the local sandbox.
``fetch`` downloads the missing ones with ``pip download --no-deps --no-binary :all:``
(the ordinary client, so the configured index is used), checks each archive against its
pinned sha256 and unpacks it to ``<cache>/<name>-<version>/``. Unpacked folders are reused,
so a second call needs no network; the generator works without any of them.

Checked and left out: more-itertools 11.2.1 (its suite takes 20 s, per mutant),
boltons 26.2.0 (3 s per run and 70 modules), jmespath 1.1.0 (compliance tests need data the
sdist lacks), iso8601 2.1.0 (tests need hypothesis), toposort 1.10 (src layout).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SDISTS", "Sdist", "fetch"]


@dataclass(frozen=True)
class Sdist:
    name: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.version}"


SDISTS = (
    # 455 tests in 0.3 s; one module of string inflections.
    Sdist(
        "inflection", "0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417"
    ),
    # 110 tests in 0.3 s; the format-string parser behind `parse.parse`.
    Sdist("parse", "1.22.4", "706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5"),
    # 193 tests in 0.8 s; functional helpers for iterables and dicts.
    Sdist("toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490"),
)


def fetch(cache_dir: Path, packages: Sequence[Sdist] = SDISTS) -> list[Path]:
    """The unpacked project folders, downloading and unpacking only what is missing."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    return [_fetch_one(cache_dir, sdist) for sdist in packages]


def _fetch_one(cache_dir: Path, sdist: Sdist) -> Path:
    target = cache_dir / sdist.dirname
    if target.is_dir():
        return target
    archive = _download(cache_dir / "downloads", sdist)
    _unpack(archive, target)
    return target


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pinned_archive(folder: Path, sdist: Sdist) -> Path | None:
    """The downloaded archive whose content hash is the pinned one, if any."""
    for path in sorted(folder.glob("*.tar.gz")):
        if _sha256(path) == sdist.sha256:
            return path
    return None


def _download(folder: Path, sdist: Sdist) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    archive = _pinned_archive(folder, sdist)
    if archive is not None:
        return archive
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    argv += ["--quiet", "--dest", str(folder), sdist.requirement]
    run = subprocess.run(argv, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(
            f"pip download {sdist.requirement} failed (exit {run.returncode}): "
            f"{run.stderr.strip()[-800:]}"
        )
    archive = _pinned_archive(folder, sdist)
    if archive is None:
        found = {path.name: _sha256(path) for path in sorted(folder.glob("*.tar.gz"))}
        raise RuntimeError(
            f"{sdist.requirement}: no archive in {folder} has the pinned sha256 "
            f"{sdist.sha256}; found {found}"
        )
    return archive


def _unpack(archive: Path, target: Path) -> None:
    """Unpack the sdist's single top folder to ``target``, atomically by rename."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".unpack-") as staging:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        tops = list(Path(staging).iterdir())
        if len(tops) != 1 or not tops[0].is_dir():
            names = sorted(path.name for path in tops)
            raise RuntimeError(f"{archive}: expected one top-level folder, found {names}")
        shutil.move(tops[0], target)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.generators.sdists",
        description="Fetch the pinned sdists minismith mutates; prints their folders.",
    )
    parser.add_argument("--cache", type=Path, required=True, help="e.g. .cache/minismith")
    args = parser.parse_args(argv)
    for path in fetch(args.cache):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
