"""The conversation format read off a checkpoint's chat template (``rollout/chat.py``).

The start-up check must pass on the real families' formats where the agent's sequence is
what the template renders, and refuse (naming the first differing token) where it is not:
a template that rewrites history, a broken template, stop tokens that do not end the
template's assistant turn. Action parsing is a reward path: a command inside the reasoning
must never run, and a malformed tool call is an observation, never a crash.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from thundersync_core.policy.chat_formats import build_chat_checkpoint
from thundersync_core.policy.io import load_tokenizer
from thundersync_core.policy.tokenizer import build_tokenizer
from thundersync_core.rollout.chat import (
    NO_BLOCK,
    NO_TOOL_CALL,
    UNFINISHED_THINKING,
    Action,
    ChatFormat,
    TemplateMismatch,
    checkpoint_stop_ids,
    parse_tool_call,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {fmt: build_chat_checkpoint(root / fmt, fmt) for fmt in ("qwen3", "llama3")}


def test_the_default_format_glue_is_chatml_as_before():
    tokenizer = build_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = ChatFormat(tokenizer, stop_token_ids=(end,))
    chat.check()
    body = tokenizer.encode("exit code: 0", add_special_tokens=False)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    closing = encode("<|im_end|>\n<|im_start|>assistant\n")
    assert chat.observation_ids(body, after=[5, end]) == [
        *encode("\n<|im_start|>user\n"),
        *body,
        *closing,
    ]
    # A reply cut by its token budget gets the end of its message from the glue.
    assert chat.observation_ids(body, after=[5, 6]) == [
        *encode("<|im_end|>\n<|im_start|>user\n"),
        *body,
        *closing,
    ]


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("qwen3", {"action_format": "tool_calls", "enable_thinking": True}),
        ("qwen3", {"action_format": "tool_calls", "enable_thinking": False}),
        ("llama3", {"action_format": "tool_calls"}),
        ("llama3", {"action_format": "bash_block"}),
    ],
)
def test_the_check_passes_on_the_real_formats(folders, fmt, options):
    tokenizer = load_tokenizer(folders[fmt])
    chat = ChatFormat.for_checkpoint(tokenizer, folders[fmt], **options)
    assert chat.stop_token_ids == tuple(
        json.loads((folders[fmt] / "generation_config.json").read_text())["eos_token_id"]
    )
    assert chat.tool_call_format == ("hermes" if fmt == "qwen3" else "json")


def test_qwen3_with_user_observations_is_refused_as_its_template_drops_reasoning(folders):
    """Observations as user messages make every earlier reply precede the "last query":
    Qwen's template then drops their reasoning, which the agent kept."""
    tokenizer = load_tokenizer(folders["qwen3"])
    with pytest.raises(TemplateMismatch, match=r"differ at token \d+: agent '<think>"):
        ChatFormat.for_checkpoint(
            tokenizer, folders["qwen3"], action_format="bash_block", enable_thinking=True
        )


def test_a_broken_template_is_refused_naming_the_position(folders, tmp_path):
    """A template that rewrites what it renders (newlines of every message folded into
    spaces): the observations the agent appended are not what the model would see."""
    broken = tmp_path / "broken"
    shutil.copytree(folders["llama3"], broken)
    template = broken / "chat_template.jinja"
    text = template.read_text()
    line = "{%- set content = text(m.content) -%}"
    assert line in text
    template.write_text(
        text.replace(line, "{%- set content = text(m.content) | replace('\\n', ' ') -%}")
    )
    tokenizer = load_tokenizer(broken)
    with pytest.raises(TemplateMismatch, match=r"differ at token (\d+)") as refused:
        ChatFormat.for_checkpoint(tokenizer, broken, action_format="tool_calls")
    message = str(refused.value)
    at = int(message.split("differ at token ")[1].split(":", maxsplit=1)[0])
    assert at > 0
    assert "agent '\\nnotes.txt" in message
    assert "template ' notes.txt" in message


