"""Per-GPU memory of the learner: the model's table for real shapes, checked on CPU.

    .venv/bin/python benchmarks/learner_memory.py [--hf configs/hf/qwen3-8b.json ...]
        [--gpu-gb 180] [--prefix-tokens 1024] [--skip-measure | --checks lora]
        [--out FILE.json]
    .venv/bin/python benchmarks/learner_memory.py --render-doc FILE.json

1. The table: ``thundersync_core.perfmodel.memory`` for each Hugging Face config (default
   Qwen3-8B and Qwen3-32B) at W = 4, 8, 16 ranks, replicated and fsdp2, bfloat16 compute,
   8192 tokens per backward, k = 1, 2, 4, 8 open groups with release="trajectory" and
   release="group"; for fsdp2 also the same layout with the batch gradient sharded
   (``learner_sharded_gradient``) and with the k open groups shared by the ranks, their
   statistics 1/W per rank (``learner_shared_groups``). A mark says which rows fit ``--gpu-gb``;
   ``configs/cluster_grpo.yaml``'s layout with Qwen3-8B is reported below the table.
   LoRA (r = 16 and 64 on q,k,v,o,gate,up,down; float32 adapters over a bfloat16 base) at
   W = 1 (replicated) to 8 (fsdp2): the sync learner (one row per backward) beside the
   streaming one with k = 1, 2, 4, 8 open groups and release="group", and what streaming
   adds split into its parts, the two adapter-sized buffers per open group among them.
2. The check: W gloo ranks (``mp.spawn``, one process group per world size) run small
   learners on CPU case after case, two GRPO steps each (the first creates AdamW's state),
   after a discarded run of the first case (a process's first full-size step allocates
   some memory for good). Per case and rank it compares the model with (a) the tracked
   tensor bytes the code reports (``state_bytes()``, ``accumulator_bytes()``, the largest
   ``live_statistics_bytes()`` seen; with the sharded gradient, the largest pending buffer
   ``accumulator_bytes()`` shows above its shards) and (b) the peak resident set of the
   second step above the case's baseline (the resident set before its model existed).
   glibc is told to map every allocation above 64 KiB on its own
   (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the resident set at once and the
   peak is the tensors' rather than the heap's; the heap, where smaller tensors live, is
   trimmed (``malloc_trim``) before the baseline and before the measured step. AdamW on
   CPU takes its per-tensor loop, so the model is asked with ``adamw_foreach=False``.
   The LoRA cases (``--checks lora`` runs them alone) train r = 8 and 64 adapters on the
   ``small`` preset's shape in float32, with the sync learner (``micro_batch_tokens`` of
   one row) and the streaming one with k = 1 and 4 open groups, after a one-token prompt
   (the two learners' rows are then the same tokens) and a 33-token one: streaming's peak
   less sync's, measured, beside the model's and beside two float32 adapter-sized buffers
   per open group.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import socket
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thundersync_core.batch import Segment, Trajectory
from thundersync_core.config import load_config
from thundersync_core.parallel.data_parallel import (
    ProcessGroupReducer,
    ShardedGradient,
    init_process_group,
)
from thundersync_core.parallel.fsdp import ShardedState, TrainState, build_train_state
from thundersync_core.parallel.shared_groups import (
    SharedGroupsGRPOLearner,
    stream_shared_groups,
)
from thundersync_core.perfmodel.memory import (
    GB,
    LORA_TARGETS,
    LearnerLayout,
    LoraSpec,
    MemoryEstimate,
    ModelShape,
    layout_of,
    memory_per_gpu,
)
from thundersync_core.policy import build_model
from thundersync_core.policy.lora import LoraSettings, apply_lora
from thundersync_core.policy.presets import preset_config
from thundersync_core.streaming import (
    GroupSpec,
    StreamingGRPOLearner,
    SyncGRPOLearner,
    groups_of,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HF = (ROOT / "configs/hf/qwen3-8b.json", ROOT / "configs/hf/qwen3-32b.json")
CLUSTER_CONFIG = ROOT / "configs/cluster_grpo.yaml"
MIB = 1 << 20
#: Every allocation above this is its own mapping, returned to the system when freed.
MMAP_THRESHOLD_BYTES = 65536
#: A table row's layouts: full fine-tuning, the sharded gradient, shared groups.
_KEYS = ("full_bytes", "sharded_gradient_bytes", "shared_groups_bytes")
#: LoRA's table: adapter ranks, learner ranks (W = 1 replicated, more fsdp2), open groups.
LORA_RANKS = (16, 64)
LORA_WORLDS = (1, 2, 4, 8)
LORA_OPEN_GROUPS = (1, 2, 4, 8)


# -- 1. the model's table ---------------------------------------------------------------------
def table_rows(
    shape: ModelShape, *, gpu_bytes: int, tokens: int, prefix_tokens: int, group_size: int
) -> list[dict[str, Any]]:
    """One row per (W, sharding, release, k): full fine-tuning, the sharded gradient and the
    shared groups (release="trajectory")."""
    rows = []
    for world in (4, 8, 16):
        for sharding in ("replicated", "fsdp2"):
            for release, k in [("trajectory", k) for k in (1, 2, 4, 8)] + [("group", 1)]:
                layout = LearnerLayout(
                    world_size=world,
                    sharding=sharding,
                    compute_dtype="bfloat16",
                    open_groups=k,
                    release=release,  # type: ignore[arg-type]
                    tokens_per_backward=tokens,
                    prefix_tokens=prefix_tokens,
                    group_size=group_size,
                )
                full = memory_per_gpu(shape, layout)
                row: dict[str, Any] = {
                    "world_size": world,
                    "sharding": sharding,
                    "release": release,
                    "open_groups": k if release == "trajectory" else None,
                    "full_bytes": full.total_bytes,
                    "full_peak_phase": full.peak_phase,
                    "full_terms": full.terms,
                    "sharded_gradient_bytes": None,
                    "sharded_gradient_peak_phase": None,
                    "shared_groups_bytes": None,
                }
                if sharding == "fsdp2":
                    sharded = memory_per_gpu(shape, replace(layout, sharded_gradient=True))
                    row["sharded_gradient_bytes"] = sharded.total_bytes
                    row["sharded_gradient_peak_phase"] = sharded.peak_phase
                if sharding == "fsdp2" and release == "trajectory":
                    shared = memory_per_gpu(
                        shape, replace(layout, sharded_gradient=True, shared_groups=True)
                    )
                    row["shared_groups_bytes"] = shared.total_bytes
                row["fits"] = {key: row[key] is not None and row[key] <= gpu_bytes for key in _KEYS}
                rows.append(row)
    return rows


def print_table(
    name: str, shape: ModelShape, rows: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    print(
        f"\n{name}: {shape.parameter_count / 1e9:.2f} B parameters, bfloat16 compute, "
        f"{args.tokens} tokens per backward, {args.prefix_tokens}-token prompts, groups of "
        f"{args.group_size}.\nGB per GPU, * fits {args.gpu_gb:g} GB; sharded grad: fsdp2 with "
        "the batch gradient sharded; shared: and k groups shared by the ranks, statistics 1/W"
    )
    print(
        f"{'W':>3} {'sharding':<10} {'release':<10} {'k':>2} {'full FT':>9} {'peak in':<14}"
        f" {'sharded grad':>13} {'shared':>11}"
    )
    for r in rows:
        cells = []
        for key in _KEYS:
            value = r[key]
            cells.append(
                "-" if value is None else f"{value / GB:.0f}{'*' if r['fits'][key] else ' '}"
            )
        k = "-" if r["open_groups"] is None else str(r["open_groups"])
        print(
            f"{r['world_size']:>3} {r['sharding']:<10} {r['release']:<10} {k:>2} {cells[0]:>9}"
            f" {r['full_peak_phase']:<14} {cells[1]:>13} {cells[2]:>11}"
        )


def verdict(shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    """Does full fine-tuning with 4 open groups per rank fit 8 GPUs: with today's layout
    (fsdp2, the batch gradient and statistics whole on every rank), with release="group",
    with the batch gradient sharded (either release), and with the 4 groups shared by the
    ranks (their statistics 1/W per rank); and up to how many tokens per backward."""
    today = LearnerLayout(
        world_size=8,
        sharding="fsdp2",
        compute_dtype="bfloat16",
        open_groups=4,
        release="trajectory",
        tokens_per_backward=args.tokens,
        prefix_tokens=args.prefix_tokens,
        group_size=args.group_size,
    )
    gpu_bytes = int(args.gpu_gb * GB)
    out = {}
    sharded = replace(today, sharded_gradient=True)
    for label, layout in (
        ("today", today),
        ("today_release_group", replace(today, release="group")),
        ("sharded_gradient", sharded),
        ("sharded_gradient_release_group", replace(sharded, release="group")),
        ("shared_groups", replace(sharded, shared_groups=True)),
    ):
        estimate = memory_per_gpu(shape, layout)
        out[label] = {
            "fits": estimate.total_bytes <= gpu_bytes,
            "total_bytes": estimate.total_bytes,
            "without_held_sources_bytes": _without_held_sources(estimate),
            "max_tokens_per_backward_that_fit": _max_tokens(shape, layout, gpu_bytes),
            "explain": estimate.explain(gpu_bytes),
        }
    return out


def _without_held_sources(estimate: MemoryEstimate) -> int:
    """The peak of a rank that never holds sources past ``max_open_groups``: no pending
    buffer in its backwards and closes (only the commit and the flush hold it)."""
    totals = estimate.totals
    for phase in ("backward", "group_close"):
        totals[phase] -= estimate.phases[phase]["pending"]
    return max(totals.values())


def cluster_layout(hf_config: Path) -> dict[str, Any]:
    """``configs/cluster_grpo.yaml``'s learner (``layout_of``) with ``hf_config``'s shape, and
    the same with release="group" (one group open)."""
    layout = layout_of(load_config(CLUSTER_CONFIG))
    shape = ModelShape.from_hf_config(hf_config)
    out: dict[str, Any] = {"config": CLUSTER_CONFIG.name, "model": hf_config.stem}
    for label, each in (
        ("as_configured", layout),
        ("release_group", replace(layout, release="group", open_groups=1)),
    ):
        estimate = memory_per_gpu(shape, each)
        out[label] = {
            "layout": each.describe(),
            "total_bytes": estimate.total_bytes,
            "without_held_sources_bytes": _without_held_sources(estimate),
            "explain": estimate.explain(),
        }
    return out


def _max_tokens(shape: ModelShape, layout: LearnerLayout, gpu_bytes: int) -> int:
    """The most tokens per backward (a multiple of 256) that fit, 0 if none does."""
    low, high = 0, 1 << 20
    while high - low > 256:
        mid = (low + high) // 512 * 256
        size = memory_per_gpu(shape, replace(layout, tokens_per_backward=mid)).total_bytes
        low, high = (mid, high) if size <= gpu_bytes else (low, mid)
    return low


def print_verdict(name: str, verdicts: dict[str, Any], gpu_gb: float) -> None:
    print(f"\n{name} full fine-tuning, 4 open groups per rank, 8 x {gpu_gb:g} GB, fsdp2:")
    for label, v in verdicts.items():
        answer = "fits" if v["fits"] else "does NOT fit"
        print(
            f"  {label}: {answer} ({v['total_bytes'] / GB:.1f} GB; fits up to "
            f"{v['max_tokens_per_backward_that_fit']} tokens per backward)\n    {v['explain']}"
        )


# -- 1b. LoRA: the sync learner beside the streaming one ---------------------------------------
def lora_layout(world: int, rank: int, args: argparse.Namespace) -> LearnerLayout:
    """Adapters of rank ``rank`` on the seven projections over a bfloat16 base: one rank
    replicated, more with fsdp2 (the adapters' float32 master and AdamW sharded)."""
    return LearnerLayout(
        world_size=world,
        sharding="replicated" if world == 1 else "fsdp2",
        compute_dtype="bfloat16",
        tokens_per_backward=args.tokens,
        prefix_tokens=args.prefix_tokens,
        group_size=args.group_size,
        lora=LoraSpec(rank, LORA_TARGETS),
    )


def lora_rows(shape: ModelShape, args: argparse.Namespace, gpu_bytes: int) -> list[dict[str, Any]]:
    """One row per (r, W, release, k): the sync learner's peak, the streaming one's, and
    what streaming adds, by term."""
    rows = []
    for rank in LORA_RANKS:
        adapters = shape.lora_parameter_count(rank, LORA_TARGETS)
        for world in LORA_WORLDS:
            layout = lora_layout(world, rank, args)
            sync = memory_per_gpu(shape, replace(layout, learner="sync"))
            for release, k in [("trajectory", k) for k in LORA_OPEN_GROUPS] + [("group", 1)]:
                streaming = memory_per_gpu(
                    shape,
                    replace(layout, release=release, open_groups=k),  # type: ignore[arg-type]
                )
                rows.append(
                    {
                        "rank": rank,
                        "world_size": world,
                        "sharding": layout.sharding,
                        "release": release,
                        "open_groups": k if release == "trajectory" else None,
                        "adapter_parameters": adapters,
                        "sync_bytes": sync.total_bytes,
                        "sync_peak_phase": sync.peak_phase,
                        "sync_terms": sync.terms,
                        "streaming_bytes": streaming.total_bytes,
                        "streaming_peak_phase": streaming.peak_phase,
                        "streaming_terms": streaming.terms,
                        "overhead_bytes": streaming.total_bytes - sync.total_bytes,
                        "overhead_parts": overhead_parts(streaming, sync, adapters),
                        "fits": {
                            "sync": sync.total_bytes <= gpu_bytes,
                            "streaming": streaming.total_bytes <= gpu_bytes,
                        },
                    }
                )
    return rows


def overhead_parts(
    streaming: MemoryEstimate, sync: MemoryEstimate, adapters: int
) -> dict[str, int]:
    """Streaming's peak less sync's, term by term (nonzero ones; they sum to the difference),
    the statistics split into two float32 adapter-sized buffers per open group and the
    prompt keys' part."""
    names = dict.fromkeys([*streaming.terms, *sync.terms])
    diff = {n: streaming.terms.get(n, 0) - sync.terms.get(n, 0) for n in names}
    statistics = diff.pop("group_statistics")
    layout = streaming.layout
    groups = layout.open_groups if layout.release == "trajectory" and statistics else 0
    parts = {"adapter_buffers": 2 * groups * 4 * adapters}
    parts["prompt_key_buffers"] = statistics - parts["adapter_buffers"]
    parts |= diff
    return {name: n for name, n in parts.items() if n}


def print_lora_table(name: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{name} LoRA: float32 adapters on {', '.join(LORA_TARGETS)} over a bfloat16 base,"
        f"\n{args.tokens} tokens per backward, {args.prefix_tokens}-token prompts; W = 1 "
        f"replicated, W > 1 fsdp2. GB per GPU, * fits {args.gpu_gb:g} GB;\nsync: one row of "
        "prompt and response per backward; group: release=group"
    )
    ks = [f"k={k}" for k in LORA_OPEN_GROUPS]
    print(
        f"{'r':>3} {'W':>2} {'adapters':>9} {'sync':>7}"
        + "".join(f" {k:>7}" for k in ks)
        + "   group"
    )
    for rank in LORA_RANKS:
        for world in LORA_WORLDS:
            these = [r for r in rows if (r["rank"], r["world_size"]) == (rank, world)]
            cells = [_gb_mark(these[0]["sync_bytes"], these[0]["fits"]["sync"])]
            cells += [_gb_mark(r["streaming_bytes"], r["fits"]["streaming"]) for r in these]
            print(
                f"{rank:>3} {world:>2} {these[0]['adapter_parameters'] / 1e6:>8.1f}M"
                + "".join(f" {cell:>7}" for cell in cells)
            )
    print(f"streaming less sync at W={LORA_WORLDS[-1]}, GB: the total, then its parts")
    for r in rows:
        if r["world_size"] != LORA_WORLDS[-1]:
            continue
        k = f"k={r['open_groups']}" if r["open_groups"] else "group"
        parts = ", ".join(f"{n} {b / GB:+.2f}" for n, b in r["overhead_parts"].items())
        print(f"  r={r['rank']:<3} {k:<6} {r['overhead_bytes'] / GB:+7.2f} = {parts}")


def _gb_mark(n: int, fits: bool) -> str:
    return f"{n / GB:.0f}{'*' if fits else ' '}"


# -- 2. the CPU check -------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    world_size: int
    sharding: Literal["replicated", "fsdp2"]
    compute_dtype: Literal["float32", "bfloat16"]
    open_groups: int
    release: Literal["trajectory", "group"]
    hidden: int
    layers: int
    vocab: int
    response_tokens: int
    prompt_tokens: int = 33
    group_size: int = 2
    sharded_gradient: bool = False
    #: Groups per rank beyond ``open_groups``: their sources are held until a close admits
    #: them (with the sharded gradient, before that close's flush).
    extra_groups: int = 0
    #: LoRA adapters of this rank on the seven projections (0: full fine-tuning).
    lora_rank: int = 0
    #: ``sync``: the sync learner, one row (prompt and response) per backward.
    learner: Literal["streaming", "sync"] = "streaming"
    #: Open groups shared by the ranks (``open_groups`` over all of them), in ticks.
    shared_groups: bool = False

    def model_args(self) -> dict[str, int]:
        return {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": 3 * self.hidden,
            "num_attention_heads": self.hidden // 64,
            "num_key_value_heads": 2,
            "vocab_size": self.vocab,
        }

    def layout(self) -> LearnerLayout:
        return LearnerLayout(
            world_size=self.world_size,
            sharding=self.sharding,
            compute_dtype=self.compute_dtype,
            open_groups=self.open_groups,
            release=self.release,
            # A row is the prompt's last token and the response.
            tokens_per_backward=1 + self.response_tokens,
            prefix_tokens=self.prompt_tokens - 1,
            group_size=self.group_size,
            sharded_gradient=self.sharded_gradient,
            shared_groups=self.shared_groups,
            adamw_foreach=False,
            lora=LoraSpec(self.lora_rank, LORA_TARGETS) if self.lora_rank else None,
            learner=self.learner,
        )


CASES = (
    Case("bf16 k1 1k tokens", 1, "replicated", "bfloat16", 1, "trajectory", 512, 4, 32768, 1023),
    Case("fp32 k2", 1, "replicated", "float32", 2, "trajectory", 1024, 4, 16384, 128),
    Case("fp32 group", 1, "replicated", "float32", 2, "group", 1024, 4, 16384, 128, group_size=3),
    Case("bf16 k2 long", 1, "replicated", "bfloat16", 2, "trajectory", 512, 8, 16384, 512),
    Case("bf16 group long", 1, "replicated", "bfloat16", 1, "group", 512, 8, 16384, 768),
    Case("fsdp2 fp32 k2", 2, "fsdp2", "float32", 2, "trajectory", 1024, 4, 16384, 64),
    Case("fsdp2 bf16 group", 2, "fsdp2", "bfloat16", 1, "group", 512, 8, 16384, 512, group_size=3),
    Case("repl fp32 k1", 2, "replicated", "float32", 1, "trajectory", 512, 8, 16384, 256),
    Case(
        "sharded fp32 k2", 2, "fsdp2", "float32", 2, "trajectory", 1024, 4, 16384, 128,
        sharded_gradient=True, extra_groups=1,
    ),
    Case(
        "sharded bf16 k1", 2, "fsdp2", "bfloat16", 1, "trajectory", 512, 8, 16384, 512,
        sharded_gradient=True, extra_groups=1,
    ),
    Case(
        "sharded bf16 group", 2, "fsdp2", "bfloat16", 1, "group", 512, 8, 16384, 512,
        group_size=3, sharded_gradient=True,
    ),
    Case(
        "sharded fp32 group", 2, "fsdp2", "float32", 1, "group", 1024, 4, 16384, 128,
        group_size=3, sharded_gradient=True,
    ),
    Case(
        "shared fp32 k2", 2, "fsdp2", "float32", 2, "trajectory", 1024, 4, 16384, 128,
        group_size=4, sharded_gradient=True, extra_groups=1, shared_groups=True,
    ),
    Case(
        "shared bf16 k4", 2, "fsdp2", "bfloat16", 4, "trajectory", 512, 8, 16384, 512,
        group_size=2, sharded_gradient=True, shared_groups=True,
    ),
)  # fmt: skip


def _lora_cases() -> tuple[Case, ...]:
    """LoRA on the ``small`` preset's shape in float32 (the training stage's one-rank
    learner): per rank and prompt, the sync learner and the streaming one with 1 and 4 open
    groups. A one-token prompt leaves the two learners the same rows."""
    cases = []
    for rank in (8, 64):
        for prompt in (1, 33):
            for learner, k in (("sync", 1), ("streaming", 1), ("streaming", 4)):
                label = "sync" if learner == "sync" else f"k{k}"
                cases.append(
                    Case(
                        f"lora r{rank} p{prompt} {label}", 1, "replicated", "float32", k,
                        "trajectory", 384, 6, 2048, 256, prompt_tokens=prompt,
                        lora_rank=rank, learner=learner,  # type: ignore[arg-type]
                    )
                )  # fmt: skip
    return tuple(cases)


LORA_CASES = _lora_cases()


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Set the peak resident set (VmHWM) to the current one (Linux clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _trim_heap() -> None:
    """Return freed heap pages to the system (glibc's malloc_trim), so the resident set
    holds live memory only. Allocations under the mmap threshold (LoRA's adapter tensors,
    most of them) live in the heap, whose freed pages stay resident and are reused later
    without the resident set growing: the measured peak of a case would depend on the
    cases before it."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _batch(case: Case, step: int) -> list[Trajectory]:
    """k (+ extra) groups per rank of ``group_size`` trajectories, every response token
    scored; the first trajectory of every group arrives before any second, so k groups are
    open (and the extra groups' sources held)."""

    rng = random.Random(step)
    # Shared groups: ``open_groups`` over all ranks; otherwise per rank.
    per = 1 if case.shared_groups else case.world_size
    n_groups = (case.open_groups + case.extra_groups) * per
    groups = []
    for g in range(n_groups):
        prompt = tuple(rng.randrange(case.vocab) for _ in range(case.prompt_tokens))
        groups.append(
            [
                Trajectory(
                    f"s{step}g{g}",
                    f"s{step}g{g}t{i}",
                    prompt,
                    (
                        Segment.action(
                            [rng.randrange(case.vocab) for _ in range(case.response_tokens)]
                        ),
                    ),
                    reward=float(i + g % 2),
                    policy_version=step,
                )
                for i in range(case.group_size)
            ]
        )
    return [group[i] for i in range(case.group_size) for group in groups]


def _warm_batch(case: Case) -> list[Trajectory]:
    """One short trajectory per rank: the first step, which creates AdamW's state."""

    return [
        Trajectory(f"w{r}", f"w{r}t0", (1, 2, 3), (Segment.action([4, 5, 6]),), reward=1.0)
        for r in range(case.world_size)
    ]


def _step(
    learner: StreamingGRPOLearner | SyncGRPOLearner,
    state: TrainState,
    batch: list[Trajectory],
    rank: int,
    world: int,
) -> dict[str, int]:
    """One step as the learner group drives it: feed this rank's groups (every rank flushes
    a sharded gradient after each group's last trajectory), barrier, clip, apply; returns
    the tracked bytes (statistics and pending at their largest, state after clip)."""

    order = {gid: i for i, gid in enumerate(dict.fromkeys(t.group_id for t in batch))}
    sizes = {gid: sum(t.group_id == gid for t in batch) for gid in order}
    if world > 1:
        learner.reducer = ProcessGroupReducer()
    if isinstance(learner, SharedGroupsGRPOLearner):
        return _shared_step(learner, state, batch, world)
    learner.begin_batch({})
    statistics = held = 0
    routed = dict.fromkeys(order, 0)
    for traj in batch:
        routed[traj.group_id] += 1
        if order[traj.group_id] % world == rank:
            if routed[traj.group_id] == 1:
                learner.add_groups(
                    {traj.group_id: GroupSpec(traj.prompt_ids, sizes[traj.group_id])}
                )
            learner.submit(traj)
            if isinstance(learner, StreamingGRPOLearner):
                statistics = max(statistics, learner.live_statistics_bytes())
            held = max(held, learner.accumulator_bytes())
        if learner.sharded_grad is not None and routed[traj.group_id] == sizes[traj.group_id]:
            learner.sharded_grad.flush()
    return _finish_step(learner, state, statistics, held)


def _shared_step(
    learner: SharedGroupsGRPOLearner,
    state: TrainState,
    batch: list[Trajectory],
    world: int,
) -> dict[str, int]:
    """One step of shared groups as the learner group drives it: every rank registers every
    group and runs the same ticks (all landed trajectories planned at once)."""
    statistics = [0]

    def seen() -> None:
        statistics[0] = max(statistics[0], learner.live_statistics_bytes())

    stream_shared_groups(
        learner,
        batch,
        groups_of(batch),
        max_open_groups=learner.max_open_groups,
        burst=len(batch),
        on_tick=seen,
    )
    return _finish_step(learner, state, statistics[0], learner.accumulator_bytes())


def _finish_step(
    learner: StreamingGRPOLearner | SyncGRPOLearner,
    state: TrainState,
    statistics: int,
    held: int,
) -> dict[str, int]:
    """Barrier, clip, apply; the tracked bytes (``held``: the most gradient bytes held while
    sources ran, whose excess over the shards is what waited for a flush)."""
    result = learner.finish()
    accumulator = learner.accumulator_bytes()
    if result.sharded:
        assert isinstance(state, ShardedState)
        state.clip_shards(1.0, result.grad_objective, -1.0)
    else:
        state.clip(1.0, result.grad_objective, -1.0)
    tracked = {"group_statistics": statistics, "accumulator": accumulator}
    tracked["pending"] = held - accumulator
    tracked |= state.state_bytes()
    state.apply()
    learner.policy_version += 1
    return tracked


def _measure(case: Case, rank: int) -> dict[str, Any]:
    gc.collect()
    _trim_heap()
    baseline = _status_bytes("VmRSS")
    model = build_model("tiny", seed=0, **case.model_args())  # type: ignore[arg-type]
    if case.lora_rank:
        # As the learner builds it: adapters on the float32 model, B zero.
        apply_lora(model, LoraSettings(r=case.lora_rank, alpha=2 * case.lora_rank))
    dtype = torch.bfloat16 if case.compute_dtype == "bfloat16" else None
    state = build_train_state(model, sharding=case.sharding, lr=1e-4, compute_dtype=dtype)
    learner: StreamingGRPOLearner | SyncGRPOLearner
    if case.learner == "sync":
        row = case.prompt_tokens + case.response_tokens
        learner = SyncGRPOLearner(state.model, micro_batch_tokens=row)  # type: ignore[arg-type]
    else:
        kind = SharedGroupsGRPOLearner if case.shared_groups else StreamingGRPOLearner
        learner = kind(
            state.model,  # type: ignore[arg-type]
            max_open_groups=case.open_groups,
            release=case.release,
        )
    if case.sharded_gradient:
        learner.sharded_grad = ShardedGradient(learner.params, dtype=learner.accum_dtype)
    _step(learner, state, _warm_batch(case), rank, case.world_size)
    gc.collect()
    _trim_heap()
    _reset_peak()
    t0 = time.perf_counter()
    tracked = _step(learner, state, _batch(case, 1), rank, case.world_size)
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM") - baseline
    del model, state, learner
    gc.collect()
    return {"rank": rank, "peak_rss_above_baseline_bytes": peak, "tracked": tracked, "s": seconds}


def _rank(rank: int, world: int, port: int, out: str, names: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    if world > 1:
        init_process_group(
            "gloo", rank=rank, world_size=world, address="127.0.0.1", port=port, timeout_s=300
        )
    cases = [c for c in (*CASES, *LORA_CASES) if c.name in names and c.world_size == world]
    # A process's first full-size step allocates some memory for good (kernel and thread
    # state): a discarded run of the first case keeps it out of every measurement.
    _measure(cases[0], rank)
    records = [{"case": case.name, **_measure(case, rank)} for case in cases]
    Path(out, f"w{world}-rank{rank}.json").write_text(json.dumps(records))
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_checks(cases: tuple[Case, ...]) -> list[dict[str, Any]]:
    # Read by glibc when each spawned rank starts.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
    names = tuple(case.name for case in cases)
    checks = []
    with tempfile.TemporaryDirectory() as out:
        for world in sorted({case.world_size for case in cases}):
            mp.spawn(_rank, args=(world, _free_port(), out, names), nprocs=world, join=True)
            for rank in range(world):
                for record in json.loads(Path(out, f"w{world}-rank{rank}.json").read_text()):
                    case = next(c for c in cases if c.name == record["case"])
                    checks.append(_compare(case, record))
    return checks


def _compare(case: Case, record: dict[str, Any]) -> dict[str, Any]:
    """The model's terms beside the tracked bytes, and its peak beside the measured one."""
    shape = ModelShape.from_hf_config(preset_config("tiny", **case.model_args()))
    estimate = memory_per_gpu(shape, case.layout())
    terms = {name: n for phase in estimate.phases.values() for name, n in phase.items()}
    tracked = record["tracked"]
    pairs = {
        "params": (terms["base"] + terms["replica"] + terms["master"], tracked["params"]),
        "grads": (terms["grads"], tracked["grads"]),
        "optimizer": (terms["optimizer"], tracked["optimizer"]),
        "accumulator": (terms["accumulator"], tracked["accumulator"]),
        "group_statistics": (terms["group_statistics"], tracked["group_statistics"]),
        "pending": (max(t["pending"] for t in estimate.phases.values() if "pending" in t),
                    tracked["pending"]),
    }  # fmt: skip
    measured = record["peak_rss_above_baseline_bytes"]
    return {
        "case": asdict(case),
        "rank": record["rank"],
        "step_s": record["s"],
        "tracked": {k: {"model": m, "measured": t} for k, (m, t) in pairs.items()},
        "model_peak_bytes": estimate.total_bytes,
        "model_peak_phase": estimate.peak_phase,
        "model_phases_bytes": estimate.totals,
        "measured_peak_rss_bytes": measured,
        "relative_error": estimate.total_bytes / measured - 1,
    }


def print_checks(checks: list[dict[str, Any]]) -> None:
    print("\nCPU check: model vs measured, MiB (tracked: model/measured; peak RSS above baseline)")
    print(
        f"{'case':<18} {'W':>1} {'r':>1} {'params':>11} {'grads':>11} {'optim':>11}"
        f" {'accum':>11} {'stats':>11} {'pending':>11} {'model peak, phase':>21} {'measured':>9}"
        f" {'error':>7}"
    )
    for c in checks:
        t = c["tracked"]
        cells = [
            f"{t[k]['model'] / MIB:.0f}/{t[k]['measured'] / MIB:.0f}"
            for k in ("params", "grads", "optimizer", "accumulator", "group_statistics", "pending")
        ]
        print(
            f"{c['case']['name']:<18} {c['case']['world_size']:>1} {c['rank']:>1}"
            + "".join(f" {cell:>11}" for cell in cells)
            + f" {c['model_peak_bytes'] / MIB:>6.0f} {c['model_peak_phase']:<14}"
            f" {c['measured_peak_rss_bytes'] / MIB:>9.0f} {c['relative_error']:>+7.1%}"
        )


def lora_overheads(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per streaming LoRA case: its peak less that of the sync case of the same rank and
    prompt, measured and modelled, beside two float32 adapter-sized buffers per open group
    and the learner's statistics counter."""
    lora = [c for c in checks if c["case"]["lora_rank"]]
    out = []
    for c in lora:
        case = Case(**c["case"])
        if case.learner == "sync":
            continue
        sync = next(
            s
            for s in lora
            if s["case"]["learner"] == "sync"
            and (s["case"]["lora_rank"], s["case"]["prompt_tokens"])
            == (case.lora_rank, case.prompt_tokens)
        )
        shape = ModelShape.from_hf_config(preset_config("tiny", **case.model_args()))
        adapters = shape.lora_parameter_count(case.lora_rank, LORA_TARGETS)
        statistics = c["tracked"]["group_statistics"]
        out.append(
            {
                "case": case.name,
                "rank": case.lora_rank,
                "prompt_tokens": case.prompt_tokens,
                "open_groups": case.open_groups,
                "adapter_parameters": adapters,
                "sync_measured_bytes": sync["measured_peak_rss_bytes"],
                "sync_model_bytes": sync["model_peak_bytes"],
                "streaming_measured_bytes": c["measured_peak_rss_bytes"],
                "streaming_model_bytes": c["model_peak_bytes"],
                "overhead_measured_bytes": c["measured_peak_rss_bytes"]
                - sync["measured_peak_rss_bytes"],
                "overhead_model_bytes": c["model_peak_bytes"] - sync["model_peak_bytes"],
                "adapter_buffers_bytes": 2 * case.open_groups * 4 * adapters,
                "statistics_counter_bytes": statistics["measured"],
                "statistics_model_bytes": statistics["model"],
            }
        )
    return out


def print_lora_overheads(rows: list[dict[str, Any]]) -> None:
    print(
        "\nLoRA on CPU (small preset, float32, one rank): peak resident set above baseline, "
        "MiB, measured/model; streaming less sync beside 2 k x 4 x adapters (two float32 "
        "adapter-sized buffers per open group); the learner's statistics counter/model"
    )
    print(
        f"{'case':<15} {'sync':>11} {'streaming':>11} {'overhead':>13} {'2k x adapters':>14}"
        f" {'statistics':>13}"
    )
    for r in rows:
        pairs = [
            (r["sync_measured_bytes"], r["sync_model_bytes"]),
            (r["streaming_measured_bytes"], r["streaming_model_bytes"]),
            (r["overhead_measured_bytes"], r["overhead_model_bytes"]),
        ]
        cells = [f"{m / MIB:.1f}/{f / MIB:.1f}" for m, f in pairs]
        stats = f"{r['statistics_counter_bytes'] / MIB:.2f}/{r['statistics_model_bytes'] / MIB:.2f}"
        print(
            f"{r['case']:<15} {cells[0]:>11} {cells[1]:>11} {cells[2]:>13}"
            f" {r['adapter_buffers_bytes'] / MIB:>14.2f} {stats:>13}"
        )


def render_doc(report: dict[str, Any]) -> str:
    """The "Learner memory" section of docs/cluster.md, from a report written by --out."""
    models = report["models"]
    names = list(models)
    intro = (
        "Peak bytes per GPU of the learner, from `thundersync_core/perfmodel/memory.py` (its "
        "docstring lists every term and when each is live), at 8 learner ranks, bfloat16 "
        f"compute, {report['tokens_per_backward']} tokens per backward, "
        f"{report['prefix_tokens']}-token prompts and groups of {report['group_size']}; GB per "
        f"GPU, * fits {report['gpu_gb']:g} GB. *sharded*: fsdp2 with "
        "`learner_sharded_gradient` (built): the batch gradient held as each rank's rows, what "
        "closes add waiting whole in float32 for the flush after each group's last trajectory "
        "(with release=trajectory also through the backwards of held sources a close admits). "
        "*shared*: on top of it `learner_shared_groups`: the k open groups shared by every "
        "rank, each rank holding 1/W of their statistics, trajectories handed to the ranks in "
        "lockstep ticks, a close added straight into the gradient's rows and the prompt "
        "forwarded again for its replay (a rank's own groups sharded over the ranks would "
        "leave each rank 1/W of W k groups: no saving). Generated by "
        "`benchmarks/learner_memory.py --out docs/bench/learner_memory.json`, then "
        "`--render-doc docs/bench/learner_memory.json`."
    )
    header = " | ".join(f"{n}: full / sharded / shared" for n in names)
    lines = ["## Learner memory", "", textwrap.fill(intro, 92), ""]
    lines += [f"| sharding | release | k | {header} |", "|---|---|---|" + "---|" * len(names)]
    rows = {n: [r for r in models[n]["rows"] if r["world_size"] == 8] for n in names}
    for i, first in enumerate(rows[names[0]]):
        k = first["open_groups"] if first["open_groups"] is not None else "-"
        cells = " | ".join(" / ".join(_doc_cell(rows[n][i], key) for key in _KEYS) for n in names)
        lines.append(f"| {first['sharding']} | {first['release']} | {k} | {cells} |")
    lines.append("")
    for n in names:
        lines.append(_doc_bullet(n, models[n]["verdict"], rows[n], report["gpu_gb"]))
    if "cluster" in report:
        lines += ["", textwrap.fill(_doc_cluster(report["cluster"]), 92)]
    checks = [c for c in report.get("checks", []) if not c["case"].get("lora_rank")]
    if checks:
        worst = max(checks, key=lambda c: abs(c["relative_error"]))
        # Shared groups' prompt statistics are counted on every rank: an upper bound.
        exact = all(
            t["model"] == t["measured"]
            for c in checks
            for name, t in c["tracked"].items()
            if not (c["case"].get("shared_groups") and name == "group_statistics")
        )
        shared = [
            c["tracked"]["group_statistics"] for c in checks if c["case"].get("shared_groups")
        ]
        bound = max((t["model"] / t["measured"] - 1 for t in shared), default=0.0)
        summary = (
            f"Checked on CPU ({len({c['case']['name'] for c in checks})} small learners on 1 and "
            "2 gloo ranks, both releases, float32 and bfloat16, with and without the sharded "
            "gradient, with shared groups, held sources included): the model's weight, "
            "gradient, optimizer, accumulator, statistics and pending bytes "
            f"{'equal' if exact else 'differ from'} the learner's own counters (shared "
            "groups' statistics: an upper bound, counting every open group's prompt statistics "
            f"on every rank, {bound:+.1%}), and its peak is "
            f"within {abs(worst['relative_error']):.1%} of the measured peak resident set "
            f"(worst: {worst['case']['name']}, {worst['relative_error']:+.1%}). On a GPU the "
            "allocator's cache, the CUDA context and NCCL buffers come on top."
        )
        lines += ["", textwrap.fill(summary, 92)]
    if any("lora_rows" in m for m in models.values()):
        lines += ["", *_doc_lora(report)]
    return "\n".join(lines) + "\n"


def _doc_lora(report: dict[str, Any]) -> list[str]:
    """The LoRA part of the section: peaks, what streaming adds, the CPU check."""
    models = report["models"]
    world = max(r["world_size"] for m in models.values() for r in m["lora_rows"])
    spread = max(
        abs(a["streaming_bytes"] - b["streaming_bytes"])
        for m in models.values()
        for a in m["lora_rows"]
        for b in m["lora_rows"]
        if (a["rank"], a["release"], a["open_groups"])
        == (b["rank"], b["release"], b["open_groups"])
    )
    intro = (
        f"LoRA: float32 adapters (r = {', '.join(str(r) for r in LORA_RANKS)}) on "
        f"{', '.join(LORA_TARGETS)} over a bfloat16 base, at {world} ranks (fsdp2), the "
        "tokens and prompts above. The frozen base is held once on every rank, with no master, "
        "gradient or optimizer state; the adapters are their own float32 master on one rank, "
        "with fsdp2 a float32 replica beside the sharded master, so from W = 1 (replicated) to "
        f"W = {world} a peak moves by {spread / GB:.1f} GB at most. *sync*: the sync learner, "
        "one row (prompt and response) per backward; k = 1, 2, 4, 8: the streaming learner "
        "with k open groups; *group*: release=group. GB per GPU, * fits "
        f"{report['gpu_gb']:g} GB."
    )
    lines = ["### LoRA: sync and streaming", "", textwrap.fill(intro, 92), ""]
    ks = " | ".join(f"k={k}" for k in LORA_OPEN_GROUPS)
    lines += [f"| model | r | adapters | sync | {ks} | group |", "|---|---|---|---|" + "---|" * 5]
    for name, m in models.items():
        for rank in LORA_RANKS:
            rows = [r for r in m["lora_rows"] if (r["rank"], r["world_size"]) == (rank, world)]
            cells = [_gb_mark(rows[0]["sync_bytes"], rows[0]["fits"]["sync"]).strip()]
            cells += [_gb_mark(r["streaming_bytes"], r["fits"]["streaming"]).strip() for r in rows]
            adapters = f"{rows[0]['adapter_parameters'] / 1e6:.1f} M"
            lines.append(f"| {name} | {rank} | {adapters} | " + " | ".join(cells) + " |")
    lines += ["", textwrap.fill(_doc_lora_overhead_intro(report, models), 92), ""]
    lines += [
        "| model | r | k | streaming - sync | 2 k x 4 P | prompt keys | prompt graphs | other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in models.items():
        for r in m["lora_rows"]:
            if r["world_size"] != world:
                continue
            parts = r["overhead_parts"]
            named = ("adapter_buffers", "prompt_key_buffers", "prompt_graphs")
            other = r["overhead_bytes"] - sum(parts.get(n, 0) for n in named)
            sizes: list[int] = [r["overhead_bytes"], *(parts.get(n, 0) for n in named), other]
            k = r["open_groups"] or "group"
            row = " | ".join(f"{size / GB:.2f}" for size in sizes)
            lines.append(f"| {name} | {r['rank']} | {k} | {row} |")
    checks = report.get("lora_checks", [])
    if checks:
        lines += ["", *_doc_lora_checks(report, checks)]
    return lines


def _doc_lora_overhead_intro(report: dict[str, Any], models: dict[str, Any]) -> str:
    name = next(iter(models))
    full = models[name]["full_sync_terms"]["activations"]
    lora = next(
        r["sync_terms"]["activations"]
        for r in models[name]["lora_rows"]
        if (r["rank"], r["world_size"]) == (LORA_RANKS[0], 1)
    )
    tokens = report["tokens_per_backward"] + report["prefix_tokens"]
    return (
        "What streaming adds to the sync peak (GB, same layout): the statistics' two float32 "
        "adapter-sized buffers per open group (2 k x 4 P, P the adapter parameters), the same "
        "buffers' part over the "
        "prompt's keys and values, each open group's prompt forward kept for its replay "
        "(prompt graphs), and the rest (*other*: the activations of a row attending to a "
        "cached prompt against those of the whole row; with release=group the held gradient). "
        "With no prompt the two learners run the same rows and streaming adds exactly "
        "2 k x 4 P (tested). The activations dominate every peak: over a bfloat16 base peft "
        "runs each float32 adapter on its own float32 copy of its input, so the sync learner's "
        f"activations for one row of {tokens} tokens of {name} are {lora / GB:.0f} GB with LoRA "
        f"r={LORA_RANKS[0]} against {full / GB:.0f} GB for full fine-tuning."
    )


def _doc_lora_checks(report: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    checks = [c for c in report["checks"] if c["case"].get("lora_rank")]
    exact = all(t["model"] == t["measured"] for c in checks for t in c["tracked"].values())
    worst = max(checks, key=lambda c: abs(c["relative_error"]))
    text = (
        f"Checked on CPU ({len(checks)} LoRA learners on the `small` preset's shape, float32, "
        "one rank, 256-token responses, a 1- or 33-token prompt, groups of 2): the model's "
        "weight, gradient, optimizer, accumulator and statistics bytes "
        f"{'equal' if exact else 'differ from'} the learners' own counters, and its peak is "
        f"within {abs(worst['relative_error']):.1%} of the measured peak resident set "
        f"(worst: {worst['case']['name']}, {worst['relative_error']:+.1%}). Streaming less "
        "sync, MiB, measured / model, beside two float32 adapter-sized buffers per open group "
        "(2 k x 4 P) and the learner's statistics counter (over the prompt's keys too)."
    )
    prompted = [r for r in rows if r["prompt_tokens"] > 1]
    if prompted:
        gaps = [r["overhead_measured_bytes"] - r["overhead_model_bytes"] for r in prompted]
        text += (
            f" After a prompt the measured difference exceeds the model's by {min(gaps) / MIB:.1f}"
            f" to {max(gaps) / MIB:.1f} MiB, growing with k: an open group's prompt graph and "
            "statistics are a few hundred tensors, many of them under the 64 KiB mmap threshold, "
            "and the resident set most likely counts the heap's holes and pages' rounding around "
            "them, which the model, counting tensor bytes, does not."
        )
    lines = [textwrap.fill(text, 92), ""]
    lines += [
        "| r | prompt | k | sync peak | streaming peak | streaming - sync | 2 k x 4 P "
        "| statistics |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            f"{r[f'{key}_measured_bytes'] / MIB:.1f} / {r[f'{key}_model_bytes'] / MIB:.1f}"
            for key in ("sync", "streaming", "overhead")
        ]
        lines.append(
            f"| {r['rank']} | {r['prompt_tokens']} | {r['open_groups']} | "
            + " | ".join(cells)
            + f" | {r['adapter_buffers_bytes'] / MIB:.2f} | "
            f"{r['statistics_counter_bytes'] / MIB:.2f} |"
        )
    return lines


def _doc_bullet(name: str, v: dict[str, Any], rows: list[dict[str, Any]], gpu_gb: float) -> str:
    today = next(r for r in rows if r["sharding"] == "fsdp2" and r["open_groups"] == 4)
    largest = sorted(today["full_terms"].items(), key=lambda kv: -kv[1])[:4]
    sharded = v["sharded_gradient"]
    bullet = (
        f"{name}, full fine-tuning, 4 open groups per rank on 8 x {gpu_gb:g} GB (fsdp2): "
        f"{_doc_verdict(v['today'])} with the batch gradient and statistics whole on every "
        "rank (largest terms, GB: "
        + ", ".join(f"{term} {b / GB:.0f}" for term, b in largest)
        + f"); release=group {_doc_verdict(v['today_release_group'])}. With the sharded "
        f"gradient it {_doc_verdict(sharded)} (a rank that never holds sources: "
        f"{sharded['without_held_sources_bytes'] / GB:.0f} GB), release=group "
        f"{_doc_verdict(v['sharded_gradient_release_group'])}; with the 4 groups shared by "
        f"the ranks it {_doc_verdict(v['shared_groups'])}."
    )
    return textwrap.fill(bullet, 92, initial_indent="- ", subsequent_indent="  ")


def _doc_cluster(cluster: dict[str, Any]) -> str:
    configured, group = cluster["as_configured"], cluster["release_group"]
    return (
        "`resources.learner.gpu_memory_gb` (GB of one learner GPU) makes a GRPO run check its "
        "layout against this model at start, before anything is reserved or loaded: ranks, "
        "`learner_sharding`, `learner_sharded_gradient`, `learner_shared_groups`, "
        "`learner_dtype`, `max_open_groups`, "
        "`grpo_release`, a backward of `learner_pack_tokens` or `rollout.max_total_tokens` "
        "after a prompt of the rest of `rollout.max_model_len`; a layout that does not fit is "
        f"refused naming every term in GB. By it, `configs/{cluster['config']}` with "
        f"{cluster['model']} ({configured['layout']}) needs about "
        f"{_doc_gb(configured['total_bytes'])} per GPU; with `grpo_release: group` about "
        f"{_doc_gb(group['total_bytes'])}: the open groups' statistics, whole on every rank, "
        "are what `learner_shared_groups` shards."
    )


def _doc_gb(n: int) -> str:
    return f"{n / 1e12:.1f} TB" if n >= 10**12 else f"{n / GB:.0f} GB"


def _doc_cell(row: dict[str, Any], key: str) -> str:
    value = row[key]
    return "-" if value is None else f"{value / GB:.0f}{'*' if row['fits'][key] else ''}"


def _doc_verdict(v: dict[str, Any]) -> str:
    tokens = v["max_tokens_per_backward_that_fit"]
    limit = f"fits up to {tokens} tokens per backward" if tokens else "no length fits"
    answer = "fits" if v["fits"] else "does not fit"
    return f"{answer} ({v['total_bytes'] / GB:.0f} GB; {limit})"


def model_report(args: argparse.Namespace) -> dict[str, Any]:
    """The tables for every ``--hf`` config (printed as they come) and the cluster layout."""
    gpu_bytes = int(args.gpu_gb * GB)
    report: dict[str, Any] = {
        "gpu_gb": args.gpu_gb,
        "tokens_per_backward": args.tokens,
        "prefix_tokens": args.prefix_tokens,
        "group_size": args.group_size,
        "compute_dtype": "bfloat16",
        "models": {},
    }
    for path in args.hf or DEFAULT_HF:
        shape = ModelShape.from_hf_config(path)
        rows = table_rows(
            shape,
            gpu_bytes=gpu_bytes,
            tokens=args.tokens,
            prefix_tokens=args.prefix_tokens,
            group_size=args.group_size,
        )
        print_table(path.stem, shape, rows, args)
        entry: dict[str, Any] = {
            "parameters": shape.parameter_count,
            "rows": rows,
            "verdict": verdict(shape, args),
        }
        print_verdict(path.stem, entry["verdict"], args.gpu_gb)
        entry["lora_rows"] = lora_rows(shape, args, gpu_bytes)
        # Full fine-tuning's sync learner on one rank, for the activations beside LoRA's.
        full = memory_per_gpu(shape, replace(lora_layout(1, 16, args), lora=None, learner="sync"))
        entry["full_sync_terms"] = full.terms
        print_lora_table(path.stem, entry["lora_rows"], args)
        report["models"][path.stem] = entry
    if CLUSTER_CONFIG.is_file() and DEFAULT_HF[0].is_file():
        report["cluster"] = cluster_layout(DEFAULT_HF[0])
        for label in ("as_configured", "release_group"):
            print(f"\n{CLUSTER_CONFIG.name}, {label}: {report['cluster'][label]['explain']}")
    return report


def measured_report(which: str) -> dict[str, Any]:
    """The CPU check of ``which`` cases (all, full, lora or shared), printed and returned."""
    shared = tuple(case for case in CASES if case.shared_groups)
    cases = {"all": (*CASES, *LORA_CASES), "full": CASES, "lora": LORA_CASES, "shared": shared}
    cases = cases[which]
    t0 = time.perf_counter()
    checks = run_checks(cases)
    print_checks(checks)
    worst = max(abs(c["relative_error"]) for c in checks)
    print(f"worst peak error {worst:.1%}; measured part {time.perf_counter() - t0:.0f} s")
    report: dict[str, Any] = {"checks": checks}
    overheads = lora_overheads(checks)
    if overheads:
        print_lora_overheads(overheads)
        report["lora_checks"] = overheads
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, action="append", help="HF config.json (repeatable)")
    parser.add_argument("--gpu-gb", type=float, default=180.0)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per backward")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="a group's prompt")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--skip-measure", action="store_true", help="the table only")
    parser.add_argument(
        "--checks",
        choices=("all", "full", "lora", "shared"),
        default="all",
        help="which CPU cases run",
    )
    parser.add_argument("--out", type=Path, help="write the table and the checks as JSON")
    parser.add_argument("--render-doc", type=Path, help="print the doc section of a --out JSON")
    args = parser.parse_args()
    if args.render_doc:
        print(render_doc(json.loads(args.render_doc.read_text())), end="")
        return
    report = model_report(args)
    if not args.skip_measure:
        report |= measured_report(args.checks)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
