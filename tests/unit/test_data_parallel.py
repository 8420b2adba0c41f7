"""Group routing and the streamed weight file: the hermetic parts of the distributed learner."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from thundersync_core.parallel.data_parallel import GroupAssigner
from thundersync_core.parallel.fsdp import write_safetensors_streamed
from thundersync_core.policy import build_model
from thundersync_core.streaming import GroupSpec, LearnerRefusal, StreamingGRPOLearner


def test_group_goes_to_least_loaded_rank_and_stays():
    assigner = GroupAssigner(2)
    assert assigner.assign("a", 10, 4) == (0, True)  # rank 0 now has 40
    assert assigner.assign("b", 5, 4) == (1, True)  # rank 1 has 20
    assert assigner.assign("c", 1, 4) == (1, True)  # 20 < 40: rank 1, now 24
    assert assigner.assign("a", 999, 4) == (0, False)  # later sources follow their group
    assert assigner.assign("d", 3, 4) == (1, True)  # 24 < 40
    assert assigner.groups_on(0) == ["a"]
    assert assigner.groups_on(1) == ["b", "c", "d"]
    assigner.reset()
    assert assigner.rank_of == {}
    assert assigner.work_tokens == [0, 0]


def test_assignment_is_a_function_of_arrival_order():
    arrivals = [("g3", 7), ("g1", 2), ("g0", 9), ("g2", 4), ("g1", 5), ("g4", 1)]
    routes = []
    for _ in range(2):
        assigner = GroupAssigner(3)
        routes.append([assigner.assign(g, n, 2)[0] for g, n in arrivals])
    assert routes[0] == routes[1] == [0, 1, 2, 1, 1, 1]


def test_streamed_safetensors_round_trip(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.float64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "w.safetensors"
    write_safetensors_streamed(path, iter(tensors.items()))
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype
        assert torch.equal(loaded[name], value), name
    assert not list(tmp_path.glob("*.partial*"))


def test_groups_added_during_a_batch_are_checked():
    learner = StreamingGRPOLearner(build_model("micro", seed=0))
    learner.begin_batch({})
    learner.add_groups({"g": GroupSpec((1, 2), 2)})
    with pytest.raises(LearnerRefusal, match="'g' is already registered"):
        learner.add_groups({"g": GroupSpec((1, 2), 2)})
    with pytest.raises(LearnerRefusal, match=r"not safe to step: 1 group\(s\) still open"):
        learner.finish()
