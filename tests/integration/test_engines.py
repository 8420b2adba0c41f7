"""Rollout engines against the learner: log-probs, seeds, weight publication (real vLLM)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import psutil
import pytest
import torch

from tests.helpers import reference_sampling_row
from thundersync_core.batch import Segment, Trajectory
from thundersync_core.policy import load_model, scored_logprobs
from thundersync_core.policy.logprobs import SamplingFilter, set_policy_sampling
from thundersync_core.rollout.engine import GenerationRequest, SamplingConfig, request_seed
from thundersync_core.rollout.hf_engine import HFEngine
from thundersync_core.rollout.weights import WeightPublisher
from thundersync_core.streaming import LearnerRefusal, SyncGRPOLearner, groups_of

pytestmark = pytest.mark.integration
SAMPLING = SamplingConfig()


def requests(n: int = 6, turn: int = 0, max_tokens: int = 12) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"t{i}/{turn}",
            tuple(range(3 + i, 20 + 2 * i)),
            max_tokens,
            request_seed(7, "g", f"t{i}", turn),
        )
        for i in range(n)
    ]


def learner_logprobs(model, request, result) -> torch.Tensor:
    ids = list(request.prompt_ids) + list(result.token_ids)
    scored = [False] * len(request.prompt_ids) + [True] * len(result.token_ids)
    with torch.no_grad():
        logp, _ = scored_logprobs(model, torch.tensor([ids]), torch.tensor([scored]))
    return logp


def assert_logprobs_match(model, reqs, results, atol=1e-4) -> float:
    worst = 0.0
    for request, result in zip(reqs, results, strict=True):
        ours = learner_logprobs(model, request, result)
        theirs = torch.tensor(result.logprobs, dtype=ours.dtype)
        worst = max(worst, float((ours - theirs).abs().max()))
    assert worst <= atol, f"engine and learner log-probs differ by {worst:.2e}"
    return worst


def one_step(model, reqs, results, version):
    """A real GRPO step on the engine's samples; large enough to move every log-prob."""
    trajectories = [
        Trajectory(
            "g",
            r.request_id,
            reqs[0].prompt_ids[:3],
            (Segment.action(o.token_ids),),
            float(i),
            policy_version=version,
        )
        for i, (r, o) in enumerate(zip(reqs, results, strict=True))
    ]
    learner = SyncGRPOLearner(model, policy_version=version)
    learner.begin_batch(groups_of(trajectories))
    for traj in trajectories:
        learner.submit(traj)
    learner.step(torch.optim.SGD(model.parameters(), lr=0.02))
    return learner


def test_hf_engine_logprobs_match_learner_and_seeds_ignore_batching(tiny_policy_dir):
    engine = HFEngine(tiny_policy_dir)
    model = load_model(tiny_policy_dir)
    reqs = requests()
    batched = engine.generate(reqs, SAMPLING)
    assert_logprobs_match(model, reqs, batched)
    alone = [engine.generate([r], SAMPLING)[0] for r in reversed(reqs)][::-1]
    assert [r.token_ids for r in alone] == [r.token_ids for r in batched]
    assert len({r.token_ids for r in batched}) == len(reqs)  # seeds differ per request


def test_vllm_logprobs_match_learner_before_and_after_publication(vllm_engine, tiny_policy_dir):
    model = load_model(tiny_policy_dir)
    reqs = requests()
    before = vllm_engine.generate(reqs, SAMPLING)
    assert {r.policy_version for r in before} == {vllm_engine.policy_version}
    start_version = vllm_engine.policy_version
    assert_logprobs_match(model, reqs, before)

    learner = one_step(model, reqs, before, start_version)
    publisher = WeightPublisher(learner, [vllm_engine])
    publication = publisher.publish()
    assert publication is not None
    assert publication.version == start_version + 1
    assert publisher.publish() is None  # same version: nothing to publish, version unchanged
    after = vllm_engine.generate(reqs, SAMPLING)
    assert {r.policy_version for r in after} == {start_version + 1}
    assert_logprobs_match(model, reqs, after)
    # The new weights are really live: the old tokens' log-probs moved.
    moved = learner_logprobs(model, reqs[0], before[0]) - torch.tensor(before[0].logprobs)
    assert float(moved.abs().max()) > 1e-2


def test_publication_is_refused_mid_batch(tiny_policy_dir):
    model = load_model(tiny_policy_dir)
    engine = HFEngine(tiny_policy_dir)
    learner = SyncGRPOLearner(model)
    traj = Trajectory("g", "t", (1, 2, 3), (Segment.action([4, 5]),), 1.0)
    learner.begin_batch(groups_of([traj, dataclasses.replace(traj, trajectory_id="u")]))
    learner.submit(traj)
    with pytest.raises(LearnerRefusal, match="batch is in progress"):
        WeightPublisher(learner, [engine]).publish()
    assert engine.policy_version == 0


def test_vllm_seeded_tokens_do_not_depend_on_batching(vllm_engine):
    reqs = requests(n=8, turn=3)
    batched = vllm_engine.generate(reqs, SAMPLING)
    alone = [vllm_engine.generate([r], SAMPLING)[0] for r in reqs]
    shuffled = vllm_engine.generate(list(reversed(reqs)), SAMPLING)[::-1]
    assert [r.token_ids for r in alone] == [r.token_ids for r in batched]
    assert [r.token_ids for r in shuffled] == [r.token_ids for r in batched]