def test_stop_tokens_that_do_not_end_the_assistant_turn_are_refused(folders, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(folders["qwen3"], other)
    config = json.loads((other / "generation_config.json").read_text())
    config["eos_token_id"] = [0]  # <|endoftext|> alone: the template ends turns with <|im_end|>
    (other / "generation_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(other)
    assert checkpoint_stop_ids(tokenizer, other) == (0,)
    with pytest.raises(TemplateMismatch, match="none of the checkpoint's stop tokens"):
        ChatFormat.for_checkpoint(tokenizer, other, action_format="tool_calls")


def test_thinking_needs_a_thinking_template(folders):
    with pytest.raises(ValueError, match="no </think> token"):
        ChatFormat.for_checkpoint(
            load_tokenizer(folders["llama3"]), folders["llama3"], enable_thinking=True
        )


def test_a_command_inside_the_reasoning_never_runs(folders):
    """The forgery: a bash block or tool call written while thinking, never closed."""
    tokenizer = load_tokenizer(folders["qwen3"])
    chat = ChatFormat.for_checkpoint(
        tokenizer, folders["qwen3"], action_format="tool_calls", enable_thinking=True
    )

    def parse(text: str) -> Action:
        return chat.parse(tokenizer.encode(text, add_special_tokens=False))

    call = chat.action_text("echo hello > hello.txt")
    assert parse(f"<think>\n{call}\n") == Action(error=UNFINISHED_THINKING)
    assert parse(f"<think>\n{call}\n</think>\n\nno call") == Action(error=NO_TOOL_CALL)
    assert parse(f"<think>\nplan\n</think>\n\n{call}") == Action("echo hello > hello.txt")
    bash = ChatFormat.for_checkpoint(
        tokenizer, folders["qwen3"], action_format="bash_block", check=False,
        enable_thinking=True,
    )  # fmt: skip
    block = "```bash\nrm -rf /app\n```"
    ids = tokenizer.encode(f"<think>\n{block}\n</think>\n\ndone", add_special_tokens=False)
    assert bash.parse(ids) == Action(error=NO_BLOCK)


@pytest.mark.parametrize(
    ("text", "fmt", "expected"),
    [
        ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
         "hermes", Action("ls")),
        ('<tool_call>{"name": "submit", "arguments": {}}</tool_call>', "hermes",
         Action(submit=True)),
        ('<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>',
         "hermes", Action("ls")),
        ('{"name": "bash", "parameters": {"command": "ls"}}', "json", Action("ls")),
        ('{"name": "submit", "parameters": {}}', "json", Action(submit=True)),
    ],
)  # fmt: skip
def test_well_formed_calls_parse(text, fmt, expected):
    assert parse_tool_call(text, fmt) == expected


@pytest.mark.parametrize(
    ("text", "fmt", "says"),
    [
        ("just words", "hermes", "No tool call found"),
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}', "hermes",
         "not closed"),
        ('<tool_call>{"name": "bash"</tool_call>', "hermes", "not valid JSON"),
        ('<tool_call>{"name": "bash", "arguments": {"command": "a"}}</tool_call>'
         '<tool_call>{"name": "submit", "arguments": {}}</tool_call>', "hermes",
         "2 tool calls"),
        ('<tool_call>{"name": "python", "arguments": {}}</tool_call>', "hermes",
         "unknown tool"),
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls", "cwd": "/"}}</tool_call>',
         "hermes", "one argument"),
        ('<tool_call>{"name": "bash", "arguments": {"command": ""}}</tool_call>', "hermes",
         "non-empty"),
        ('<tool_call>{"name": "submit", "arguments": {"done": true}}</tool_call>', "hermes",
         "no arguments"),
        ('<tool_call>{"name": "bash", "args": {"command": "ls"}}</tool_call>', "hermes",
         "unexpected keys"),
        ('<tool_call>["bash"]</tool_call>', "hermes", 'with a "name"'),
        ('{"name": "bash", "parameters": 3}', "json", "must be a JSON object"),
        ("", "json", "No tool call found"),
    ],
)  # fmt: skip
def test_malformed_calls_become_observations(text, fmt, says):
    action = parse_tool_call(text, fmt)
    assert action.command is None
    assert not action.submit
    assert action.error is not None
    assert says in action.error
