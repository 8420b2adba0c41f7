"""Shared parts of the release-tail benchmarks: timed feeding, subprocess workers, memory."""

from __future__ import annotations

import json
import queue
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil


def feed_on_schedule(
    releases: Sequence[tuple[float, Any]],
    submit: Callable[[Any], None],
    finish: Callable[[], Any],
) -> tuple[Any, dict[str, float]]:
    """Release sources at their times from a feeder thread; the learner runs on this thread.

    Returns finish()'s result and timings: the learner work left after the last release
    (the tail), the learner's busy time, and the step's wall time from the first release.
    """
    inbox: queue.Queue[Any] = queue.Queue()
    ordered = sorted(releases, key=lambda pair: pair[0])
    start = time.perf_counter()

    def feeder() -> None:
        for at, source in ordered:
            time.sleep(max(0.0, start + at - time.perf_counter()))
            inbox.put(source)

    threading.Thread(target=feeder, daemon=True).start()
    busy_s = 0.0
    for _ in ordered:
        source = inbox.get()
        t0 = time.perf_counter()
        submit(source)
        busy_s += time.perf_counter() - t0
    last_release = start + ordered[-1][0]
    t0 = time.perf_counter()
    result = finish()
    done = time.perf_counter()
    busy_s += done - t0
    return result, {
        "tail_after_last_release_s": done - last_release,
        "learner_busy_s": busy_s,
        "step_wall_s": done - start,
    }


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_worker(script: str, argv: Sequence[str]) -> dict[str, Any]:
    """Run ``script --worker ...`` in a fresh process (so its peak memory is its own)."""
    done = subprocess.run(
        [sys.executable, script, *argv], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker {argv} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
