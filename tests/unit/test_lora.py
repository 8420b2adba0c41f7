"""LoRA adapters: the streamed update is exact, only adapters move, saved adapters load.

Why a pass cannot be chance: the references below are written out here (full-sequence
forwards through the model's own ``logits``, full-vocabulary log-softmax, one backward of
the whole batch loss), independent of the learners' scored-position projection, prompt
proxies and adjoint replays. B starts non-zero, so the gradients with respect to A and to B
are both dense and are compared separately (a wrong A part could hide under the larger B
part of one global maximum). The adapters sit on q_proj, v_proj and down_proj only, so
layer 0's keys depend on no trainable parameter: the prompt replays must skip them and still
carry the v_proj and later-layer adjoints. A dropped adjoint or a wrong advantage moves the
result by O(1) relative. Tolerances as for full-parameter training: float64 1e-10 (rounding
alone is ~1e-15 here), float32 1e-5 (measured ~1e-6: the split backward sums in another
order).
"""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from tests.helpers import multi_turn_batch, random_batch, run_opd_stream, run_opd_sync
from thundersync_core.batch import Trajectory, trajectory_to_json
from thundersync_core.policy import build_model, load_model
from thundersync_core.policy.lora import (
    LoraSettings,
    adapter_settings,
    adapter_state_dict,
    apply_lora,
    load_adapter,
    merged_state_dict,
    parse_lora,
    save_adapter,
    saved_key,
)
from thundersync_core.replay import replay
from thundersync_core.streaming import StreamingGRPOLearner, SyncGRPOLearner, groups_of

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
DTYPES = [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32")]
SETTINGS = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
#: Large enough that grad A (proportional to B) is far above rounding.
INIT_B_STD = 0.05


def lora_model(dtype: torch.dtype, settings: LoraSettings = SETTINGS, seed: int = 5):
    model = build_model("micro", seed=3, dtype=dtype)
    return apply_lora(model, settings, seed=seed, init_b_std=INIT_B_STD)


@pytest.fixture(scope="module")
def models():
    return {dtype: lora_model(dtype) for dtype in (torch.float64, torch.float32)}


@pytest.fixture(scope="module")
def grpo_batch():
    return random_batch(seed=11, vocab=1024, n_groups=3, group_size=4)


@pytest.fixture(scope="module")
def opd_batch():
    return multi_turn_batch(seed=13, vocab=1024)


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def sequence(traj: Trajectory) -> tuple[list[int], list[int]]:
    """The full token list and the positions whose token the loss scores."""
    tokens = list(traj.prompt_ids) + [i for s in traj.segments for i in s.ids]
    scored = [False] * len(traj.prompt_ids) + [b for s in traj.segments for b in s.scored]
    return tokens, [pos for pos in range(1, len(tokens)) if scored[pos]]


def token_logprobs(model, traj: Trajectory) -> torch.Tensor:
    tokens, positions = sequence(traj)
    logits = model(input_ids=torch.tensor([tokens])).logits[0]
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return torch.stack([logp[pos - 1, tokens[pos]] for pos in positions])


def reference_grad_j(model, batch: list[Trajectory]) -> dict[str, torch.Tensor]:
    """grad J over the adapters: J = (1/G) sum_g sum_i A_i S_i, A_i from the group's mean
    and population std (0 for a group of equal rewards), one backward."""
    groups: dict[str, list[Trajectory]] = {}
    for traj in batch:
        groups.setdefault(traj.group_id, []).append(traj)
    objective = torch.zeros((), dtype=torch.float64)
    for members in groups.values():
        rewards = [t.reward for t in members]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for traj in members:
            advantage = 0.0 if len(set(rewards)) == 1 else (traj.reward - mean) / (std + 1e-6)
            objective = objective + advantage * token_logprobs(model, traj).sum()
    objective = objective / len(groups)
    params = adapters(model)
    return dict(zip(params, torch.autograd.grad(objective, list(params.values())), strict=True))


def reference_grad_l(model, batch: list[Trajectory]) -> dict[str, torch.Tensor]:
    """grad L over the adapters: L = (1/N) sum_t sg(log pi_t - q_t) log pi_t, one backward."""
    total = torch.zeros((), dtype=torch.float64)
    n_tokens = 0
    for traj in batch:
        logprobs = token_logprobs(model, traj)
        assert traj.teacher_logprobs is not None
        teacher = torch.tensor(traj.teacher_logprobs, dtype=logprobs.dtype)
        total = total + ((logprobs.detach() - teacher) * logprobs).sum()
        n_tokens += len(teacher)
    params = adapters(model)
    loss = total / n_tokens
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def assert_close_by_part(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol: float):
    """max |ref - got| / max |ref| below ``tol`` over the A tensors and over the B tensors."""
    assert ref.keys() == got.keys()
    for part in ("lora_A", "lora_B"):
        names = [n for n in ref if f".{part}." in n]
        assert names, part
        scale = max(float(ref[n].double().abs().max()) for n in names)
        assert scale > 0, f"{part}: reference gradient is zero, the comparison shows nothing"
        diff = max(float((ref[n].double() - got[n].double()).abs().max()) for n in names)
        assert diff / scale <= tol, (part, diff / scale)


def feed(learner, batch, order, pack_tokens=0, rng=None):
    """``order`` one at a time, or (``pack_tokens``) in chunks of 1 to 4 landed at once."""
    learner.begin_batch(groups_of(batch))
    if not pack_tokens:
        for traj in order:
            learner.submit(traj)
        return learner.finish()
    pending = list(order)
    while pending:
        size = rng.randint(1, 4)
        chunk, pending = pending[:size], pending[size:]
        learner.submit_many(chunk, pack_tokens=pack_tokens)
    return learner.finish()


# -- settings --------------------------------------------------------------------------------
def test_parse_lora_reads_the_command_line_form():
    assert parse_lora("r=8,alpha=16") == LoraSettings(r=8, alpha=16.0)
    settings = parse_lora("r=2, alpha=4.5, dropout=0, targets=q_proj+v_proj")
    assert settings == LoraSettings(r=2, alpha=4.5, target_modules=("q_proj", "v_proj"))
    assert settings.scaling == 2.25


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("alpha=16", "'r' is required"),
        ("r=8", "'alpha' is required"),
        ("r=eight,alpha=16", "r must be an integer"),
        ("r=0,alpha=16", "r must be an integer >= 1"),
        ("r=8,alpha=x", "alpha must be a number"),
        ("r=8,alpha=-1", "alpha must be a finite number > 0"),
        ("r=8,alpha=16,dropout=1.5", "dropout must be in [0, 1)"),
        ("r=8,alpha=16,rank=3", "unknown field 'rank'"),
        ("r=8,alpha=16,r=4", "'r' given twice"),
        ("r=8,alpha=16,targets=q_proj++v_proj", "targets has an empty name"),
        ("r=8,alpha", "'alpha' is not key=value"),
    ],
)
def test_parse_lora_names_the_bad_field(text, field):
    with pytest.raises(ValueError, match="--lora") as info:
        parse_lora(text)
    assert field in str(info.value)


