"""Core pinning reaches threads that were running before the pin, and what they start later."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from thundersync_core.runtime.placement import pin_to_cores

# Run in a child: pinning changes the whole process, which the test session must not suffer.
CHILD = textwrap.dedent(
    """
    import json, os, sys, threading
    from thundersync_core.runtime.placement import pin_to_cores

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
