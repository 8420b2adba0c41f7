"""The Docker backend's image, built on this machine from Debian's packages: no registry.

    thundersync sandbox build-image [--tag thundersync-sandbox:latest] [--suite bookworm]

Two steps, as on a machine that reaches Debian's mirror but no image registry:

1. a minimal Debian root file system (``debootstrap --variant=minbase``) with python3,
   imported as ``thundersync-sandbox-base:<key>``;
2. the layers graders and tasks need (``LAYERS``: pytest, git, patch, procps, /app), built
   FROM that base by the daemon.

``<key>`` is a digest of the whole recipe (suite, packages, layers), stored as the image's
``thundersync.recipe`` label: a second call finds the image with that key and builds
nothing, and a changed recipe builds anew. Needs root (debootstrap) and the Debian package
``debootstrap``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from thundersync_core.rollout.sandbox.docker_backend import DEFAULT_IMAGE, connect_docker

__all__ = ["LAYERS", "build_image", "recipe_key"]

DEFAULT_SUITE = "bookworm"
BASE_PACKAGES = ("python3",)
# What graders and tasks call beyond a bare Debian: pytest for SWE grading, git and patch
# to apply bug patches, procps for process checks.
LAYERS = """\
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3-pytest git patch procps \\
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
"""
RECIPE_LABEL = "thundersync.recipe"
_DEBOOTSTRAP_TIMEOUT_S = 900


def recipe_key(suite: str = DEFAULT_SUITE) -> str:
    recipe = json.dumps({"suite": suite, "packages": BASE_PACKAGES, "layers": LAYERS})
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _labelled(client: Any, tag: str, key: str) -> bool:
    import docker  # noqa: PLC0415

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return (image.labels or {}).get(RECIPE_LABEL) == key


def build_image(
    tag: str = DEFAULT_IMAGE, *, suite: str = DEFAULT_SUITE, client: Any = None
) -> dict[str, Any]:
    """Build ``tag`` unless an image of this recipe already has it; says what it did."""
    client = client or connect_docker()
    key = recipe_key(suite)
    if _labelled(client, tag, key):
        return {"image": tag, "recipe": key, "built": False}
    start = time.monotonic()
    base = f"thundersync-sandbox-base:{key}"
    if not _exists(client, base):
        _import_rootfs(client, base, suite)
    import docker  # noqa: PLC0415

    dockerfile = f"FROM {base}\n{LAYERS}LABEL {RECIPE_LABEL}={key}\n"
    context = _tar_context({"Dockerfile": dockerfile.encode()})
    try:
        client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, pull=False)
    except (docker.errors.BuildError, docker.errors.APIError) as exc:
        raise RuntimeError(f"building {tag} FROM {base} failed: {exc}") from exc
    return {"image": tag, "recipe": key, "built": True, "seconds": time.monotonic() - start}


def _exists(client: Any, tag: str) -> bool:
    import docker  # noqa: PLC0415

    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def _import_rootfs(client: Any, base: str, suite: str) -> None:
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise RuntimeError(
            "building the sandbox image needs 'debootstrap' (Debian package: "
            "apt-get install -y debootstrap)"
        )
    if os.geteuid() != 0:
        raise RuntimeError("building the sandbox image needs root (debootstrap)")
    with tempfile.TemporaryDirectory(prefix="thundersync-rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs"
        argv = [debootstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}"]
        run = subprocess.run(
            [*argv, suite, str(rootfs)],
            capture_output=True,
            text=True,
            timeout=_DEBOOTSTRAP_TIMEOUT_S,
            check=False,
        )
        if run.returncode != 0:
            tail = (run.stdout + run.stderr).strip()[-800:]
            raise RuntimeError(f"debootstrap {suite} failed (exit {run.returncode}): {tail}")
        archive = Path(scratch) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(archive), "."], check=True)
        repository, _, tag = base.partition(":")
        client.api.import_image_from_file(str(archive), repository=repository, tag=tag)


def _tar_context(files: dict[str, bytes]) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, payload in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    buffer.seek(0)
    return buffer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tag", default=DEFAULT_IMAGE, help="image name (docker backend)")
    parser.add_argument("--suite", default=DEFAULT_SUITE, help="Debian suite for the rootfs")


def run(args: argparse.Namespace) -> int:
    try:
        print(json.dumps(build_image(args.tag, suite=args.suite)))
    except RuntimeError as exc:
        print(f"thundersync sandbox build-image: error: {exc}", file=sys.stderr)
        return 2
    return 0
