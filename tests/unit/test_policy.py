"""Presets, tokenizer, HF-format save/load, the wide norm and scored log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from thundersync_core.policy import (
    PRESETS,
    build_model,
    build_tokenizer,
    load_model,
    load_tokenizer,
    parameter_count,
    scored_logprobs,
)
from thundersync_core.policy.norm import WideRMSNorm


def test_presets_have_head_dim_64_and_a_few_million_parameters():
    assert all(p.head_dim == 64 for p in PRESETS.values())
    assert 2e6 < parameter_count(build_model("tiny")) < 8e6
    with pytest.raises(KeyError, match="unknown model preset 'huge'"):
        build_model("huge")


def test_tokenizer_round_trips_any_text_and_has_a_chat_template():
    tok = build_tokenizer(vocab_size=1024)
    text = "grep -rn 'naïve' src/ | wc -l  # ünïcödé ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "List files"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nList files<|im_end|>\n<|im_start|>assistant\n"
    assert len(tok) <= 1024
    # Merges were learned: common shell text costs far fewer tokens than bytes.
    assert len(tok("python -m pytest -q")["input_ids"]) < len("python -m pytest -q") / 2


def test_save_and_from_pretrained_round_trip(micro_model_dir):
    model = load_model(micro_model_dir)
    again = build_model("micro", seed=7)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    torch.testing.assert_close(model(input_ids=ids).logits, again(input_ids=ids).logits)
    assert isinstance(model.model.norm, WideRMSNorm)
    tok = load_tokenizer(micro_model_dir)
    assert tok.decode(tok("ls -la")["input_ids"]) == "ls -la"


def test_wide_norm_equals_stock_norm_in_fp32_and_stays_fp64():
    stock = Qwen3RMSNorm(64)
    torch.nn.init.normal_(stock.weight)
    wide = WideRMSNorm(stock.weight, stock.variance_epsilon)
    x = torch.randn(3, 64)
    assert torch.equal(stock(x), wide(x))
    x64 = torch.randn(3, 64, dtype=torch.float64)
    w64 = WideRMSNorm(torch.nn.Parameter(stock.weight.double()), 1e-6)
    expected = w64.weight * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(w64(x64), expected, rtol=1e-15, atol=0)


def test_scored_logprobs_equal_full_vocabulary_log_softmax(micro64):
    ids = torch.tensor([[4, 8, 15, 16, 23, 42], [1, 2, 3, 4, 5, 6]])
    scored = torch.tensor([[0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    logp, rows = scored_logprobs(micro64, ids, scored)
    full = torch.log_softmax(micro64(input_ids=ids).logits, -1)
    expected = [full[b, t - 1, ids[b, t]] for b in range(2) for t in range(6) if scored[b, t]]
    torch.testing.assert_close(logp, torch.stack(expected), rtol=1e-12, atol=0)
    assert rows.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="first token"):
        scored_logprobs(micro64, ids, torch.ones_like(scored))