def test_apply_lora_freezes_the_base_and_draws_adapters_from_the_seed():
    model = build_model("micro", seed=3)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_lora(model, LoraSettings(r=4, alpha=8), seed=1) is model
    assert type(model).__name__ == "Qwen3ForCausalLM"  # not wrapped: logprobs.py's contract
    trainable = sorted(adapters(model))
    # 2 layers x 7 projections x (A, B), and nothing else.
    assert len(trainable) == 28
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(not p.detach().any() for n, p in adapters(model).items() if ".lora_B." in n)
    # B = 0: the policy is the base model, and the base weights are untouched.
    ids = torch.tensor([[1, 5, 9, 2]])
    fresh = build_model("micro", seed=3)
    assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)
    merged = merged_state_dict(model)
    assert all(torch.equal(merged[k], base[k]) for k in base)
    again = apply_lora(build_model("micro", seed=3), LoraSettings(r=4, alpha=8), seed=1)
    other = apply_lora(build_model("micro", seed=3), LoraSettings(r=4, alpha=8), seed=2)
    ours, theirs, same = (
        adapter_state_dict(model),
        adapter_state_dict(other),
        adapter_state_dict(again),
    )
    assert all(torch.equal(ours[k], same[k]) for k in ours)
    assert any(not torch.equal(ours[k], theirs[k]) for k in ours if ".lora_A." in k)


