"""``thundersync sandbox exec``: run one command in a fresh sandbox and print its result.

    thundersync sandbox exec [--backend local|docker] [--timeout S] [--memory-mb M]
                             [--workdir-from DIR] [--image IMAGE] -- CMD [ARGS...]
    thundersync sandbox build-image [--tag IMAGE] [--suite SUITE]

``exec`` prints one JSON object, ``ExecResult.to_json()``, and exits 0 whenever the sandbox
ran the command (its own status is in the JSON); 2 when the sandbox could not be set up.
``build-image`` builds the Docker backend's image from Debian's packages (see image.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from thundersync_core.rollout.sandbox import SandboxError, SandboxLimits, image, open_sandbox
from thundersync_core.rollout.sandbox.base import SandboxUnavailable

__all__ = ["add_parser", "run"]

_DEFAULTS = SandboxLimits()


def add_parser(subparsers: Any) -> None:
    """Add ``sandbox exec`` to the ``thundersync`` subcommands; dispatch on ``run``."""
    sandbox = subparsers.add_parser("sandbox", help="run commands in an isolated sandbox")
    actions = sandbox.add_subparsers(dest="sandbox_command", required=True)
    p = actions.add_parser(
        "exec",
        help="run CMD in a fresh sandbox and print the result as JSON",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", default="local", choices=["local", "docker"])
    p.add_argument("--timeout", type=float, default=_DEFAULTS.timeout_s, help="seconds")
    p.add_argument("--memory-mb", type=int, default=_DEFAULTS.memory_mb)
    p.add_argument("--workdir-from", type=Path, help="folder copied in as the workdir")
    p.add_argument("--image", help="Docker image (docker backend only)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    build = actions.add_parser(
        "build-image", help="build the Docker backend's image locally, from Debian's packages"
    )
    image.add_arguments(build)


def run(args: argparse.Namespace) -> int:
    if args.sandbox_command == "build-image":
        return image.run(args)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise ValueError("sandbox exec: no command given (put it after --)")
    if args.workdir_from is not None and not args.workdir_from.is_dir():
        raise FileNotFoundError(f"--workdir-from {args.workdir_from}: not a folder")
    limits = SandboxLimits(timeout_s=args.timeout, memory_mb=args.memory_mb)
    try:
        sandbox = open_sandbox(
            args.backend, limits=limits, workdir_from=args.workdir_from, image=args.image
        )
    except (SandboxUnavailable, SandboxError) as exc:
        print(f"thundersync sandbox exec: error: {exc}", file=sys.stderr)
        return 2
    with sandbox:
        result = sandbox.exec(command)
    print(json.dumps(result.to_json()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m thundersync_core.rollout.sandbox.cli exec -- ...``)."""
    parser = argparse.ArgumentParser(prog="thundersync")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["sandbox", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
