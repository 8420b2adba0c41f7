"""``thundersync eval``: pass@k, SWE-bench log grading, agent evaluation, cadence, comparison.

    thundersync eval passk --results FILE.jsonl --k 1,3,5
    thundersync eval grade-swebench --instance FILE.json --log FILE.txt
    thundersync eval swebench-harness --predictions FILE.jsonl --dataset PARQUET --run-id ID
    thundersync eval run --model DIR --tasks DIR [--swe PARQUET] --k 3 --out FILE.jsonl
    thundersync eval cadence --run RUN_DIR --k 3 (--prep DIR | --tasks DIR [--swe PARQUET])
    thundersync eval compare --runs RUN_DIR [RUN_DIR ...] --target X --budget H --out DIR

Handlers import their modules when called, so ``thundersync --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def _add_pool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", type=Path, help="folder of Harbor-format terminal tasks")
    p.add_argument("--swe", type=Path, help="SWE-smith-schema records (prep parquet)")
    p.add_argument(
        "--repos", type=Path, help="repository snapshots at REPOS/<repo>/<base_commit> "
        "(default: the prep layout, <parquet>/../../repos)"
    )  # fmt: skip
    p.add_argument("--prep", type=Path, help="a prep output folder: use its --split pools")
    p.add_argument("--split", default="dev", choices=["dev", "train"], help="with --prep")
    p.add_argument("--limit", default=0, type=int, help="first N tasks of each pool (0: all)")


def _add_agent_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", default=3, type=int, help="attempts per task")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    p.add_argument("--backend", default="local", choices=["local", "docker"])
    p.add_argument("--image", help="Docker image (--backend docker; default thundersync-sandbox)")
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--temperature", default=1.0, type=float)
    p.add_argument("--top-p", default=1.0, type=float)
    p.add_argument("--top-k", default=0, type=int, help="0: no top-k filter")
    p.add_argument(
        "--action-format", default="bash_block", choices=["bash_block", "tool_calls"],
        help="fenced bash blocks, or the chat template's own tool calls (as trained)",
    )  # fmt: skip
    p.add_argument("--tool-call-format", default="auto", choices=["auto", "hermes", "json"])
    p.add_argument(
        "--enable-thinking", default=None, choices=["true", "false"],
        help="a thinking template's switch (default: the template's own)",
    )  # fmt: skip
    p.add_argument("--max-turns", default=4, type=int)
    p.add_argument("--max-tokens-per-turn", default=64, type=int)
    p.add_argument("--command-timeout", default=10.0, type=float, help="seconds per command")
    p.add_argument("--grade-timeout", default=120.0, type=float, help="seconds per SWE pytest")
    p.add_argument("--batch", default=32, type=int, help="episodes run concurrently")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate policies: pass@k, SWE-bench grading, comparisons")
    verbs = p.add_subparsers(dest="eval_command", required=True)

    passk = verbs.add_parser("passk", help="pass@k from per-attempt JSONL results")
    passk.add_argument("--results", required=True, type=Path)
    passk.add_argument("--k", default="1", help="comma-separated k values, e.g. 1,3,5")

    grade = verbs.add_parser("grade-swebench", help="grade one SWE-bench/SWE-smith test log")
    grade.add_argument("--instance", required=True, type=Path, help="instance record (JSON)")
    grade.add_argument("--log", required=True, type=Path, help="test output log")

    harness = verbs.add_parser(
        "swebench-harness",
        help="run swebench's Docker evaluation of predictions in the instances' own images",
    )
    harness.add_argument("--predictions", required=True, type=Path, help="predictions JSONL")
    harness.add_argument(
        "--dataset", required=True,
        help="SWE-bench records: a .parquet/.json/.jsonl file, or a Hugging Face name",
    )  # fmt: skip
    harness.add_argument("--split", default="test")
    harness.add_argument("--instance-ids", nargs="*", default=[], help="default: predicted ones")
    harness.add_argument("--run-id", required=True, help="names the harness's log folder")
    harness.add_argument("--max-workers", default=1, type=int)
    harness.add_argument("--timeout", default=1800, type=int, help="seconds per instance")
    harness.add_argument("--report-dir", default=Path("."), type=Path)

    run_p = verbs.add_parser("run", help="evaluate one policy with the bash agent")
    run_p.add_argument("--model", required=True, type=Path, help="Hugging Face policy folder")
    run_p.add_argument("--out", required=True, type=Path, help="per-attempt results (JSONL)")
    _add_pool_args(run_p)
    _add_agent_args(run_p)

    cadence = verbs.add_parser("cadence", help="evaluate every published checkpoint of a run")
    cadence.add_argument("--run", required=True, type=Path, help="training run folder")
    cadence.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: model/)")
    _add_pool_args(cadence)
    _add_agent_args(cadence)

    comp = verbs.add_parser("compare", help="compare runs at matched device-hours")
    comp.add_argument("--runs", required=True, nargs="+", type=Path)
    comp.add_argument("--target", required=True, type=float, help="score to reach")
    comp.add_argument("--budget", required=True, type=float, help="device-hours budget")
    comp.add_argument("--metric", default="pass@1", help="summary field, e.g. pass@3")
    comp.add_argument("--baseline", default="sync", help="schedule the speedups refer to")
    comp.add_argument("--out", required=True, type=Path, help="folder for plots and tables")


def _pools(args: argparse.Namespace) -> dict:
    from eval.terminal_eval import load_pools, load_prep_pools  # noqa: PLC0415

    if args.prep is not None:
        if args.tasks is not None or args.swe is not None:
            raise ValueError("--prep selects the pools itself; drop --tasks/--swe")
        return load_prep_pools(
            args.prep, args.split, limit=args.limit, grade_timeout_s=args.grade_timeout
        )
    if args.tasks is None and args.swe is None:
        raise ValueError("give --tasks and/or --swe, or --prep")
    return load_pools(
        args.tasks, args.swe, args.repos, limit=args.limit, grade_timeout_s=args.grade_timeout
    )


def _settings(args: argparse.Namespace) -> Any:
    from eval.terminal_eval import EvalSettings  # noqa: PLC0415

    return EvalSettings(
        k=args.k,
        max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens_per_turn,
        command_timeout_s=args.command_timeout,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        action_format=args.action_format,
        tool_call_format=args.tool_call_format,
        enable_thinking=None if args.enable_thinking is None else args.enable_thinking == "true",
        seed=args.seed,
        backend=args.backend,
        docker_image=args.image,
        episodes_per_batch=args.batch,
        grade_timeout_s=args.grade_timeout,
    )


def _run_passk(args: argparse.Namespace) -> int:
    from eval.passk import load_results, parse_ks, score  # noqa: PLC0415

    ks = parse_ks(args.k)
    print(json.dumps(score(load_results(args.results), ks)))
    return 0


def _run_grade(args: argparse.Namespace) -> int:
    from eval.swebench_eval import grade_log, load_instance  # noqa: PLC0415

    instance = load_instance(args.instance)
    if not args.log.is_file():
        raise FileNotFoundError(f"--log {args.log}: no such file")
    grade = grade_log(instance, args.log.read_text(encoding="utf-8", errors="replace"))
    print(json.dumps(grade.to_json()))
    return 0


def _run_harness(args: argparse.Namespace) -> int:
    import sys  # noqa: PLC0415

    from eval.swebench_eval import DockerUnavailable, run_docker_harness  # noqa: PLC0415

    if not args.predictions.is_file():
        raise FileNotFoundError(f"--predictions {args.predictions}: no such file")
    try:
        report = run_docker_harness(
            args.predictions,
            dataset_name=args.dataset,
            run_id=args.run_id,
            split=args.split,
            instance_ids=args.instance_ids,
            max_workers=args.max_workers,
            timeout_s=args.timeout,
            report_dir=args.report_dir,
        )
    except DockerUnavailable as exc:
        print(f"thundersync eval swebench-harness: refused: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"report": str(report)}))
    return 0


def _run_run(args: argparse.Namespace) -> int:
    from eval.io import write_jsonl  # noqa: PLC0415
    from eval.terminal_eval import run_eval, summarize  # noqa: PLC0415

    settings = _settings(args)
    pools = _pools(args)
    rows, info = run_eval(args.model, pools, settings, engine_kind=args.engine)
    write_jsonl(args.out, rows)
    print(json.dumps({"out": str(args.out)} | info | summarize(rows, settings.ks)))
    return 0


def _run_cadence(args: argparse.Namespace) -> int:
    from eval.cadence import evaluate_run  # noqa: PLC0415

    settings = _settings(args)
    result = evaluate_run(
        args.run,
        _pools(args),
        settings,
        engine_kind=args.engine,
        tokenizer_dir=args.tokenizer,
    )
    print(json.dumps(vars(result)))
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from eval.report import write_comparison  # noqa: PLC0415

    comparison, table = write_comparison(
        args.runs,
        target=args.target,
        budget_dh=args.budget,
        metric=args.metric,
        out_dir=args.out,
        baseline=args.baseline,
    )
    print(table)
    print(json.dumps(comparison))
    return 0


_HANDLERS = {
    "passk": _run_passk,
    "grade-swebench": _run_grade,
    "swebench-harness": _run_harness,
    "run": _run_run,
    "cadence": _run_cadence,
    "compare": _run_compare,
}


def run(args: argparse.Namespace) -> int:
    return _HANDLERS[args.eval_command](args)
