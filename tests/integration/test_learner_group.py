"""The learner group through Ray: two rank actors in a gloo group take the one-process step.

Two ``LearnerRank`` actors form the process group behind a ``LearnerGroup`` facade (the
actor train.py starts when ``resources.learner.ranks`` > 1); the schedule's calls go to the
facade, which routes groups to ranks. The one-process ``LearnerWorker`` runs the same
batch. Why a pass cannot be chance: the loss and the gradient norm are batch-global (a rank
normalising alone would be off by its share of the groups), and the published weights are
compared entry by entry after an AdamW step. The group's DCP checkpoint then resumes in the
one-process learner with the group's weights.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import multi_turn_batch, random_batch, reference_grad_j
from thundersync_core.batch import turns_of
from thundersync_core.config import LearnerResources, ResourcesConfig, TrainConfig
from thundersync_core.objectives.opd import split_by_turn
from thundersync_core.policy.io import load_model
from thundersync_core.replay import interleave
from thundersync_core.runtime.learner_group import LearnerGroup
from thundersync_core.runtime.learner_worker import LearnerWorker
from thundersync_core.runtime.placement import remote_role
from thundersync_core.streaming import LearnerRefusal, groups_of

pytestmark = pytest.mark.integration

LR = 5e-2  # large enough that float32 storage rounding stays below 1e-5 of the update


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def start_group(ray_session, micro_model_dir, tmp_path):
    """Starts a test's LearnerGroup actors and kills them after it, passed or failed: a
    group left alive holds its ranks' CPUs for every later test of the session."""
    started = []

    def start(config: TrainConfig):
        role = config.resources.learner.model_copy(update={"num_cpus": 0.0})
        group = remote_role(LearnerGroup, role).remote(
            micro_model_dir, config, publish_dir=tmp_path / "group", timeout_s=60.0
        )
        started.append(group)
        return group

    yield start
    for group in started:
        ray_session.kill(group)


def config_for(ranks: int, *, sharded: bool = False, shared: bool = False) -> TrainConfig:
    """``sharded``: fsdp2 ranks holding the batch gradient 1/W each (flushed per group);
    ``shared``: and the open groups shared by the ranks, their statistics 1/W each."""
    learner = LearnerResources(num_cpus=1.0, cores=(), ranks=ranks)
    return TrainConfig(
        objective="grpo",
        schedule="thundersync",
        loss_agg="seq-sum",
        lr=LR,
        max_open_groups=2,
        learner_sharding="fsdp2" if sharded else "replicated",
        learner_sharded_gradient=sharded,
        learner_shared_groups=shared,
        resources=ResourcesConfig(learner=learner, learner_peak_flops=1e9),
    )


