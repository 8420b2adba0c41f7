"""How a generation round's requests are spread over several engines."""

from __future__ import annotations

from thundersync_core.rollout.engine import GenerationRequest
from thundersync_core.rollout.engine_pool import assign_requests


def _request(group: str, trajectory: int, turn: int = 0) -> GenerationRequest:
    return GenerationRequest(f"{group}-t{trajectory}/{turn}", (1, 2), 4, seed=0, group_id=group)


def test_a_group_stays_on_one_engine_and_new_groups_go_to_the_least_loaded():
    affinity: dict[str, int] = {}
    first = [_request("a", i) for i in range(4)] + [_request("b", i) for i in range(2)]
    first += [_request("c", 0)]
    # a (4 requests) -> 0; b -> 1 (0 requests there); c -> 1 (2 < 4).
    assert assign_requests(first, 2, affinity) == [0, 0, 0, 0, 1, 1, 1]
    assert affinity == {"a": 0, "b": 1, "c": 1}
    # A later round: known groups keep their engine whatever the load; d takes engine 0,
    # which has fewer requests in this round (1 against 2).
    later = [_request("b", 0, 1), _request("a", 3, 1), _request("c", 0, 1), _request("d", 0)]
    assert assign_requests(later, 2, affinity) == [1, 0, 1, 0]
    # Equal load: fewer groups first (engine 0 holds a and d, engine 1 holds b and c: tie),
    # then the lowest index.
    assert assign_requests([_request("e", 0)], 2, affinity) == [0]


def test_the_assignment_depends_only_on_the_requests_order():
    requests = [_request(g, i) for g in "pqrstu" for i in range(3)]
    one, two = {}, {}
    assert assign_requests(requests, 3, one) == assign_requests(requests, 3, two)
    assert sorted(set(one.values())) == [0, 1, 2]  # every engine gets groups


def test_requests_without_a_group_are_grouped_by_trajectory():
    affinity: dict[str, int] = {}
    plain = [GenerationRequest(f"t{i}/0", (1,), 4, seed=0) for i in range(4)]
    assert assign_requests(plain, 2, affinity) == [0, 1, 0, 1]
    assert set(affinity) == {"t0", "t1", "t2", "t3"}
