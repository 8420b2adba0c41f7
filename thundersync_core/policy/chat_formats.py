"""Tiny random chat checkpoints in the formats of real model families, built offline.

A checkpoint folder from the hub carries more than weights: a chat template, special and
stop tokens, a thinking switch, native tool calls, a list of end-of-turn ids in
``generation_config.json``. To test that the pipeline takes any such folder, this module
builds small random ones in the layout of each family, with no download:

- ``qwen3``: ChatML turns, ``<think>`` reasoning, ``<tool_call>`` JSON calls, tool results
  as ``<tool_response>`` blocks in a user turn, ``Qwen3ForCausalLM`` with tied embeddings.
- ``llama3``: header-delimited turns after ``<|begin_of_text|>``, tools in an
  ``Environment: ipython`` system message, calls as a bare ``{"name", "parameters"}`` JSON
  reply, results under the ``ipython`` role, ``LlamaForCausalLM`` with untied embeddings.

Each format's byte-level BPE is trained on a deterministic synthetic corpus of agent
sessions rendered by that format's own template, so control strings, fenced bash blocks,
tool-call JSON and shell output tokenize compactly; being byte-level, any string
round-trips.

Simplifications, and why:

- The templates are written here and reproduce each family's layout, not its prose: the
  tool instructions are short and worded for this project. Nothing else (dates, builtin
  tools, multimodal parts beyond text) is rendered; the tests need the control structure.
- Message content is never trimmed, so a re-rendered history keeps the exact text the model
  produced.
- ``qwen3``: every assistant turn after the last real user query renders its think block,
  an empty one (``<think>\\n\\n</think>\\n\\n``) when it has no reasoning, which is what the
  ``enable_thinking=False`` generation prompt put before the reply: an agent turn re-renders
  as a prefix of the next prompt.
- ``llama3``: the tokenizer adds ``<|begin_of_text|>`` to plain ``encode`` calls like the
  real one; ``apply_chat_template`` tokenizes without special tokens, so a rendered chat
  holds it once.
- Model width, depth and heads come from a preset in ``presets.py`` (head_dim 64: vLLM's
  CPU attention needs >= 32); the vocabulary is the tokenizer's, rounded up to a multiple of
  64 as real checkpoints pad it.

Add a format by writing its template, adding a ``ChatFormat`` entry to ``_FORMATS`` and a
name to ``ChatFormatName`` and ``FORMATS``; ``_conversation`` supplies the corpus, rendered
by the new template.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils.chat_template_utils import render_jinja_template

from thundersync_core.policy.presets import PRESETS, ModelPreset

__all__ = [
    "BASH_TOOL",
    "FORMATS",
    "SUBMIT_TOOL",
    "ChatFormat",
    "ChatFormatName",
    "build_chat_checkpoint",
    "build_chat_tokenizer",
    "chat_format",
]

ChatFormatName = Literal["qwen3", "llama3"]
FORMATS: tuple[str, ...] = ("qwen3", "llama3")

#: Real checkpoints pad the embedding to a multiple of this (tensor cores, sharding).
VOCAB_MULTIPLE = 64

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in the task's sandbox and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
        },
    },
}
SUBMIT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "End the episode: the task is done.",
        "parameters": {"type": "object", "properties": {}},
    },
}

# Shared by both templates: a message's text, whether its content is a string, None, a list
# of {"type": "text", "text": ...} parts, or a JSON value (rendered as JSON).
_TEXT_MACRO = r"""
{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is none or content is undefined -%}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content | tojson -}}
    {%- endif -%}
{%- endmacro -%}
"""

# A tool call as a JSON object: {"name": ..., "<key>": <arguments>}; arguments given as a
# JSON string are inserted as they are.
_CALL_MACRO = r"""
{%- macro call_json(call, key) -%}
    {%- set f = call.function if call.function is defined else call -%}
    {{- '{"name": ' + f.name | tojson + ', "' + key + '": ' -}}
    {%- if f.arguments is string -%}
        {{- f.arguments -}}
    {%- else -%}
        {{- f.arguments | tojson -}}
    {%- endif -%}
    {{- '}' -}}
{%- endmacro -%}
"""

# Layout (every newline shown):
#   [tools]   <|im_start|>system\n{system}\n\n# Tools\n\n...<tools>\n{tool json}\n...
#             </tools>\n\n...</tool_call><|im_end|>\n        ({system}\n\n only if given)
#   message   <|im_start|>{role}\n{content}<|im_end|>\n
#   assistant <|im_start|>assistant\n[<think>\n{reasoning}\n</think>\n\n]{content}
#             [\n]<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>...<|im_end|>\n
#             (think block only after the last real user query; "\n" before a call unless
#             it is the first call and the content is empty)
#   tools     <|im_start|>user(\n<tool_response>\n{content}\n</tool_response>)+<|im_end|>\n
#   prompt    <|im_start|>assistant\n[<think>\n\n</think>\n\n when enable_thinking=False]
_QWEN3_TEMPLATE = (
    _TEXT_MACRO
    + _CALL_MACRO
    + r"""
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}
        {%- set c = text(m.content) -%}
        {%- if not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) -%}
            {%- set ns.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- text(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call functions to help with the request. '
        + 'Their signatures, one JSON object per line:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + tool | tojson -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, reply with a JSON object inside '
        + '<tool_call></tool_call> tags:\n<tool_call>\n'
        + '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- set content = text(m.content) -%}
    {%- if loop.first and m.role == 'system' and tools -%}
    {%- elif m.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query -%}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {%- set content = content.lstrip('\n') -%}
        {{- content -}}
        {%- for call in m.tool_calls or [] -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n' + call_json(call, 'arguments') + '\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""
).strip()

# Layout (every newline shown):
#   start     <|begin_of_text|>
#   [tools]   <|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n
#             {system}\n\nYou can call ... its value}.(\n\n{tool json})+<|eot_id|>
#             ({system}\n\n only if given)
#   message   <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>
#             (role "tool" is written "ipython")
#   assistant ...\n\n{content}[\n]{"name": ..., "parameters": ...}...<|eot_id|>
#             ("\n" before a call unless it is the first call and the content is empty)
#   prompt    <|start_header_id|>assistant<|end_header_id|>\n\n
_LLAMA3_TEMPLATE = (
    _TEXT_MACRO
    + _CALL_MACRO
    + r"""
{{- '<|begin_of_text|>' -}}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n' -}}
    {%- if has_system -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
    {{- 'You can call the functions below. To call one, reply with only a JSON object of the '
        + 'form {"name": function name, "parameters": dictionary of argument name and its '
        + 'value}.' -}}
    {%- for tool in tools -%}{{- '\n\n' + tool | tojson -}}{%- endfor -%}
    {{- '<|eot_id|>' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- if not (loop.first and has_system and tools) -%}
        {%- set content = text(m.content) -%}
        {%- set role = 'ipython' if m.role == 'tool' else m.role -%}
        {{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + content -}}
        {%- for call in m.tool_calls or [] -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- call_json(call, 'parameters') -}}
        {%- endfor -%}
        {{- '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""
).strip()


@dataclass(frozen=True)
class ChatFormat:
    """A family's control tokens, template and architecture.

    ``special`` tokens are dropped by ``decode(skip_special_tokens=True)``; ``added`` tokens
    are single ids too but survive it (markup the model writes inside a reply). ``eos`` is
    the assistant's end of turn; ``stop`` lists the tokens ``generation_config.json`` names
    as end of generation. ``thinking``: the corpus carries reasoning.
    """

    name: str
    special: tuple[str, ...]
    added: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    stop: tuple[str, ...]
    chat_template: str
    thinking: bool
    config_class: type[Qwen3Config] | type[LlamaConfig]
    model_class: type[Qwen3ForCausalLM] | type[LlamaForCausalLM]
    #: config.json fields beside the preset's shape, as the family sets them.
    architecture: Mapping[str, Any]
    #: config.json's eos_token_id: the end-of-turn token alone, or every stop token.
    config_eos: Literal["eos", "stop"]


_FORMATS: dict[str, ChatFormat] = {
    "qwen3": ChatFormat(
        name="qwen3",
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=(
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stop=("<|im_end|>", "<|endoftext|>"),
        chat_template=_QWEN3_TEMPLATE,
        thinking=True,
        config_class=Qwen3Config,
        model_class=Qwen3ForCausalLM,
        architecture={
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "rms_norm_eps": 1e-6,
        },
        config_eos="eos",
    ),
    "llama3": ChatFormat(
        name="llama3",
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),
        added=(),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        stop=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        chat_template=_LLAMA3_TEMPLATE,
        thinking=False,
        config_class=LlamaConfig,
        model_class=LlamaForCausalLM,
        architecture={
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
            "rms_norm_eps": 1e-5,
        },
        config_eos="stop",
    ),
}


def chat_format(fmt: str) -> ChatFormat:
    if fmt not in _FORMATS:
        raise KeyError(f"unknown chat format {fmt!r}; known: {list(FORMATS)}")
    return _FORMATS[fmt]


# The synthetic corpus: agent sessions over a shell, in both action styles the project
# meets (fenced bash blocks answered in a user turn, and native tool calls).
_SYSTEM_PROMPTS = (
    "You are an agent working in a Linux shell. Reply with one command in a fenced block.",
    "You are a careful software engineer. Solve the task in the repository, then submit.",
    "You are a helpful assistant.",
)
_TASK_WORDS = (
    "fix the failing test in the repository",
    "write a script that counts the lines in every file",
    "find the bug in the parser and make the tests pass",
    "create a file named out.txt that contains hello",
    "print the total of the numbers in data.csv",
    "sort the words in input.txt and remove duplicates",
    "the function returns the wrong value for empty lists",
    "make the build succeed",
    "rename the module and update its imports",
)
_COMMANDS = (
    "ls -la",
    "cat README.md",
    "grep -rn TODO src",
    "python -m pytest -q",
    "pip install -e .",
    "git diff",
    "git status",
    "sed -n '1,40p' main.py",
    "echo hello > out.txt",
    "wc -l *.py",
    "find . -name '*.py'",
    "head -n 20 data.csv",
    "mkdir -p build && cd build && make",
    "sort input.txt | uniq > sorted.txt",
    "python solve.py",
    "cat out.txt",
)
_OUTPUTS = (
    "",
    "hello",
    "README.md\nmain.py\nsrc\ntests",
    "3 passed in 0.02s",
    "1 failed, 2 passed in 0.05s",
    "Traceback (most recent call last):\n"
    '  File "main.py", line 12, in <module>\n'
    "    print(total(values))\n"
    "ValueError: invalid literal for int() with base 10: ''",
    "stderr:\nbash: line 1: missing: command not found",
    " 42 main.py\n 17 util.py\n 59 total",
    "On branch main\nnothing to commit, working tree clean",
    "src/parser.py:31:    # TODO: handle empty input",
)
_FILES = ("main.py", "util.py", "parser.py", "data.csv", "input.txt", "out.txt", "test_main.py")
_CODE = (
    "def total(values):\n    return sum(int(v) for v in values if v)\n",
    "import sys\n\nfor line in open(sys.argv[1]):\n    print(line.strip())\n",
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n",
    "def test_total():\n    assert total([1, 2, 3]) == 6\n",
    'if __name__ == "__main__":\n    main()\n',
)
_THOUGHTS = (
    "The task asks me to {task}. I should look at the files first.",
    "The output shows what went wrong. Next I will run `{command}`.",
    "That worked, so the task is done and I can submit.",
    "Let me check the result with `{command}` before submitting.",
)


def _command(rng: random.Random) -> str:
    command = rng.choice(_COMMANDS)
    if rng.random() < 0.4:
        command = f"{rng.choice(('cat', 'python', 'wc -l', 'head -n 5'))} {rng.choice(_FILES)}"
    return command


def _observation(rng: random.Random) -> str:
    code = rng.choice((0, 0, 0, 1, 2, 127))
    output = rng.choice((*_OUTPUTS, *_CODE, str(rng.randint(0, 10_000))))
    return f"exit code: {code}" + (f"\n{output}" if output else "")


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _conversation(rng: random.Random, thinking: bool) -> tuple[list[dict[str, Any]], bool]:
    """One agent session as chat messages, and whether it uses native tool calls."""
    tool_style = rng.random() < 0.5
    task = rng.choice(_TASK_WORDS)
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.8:
        messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": f"{task.capitalize()}."})
    for step in range(rng.randint(1, 4)):
        command = _command(rng)
        last = step == 3 or rng.random() < 0.25
        reply: dict[str, Any] = {"role": "assistant"}
        if thinking and rng.random() < 0.6:
            thought = rng.choice(_THOUGHTS).format(task=task, command=command)
            reply["reasoning_content"] = thought
        if tool_style:
            reply["content"] = rng.choice(("", "", f"I will run `{command}`."))
            reply["tool_calls"] = [
                _call("submit", {}) if last else _call("bash", {"command": command})
            ]
        else:
            reply["content"] = f"```bash\n{'submit' if last else command}\n```"
        messages.append(reply)
        if last:
            break
        role = "tool" if tool_style else "user"
        messages.append({"role": role, "content": _observation(rng)})
    return messages, tool_style


def _corpus(fmt: ChatFormat, n_sessions: int, seed: int) -> list[str]:
    """Text pieces between control tokens of ``n_sessions`` rendered sessions.

    Control tokens are cut out so that BPE spends no merges on strings that always
    encode as one id.
    """
    rng = random.Random(seed)
    sessions = [_conversation(rng, fmt.thinking) for _ in range(n_sessions)]
    pieces: list[str] = []
    for with_tools in (False, True):
        chats = [messages for messages, tool_style in sessions if tool_style == with_tools]
        # Annotated as returning str; it returns (texts, generation indices).
        output: Any = render_jinja_template(
            conversations=chats,
            tools=[BASH_TOOL, SUBMIT_TOOL] if with_tools else None,
            chat_template=fmt.chat_template,
        )
        rendered, _ = output
        pieces.extend(rendered)
    control = re.compile("|".join(re.escape(t) for t in fmt.special + fmt.added))
    return [piece for text in pieces for piece in control.split(text) if piece]


def build_chat_tokenizer(
    fmt: ChatFormatName, *, vocab_size: int = 2048, seed: int = 0
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ``fmt``'s control tokens and chat template.

    ``vocab_size`` bounds ``len(tokenizer)``, control tokens included. Deterministic in
    ``seed`` (which also picks the corpus).
    """
    spec = chat_format(fmt)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(spec.added),
        special_tokens=list(spec.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec, n_sessions=600, seed=seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    named = {spec.eos, spec.pad} | ({spec.bos} if spec.bos else set())
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        additional_special_tokens=[t for t in spec.special if t not in named],
        # Only a family with a BOS token prepends it to plain encodes, as the real ones do.
        add_bos_token=spec.bos is not None,
        chat_template=spec.chat_template,
        model_max_length=max(p.max_position_embeddings for p in PRESETS.values()),
    )


def _token_ids(tokenizer: PreTrainedTokenizerFast, tokens: tuple[str, ...]) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"control tokens {tokens} map to {ids}: not all in the vocabulary")
    return [int(i) for i in ids]  # type: ignore[arg-type]


def _model_config(
    spec: ChatFormat, preset: ModelPreset, tokenizer: PreTrainedTokenizerFast
) -> PretrainedConfig:
    shape = asdict(preset)
    shape["vocab_size"] = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    stop_ids = _token_ids(tokenizer, spec.stop)
    return spec.config_class(
        **shape,
        **spec.architecture,
        attention_dropout=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id if spec.config_eos == "eos" else stop_ids,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_chat_checkpoint(
    directory: Path,
    fmt: ChatFormatName,
    *,
    preset: str = "micro",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a random ``fmt`` chat model in Hugging Face format into ``directory``.

    The folder holds config.json, model.safetensors, the tokenizer files (the template in
    chat_template.jinja) and generation_config.json with the format's stop ids. The
    tokenizer's vocabulary is bounded by the preset's ``vocab_size``. Deterministic in
    ``seed``.
    """
    spec = chat_format(fmt)
    if preset not in PRESETS:
        raise KeyError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    shape = PRESETS[preset]
    tokenizer = build_chat_tokenizer(fmt, vocab_size=shape.vocab_size, seed=seed)
    config = _model_config(spec, shape, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.model_class(config)
    # transformers wraps .to() in a decorator that mypy cannot see through.
    model.to(dtype)  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=_token_ids(tokenizer, spec.stop),
        pad_token_id=tokenizer.pad_token_id,
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