@pytest.mark.parametrize(
    "layout",
    ["whole", "sharded", "shared"],
    ids=["whole-accumulators", "sharded-gradient", "shared-groups"],
)
def test_two_rank_group_takes_the_single_process_step(
    ray_session, start_group, micro_model_dir, tmp_path, layout
):
    sharded = layout != "whole"
    ray = ray_session
    batch = random_batch(seed=17, vocab=1024, n_groups=3, group_size=3)
    groups = {g: (spec.prompt_ids, spec.size) for g, spec in groups_of(batch).items()}

    single = LearnerWorker(micro_model_dir, config_for(1), publish_dir=tmp_path / "single")
    single.begin(groups)
    for traj in batch:
        single.submit(traj, None)
    expected = single.step(0)

    two = config_for(2, sharded=sharded, shared=layout == "shared")
    group = start_group(two)
    assert ray.get(group.begin.remote(groups)) == 0
    for traj in reversed(batch):  # another arrival order: the sum is order-free
        group.submit.remote(traj, None)
    got = ray.get(group.step.remote(0), timeout=120)
    # The batch gradient each rank holds: whole, or its half of the rows when sharded.
    held = [b["accumulators"] for b in ray.get(group.state_bytes.remote())]
    whole = single.learner.accumulator_bytes()
    if sharded:
        assert all(0 < b <= whole / 2 * 1.05 for b in held), (held, whole)
    else:
        assert held == [whole, whole]

    assert got["policy_version"] == expected["policy_version"] == 1
    assert got["n_sources"] == expected["n_sources"] == len(batch)
    assert got["counters"]["groups_closed"] == 3
    if layout == "shared":  # lockstep ticks, each group's statistics reduce-scattered
        assert 0 < got["counters"]["ticks"] <= len(batch)
        assert got["counters"]["trajectory_backwards"] == len(batch)
        assert got["counters"]["stat_reductions"] >= got["counters"]["ticks"]
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    before = load_file(str(micro_model_dir / "model.safetensors"))
    after_single = load_file(expected["weights"])
    after_group = load_file(got["weights"])
    # AdamW's first step is lr * g / (|g| + eps), about lr * sign(g): an entry whose gradient
    # is within rounding (~1e-7 of the largest) of zero may move either way, so the updates
    # are compared where the plain reference gradient is clear of zero, which must be
    # nearly every entry.
    _, reference = reference_grad_j(load_model(micro_model_dir), batch, "seq-sum")
    largest = max(float(g.abs().max()) for g in reference.values())
    compared = total = 0
    for name, grad in reference.items():
        clear = grad.abs() > 1e-4 * largest
        update_single = (after_single[name] - before[name])[clear]
        update_group = (after_group[name] - before[name])[clear]
        assert torch.allclose(update_group, update_single, rtol=0, atol=1e-5 * LR), name
        compared += int(clear.sum())
        total += grad.numel()
    assert compared / total > 0.95

    # The group's checkpoint (DCP) resumes in the one-process learner with its weights.
    path = ray.get(group.save_checkpoint.remote(str(tmp_path / "ckpt"), 1, {}), timeout=120)
    resumed = LearnerWorker(
        micro_model_dir, config_for(1), publish_dir=tmp_path / "resumed", resume_from=path
    )
    assert resumed.version() == 1
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param.detach(), after_group[name]), name


def test_opd_turns_over_ranks_with_the_sharded_gradient_take_the_single_process_step(
    ray_session, start_group, micro_model_dir, tmp_path
):
    """OPD turns in lockstep ticks (one turn per rank, every rank flushing the sharded batch
    gradient after each): the step of one process."""
    ray = ray_session
    batch = multi_turn_batch(seed=5, vocab=1024, n_groups=3, group_size=2)
    groups = {g: (spec.prompt_ids, spec.size) for g, spec in groups_of(batch).items()}
    turns = list(interleave({t.trajectory_id: turns_of(t, split_by_turn(t)) for t in batch},
                            random.Random(2)))  # fmt: skip

    def opd(ranks: int) -> TrainConfig:
        base = config_for(ranks, sharded=ranks > 1)
        return base.model_copy(update={"objective": "opd"})

    single = LearnerWorker(micro_model_dir, opd(1), publish_dir=tmp_path / "single")
    single.begin(groups)
    for turn in turns:
        single.submit_turn((turn, None))
    expected = single.step(0)

    group = start_group(opd(2))
    ray.get(group.begin.remote(groups))
    for turn in turns:
        group.submit_turn.remote((turn, None))
    got = ray.get(group.step.remote(0), timeout=120)
    assert got["n_sources"] == expected["n_sources"] == len(turns)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    held = [b["accumulators"] for b in ray.get(group.state_bytes.remote())]
    whole = single.learner.accumulator_bytes()
    assert all(0 < b <= whole / 2 * 1.05 for b in held), (held, whole)