def test_a_cpu_engine_caches_prompts_in_32_token_blocks(vllm_engine):
    """A group's samples share their prompt's cached blocks: at vLLM CPU's default of 128
    tokens a 200-token prompt shared 128; at 32, 192. A cached prefix samples as a fresh one."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    if not current_platform.is_cpu():
        pytest.skip("the block size is set on CPU only")
    assert vllm_engine.llm.llm_engine.vllm_config.cache_config.block_size == 32
    prompt = tuple(3 + (7 * i) % 500 for i in range(200))
    request = GenerationRequest("p/0", prompt, 12, request_seed(7, "g", "p", 0))
    vllm_engine.llm.reset_prefix_cache()
    fresh = vllm_engine.generate([request], SAMPLING)[0]
    cached = vllm_engine.generate([dataclasses.replace(request, request_id="p/1")], SAMPLING)[0]
    assert cached.token_ids == fresh.token_ids
    assert cached.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)


_OWN_PROCESS_ENGINE = """
import json, sys
from pathlib import Path
from thundersync_core.rollout.engine import GenerationRequest, SamplingConfig
from thundersync_core.rollout.vllm_engine import VLLMEngine

engine = VLLMEngine(Path(sys.argv[1]), max_model_len=2048, engine_core="auto")
reqs = [GenerationRequest(*r) for r in json.loads(sys.argv[2])]
results = engine.generate(reqs, SamplingConfig())
print(json.dumps({"pids": engine.engine_pids(),
                  "results": [[list(r.token_ids), list(r.logprobs)] for r in results]}))
"""


def test_an_engine_alone_in_its_process_runs_its_core_there_and_samples_the_same(
    vllm_engine, tiny_policy_dir
):
    """``engine_core: auto`` on CPU in a process pinned to one core (a role's engine, as the
    embedded config pins it) runs vLLM's engine core in that process, a real one started
    here: no engine child process, and the tokens and log-probs of the session's engine,
    whose core is a child process."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    if not current_platform.is_cpu():
        pytest.skip("the engine core moves into the role's process on CPU only")
    reqs = requests(n=5, max_tokens=16)
    done = subprocess.run(
        [sys.executable, "-c", _OWN_PROCESS_ENGINE, str(tiny_policy_dir),
         json.dumps([dataclasses.astuple(r) for r in reqs])],
        capture_output=True, text=True, timeout=300, check=False,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["pids"] == []
    assert vllm_engine.engine_pids(), "the session's engine core is a child process"
    # The policy's own weights (an earlier test may have published others).
    vllm_engine.load_weights(tiny_policy_dir / "model.safetensors", vllm_engine.policy_version)
    expected = vllm_engine.generate(reqs, SAMPLING)
    for (tokens, logprobs), want in zip(got["results"], expected, strict=True):
        assert tuple(tokens) == want.token_ids
        assert logprobs == pytest.approx(list(want.logprobs), abs=1e-5)


def test_vllm_engine_core_process_is_found(vllm_engine):
    """The engine watchdog and roles.json need the engine core's pid: one child process of
    this one, the one vLLM titles ``VLLM::EngineCore``."""
    [pid] = vllm_engine.engine_pids()
    core = psutil.Process(pid)
    assert core.ppid() == os.getpid()
    assert core.name().startswith("VLLM::EngineCor")


SAMPLER = SamplingConfig(temperature=0.7, top_p=0.9, top_k=0)


def reference_sampled_logprobs(model64, request, result, sampler) -> list[float]:
    """Each sampled token's log-prob under the sampler, from a float64 forward and the
    written-out filter (``reference_sampling_row``)."""
    ids = list(request.prompt_ids) + list(result.token_ids)
    with torch.no_grad():
        logits = model64(input_ids=torch.tensor([ids])).logits[0]
    start = len(request.prompt_ids)
    return [
        reference_sampling_row(logits[start + i - 1].tolist(), sampler)[token]
        for i, token in enumerate(result.token_ids)
    ]


@pytest.mark.parametrize("engine_kind", ["hf", "vllm"])
def test_behaviour_logprobs_are_the_sampled_distributions(
    engine_kind, vllm_engine, tiny_policy_dir
):
    """At temperature 0.7 with a 0.9 nucleus both engines report the log-prob of each sampled
    token under the distribution sampled, as a plain float64 recompute gives it; the
    learner's policy (the tempered softmax) gives each token at most that."""
    if engine_kind == "vllm":
        engine = vllm_engine
        # The session's engine may hold published weights: give it the folder's again.
        engine.load_weights(tiny_policy_dir / "model.safetensors", engine.policy_version)
    else:
        engine = HFEngine(tiny_policy_dir)
    reqs = requests(n=4, max_tokens=16)
    results = engine.generate(reqs, SAMPLER)
    model64 = load_model(tiny_policy_dir, dtype=torch.float64)
    learner = load_model(tiny_policy_dir)
    set_policy_sampling(learner, SamplingFilter(SAMPLER.temperature))
    worst, cut = 0.0, 0
    for request, result in zip(reqs, results, strict=True):
        want = torch.tensor(reference_sampled_logprobs(model64, request, result, SAMPLER))
        got = torch.tensor(result.logprobs, dtype=torch.float64)
        assert bool(torch.isfinite(want).all()), "a sampled token outside the nucleus"
        worst = max(worst, float((want - got).abs().max()))
        tempered = learner_logprobs(learner, request, result).double()
        assert bool((tempered <= got + 1e-4).all())
        cut += int((tempered < got - 1e-3).sum())
    assert worst <= 1e-4, f"{engine_kind}: behaviour log-probs off by {worst:.2e}"
    assert cut > 0  # the nucleus renormalised some steps: a raw log-prob would be caught
