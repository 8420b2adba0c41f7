"""The warm starts of a training run: given, or made once and kept under a key.

With ``warm_start.cache_dir`` a warm start is kept at ``<cache>/<policy|teacher>-<key>``,
the key a sha256 over everything it depends on (see ``warm_start_key``); every run with the
same key reuses it. With ``warm_start.preset`` the warm start is made at that preset and
grown into ``policy.preset`` beside it (``<name>-<preset>``). A warm start is written to a
scratch folder named by host and process beside its target and renamed into place, so a
folder at the target is complete; scratch folders of processes that died on this host are
removed at the next start. The fine-tuning runs as ``thundersync warm-start`` in a child
process (``runtime/child.py``: tcmalloc where the system has it, killed with its parent).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from thundersync_core.config import TrainConfig
from thundersync_core.rollout.weights import process_alive
from thundersync_core.runtime.child import run_child, tcmalloc

__all__ = ["digest_code", "digest_files", "prepare_policies", "warm_start_key"]


def prepare_policies(
    config: TrainConfig, out: Path, train_roots: Sequence[Path]
) -> tuple[Path, Path | None]:
    """(policy folder, teacher folder or None): given, or warm-started once per run folder.

    The warm start sees ``train_roots`` and, with ``tasks.warm_start_pool``, the prep run's
    warm-start-only tasks (generated apart from every train, dev and evaluation task).
    """
    extra = Path(config.tasks.prep_dir) / "terminal" / "warmstart.parquet"
    if config.tasks.warm_start_pool and extra.is_file():
        train_roots = [*train_roots, extra]
    policy = config.policy.path or _warm(
        config, out / "warmstart" / "policy", train_roots, config.warm_start.steps
    )
    if config.objective != "opd":
        return Path(policy), None
    from_policy = config.warm_start.teacher_init == "policy"
    teacher = config.policy.teacher_path or _warm(
        config,
        out / "warmstart" / "teacher",
        train_roots,
        config.warm_start.teacher_steps,
        init_from=Path(policy) if from_policy else None,
    )
    return Path(policy), Path(teacher)


def _warm(
    config: TrainConfig,
    target: Path,
    roots: Sequence[Path],
    steps: int,
    init_from: Path | None = None,
) -> Path:
    start = config.warm_start.preset
    if init_from is None and start is not None and start != config.policy.preset:
        at_start = config.model_copy(
            update={"policy": config.policy.model_copy(update={"preset": start})}
        )
        return _grown(_warm(at_start, target, roots, steps), config.policy.preset, config.seed)
    if config.warm_start.cache_dir is not None:
        key = warm_start_key(config, roots, steps, init_from)
        target = Path(config.warm_start.cache_dir) / f"{target.name}-{key[:16]}"
    if (target / "config.json").is_file():
        if config.warm_start.cache_dir is not None:
            print(f"[warm start] reusing {target}", flush=True)
        return target

    def write(scratch: Path) -> None:
        if not config.warm_start.enabled:
            from thundersync_core.policy import (  # noqa: PLC0415
                build_model,
                build_tokenizer,
                save_policy,
            )

            model = build_model(config.policy.preset, seed=config.seed)
            save_policy(model, build_tokenizer(vocab_size=model.config.vocab_size), scratch)
            return
        from thundersync_core.warmstart.sft import SUMMARY_FILE  # noqa: PLC0415

        argv = [
            sys.executable, "-m", "thundersync_core.cli", "warm-start",
            "--out", str(scratch),
            "--preset", config.policy.preset,
            "--steps", str(steps),
            "--lr", repr(config.warm_start.lr),
            "--seed", str(config.seed),
            "--compute-dtype", config.warm_start.compute_dtype,
            "--threads", str(len(os.sched_getaffinity(0))),
        ]  # fmt: skip
        for root in roots:
            argv += ["--tasks", str(root)]
        if config.tasks.families:
            argv += ["--families", ",".join(config.tasks.families)]
        if init_from is not None:
            argv += ["--init-from", str(init_from)]
        if tcmalloc() is None:
            print(
                "[warm start] no tcmalloc here (Debian: libtcmalloc-minimal4): the fine-tuning "
                "runs on glibc's malloc, slower (the demo's 1,500 steps: 816 s against 511 s)",
                flush=True,
            )
        run_child(f"the warm start into {target}", argv)
        summary = json.loads((scratch / SUMMARY_FILE).read_text())
        summary["out_dir"] = str(target)
        (scratch / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        print(
            f"[warm start] {target}: {summary['steps']} steps, loss {summary['first_loss']:.3f}"
            f" -> {summary['final_loss']:.3f}, {summary['wall_s']:.0f} s",
            flush=True,
        )

    return _write_in_place(target, write)


def _grown(trained: Path, preset: str, seed: int) -> Path:
    """``trained`` grown into ``preset`` (``policy/grow.py``), kept beside it by name."""
    target = trained.with_name(f"{trained.name}-{preset}")
    if (target / "config.json").is_file():
        return target

    def write(scratch: Path) -> None:
        from thundersync_core.policy import build_model  # noqa: PLC0415
        from thundersync_core.policy.grow import grow_into  # noqa: PLC0415
        from thundersync_core.policy.io import load_model  # noqa: PLC0415
        from thundersync_core.warmstart.sft import SUMMARY_FILE  # noqa: PLC0415

        shutil.copytree(trained, scratch)  # tokenizer, chat template, generation config
        for weights in scratch.glob("model*.safetensors*"):
            weights.unlink()
        model = build_model(preset, seed=seed)
        grow_into(load_model(trained), model)
        model.save_pretrained(scratch, safe_serialization=True)
        summary_file = scratch / SUMMARY_FILE
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        summary.update(grown_from=str(trained), grown_to=preset, out_dir=str(target))
        summary_file.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"[warm start] grown into the {preset} preset: {target}", flush=True)

    return _write_in_place(target, write)


def _write_in_place(target: Path, write: Callable[[Path], None]) -> Path:
    """``write`` a model folder beside ``target`` and rename it into place, so a folder at
    the target is complete; ``target`` (another run's, the same) if it got there first."""
    _remove_abandoned_scratch(target)
    scratch = target.with_name(f"{_scratch_prefix(target)}{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    write(scratch)
    if target.exists() and not (target / "config.json").is_file():
        shutil.rmtree(target)  # incomplete: written in place by an older version, then stopped
    try:
        scratch.rename(target)
    except OSError:
        # Another run with the same key finished first: its folder is the same model.
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def warm_start_key(
    config: TrainConfig, roots: Sequence[Path], steps: int, init_from: Path | None = None
) -> str:
    """sha256 over what a warm start depends on: its settings, the starting weights (a
    preset, or the files of ``init_from``), every file of every task it trains on, and the
    warm-start, policy and agent code."""
    from thundersync_core.warmstart.tasks import collect_tasks  # noqa: PLC0415

    families = config.tasks.families or None
    settings = {
        "enabled": config.warm_start.enabled,
        "preset": config.policy.preset if init_from is None else None,
        "steps": steps,
        "lr": config.warm_start.lr,
        "seed": config.seed,
        "families": sorted(families or []),
    }
    if config.warm_start.compute_dtype != "float32":  # keys made before the setting stay
        settings["compute_dtype"] = config.warm_start.compute_dtype
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    if init_from is not None:
        digest_files(digest, Path(init_from), "init_from")
    if config.warm_start.enabled:
        for task in collect_tasks(list(roots), families=families):
            digest_files(digest, task.root, task.task_id)
    digest_code(digest)
    return digest.hexdigest()


def _scratch_prefix(target: Path) -> str:
    # The host is in the name: a cache on a shared file system sees other hosts' pids.
    return f".{target.name}.partial-{socket.gethostname()}-"


def _remove_abandoned_scratch(target: Path) -> None:
    """Removes this host's scratch folders of warm starts into ``target`` whose process is
    gone (killed mid-way); a live process's scratch, or another host's, is left alone."""
    prefix = _scratch_prefix(target)
    for scratch in target.parent.glob(f"{prefix}*"):
        pid = scratch.name[len(prefix) :]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def digest_code(digest: Any) -> None:
    """The warm-start, policy and agent code: what a warm start's weights depend on."""
    package = Path(__file__).resolve().parent.parent
    for code in ("warmstart", "policy", "rollout"):
        digest_files(digest, package / code, code, pattern="*.py")


def digest_files(digest: Any, root: Path, label: str, pattern: str = "*") -> None:
    for path in sorted(p for p in root.rglob(pattern) if p.is_file()):
        digest.update(f"{label}/{path.relative_to(root).as_posix()}".encode())
        digest.update(path.read_bytes())