def test_a_tick_one_rank_refuses_fails_the_step_at_once_naming_why(ray_session, start_group):
    """Shared groups through Ray: a trajectory of another policy version is refused by its
    rank, every rank refuses that tick, the dispatcher stops and the step names the cause,
    long before the collective timeout."""
    ray = ray_session
    batch = random_batch(seed=17, vocab=1024, n_groups=2, group_size=2)
    batch[1] = dataclasses.replace(batch[1], policy_version=3)
    groups = {g: (spec.prompt_ids, spec.size) for g, spec in groups_of(batch).items()}
    group = start_group(config_for(2, sharded=True, shared=True))
    ray.get(group.begin.remote(groups))
    for traj in batch:
        group.submit.remote(traj, None)
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        ray.get(group.step.remote(0), timeout=120)
    assert time.monotonic() - start < 30
    # Whichever rank the trajectory went to, the step names its refusal first, then the
    # other rank's, which refused only because it did.
    said = str(refused.value).split("LearnerRefusal: ", 1)[1]
    assert re.match(r"step 0: rank (\d): .*policy version 3.*; rank (?!\1)\d: learner rank\(s\) "
                    r"\[\d\] refused a tick", said), said  # fmt: skip


def test_weights_are_not_published_mid_batch(micro_model_dir, tmp_path):
    """The runtime's publication (``weights_and_version``) is refused between begin and the
    step, as ``WeightPublisher`` refuses it in process."""
    batch = random_batch(seed=3, vocab=1024, n_groups=1, group_size=2)
    learner = LearnerWorker(micro_model_dir, config_for(1), publish_dir=tmp_path / "pub")
    assert learner.weights_and_version()[1] == 0
    learner.begin({g: (s.prompt_ids, s.size) for g, s in groups_of(batch).items()})
    learner.submit(batch[0], None)
    with pytest.raises(LearnerRefusal, match="refusing to publish weights version 0: a batch"):
        learner.weights_and_version()
    learner.submit(batch[1], None)
    learner.step(0)
    path, version = learner.weights_and_version()
    assert version == 1
    assert load_file(path).keys() == load_file(str(micro_model_dir / "model.safetensors")).keys()


@pytest.mark.parametrize("pack_tokens", [0, 4096])
def test_timing_passes_leave_the_learner_as_it_was(micro_model_dir, tmp_path, pack_tokens):
    """The bench's contention measurement (``time_sources``) times every source and drops
    its scratch batches: the next step is the step an untouched learner takes. With a stop
    file the passes repeat until it appears; mid-batch the pass is refused. With packs a
    group runs whole, as the schedules' learner runs it, its time shared by its sources."""
    batch = random_batch(seed=5, vocab=1024, n_groups=2, group_size=2)
    groups = {g: (s.prompt_ids, s.size) for g, s in groups_of(batch).items()}
    config = config_for(1).model_copy(update={"learner_pack_tokens": pack_tokens})
    assert config.packs == bool(pack_tokens)
    timed = LearnerWorker(micro_model_dir, config, publish_dir=tmp_path / "timed")
    plain = LearnerWorker(micro_model_dir, config, publish_dir=tmp_path / "plain")
    times = timed.time_sources(groups, batch)
    # One at a time in the batch's order; with packs a group at a time, in the order its
    # first trajectory comes.
    order = [t.trajectory_id for t in batch]
    if pack_tokens:
        firsts = list(dict.fromkeys(t.group_id for t in batch))
        order = [t.trajectory_id for g in firsts for t in batch if t.group_id == g]
    assert [i for i, _, _ in times] == order
    assert all(end > start for _, start, end in times)
    if pack_tokens:  # a group's sources share its one submit: consecutive intervals
        by_id = {t.trajectory_id: t.group_id for t in batch}
        for (a, _, a_end), (b, b_start, _) in itertools.pairwise(times):
            if by_id[a] == by_id[b]:
                assert a_end == pytest.approx(b_start, abs=1e-9)
    stop = tmp_path / "stop"
    threading.Timer(1.0, stop.touch).start()
    repeated = timed.time_sources(groups, batch, str(stop))
    assert len(repeated) > len(batch), "passes repeat until the stop file exists"
    assert timed.version() == 0
    for learner in (timed, plain):
        learner.begin(groups)
        for traj in batch:
            learner.submit(traj, None)
    with pytest.raises(LearnerRefusal, match="batch is in progress"):
        timed.time_sources(groups, batch)
    a, b = timed.step(0), plain.step(0)
    assert a["loss"] == b["loss"]
    assert a["grad_norm"] == b["grad_norm"]
    after = load_file(a["weights"])
    assert all(torch.equal(after[k], v) for k, v in load_file(b["weights"]).items())


