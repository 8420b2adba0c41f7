"""Publication by collective: buckets, and a real gloo broadcast between two processes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from thundersync_core.policy import build_model
from thundersync_core.rollout.weight_sync import (
    GroupAddress,
    WeightGroup,
    buckets_of,
    digest,
    layout_of,
    receive_weights,
    send_weights,
)


def test_buckets_hold_consecutive_parameters_within_the_budget():
    layout = [("a", (10,)), ("b", (3, 2)), ("c", (40,)), ("d", (1,))]
    # float32: 40, 24, 160, 4 bytes.
    assert buckets_of(layout, torch.float32, 64) == [[0, 1], [2], [3]]
    assert buckets_of(layout, torch.bfloat16, 64) == [[0, 1], [2], [3]]  # 20, 12, 80, 2
    assert buckets_of(layout, torch.bfloat16, 1000) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        buckets_of(layout, torch.float32, 0)


def _receiver(port: int, layout, dtype, out) -> None:
    group = WeightGroup(_address(port), rank=1)
    for _ in range(2):  # two publications over one group
        staged = receive_weights(group, layout, dtype=dtype, bucket_bytes=50_000)
        out.put({name: digest(t) for name, t in staged})


def _address(port: int) -> GroupAddress:
    return GroupAddress("gloo", host="127.0.0.1", port=port, world_size=2, timeout_s=60)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_publication_arrives_bitwise_in_the_engine_dtype(dtype):
    model = build_model("micro", seed=2)
    named = list(model.named_parameters())
    layout = layout_of(named)
    assert len(buckets_of(layout, dtype, 50_000)) > 3, "the test must cross several buckets"
    port = _port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    peer = ctx.Process(target=_receiver, args=(port, layout, dtype, out))
    peer.start()
    try:
        group = WeightGroup(_address(port), rank=0)
        sent = send_weights(group, named, layout, dtype=dtype, bucket_bytes=50_000)
        element = torch.empty((), dtype=dtype).element_size()
        assert sent == sum(p.numel() for _, p in named) * element
        expected = {name: digest(p.detach().to(dtype)) for name, p in named}
        assert out.get(timeout=60) == expected
        with torch.no_grad():
            for _, p in named:
                p.add_(1.0)
        send_weights(group, named, layout, dtype=dtype, bucket_bytes=50_000)
        moved = out.get(timeout=60)
        assert moved == {name: digest(p.detach().to(dtype)) for name, p in named}
        assert moved != expected
    finally:
        peer.join(timeout=60)
        peer.kill()


def test_a_sender_refuses_parameters_the_engines_do_not_expect():
    model = build_model("micro", seed=2)
    named = list(model.named_parameters())
    layout = layout_of(named)
    renamed = [("other", named[0][1]), *named[1:]]

    class Silent:  # no peer is needed: the refusal comes before anything is sent
        def broadcast(self, tensor):
            raise AssertionError("nothing may be sent")

    with pytest.raises(ValueError, match=r"parameter 0 is 'other'.*engines expect"):
        send_weights(Silent(), renamed, layout, dtype=torch.float32, bucket_bytes=10**9)  # type: ignore[arg-type]


def test_collective_publication_serves_every_schedule():
    from thundersync_core.config import TrainConfig  # noqa: PLC0415

    # The pipeline's in-flight updates too: the engines take the broadcast at the next round.
    for schedule in ("sync", "thundersync", "async", "pipeline"):
        TrainConfig(schedule=schedule, rollout={"publication": "collective"})
    TrainConfig(rollout={"publication": "collective"}, resources={"learner": {"ranks": 2}})


def test_a_publication_that_did_not_arrive_whole_fails_naming_the_engine():
    from thundersync_core.schedules.base import check_publication  # noqa: PLC0415

    sent = {"bytes": 10, "checksum": "abc"}
    check_publication(3, sent, [{"checksum": "abc", "differ": [], "engine": 0}] * 2)
    with pytest.raises(RuntimeError, match=r"version 3: engine 1 .*other bytes"):
        check_publication(
            3, sent, [{"checksum": "abc", "differ": [], "engine": 0},
                      {"checksum": "abd", "differ": [], "engine": 1}]
        )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"engine 0 .*differ from what it received.*qkv"):
        check_publication(3, sent, [{"checksum": "abc", "differ": ["layers.0.qkv_proj.weight"]}])


def test_the_learner_refuses_to_send_weights_mid_batch(micro_model_dir, tmp_path):
    from tests.helpers import random_batch  # noqa: PLC0415
    from thundersync_core.config import TrainConfig  # noqa: PLC0415
    from thundersync_core.runtime.learner_worker import LearnerWorker  # noqa: PLC0415
    from thundersync_core.streaming import LearnerRefusal, groups_of  # noqa: PLC0415

    config = TrainConfig(
        rollout={"publication": "collective"},
        resources={"learner": {"cores": []}, "learner_peak_flops": 1e9},
    )
    learner = LearnerWorker(micro_model_dir, config, publish_dir=tmp_path / "pub")
    batch = random_batch(seed=3, vocab=1024, n_groups=1, group_size=2)
    learner.begin({g: (s.prompt_ids, s.size) for g, s in groups_of(batch).items()})
    with pytest.raises(LearnerRefusal, match="refusing to publish weights version 0: a batch"):
        learner.send_weights()
    for traj in batch:
        learner.submit(traj, None)
    record = learner.step(0)
    assert record["weights"] == "", "collective publication writes no weight file"
    assert not list((tmp_path / "pub").glob("*.safetensors"))