@pytest.mark.parametrize(
    ("settings", "kwargs", "message"),
    [
        (LoraSettings(r=4, alpha=8, dropout=0.1), {}, "dropout 0.1 > 0"),
        (LoraSettings(r=4, alpha=8, target_modules=("qkv",)), {}, "match no layer"),
        (LoraSettings(r=4, alpha=8, target_modules=("lm_head",)), {}, "output head"),
        (LoraSettings(r=4, alpha=8, target_modules=("embed_tokens",)), {}, "embedding"),
        (LoraSettings(r=4, alpha=8), {"init_b_std": -1.0}, "init_b_std"),
    ],
)
def test_apply_lora_refuses(settings, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_lora(build_model("micro", seed=3), settings, **kwargs)


def test_apply_lora_refuses_a_second_adapter_and_allows_dropout_when_asked():
    model = apply_lora(build_model("micro", seed=3), SETTINGS)
    with pytest.raises(ValueError, match="already carries LoRA adapters"):
        apply_lora(model, SETTINGS)
    noisy = LoraSettings(r=4, alpha=8, dropout=0.1)
    model = apply_lora(build_model("micro", seed=3), noisy, allow_dropout=True)
    assert adapter_settings(model) == LoraSettings(
        r=4, alpha=8, dropout=0.1, target_modules=tuple(sorted(noisy.target_modules))
    )


# -- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_grpo_adapter_gradient_is_the_sync_and_reference_one(models, grpo_batch, dtype):
    model = models[dtype]
    ref = reference_grad_j(model, grpo_batch)
    sync = feed(SyncGRPOLearner(model), grpo_batch, grpo_batch).grad_objective
    assert_close_by_part(ref, sync, TOLERANCE[dtype])
    runs = [
        ("trajectory", "arrival", 0, 0),  # one backward as each reward lands
        ("trajectory", "arrival", 1, 0),
        ("trajectory", "arrival", 2, 64),  # landed rewards that close a group run as packs
        ("trajectory", "fixed", 5, 0),  # sums in trajectory-id order
        ("group", "arrival", 3, 0),  # a group's backwards once its last reward lands
        ("group", "arrival", 4, 64),
    ]
    for release, sum_order, seed, pack_tokens in runs:
        rng = random.Random(seed)
        order = rng.sample(grpo_batch, len(grpo_batch))
        learner = StreamingGRPOLearner(model, max_open_groups=2, release=release, order=sum_order)
        result = feed(learner, grpo_batch, order, pack_tokens, rng)
        assert_close_by_part(ref, result.grad_objective, TOLERANCE[dtype])
        assert_close_by_part(sync, result.grad_objective, TOLERANCE[dtype])
        assert result.counters["prefix_replays"] == 3
        if pack_tokens:
            assert result.counters["packed_trajectories"] > 0
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_opd_adapter_gradient_is_the_sync_and_reference_one(models, opd_batch, dtype):
    model = models[dtype]
    ref = reference_grad_l(model, opd_batch)
    sync = run_opd_sync(model, opd_batch).grad_objective
    assert_close_by_part(ref, sync, TOLERANCE[dtype])
    for seed in range(3):
        _, result = run_opd_stream(model, opd_batch, seed)
        assert_close_by_part(ref, result.grad_objective, TOLERANCE[dtype])
        assert_close_by_part(sync, result.grad_objective, TOLERANCE[dtype])
        assert result.counters["trajectory_replays"] > 0  # the adjoint path ran
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("targets", [("q_proj",), None], ids=["queries", "default"])
def test_other_target_sets_stay_exact(grpo_batch, opd_batch, targets):
    """Attention queries only (no key or value depends on a trainable parameter: every
    prompt adjoint is dropped) and every projection (the default)."""
    settings = LoraSettings(r=2, alpha=2, **({"target_modules": targets} if targets else {}))
    model = lora_model(torch.float64, settings)
    order = random.Random(0).sample(grpo_batch, len(grpo_batch))
    streamed = feed(StreamingGRPOLearner(model, max_open_groups=2), grpo_batch, order)
    assert_close_by_part(reference_grad_j(model, grpo_batch), streamed.grad_objective, 1e-10)
    _, opd = run_opd_stream(model, opd_batch, seed=1)
    assert_close_by_part(reference_grad_l(model, opd_batch), opd.grad_objective, 1e-10)


def test_a_step_moves_the_adapters_only(grpo_batch):
    model = lora_model(torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # The optimizer is handed every parameter: frozen ones get no gradient, so not even
    # AdamW's weight decay touches them.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    learner = StreamingGRPOLearner(model, max_open_groups=2)
    learner.begin_batch(groups_of(grpo_batch))
    for traj in random.Random(7).sample(grpo_batch, len(grpo_batch)):
        learner.submit(traj)
    learner.step(optimizer)
    after = model.state_dict()
    for key, value in before.items():
        if ".lora_" in key:
            assert not torch.equal(after[key], value), f"{key} did not move"
        else:
            assert torch.equal(after[key], value), f"{key} moved"
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)


# -- saved adapters --------------------------------------------------------------------------
def test_save_and_load_round_trip_bitwise_in_peft_naming(models, tmp_path):
    model = models[torch.float64]
    folder = save_adapter(model, SETTINGS, tmp_path / "adapter", base_model_name_or_path="micro")
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in saved
    assert len(saved) == 2 * 2 * 3  # layers x targets x (A, B)
    assert set(saved) == {saved_key(n) for n in adapters(model)}
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == "micro"
    # Into a model without adapters, and into one whose adapters hold other values.
    for target in (
        build_model("micro", seed=3, dtype=torch.float64),
        lora_model(torch.float64, seed=9),
    ):
        load_adapter(target, folder)
        ours, theirs = adapter_state_dict(model), adapter_state_dict(target)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert not any(p.requires_grad for n, p in target.named_parameters() if ".lora_" not in n)
    wrong_rank = apply_lora(build_model("micro", seed=3), LoraSettings(r=2, alpha=8))
    with pytest.raises(ValueError, match="r is 4 but the model's adapters have 2"):
        load_adapter(wrong_rank, folder)
    with pytest.raises(ValueError, match=r"alpha is 2\.0 but"):
        save_adapter(
            model, LoraSettings(r=4, alpha=2, target_modules=SETTINGS.target_modules), tmp_path
        )


def test_merged_weights_and_peft_loading_give_the_lora_models_logits(models, tmp_path):
    model = models[torch.float64]
    ids = torch.tensor([[3, 17, 250, 999, 4, 61, 7]])
    expected = model(input_ids=ids).logits.detach()
    # Merged into the plain model, for engines without LoRA: same keys, same policy.
    plain = build_model("micro", seed=0, dtype=torch.float64)
    merged = merged_state_dict(model)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged, strict=True)
    got = plain(input_ids=ids).logits.detach()
    assert float((got - expected).abs().max()) <= 1e-10 * float(expected.abs().max())
    assert not torch.equal(
        got, build_model("micro", seed=3, dtype=torch.float64)(input_ids=ids).logits
    )
    # What save_adapter writes is what peft itself loads.
    folder = save_adapter(model, SETTINGS, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(
        build_model("micro", seed=3, dtype=torch.float64), folder
    )
    got = peft_model(input_ids=ids).logits.detach()
    assert float((got - expected).abs().max()) <= 1e-10 * float(expected.abs().max())


# -- replay ----------------------------------------------------------------------------------
def test_replay_with_lora_writes_the_adapter_gradient(micro_model_dir, grpo_batch, tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(trajectory_to_json(t) + "\n" for t in grpo_batch))
    text = "r=4,alpha=8,targets=q_proj+v_proj+down_proj"
    common = {"model_dir": micro_model_dir, "batch_path": path, "dtype": "float64"}
    lora = {"lora": text, "lora_seed": 5, "lora_init_b_std": INIT_B_STD}
    runs = {
        "sync": {"schedule": "sync"},
        "stream": {"schedule": "stream", "seed": 1},
        "packs": {"schedule": "stream", "seed": 2, "pack_tokens": 64},
        "group": {"schedule": "stream", "seed": 3, "release": "group"},
    }
    grads = {}
    for name, options in runs.items():
        summary = replay(out_dir=tmp_path / name, **common, **lora, **options)
        assert summary["lora"] == {
            "r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"], "seed": 5,
            "init_b_std": INIT_B_STD,
        }  # fmt: skip
        grads[name] = load_file(str(tmp_path / name / "gradient.safetensors"))
    model = load_model(micro_model_dir, dtype=torch.float64)
    apply_lora(model, parse_lora(text), seed=5, init_b_std=INIT_B_STD)
    ref = {saved_key(n): g for n, g in reference_grad_j(model, grpo_batch).items()}
    assert set(grads["sync"]) == set(adapter_state_dict(model))  # adapter tensors only
    for grad in grads.values():
        assert_close_by_part(ref, grad, 1e-10)


def test_replay_opd_with_lora_streams_exactly(micro_model_dir, opd_batch, tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(trajectory_to_json(t) + "\n" for t in opd_batch))
    common = {"model_dir": micro_model_dir, "batch_path": path, "objective": "opd"}
    lora = {"lora": "r=2,alpha=4,targets=v_proj+up_proj", "lora_init_b_std": INIT_B_STD}
    for schedule in ("sync", "stream"):
        replay(out_dir=tmp_path / schedule, schedule=schedule, dtype="float64", **common, **lora)
    sync, stream = (
        load_file(str(tmp_path / s / "gradient.safetensors")) for s in ("sync", "stream")
    )
    assert_close_by_part(sync, stream, 1e-10)
    assert all(k.startswith("base_model.model.") for k in sync)
