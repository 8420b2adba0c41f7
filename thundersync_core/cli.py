"""The ``thundersync`` command."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a logged batch through a learner and write its gradient",
        description="Replay a logged batch; writes OUT/gradient.safetensors and summary.json.",
    )
    p.add_argument("--model", required=True, type=Path, help="Hugging Face causal-LM folder")
    p.add_argument("--batch", required=True, type=Path, help="batch file, one trajectory a line")
    p.add_argument("--objective", default="grpo", choices=["grpo", "opd"])
    p.add_argument("--schedule", default="sync", choices=["sync", "stream"])
    p.add_argument("--loss-agg", default="seq-sum", choices=["seq-sum", "token-mean"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--seed", default=0, type=int, help="arrival order for --schedule stream")
    p.add_argument("--max-open-groups", default=4, type=int, help="admission cap (stream)")
    p.add_argument(
        "--pack-tokens", default=0, type=int,
        help="GRPO stream: arrivals in random chunks, run as packs of at most N tokens",
    )  # fmt: skip
    p.add_argument(
        "--order", default="arrival", choices=["arrival", "fixed"],
        help="GRPO stream: sums in arrival order, or in trajectory-id order (bitwise sync's)",
    )  # fmt: skip
    p.add_argument(
        "--release", default="trajectory", choices=["trajectory", "group"],
        help="GRPO stream: a backward as each reward lands, or once its group's are all in",
    )  # fmt: skip
    p.add_argument(
        "--chunks", default=1, type=int,
        help="GRPO stream, with --pack-tokens and --order fixed: each group as N id-chunks",
    )  # fmt: skip
    p.add_argument(
        "--lora", default=None, metavar="r=R,alpha=A[,dropout=0][,targets=q_proj+v_proj]",
        help="train LoRA adapters (base frozen); the gradient file holds the adapters only",
    )  # fmt: skip
    p.add_argument("--lora-seed", default=0, type=int, help="the adapters' initial draw")
    p.add_argument("--out", required=True, type=Path)


def _add_init_policy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "init-policy",
        help="write a freshly initialised preset policy (model + tokenizer) in HF format",
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--out", required=True, type=Path)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the embedded demo (tiny policy, streamed GRPO steps)")
    p.add_argument("--out", default=Path("runs/demo"), type=Path)
    p.add_argument("--steps", default=4, type=int)


def _run_demo(args: argparse.Namespace) -> int:
    from thundersync_core.demo import run_demo

    run_demo(args.out, steps=args.steps)
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    from thundersync_core.replay import replay

    summary = replay(
        model_dir=args.model,
        batch_path=args.batch,
        out_dir=args.out,
        objective=args.objective,
        schedule=args.schedule,
        loss_agg=args.loss_agg,
        dtype=args.dtype,
        seed=args.seed,
        max_open_groups=args.max_open_groups,
        pack_tokens=args.pack_tokens,
        order=args.order,
        release=args.release,
        chunks=args.chunks,
        lora=args.lora,
        lora_seed=args.lora_seed,
    )
    print(json.dumps(summary))
    return 0


def _run_init_policy(args: argparse.Namespace) -> int:
    from thundersync_core.policy import build_model, build_tokenizer, parameter_count, save_policy

    model = build_model(args.preset, seed=args.seed)
    tokenizer = build_tokenizer(vocab_size=model.config.vocab_size)
    save_policy(model, tokenizer, args.out)
    print(json.dumps({"out": str(args.out), "parameters": parameter_count(model)}))
    return 0


STAGE_COMMANDS = {
    "rollout": "thundersync_core.rollout.cli",
    "sandbox": "thundersync_core.rollout.sandbox.cli",
    "prep": "data_prep.cli",
    "train": "thundersync_core.train_cli",
    "bench": "thundersync_core.bench_cli",
    "eval": "eval.cli",
    "perfmodel": "thundersync_core.perfmodel.cli",
    "plan": "thundersync_core.perfmodel.plan_cli",
    "experiment": "flows.cli",
    "warm-start": "thundersync_core.warmstart.cli",
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="thundersync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_replay(sub)
    _add_init_policy(sub)
    _add_demo(sub)
    handlers = {"replay": _run_replay, "init-policy": _run_init_policy, "demo": _run_demo}
    # Stage commands live with their stage; their modules import nothing heavy at top level.
    for name, module_path in STAGE_COMMANDS.items():
        module = importlib.import_module(module_path)
        module.add_parser(sub)
        handlers[name] = module.run
    args = parser.parse_args(argv)
    from thundersync_core.batch import BatchFormatError
    from thundersync_core.streaming.base import LearnerRefusal

    try:
        return handlers[args.command](args)
    except (
        BatchFormatError,
        LearnerRefusal,
        FileNotFoundError,
        FileExistsError,
        ValueError,
        KeyError,
    ) as exc:
        print(f"thundersync {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
