"""Core pinning reaches threads that were running before the pin, and what they start later."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from thundersync_core.runtime.placement import check_cores, pin_to_cores

# Run in a child: pinning changes the whole process, which the test session must not suffer.
CHILD = textwrap.dedent(
    """
    import json, os, sys, threading
    from thundersync_core.runtime.placement import check_cores, pin_to_cores

    go, started = threading.Event(), {}

    def early():
        go.wait()
        # A thread started by a thread that existed before the pin.
        late = threading.Thread(target=lambda: started.update(
            late=sorted(os.sched_getaffinity(threading.get_native_id()))))
        late.start()
        late.join()

    worker = threading.Thread(target=early)
    worker.start()
    while worker.native_id is None:
        pass
    pin_to_cores([int(sys.argv[1])])
    early_affinity = sorted(os.sched_getaffinity(worker.native_id))
    go.set()
    worker.join()
    print(json.dumps({"early": early_affinity, "late": started["late"],
                      "main": sorted(os.sched_getaffinity(0))}))
    """
)


def test_pinning_moves_threads_that_already_run_and_their_children():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two usable cores to tell a pinned thread from an unpinned one")
    target = cores[-1]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(target)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"early": [target], "late": [target], "main": [target]}


def test_a_core_the_host_lacks_is_named():
    missing = max(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))) + 1
    with pytest.raises(ValueError, match=rf"cores \[{missing}\] do not exist"):
        pin_to_cores([missing])


GRADERS = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from thundersync_core.rollout.agent import grader_pool
    from thundersync_core.runtime.placement import check_cores, pin_to_cores

    rollout, grader = int(sys.argv[1]), int(sys.argv[2])
    pin_to_cores([rollout])
    pool = grader_pool(2, [grader])
    child = "import os; print(sorted(os.sched_getaffinity(0)))"
    thread, verifier = pool.submit(lambda: (
        sorted(os.sched_getaffinity(0)),
        subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout,
    )).result()
    print(json.dumps({"thread": thread, "verifier": json.loads(verifier),
                      "main": sorted(os.sched_getaffinity(0))}))
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_graders_and_the_processes_they_start_run_on_their_cores():
    rollout, grader = sorted(os.sched_getaffinity(0))[:2]
    done = subprocess.run(
        [sys.executable, "-c", GRADERS, str(rollout), str(grader)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"thread": [grader], "verifier": [grader], "main": [rollout]}


def test_grader_cores_that_do_not_exist_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"rollout.grader_cores: cores \[4096\]"):
        check_cores([4096], "rollout.grader_cores")
