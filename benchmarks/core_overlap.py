"""How much two cores give side by side: the ceiling of any overlap schedule on a machine.

ThunderSync overlaps the learner with the rollout: two stages of R and L seconds of work
that sync runs one after the other (R + L) run side by side (max(aR, bL) at best), where
a and b are how much slower each stage runs while the other one runs too. The best case,
at L = aR/b, is a speedup of 1/a + 1/b: 2x only where the two cores do not slow each other.
Two vCPUs of a cloud VM are often the two hardware threads of one physical core, whose
vector units they share: there two matmul-bound stages slow each other and the ceiling
falls well below 2x, whatever the schedule.

This measures a and b for workloads shaped like the stages, each on one core beside a
learner-shaped one (``--learner``, matmul by default) on the other: ``matmul`` (float32
products of a small model's shapes on one thread: the learner's forward and backward, and
the engine's prefill), ``bf16`` (the same in bfloat16), ``stream`` (copying arrays larger
than the caches: memory bound decoding), ``spawn`` (starting short processes: verifiers),
``bwrap`` and ``bwrap-nonet`` (starting a process in new namespaces, with and without a
network namespace of its own) and ``sandbox`` (the local sandbox running ``true``: what
every command of an episode costs). Each runs alone, then beside the learner-shaped one
(one process per core, started together), for ``--seconds`` each; the rate is operations
a second.

    python benchmarks/core_overlap.py [--seconds 5] [--repeats 3] [--cores 0 1]
        [--workloads matmul stream sandbox] [--learner matmul] [--out FILE.json]

A VM's contention drifts over minutes (its host's other load is not ours to see), so each
repeat measures both alone right before the pair, and the table gives the median slowdowns
and the range of the ceiling over the repeats; the JSON has every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from thundersync_core.rollout.sandbox import open_sandbox

WORKLOADS = ("matmul", "bf16", "stream", "spawn", "bwrap", "bwrap-nonet", "sandbox")
#: A bwrap start with the local sandbox's namespaces (its mounts aside): net, pid, ipc, uts.
BWRAP = ["bwrap", "--ro-bind", "/", "/", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
BWRAP += ["--die-with-parent", "--new-session"]


def _matmul(dtype_name: str) -> Callable[[], None]:
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    # A wide policy layer's shapes: a pack of 512 tokens through a 512 -> 2048 projection.
    x = torch.randn(512, 512, dtype=dtype)
    w = torch.randn(512, 2048, dtype=dtype)

    def op() -> None:
        torch.mm(x, w)

    return op


def _stream() -> Callable[[], None]:
    torch.set_num_threads(1)
    # 64 MiB each way: twice the L3 of the box it was written on.
    src = torch.ones(16 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)

    def op() -> None:
        dst.copy_(src)

    return op


def _command(argv: list[str]) -> Callable[[], None]:
    def op() -> None:
        subprocess.run(argv, check=True)

    return op


def _sandbox(stack: ExitStack) -> Callable[[], None]:
    sandbox = stack.enter_context(open_sandbox("local"))

    def op() -> None:
        result = sandbox.exec("true")
        if result.exit_code != 0:
            raise RuntimeError(f"the sandbox's `true` exited {result.exit_code}")

    return op


def _operation(kind: str, stack: ExitStack) -> Callable[[], None]:
    """One operation of ``kind``; what it opens is closed with ``stack``."""
    if kind in ("matmul", "bf16"):
        return _matmul("float32" if kind == "matmul" else "bfloat16")
    if kind == "stream":
        return _stream()
    if kind == "spawn":
        return _command(["/bin/true"])
    if kind in ("bwrap", "bwrap-nonet"):
        return _command([*BWRAP, *(["--unshare-net"] if kind == "bwrap" else []), "/bin/true"])
    if kind == "sandbox":
        return _sandbox(stack)
    raise ValueError(f"--workloads: unknown {kind!r} (one of {', '.join(WORKLOADS)})")


def worker(kind: str, core: int, seconds: float) -> dict[str, float]:
    """Run ``kind`` on ``core`` for ``seconds``, once warm and told to go: prints ``ready``
    and waits for a line on stdin (the parent sends it when every worker is ready)."""
    os.sched_setaffinity(0, {core})
    with ExitStack() as stack:
        op = _operation(kind, stack)
        for _ in range(3):  # warm up: first calls allocate and pick kernels
            op()
        print("ready", flush=True)
        sys.stdin.readline()
        count, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds:
            op()
            count += 1
    return {"ops": count, "seconds": elapsed, "rate": count / elapsed}


def _launch(kind: str, core: int, seconds: float) -> subprocess.Popen[str]:
    args = [sys.executable, __file__, "--worker", kind, "--core", str(core)]
    args += ["--seconds", str(seconds)]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _rates(jobs: list[tuple[str, int]], seconds: float) -> list[float]:
    """Run the (workload, core) jobs at once; each one's rate."""
    procs = [_launch(kind, core, seconds) for kind, core in jobs]
    for (kind, core), proc in zip(jobs, procs, strict=True):
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            for other in procs:  # the others wait for a go that will not come
                other.kill()
                other.wait()
            raise RuntimeError(f"the {kind} worker on core {core} failed ({proc.returncode})")
    rates = []
    for proc in procs:  # go, all at once
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for (kind, core), proc in zip(jobs, procs, strict=True):
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"the {kind} worker on core {core} failed ({proc.returncode})")
        rates.append(float(json.loads(out)["rate"]))
    return rates


