"""Sandboxes for agent tool calls: a private workdir per trajectory, no network, limits.

``open_sandbox("local")`` isolates with bubblewrap on this machine (see local.py);
``open_sandbox("docker")`` runs one container per trajectory (see docker_backend.py).
Both honour ``SandboxLimits`` and return ``ExecResult``; base.py states the contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from thundersync_core.rollout.sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxPathError,
    SandboxUnavailable,
)

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxPathError",
    "SandboxUnavailable",
    "open_sandbox",
]


def open_sandbox(
    backend: Literal["local", "docker"] = "local",
    *,
    limits: SandboxLimits | None = None,
    workdir_from: Path | None = None,
    image: str | None = None,
    ro_binds: Sequence[Path] = (),
) -> Sandbox:
    """A fresh sandbox; ``workdir_from`` is copied into its workdir.

    ``image`` is the Docker image (default ``thundersync-sandbox:latest``, made by
    ``thundersync sandbox build-image``); the local backend has no
    image and refuses one. ``ro_binds`` are host paths made readable at the same path.
    Raises SandboxUnavailable when the backend cannot run here.
    """
    if backend == "local":
        if image is not None:
            raise ValueError(f"image={image!r} applies to the docker backend, not local")
        from thundersync_core.rollout.sandbox.local import LocalSandbox  # noqa: PLC0415

        return LocalSandbox(limits, ro_binds=ro_binds, workdir_from=workdir_from)
    if backend == "docker":
        from thundersync_core.rollout.sandbox.docker_backend import (  # noqa: PLC0415
            DEFAULT_IMAGE,
            DockerSandbox,
        )

        return DockerSandbox(
            limits, image=image or DEFAULT_IMAGE, ro_binds=ro_binds, workdir_from=workdir_from
        )
    raise ValueError(f"backend must be 'local' or 'docker', got {backend!r}")
