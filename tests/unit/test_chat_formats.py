"""Tiny chat checkpoints in real families' formats: folder, tokens, templates, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from thundersync_core.policy.chat_formats import (
    BASH_TOOL,
    FORMATS,
    SUBMIT_TOOL,
    ChatFormatName,
    build_chat_checkpoint,
    build_chat_tokenizer,
    chat_format,
)
from thundersync_core.policy.io import load_model
from thundersync_core.policy.norm import WideRMSNorm

TOOLS = [BASH_TOOL, SUBMIT_TOOL]
TOOL_LINES = [json.dumps(tool) for tool in TOOLS]

CONVERSATION = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "List the files."},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Look first.",
        "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
        ],
    },
    {"role": "tool", "content": "exit code: 0\na.txt"},
    # Arguments as a JSON string, as OpenAI-style clients send them.
    {
        "role": "assistant",
        "content": "Done.",
        "tool_calls": [{"type": "function", "function": {"name": "submit", "arguments": "{}"}}],
    },
]

QWEN3_EXPECTED = (
    "<|im_start|>system\nYou are an agent.\n\n# Tools\n\n"
    "You may call functions to help with the request. "
    "Their signatures, one JSON object per line:\n"
    f"<tools>\n{TOOL_LINES[0]}\n{TOOL_LINES[1]}\n</tools>\n\n"
    "To call a function, reply with a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\nList the files.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nLook first.\n</think>\n\n"
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nexit code: 0\na.txt\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\nDone.\n"
    '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>\n'
)

LLAMA3_EXPECTED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\n\nYou are an agent.\n\n"
    "You can call the functions below. To call one, reply with only a JSON object of the "
    'form {"name": function name, "parameters": dictionary of argument name and its value}.'
    f"\n\n{TOOL_LINES[0]}\n\n{TOOL_LINES[1]}<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nList the files.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "bash", "parameters": {"command": "ls"}}<|eot_id|>'
    "<|start_header_id|>ipython<|end_header_id|>\n\nexit code: 0\na.txt<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    'Done.\n{"name": "submit", "parameters": {}}<|eot_id|>'
)

STOP_TOKENS = {
    "qwen3": ["<|im_end|>", "<|endoftext|>"],
    "llama3": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
}


@pytest.fixture(scope="module", params=FORMATS)
def fmt(request: pytest.FixtureRequest) -> ChatFormatName:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(fmt: ChatFormatName, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_checkpoint(tmp_path_factory.mktemp(f"chat-{fmt}"), fmt, seed=1)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path):
    return AutoTokenizer.from_pretrained(checkpoint)


def test_folder_loads_and_a_forward_gives_logits_over_the_model_vocab(fmt, checkpoint, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    expected_class = {"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}[fmt]
    assert type(model).__name__ == expected_class
    config = model.config
    assert config.head_dim == 64
    assert config.vocab_size >= len(tokenizer)
    assert config.vocab_size % 64 == 0
    assert model.dtype == torch.float32
    assert config.tie_word_embeddings == (fmt == "qwen3")
    ids = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=ids["input_ids"]).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()
    # The project's loader takes the folder too, and installs its wide norm.
    assert isinstance(load_model(checkpoint).model.norm, WideRMSNorm)


def test_every_control_token_is_one_id_and_round_trips(fmt, tokenizer):
    spec = chat_format(fmt)
    for token in spec.special + spec.added:
        ids = tokenizer.encode(f"a{token}b", add_special_tokens=False)
        assert len(ids) == 3, (token, ids)
        assert tokenizer.decode(ids) == f"a{token}b"
        # Markup the model writes inside a reply survives skipping special tokens.
        kept = tokenizer.decode(ids, skip_special_tokens=True)
        assert kept == (f"a{token}b" if token in spec.added else "ab"), token
    text = "grep -rn 'naïve' src/ | wc -l  # ünïcödé ✓\n\texit code: 0"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_generation_config_lists_the_stop_ids(fmt, checkpoint, tokenizer):
    generation = GenerationConfig.from_pretrained(checkpoint)
    stop = STOP_TOKENS[fmt]
    assert generation.eos_token_id == [tokenizer.convert_tokens_to_ids(t) for t in stop]
    assert tokenizer.eos_token in stop
    assert generation.pad_token_id == tokenizer.pad_token_id
    assert generation.bos_token_id == tokenizer.bos_token_id


def test_tool_conversation_renders_the_family_layout(fmt, tokenizer):
    expected = {"qwen3": QWEN3_EXPECTED, "llama3": LLAMA3_EXPECTED}[fmt]
    assert tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False) == expected


def test_an_agent_turn_re_renders_as_a_prefix_of_the_next_prompt(checkpoint, tokenizer):
    """What the model saw plus what it wrote is where the next prompt starts."""
    end = tokenizer.eos_token
    history = CONVERSATION[:2]
    prompt = tokenizer.apply_chat_template(
        history, tools=TOOLS, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    reply = "```bash\nls\n```"
    after = [
        *history,
        {"role": "assistant", "content": reply},
        {"role": "tool", "content": "exit code: 0"},
    ]
    rendered = tokenizer.apply_chat_template(after, tools=TOOLS, tokenize=False)
    assert rendered.startswith(prompt + reply + end)


def test_common_agent_text_tokenizes_compactly(tokenizer):
    for text in ("exit code: 0\n", "```bash\npython -m pytest -q\n```", '{"command": "ls -la"}'):
        assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) / 2, text


def test_qwen3_thinking_switch_and_reasoning_of_earlier_turns():
    tok = build_chat_tokenizer("qwen3", vocab_size=1024)
    user = [{"role": "user", "content": "Hi"}]
    head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    render = tok.apply_chat_template
    assert render(user, add_generation_prompt=True, tokenize=False) == head
    on = render(user, add_generation_prompt=True, enable_thinking=True, tokenize=False)
    assert on == head
    off = render(user, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert off == head + "<think>\n\n</think>\n\n"

    # Reasoning inline in the content is the same as the reasoning_content field.
    thought = {"role": "assistant", "content": "<think>\nPlan.\n</think>\n\nHello"}
    kept = "<|im_start|>assistant\n<think>\nPlan.\n</think>\n\nHello<|im_end|>\n"
    dropped = "<|im_start|>assistant\nHello<|im_end|>\n"
    # Only tool responses follow (a tool message, or a user turn holding one): kept.
    for follow_up in (
        {"role": "tool", "content": "ok"},
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
    ):
        assert kept in render([*user, thought, follow_up], tokenize=False)
    # A later real user query drops it.
    later = render([*user, thought, {"role": "user", "content": "More"}], tokenize=False)
    assert dropped in later
    assert "Plan." not in later
    field = {"role": "assistant", "content": "Hello", "reasoning_content": "\nPlan.\n"}
    assert render([*user, field], tokenize=False) == render([*user, thought], tokenize=False)


def test_llama3_chat_ids_hold_one_begin_of_text():
    tok = build_chat_tokenizer("llama3", vocab_size=1024)
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert ids["input_ids"].count(bos) == 1
    assert ids["input_ids"][0] == bos
    # Plain encodes prepend it, as the real family's tokenizer does.
    assert tok.encode("ls")[0] == bos
    assert bos not in tok.encode("ls", add_special_tokens=False)
    # No thinking switch in this family: the prompt ignores it.
    user = [{"role": "user", "content": "Hi"}]
    prompts = {
        tok.apply_chat_template(user, add_generation_prompt=True, enable_thinking=e, tokenize=False)
        for e in (True, False)
    }
    assert prompts == {
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_building_twice_with_one_seed_gives_the_same_folder(fmt, tmp_path):
    first = build_chat_checkpoint(tmp_path / "a", fmt, seed=3)
    second = build_chat_checkpoint(tmp_path / "b", fmt, seed=3)
    other = build_chat_checkpoint(tmp_path / "c", fmt, seed=4)
    for name in ("tokenizer.json", "chat_template.jinja", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    weights = [load_file(d / "model.safetensors") for d in (first, second, other)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # The seed reaches the weights (and the corpus), so the equality above is not vacuous.
    embed = "model.embed_tokens.weight"
    assert not torch.equal(weights[0][embed], weights[2][embed])


def test_unknown_format_is_refused():
    with pytest.raises(KeyError, match="unknown chat format 'mistral'"):
        build_chat_tokenizer("mistral")  # type: ignore[arg-type]