def _pair(kind: str, learner: str, cores: tuple[int, int], seconds: float) -> dict[str, float]:
    """One repeat: each alone, then the two side by side, back to back (the host's speed
    drifts over minutes, so each slowdown is taken against the alone rates just before)."""
    first, second = cores
    alone_a = _rates([(kind, first)], seconds)[0]
    alone_b = _rates([(learner, second)], seconds)[0]
    rate_a, rate_b = _rates([(kind, first), (learner, second)], seconds)
    a, b = alone_a / rate_a, alone_b / rate_b
    return {
        "alone_first": alone_a,
        "alone_second": alone_b,
        "slowdown_first": a,
        "slowdown_second": b,
        "overlap_ceiling": 1 / a + 1 / b,
    }


def measure(
    workloads: list[str], learner: str, cores: tuple[int, int], seconds: float, repeats: int
) -> dict[str, object]:
    """Each workload on the first core beside ``learner`` on the second, ``repeats`` rounds
    over the workloads; per pair the median of each figure and every repeat."""
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in workloads}
    for _ in range(repeats):
        for kind in workloads:
            runs[kind].append(_pair(kind, learner, cores, seconds))
    pairs = []
    for kind, repeats_of in runs.items():
        figures = ("slowdown_first", "slowdown_second", "overlap_ceiling")
        pairs.append(
            {"pair": f"{kind}@{cores[0]} + {learner}@{cores[1]}"}
            | {k: statistics.median(r[k] for r in repeats_of) for k in figures}
            | {
                "ceiling_range": [
                    min(r["overlap_ceiling"] for r in repeats_of),
                    max(r["overlap_ceiling"] for r in repeats_of),
                ],
                "repeats": repeats_of,
            }
        )
    return {
        "cores": list(cores),
        "seconds": seconds,
        "learner": learner,
        "pairs": pairs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["matmul", "stream", "sandbox"],
        choices=WORKLOADS,
        help="each runs on the first core beside --learner on the second",
    )
    parser.add_argument("--learner", default="matmul", choices=WORKLOADS)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.core, args.seconds)))
        return 0
    available = os.sched_getaffinity(0)
    if args.cores[0] == args.cores[1] or not set(args.cores) <= available:
        parser.error(f"--cores: two different cores of this process's {sorted(available)}")
    if args.repeats < 1:
        parser.error(f"--repeats: at least 1, got {args.repeats}")
    cores = (args.cores[0], args.cores[1])
    result = measure(args.workloads, args.learner, cores, args.seconds, args.repeats)
    given = sys.argv[1:] if argv is None else argv
    result = {"command": " ".join(["python", "benchmarks/core_overlap.py", *given])} | result
    print(f"{'side by side (median)':<28} {'slowdown':>9} {'slowdown':>9} {'ceiling':>8}  range")
    for pair in result["pairs"]:  # type: ignore[attr-defined]
        low, high = pair["ceiling_range"]
        print(
            f"{pair['pair']:<28} {pair['slowdown_first']:>9.3f} "
            f"{pair['slowdown_second']:>9.3f} {pair['overlap_ceiling']:>7.2f}x"
            f"  {low:.2f}-{high:.2f}x"
        )
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
