"""Growing a policy into a larger preset keeps its function, and the new parts train."""

from __future__ import annotations

import json

import pytest
import torch

from thundersync_core.config import TrainConfig
from thundersync_core.policy import build_model
from thundersync_core.policy.grow import check_growth, grow_into
from thundersync_core.policy.io import load_model
from thundersync_core.warmstart.cache import prepare_policies


def _without_eps(model: torch.nn.Module) -> torch.nn.Module:
    # The norms' epsilon is the one term growth does not carry over exactly (it is added
    # to a mean over more dimensions); without it the function is the same to rounding.
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.0
    return model


def _trained_looking(name: str, dtype: torch.dtype) -> torch.nn.Module:
    model = _without_eps(build_model(name, seed=1, dtype=dtype))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(3)
        for param_name, param in model.named_parameters():
            if "norm" in param_name:  # norms away from one, so their rescaling shows
                param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("large", ["small", "medium"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_grown_model_computes_what_the_small_one_did(large, dtype, tol):
    small = _trained_looking("tiny", dtype)
    grown = _without_eps(build_model(large, seed=2, dtype=dtype))
    before = {n: p.clone() for n, p in grown.named_parameters()}
    grow_into(small, grown)
    ids = torch.randint(
        0, small.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want, got = small(ids).logits, grown(ids).logits
    assert float((want - got).abs().max() / want.abs().max()) <= tol
    # It is the larger model: more parameters, and new layers that are the identity now.
    assert grown.config.num_hidden_layers > small.config.num_hidden_layers
    last = grown.config.num_hidden_layers - 1
    assert not grown.model.layers[last].mlp.down_proj.weight.any()
    # What reads only zeros keeps the larger preset's initialisation.
    q = f"model.layers.{last}.self_attn.q_proj.weight"
    assert torch.equal(dict(grown.named_parameters())[q], before[q])


def test_growth_in_width_alone_keeps_the_function():
    # The embedded policy: tiny's four layers, a wider residual stream, more heads and MLP.
    small = _trained_looking("tiny", torch.float64)
    grown = _without_eps(build_model("wide", seed=2, dtype=torch.float64))
    grow_into(small, grown)
    ids = torch.randint(
        0, small.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want, got = small(ids).logits, grown(ids).logits
    assert float((want - got).abs().max() / want.abs().max()) <= 1e-12
    assert grown.config.intermediate_size > small.config.intermediate_size
    new_neurons = grown.model.layers[0].mlp.down_proj.weight[:, small.config.intermediate_size :]
    assert not new_neurons.any()  # they write nothing yet


def test_the_new_parts_get_gradients():
    small = _trained_looking("tiny", torch.float64)
    grown = _without_eps(build_model("small", seed=2, dtype=torch.float64))
    grow_into(small, grown)
    ids = torch.randint(
        0, small.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1)
    )
    grown(ids, labels=ids).loss.backward()
    hidden, last = small.config.hidden_size, grown.config.num_hidden_layers - 1
    # Zero blocks that write the new residual dimensions, a new layer's output projection
    # and the new embedding columns all get a gradient at once.
    layer0 = grown.model.layers[0]
    assert layer0.self_attn.o_proj.weight.grad[hidden:].abs().sum() > 0
    assert layer0.mlp.down_proj.weight.grad[hidden:].abs().sum() > 0
    assert grown.model.layers[last].mlp.down_proj.weight.grad.abs().sum() > 0
    assert grown.model.embed_tokens.weight.grad[:, hidden:].abs().sum() > 0


def test_growth_that_cannot_keep_the_function_is_refused_naming_it():
    with pytest.raises(ValueError, match="vocab_size differs"):
        check_growth("micro", "tiny")
    with pytest.raises(ValueError, match="hidden_size would shrink"):
        check_growth("small", "tiny")
    with pytest.raises(ValueError, match=r"warm_start.preset 'giant'"):
        TrainConfig(policy={"preset": "small"}, warm_start={"preset": "giant"})


def test_a_warm_start_made_small_is_grown_once_and_kept(tmp_path):
    config = TrainConfig(
        policy={"preset": "small"},
        warm_start={"enabled": False, "preset": "tiny", "cache_dir": tmp_path / "cache"},
        tasks={"prep_dir": tmp_path / "prep"},
    )
    policy, teacher = prepare_policies(config, tmp_path / "run", [])
    assert teacher is None
    assert policy.name.endswith("-small")
    small = policy.with_name(policy.name.removesuffix("-small"))
    assert json.loads((small / "config.json").read_text())["hidden_size"] == 256
    assert json.loads((policy / "config.json").read_text())["hidden_size"] == 384
    assert json.loads((policy / "warmstart.json").read_text())["grown_to"] == "small"
    assert (policy / "tokenizer.json").is_file()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = load_model(small)(ids).logits.log_softmax(-1)
        got = load_model(policy)(ids).logits.log_softmax(-1)
    # The norms' epsilon against a random model's small activations: close, not exact.
    assert float((want - got).abs().max()) < 5e-2
    stamp = (policy / "model.safetensors").stat().st_mtime_ns
    again, _ = prepare_policies(config, tmp_path / "run2", [])
    assert again == policy
    assert (policy / "model.safetensors").stat().st_mtime_ns == stamp