def test_timing_leaves_out_groups_with_equal_rewards(micro_model_dir, tmp_path):
    """With packs a group whose rewards are all equal costs the learner nothing, so the
    timing pass leaves it out; a batch of only such groups times nothing and returns at
    once, even with a stop file that never appears (the bench then reports no contention)."""
    batch = random_batch(seed=6, vocab=1024, n_groups=3, group_size=3)
    uniform = [dataclasses.replace(t, reward=1.0) if t.group_id != "g1" else t for t in batch]
    groups = {g: (s.prompt_ids, s.size) for g, s in groups_of(batch).items()}
    config = config_for(1).model_copy(update={"learner_pack_tokens": 4096})
    timed = LearnerWorker(micro_model_dir, config, publish_dir=tmp_path / "timed")
    times = timed.time_sources(groups, uniform)
    assert [i for i, _, _ in times] == [t.trajectory_id for t in batch if t.group_id == "g1"]
    all_equal = [dataclasses.replace(t, reward=0.0) for t in batch]
    started = time.monotonic()
    assert timed.time_sources(groups, all_equal, str(tmp_path / "never")) == []
    assert time.monotonic() - started < 5.0
    assert timed.version() == 0


def test_ranks_sit_in_one_placement_group_that_is_given_back(
    ray_session, micro_model_dir, tmp_path
):
    """The ranks run in their bundles (the group's CPUs are in use while they live), a
    request the cluster cannot meet is refused naming the role and what is free, and
    stopping the roles gives every group back."""
    ray = ray_session
    from ray.util.placement_group import placement_group_table  # noqa: PLC0415

    from thundersync_core.runtime.placement import reserve  # noqa: PLC0415
    from thundersync_core.runtime.roles import (  # noqa: PLC0415
        reserve_roles,
        start_learner,
        stop_roles,
    )
    from thundersync_core.schedules.base import Roles  # noqa: PLC0415

    free_before = ray.available_resources().get("CPU", 0.0)
    config = config_for(2)
    learner = config.resources.learner.model_copy(update={"placement": "strict_pack"})
    config = config.model_copy(
        update={"resources": config.resources.model_copy(update={"learner": learner})}
    )
    reserved = reserve_roles(config, teacher=False)
    group_pg = reserved["learner"].group
    table = placement_group_table(group_pg)
    assert (table["state"], table["strategy"]) == ("CREATED", "STRICT_PACK")
    assert list(table["bundles"].values()) == [{"CPU": 0.5}] * 2
    roles = Roles(None, None, None, reservations=list(reserved.values()))
    roles.learner = start_learner(
        config, micro_model_dir, publish_dir=tmp_path / "pub", reservation=reserved["learner"]
    )
    assert ray.get(roles.learner.version.remote(), timeout=120) == 0
    # Each rank holds its bundle's half CPU: the group has none left while they live.
    group_cpu = f"CPU_group_{group_pg.id.hex()}"
    assert ray.cluster_resources()[group_cpu] == pytest.approx(1.0)
    assert ray.available_resources().get(group_cpu, 0.0) == pytest.approx(0.0, abs=1e-3)
    # More than is free: refused within the timeout, naming the role, not pending for ever.
    free = ray.available_resources().get("CPU", 0.0)
    greedy = config.resources.teacher.model_copy(update={"num_cpus": free + 0.5})
    with pytest.raises(
        ValueError,
        match=r"resources\.teacher: 1 bundle\(s\) of .* CPU \(pack\) "
        r"could not be placed within 2 s .* the cluster has [\d.]+ CPU, 0 GPU free",
    ):
        reserve("teacher", greedy, timeout_s=2.0)
    stop_roles(roles)
    assert placement_group_table(group_pg)["state"] == "REMOVED"
    assert roles.reservations == []
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0.0) < free_before - 1e-6:
        assert time.time() < deadline, ray.available_resources()
        time.sleep(0.2)
