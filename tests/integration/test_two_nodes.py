"""A thundersync GRPO job on a real two-node Ray cluster on this machine: ``ray start
--head`` and a second raylet joining it, each node with its own CPUs. The driver is the
``thundersync train`` CLI joining through ``RAY_ADDRESS``. Two vLLM engines and two learner
ranks (gloo) are each spread over both nodes (``strict_spread``), and every step's weights
reach both engines by collective publication, verified on each engine. The learner is laid
out as on a cluster: fsdp2 ranks with the batch gradient sharded and the open groups shared by
the ranks (``learner_shared_groups``).

The engines sample what one engine does and the update is the one-process learner's: the
session's sync reference on one vLLM engine (file publication, one learner process) sampled
the same tokens (seeded per request; bitwise the same log-probs on the first step, whose
weights are the same), so the losses and gradient norms agree to fp32 rounding and AdamW's
first update agrees wherever the plain reference gradient is clear of zero (two ranks sum
in another order). Each engine must have sampled step k with the version published after
step k - 1. This is also the several-engines test: two engines train as one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import checkpoint_weights, reference_grad_j, train_config_file
from thundersync_core.batch import read_batch
from thundersync_core.policy.io import load_model

pytestmark = pytest.mark.integration

STEPS = 2
LR = 1e-3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ray_env() -> dict[str, str]:
    # A loopback test cluster: no token (``ray start --head`` turns token auth on otherwise).
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {
        "RAY_AUTH_MODE": "disabled"
    }


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[str]:
    """A head node and a second node, 2 CPUs each; yields the cluster address."""
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert ray_cli, "the ray CLI is not installed"
    # Short: the nodes' Unix sockets live under it.
    root = Path(tempfile.mkdtemp(prefix="ray2n-", dir="/tmp"))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=2"]
    common += ["--object-store-memory=200000000", "--disable-usage-stats"]
    nodes = []
    try:
        with open(root / "head.log", "w") as log:
            nodes.append(
                subprocess.Popen(
                    [ray_cli, "start", "--head", f"--port={port}", "--include-dashboard=false",
                     f"--temp-dir={root}", *common],
                    stdout=log, stderr=subprocess.STDOUT, env=_ray_env(),
                )
            )  # fmt: skip
        _wait_for_nodes(address, 1, nodes, root)
        with open(root / "second.log", "w") as log:
            nodes.append(
                subprocess.Popen(
                    [ray_cli, "start", f"--address={address}", *common],
                    stdout=log, stderr=subprocess.STDOUT, env=_ray_env(),
                )
            )  # fmt: skip
        _wait_for_nodes(address, 2, nodes, root)
        yield address
    finally:
        for node in reversed(nodes):  # SIGTERM: each `ray start --block` stops its processes
            node.terminate()
        for node in nodes:
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
        shutil.rmtree(root, ignore_errors=True)


def _wait_for_nodes(address: str, n: int, nodes: list, root: Path, timeout_s: float = 90) -> None:
    probe = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for node in nodes:
            if node.poll() is not None:
                logs = "".join(p.read_text()[-2000:] for p in root.glob("*.log"))
                pytest.fail(f"a ray node exited ({node.returncode}):\n{logs}")
        done = subprocess.run(
            [sys.executable, "-c", probe, address],
            capture_output=True, text=True, env=_ray_env(), timeout=60, check=False,
        )  # fmt: skip
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        time.sleep(1)
    pytest.fail(f"the cluster at {address} did not reach {n} node(s) in {timeout_s:.0f} s")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_thundersync_on_two_nodes_updates_as_one_process(
    two_node_cluster, tmp_path, tiny_prep_dir, solver_policy_dir, uninterrupted_vllm_run
):
    config = train_config_file(
        tmp_path,
        tiny_prep_dir,
        solver_policy_dir,
        schedule="thundersync",
        steps=STEPS,
        lr=LR,
        # The cluster's learner layout: fsdp2 ranks, the batch gradient sharded, the open
        # groups shared by the ranks (their statistics 1/W each, trajectories in ticks).
        learner_sharding="fsdp2",
        learner_sharded_gradient=True,
        learner_shared_groups=True,
        rollout__engine="vllm",
        rollout__publication="collective",
        rollout__verify_publication=True,
        resources__rollout={"num_cpus": 2, "engines": 2, "placement": "strict_spread",
                            "cores": [0]},
        resources__learner={"num_cpus": 2, "ranks": 2, "placement": "strict_spread",
                            "cores": [1]},
    )  # fmt: skip
    out = tmp_path / "two-nodes"
    env = _ray_env() | {"RAY_ADDRESS": two_node_cluster}
    done = subprocess.run(
        [sys.executable, "-m", "thundersync_core.cli", "train", "--config", str(config),
         "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # Where the roles ran: both learner ranks and both engines on different nodes.
    nodes = json.loads((out / "roles.json").read_text())["nodes"]
    assert len(set(nodes["learner"])) == 2, nodes
    assert len(set(nodes["engines"])) == 2, nodes

    reference, got = _records(uninterrupted_vllm_run)[:STEPS], _records(out)
    assert len(got) == STEPS
    for step, (one, two) in enumerate(zip(reference, got, strict=True)):
        # Each engine sampled step k with the version published after step k - 1, and
        # received every publication whole (verify_publication refuses otherwise).
        assert two["engine_versions"] == [[step], [step]], two["engine_versions"]
        assert min(two["engine_requests"]) > 0, two["engine_requests"]
        assert two["publication_bytes"] > 0
        assert two["reward_mean"] == one["reward_mean"], step
        # Step 0 starts from the same weights: only the sum order differs (float32, 1e-5).
        # Later steps start from weights that already differ where step 0's gradient was
        # within rounding of zero (AdamW moved those entries by their sign, +-lr; see
        # below), so their loss and gradient are another model's by that much: measured
        # up to 1.1e-5 apart at step 1, bounded here at 1e-4.
        rel = 1e-5 if step == 0 else 1e-4
        assert two["loss"] == pytest.approx(one["loss"], rel=rel, abs=1e-7), step
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=rel), step
        # Requests are seeded: the engines sample the tokens one engine does. On the first
        # step the weights are the same, so the sampled log-probs are too (bitwise).
        name = f"step-{step:06d}.jsonl"
        batches = [
            {
                t.trajectory_id: (t.segments, t.behaviour_logprobs if step == 0 else None)
                for t in read_batch(run / "batches" / name)
            }
            for run in (uninterrupted_vllm_run, out)
        ]
        assert batches[0] == batches[1], f"step {step}: the two-node run sampled other tokens"
        # Shared groups: the trajectories went to the ranks in lockstep ticks, one per rank.
        assert len(batches[1]) / 2 <= two["ticks"] <= len(batches[1]), two["ticks"]
    # Each publication carried the whole model in the engines' dtype (float32 on CPU); the
    # one-engine file run sent none.
    n_params = sum(
        t.numel() for t in load_file(str(solver_policy_dir / "model.safetensors")).values()
    )
    assert {r["publication_bytes"] for r in got} == {4 * n_params}
    assert "publication_bytes" not in reference[0]
    assert "engine_requests" not in reference[0]

    # AdamW's first update, lr * g / (|g| + eps), two ranks against one process. Two ranks
    # sum in another order, so an entry whose gradient is within rounding of zero may move
    # either way: the updates must agree to 1e-5 lr wherever the plain reference gradient
    # of the first batch is clear of zero (above 1e-4 of its largest entry: an entry near
    # 1e-5 of it carries a float32 sum-order error of ~1e-3 of itself, and AdamW's first
    # step passes eps / |g| of that on, ~1e-5 lr), or exactly zero (rows of tokens the batch
    # never saw: weight decay alone), and hardly any entry may differ at all. An update is read
    # back as new weight minus old, each rounded to float32, so two updates that agree to
    # 1e-5 lr can still read one unit in the last place of the weight apart.
    before = load_file(str(solver_policy_dir / "model.safetensors"))
    one, two = checkpoint_weights(uninterrupted_vllm_run, 1), checkpoint_weights(out, 1)
    first = read_batch(uninterrupted_vllm_run / "batches" / "step-000000.jsonl")
    _, grads = reference_grad_j(load_model(solver_policy_dir), first, "token-mean")
    largest = max(float(g.abs().max()) for g in grads.values())
    compared = nonzero = differ = differ_off_zero = total = 0
    for name, grad in grads.items():
        clear = grad.abs() > 1e-4 * largest
        kept = clear | (grad == 0)
        update_one, update_two = one[name] - before[name], two[name] - before[name]
        ulp = torch.finfo(torch.float32).eps * torch.maximum(before[name].abs(), one[name].abs())
        assert ((update_two - update_one).abs() <= 1e-5 * LR + ulp)[kept].all(), name
        assert (update_one[clear].abs() > 0.5 * LR).all(), f"{name}: the step must move it"
        compared += int(clear.sum())
        nonzero += int((grad != 0).sum())
        moved = (update_two - update_one).abs() > 1e-5 * LR
        differ += int(moved.sum())
        differ_off_zero += int((moved & (grad.abs() >= 1e-6 * largest)).sum())
        total += grad.numel()
    assert compared / nonzero > 0.7, f"only {compared} of {nonzero} entries clear of zero"
    # Entries within rounding of zero (below 1e-6 of the largest) take AdamW's first step by
    # their sign, which two sum orders may flip (about 0.1% of the entries here); beyond
    # them hardly any entry may move otherwise.
    assert differ / total < 3e-3, f"{differ} of {total} entries moved otherwise"
    assert differ_off_zero / total < 1e-3, f"{differ_off_zero} of {total} off zero moved otherwise"
