"""Core pinning reaches threads that were running before the pin, and what they start later."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

from thundersync_core.config import (
    LearnerResources,
    ResourcesConfig,
    RoleResources,
    RolloutResources,
)
from thundersync_core.runtime.placement import (
    bundles_of,
    check_cores,
    check_feasible,
    pin_to_cores,
)

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


def _resources(**roles: RoleResources) -> ResourcesConfig:
    return ResourcesConfig(**roles)


def test_roles_the_cluster_cannot_place_are_refused_naming_the_role():
    """Ray leaves an actor it cannot place pending forever; start-up refuses instead."""
    one_gpu_node = [{"CPU": 16.0, "GPU": 1.0}]
    opd = _resources(
        rollout=RolloutResources(num_cpus=1, num_gpus=1),
        learner=LearnerResources(num_cpus=1, num_gpus=0),
        teacher=RoleResources(num_cpus=1, num_gpus=1),
    )
    # The teacher's GPUs count: two asked, one there.
    with pytest.raises(
        ValueError, match=r"ask for 2 GPUs \(rollout 1, learner 0, teacher 1\).*has 1"
    ):
        check_feasible(opd, one_gpu_node)
    two_nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]
    check_feasible(opd, two_nodes)  # one GPU role per node fits
    wide = _resources(rollout=RolloutResources(num_cpus=1, num_gpus=2))
    with pytest.raises(ValueError, match=r"resources.rollout: its actor needs 1 CPUs and 2 GPUs"):
        check_feasible(wide, two_nodes)
    # Two engines of one GPU each fit two one-GPU nodes; one two-GPU engine does not.
    engines = _resources(rollout=RolloutResources(num_cpus=2, num_gpus=2, engines=2))
    check_feasible(engines, two_nodes)
    with pytest.raises(ValueError, match=r"resources.rollout: each of its 2 engines needs"):
        check_feasible(engines, [{"CPU": 8.0, "GPU": 0.5}] * 4)
    ranks = _resources(learner=LearnerResources(num_cpus=20, ranks=2))
    check_feasible(ranks, [{"CPU": 10.0, "GPU": 0.0}] * 2)  # 10 CPUs per rank, one per node
    with pytest.raises(ValueError, match=r"resources.learner: each of its 2 ranks needs 10 CPUs"):
        check_feasible(ranks, [{"CPU": 8.0, "GPU": 0.0}] * 2)


def test_a_role_reserves_a_bundle_per_rank_or_engine_and_nothing_when_it_holds_nothing():
    assert bundles_of(LearnerResources(num_cpus=2, num_gpus=8, ranks=8)) == (
        8,
        {"CPU": 0.25, "GPU": 1.0},
    )
    assert bundles_of(RolloutResources(num_cpus=4, num_gpus=4, engines=2)) == (
        2,
        {"CPU": 2.0, "GPU": 2.0},
    )
    # One engine: one bundle for the worker that holds it; no GPUs, no GPU key.
    assert bundles_of(RolloutResources(num_cpus=1)) == (1, {"CPU": 1.0})
    # The default teacher holds nothing: it reserves no group (Ray refuses empty bundles).
    assert bundles_of(RoleResources(num_cpus=0.0)) == (1, {})
    with pytest.raises(ValidationError, match="placement"):
        RoleResources(placement="everywhere")  # type: ignore[arg-type]


NICE = textwrap.dedent(
    """
    import json, os, sys, threading
    from thundersync_core.runtime.placement import set_nice

    go, started = threading.Event(), {}
    nice_of = lambda tid: os.getpriority(os.PRIO_PROCESS, tid)

    def early():
        go.wait()
        late = threading.Thread(target=lambda: started.update(late=nice_of(0)))
        late.start()
        late.join()

    worker = threading.Thread(target=early)
    worker.start()
    while worker.native_id is None:
        pass
    before = nice_of(0)
    got = set_nice(int(sys.argv[1]), "resources.learner.nice")
    early_nice = nice_of(worker.native_id)
    go.set()
    worker.join()
    print(json.dumps({"before": before, "returned": got, "main": nice_of(0),
                      "early": early_nice, "late": started["late"]}))
    """
)


def _nice_child(nice: int, *prefix: str) -> tuple[dict[str, int], str]:
    out = subprocess.run(
        [*prefix, sys.executable, "-c", NICE, str(nice)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_niceness_reaches_threads_that_already_run_and_their_children():
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current >= 19:
        pytest.skip("this process already runs at the highest niceness, 19")
    target = min(current + 3, 19)  # raising it is always allowed
    seen, _ = _nice_child(target)
    assert seen["before"] != target
    assert {k: seen[k] for k in ("returned", "main", "early", "late")} == dict.fromkeys(
        ("returned", "main", "early", "late"), target
    )


def test_a_niceness_not_permitted_is_named_and_changes_nothing():
    prefix: tuple[str, ...] = ("nice", "-n", "10")
    if os.geteuid() == 0:  # root may lower it: run the child as an unprivileged user
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs setpriv (util-linux) to drop root")
        prefix += (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups")
    seen, err = _nice_child(-5, *prefix)
    assert seen["before"] >= 10
    assert seen["returned"] == seen["main"] == seen["early"] == seen["late"] == seen["before"]
    assert "resources.learner.nice: niceness -5 not permitted" in err


def test_niceness_is_checked_in_the_config():
    assert LearnerResources(nice=0).nice == 0
    assert LearnerResources().nice is None
    with pytest.raises(ValidationError, match="nice"):
        LearnerResources(nice=20)
    with pytest.raises(ValidationError, match="nice"):
        LearnerResources(nice=-21)
