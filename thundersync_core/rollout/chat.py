"""A checkpoint's conversation format, as the agent speaks it, token by token.

The agent never re-renders a conversation: it keeps the prompt's ids, appends each action's
sampled ids as they are, and appends each observation as a segment of ids that holds the
chat template's glue (the end of the assistant message, the observation message's header,
the observation, its end, the next assistant header). ``ChatFormat`` derives that glue
from the checkpoint's own chat template, by rendering a conversation with stand-in texts
and reading what surrounds them, so any Hugging Face chat folder works: ChatML (Qwen),
Llama 3's header tokens, and whatever a template renders between turns.

What the model is trained on must be what it would see, so ``check`` renders one episode's
messages through the template as a whole and compares the ids with the agent's incremental
sequence; a difference (a template that rewrites history, e.g. drops earlier reasoning, or
a stop token that does not end the template's assistant message) is refused naming the
first differing position and both texts.

Two action formats: ``bash_block``, a fenced bash block in the reply (the observation comes
back as a user message), and ``tool_calls``, the checkpoint's own tool-call syntax for a
``bash`` and a ``submit`` tool offered through the template's ``tools`` argument
(``hermes``: ``<tool_call>{json}</tool_call>`` as Qwen writes it; ``json``: one JSON object
``{"name": ..., "parameters": ...}`` as Llama 3 writes it), observations as tool messages.
With a thinking template (``enable_thinking``), actions are parsed after ``</think>`` only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from thundersync_core.rollout.engine import SamplingConfig

ActionFormat = Literal["bash_block", "tool_calls"]
ToolCallFormat = Literal["auto", "hermes", "json"]

BASH_SYSTEM_PROMPT = (
    "You are an agent working in a Linux shell. Reply with one command in a fenced block:\n"
    "```bash\n<command>\n```\nWhen the task is done, reply with:\n```bash\nsubmit\n```"
)
TOOLS_SYSTEM_PROMPT = (
    "You are an agent working in a Linux shell. Run one command at a time with the bash "
    "tool. When the task is done, call the submit tool."
)
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run one shell command in the task's sandbox; returns its exit code, "
        "stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command."}},
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
TOOLS = (BASH_TOOL, SUBMIT_TOOL)

NO_BLOCK = "No command found: reply with one ```bash block, closing ``` on its own line."
NO_TOOL_CALL = "No tool call found: call the bash tool with a command, or the submit tool."
UNFINISHED_THINKING = "No action: the reasoning did not end (no </think>) within the turn."
_BLOCK = re.compile(r"```(?:bash|sh)?[ \t]*\n(.*?)\n```[ \t]*(?:\n|$)", re.DOTALL)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# Stand-ins for an action and an observation while reading the template's glue: plain
# letters, which no template rewrites.
_ACTION_MARK = "QXACTIONXQ"
_OBSERVATION_MARK = "QXOBSERVATIONXQ"


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...
    def encode(self, text: str, add_special_tokens: bool = ..., **kwargs: Any) -> list[int]: ...
    def decode(self, ids: Any, skip_special_tokens: bool = ...) -> str: ...
    def convert_tokens_to_ids(self, token: str) -> Any: ...


class TemplateMismatch(ValueError):
    """The chat template renders an episode otherwise than the agent builds it."""


@dataclass(frozen=True)
class Action:
    """What a reply asks for: a command to run, the end of the episode, or neither (then
    ``error`` is the observation that says what was wrong)."""

    command: str | None = None
    submit: bool = False
    error: str | None = None


def parse_action(text: str) -> str | None:
    """The first fenced bash block's body, or None when there is no well-formed block."""
    match = _BLOCK.search(text)
    return match.group(1) if match else None


def checkpoint_stop_ids(tokenizer: ChatTokenizer, model_dir: Path | None) -> tuple[int, ...]:
    """The ids that end a reply: ``eos_token_id`` of the checkpoint's generation_config.json
    (one id or a list), else the tokenizer's end-of-sequence token."""
    ids: list[int] = []
    config = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids = [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    if not ids:
        eos_id = getattr(tokenizer, "eos_token_id", None)
        if eos_id is None:
            raise ValueError(
                f"{model_dir}: no stop token: generation_config.json has no eos_token_id "
                "and the tokenizer no eos_token"
            )
        ids = [int(eos_id)]
    return tuple(dict.fromkeys(ids))


class ChatFormat:
    """Prompt, observation glue, stop tokens and action parsing of one chat template."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        stop_token_ids: Sequence[int],
        system_prompt: str | None = None,
        action_format: ActionFormat = "bash_block",
        tool_call_format: ToolCallFormat = "auto",
        enable_thinking: bool | None = None,
    ) -> None:
        if not stop_token_ids:
            raise ValueError("a chat format needs at least one stop token id")
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.action_format: ActionFormat = action_format
        self.enable_thinking = enable_thinking
        self.system_prompt = system_prompt or (
            BASH_SYSTEM_PROMPT if action_format == "bash_block" else TOOLS_SYSTEM_PROMPT
        )
        self.tools: tuple[dict[str, Any], ...] = TOOLS if action_format == "tool_calls" else ()
        self.observation_role = "tool" if action_format == "tool_calls" else "user"
        self.thinks = self._has_token("</think>")
        if enable_thinking and not self.thinks:
            raise ValueError(
                "rollout.enable_thinking: true, but the checkpoint's tokenizer has no "
                "</think> token: its template has no thinking mode"
            )
        self.tool_call_format = (
            self._detect_tool_call_format() if tool_call_format == "auto" else tool_call_format
        )
        self._stop_texts = {
            i: tokenizer.decode([i], skip_special_tokens=False) for i in self.stop_token_ids
        }
        self._after_action, self._after_observation = self._glue()

    @classmethod
    def for_checkpoint(
        cls,
        tokenizer: ChatTokenizer,
        model_dir: Path | None,
        *,
        check: bool = True,
        **options: Any,
    ) -> ChatFormat:
        """The format of a checkpoint folder: stop tokens from its generation config,
        ``options`` as the constructor takes them; with ``check`` the start-up check runs."""
        chat = cls(tokenizer, stop_token_ids=checkpoint_stop_ids(tokenizer, model_dir), **options)
        if check:
            chat.check()
        return chat

    # -- the template ----------------------------------------------------------------------
    def _has_token(self, token: str) -> bool:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        return len(ids) == 1

    def _detect_tool_call_format(self) -> Literal["hermes", "json"]:
        return "hermes" if self._has_token("<tool_call>") else "json"

    def _template_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.tools:
            kwargs["tools"] = list(self.tools)
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self._template_kwargs(),
        )
        return str(text)

    def _base_messages(self, instruction: str) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": instruction},
        ]

    def _glue(self) -> tuple[str, str]:
        """(text between an action and the observation's body, text after the body up to
        the next reply), read off the template around stand-ins."""
        messages = [
            *self._base_messages("task"),
            {"role": "assistant", "content": _ACTION_MARK},
            {"role": self.observation_role, "content": _OBSERVATION_MARK},
        ]
        if self.observation_role == "tool":
            messages[-1]["name"] = "bash"
        text = self.render(messages, generation_prompt=True)
        if text.count(_ACTION_MARK) != 1 or text.count(_OBSERVATION_MARK) != 1:
            raise TemplateMismatch(
                "the chat template does not render an assistant message followed by a "
                f"{self.observation_role} message with their contents verbatim: {text!r}"
            )
        after_action = text[
            text.index(_ACTION_MARK) + len(_ACTION_MARK) : text.index(_OBSERVATION_MARK)
        ]
        after_observation = text[text.index(_OBSERVATION_MARK) + len(_OBSERVATION_MARK) :]
        if not any(after_action.startswith(t) for t in self._stop_texts.values()):
            raise TemplateMismatch(
                f"the chat template ends an assistant message with {after_action!r}, which "
                f"starts with none of the checkpoint's stop tokens "
                f"{sorted(self._stop_texts.values())}: generation would not stop where the "
                "template ends the turn (generation_config.json eos_token_id)"
            )
        return after_action, after_observation

    # -- what the agent builds -------------------------------------------------------------
    def prompt_ids(self, instruction: str) -> tuple[int, ...]:
        """The prompt of a task up to the first reply (system prompt, tools, instruction)."""
        prompt = self.tokenizer.apply_chat_template(
            self._base_messages(instruction),
            add_generation_prompt=True,
            **self._template_kwargs(),
        )
        ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        return tuple(int(i) for i in ids)

    @property
    def reply_stop_id(self) -> int:
        """The stop token the template ends an assistant message with."""
        return next(i for i, t in self._stop_texts.items() if self._after_action.startswith(t))

    def ended(self, action_ids: Sequence[int]) -> bool:
        """Whether a reply stopped on a stop token (not on its length budget)."""
        return bool(action_ids) and int(action_ids[-1]) in self.stop_token_ids

    def observation_ids(self, body_ids: Sequence[int], *, after: Sequence[int]) -> list[int]:
        """The observation segment after the reply ``after``: the end of the reply where it
        did not sample one, the observation message around ``body_ids``, the next header."""
        before = self._after_action
        if self.ended(after):
            stop = self._stop_texts[int(after[-1])]
            if before.startswith(stop):
                before = before[len(stop) :]
        encode = self.tokenizer.encode
        return [
            *encode(before, add_special_tokens=False),
            *body_ids,
            *encode(self._after_observation, add_special_tokens=False),
        ]

    def parse(self, action_ids: Sequence[int]) -> Action:
        """The action of a reply: after the reasoning, a bash block or one tool call."""
        text = self.tokenizer.decode(list(action_ids), skip_special_tokens=True)
        if self.thinks:
            if "</think>" in text:
                text = text.rsplit("</think>", 1)[1]
            elif "<think>" in text:
                return Action(error=UNFINISHED_THINKING)
        if self.action_format == "bash_block":
            command = parse_action(text)
            if command is None:
                return Action(error=NO_BLOCK)
            return Action(submit=True) if command.strip() == "submit" else Action(command)
        return parse_tool_call(text, self.tool_call_format)

    def action_text(self, command: str | None) -> str:
        """The reply that runs ``command`` (None: submits), written as this format asks."""
        if self.action_format == "bash_block":
            return f"```bash\n{command if command is not None else 'submit'}\n```"
        name, arguments = ("bash", {"command": command}) if command is not None else ("submit", {})
        if self.tool_call_format == "hermes":
            return (
                "<tool_call>\n"
                + json.dumps({"name": name, "arguments": arguments})
                + "\n</tool_call>"
            )
        return json.dumps({"name": name, "parameters": arguments})

    # -- the start-up check ----------------------------------------------------------------
    def check(self, *, reasoning: str = "I will look at the files first.") -> None:
        """Render a three-turn episode as one conversation and compare its ids with the
        agent's incremental sequence; refuse a difference naming where it starts."""
        commands = ["ls -la", "wc -l notes.txt", None]
        observations = ["exit code: 0\nnotes.txt", "exit code: 0\n3 notes.txt"]
        think = f"<think>\n{reasoning}\n</think>\n\n" if self.reasons() else ""
        messages = self._base_messages("Count the lines of notes.txt.")
        incremental = list(self.prompt_ids("Count the lines of notes.txt."))
        stop = self.reply_stop_id
        for turn, command in enumerate(commands):
            reply = think + self.action_text(command)
            action_ids = [*self.tokenizer.encode(reply, add_special_tokens=False), stop]
            incremental += action_ids
            messages.append(self._assistant_message(think, command))
            if turn < len(observations):
                body = self.tokenizer.encode(observations[turn], add_special_tokens=False)
                incremental += self.observation_ids(body, after=action_ids)
                message = {"role": self.observation_role, "content": observations[turn]}
                if self.observation_role == "tool":
                    message["name"] = "bash"
                messages.append(message)
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, **self._template_kwargs()
        )
        whole = [int(i) for i in (rendered["input_ids"] if hasattr(rendered, "keys") else rendered)]
        if whole[: len(incremental)] != incremental:
            at = next(
                (i for i, (a, b) in enumerate(zip(incremental, whole, strict=False)) if a != b),
                min(len(incremental), len(whole)),
            )
            decode = self.tokenizer.decode
            raise TemplateMismatch(
                f"chat template check ({self.action_format}"
                f"{', thinking' if self.enable_thinking else ''}): the agent's token sequence "
                f"and the template's rendering of the same episode differ at token {at}: "
                f"agent {decode(incremental[at : at + 24], skip_special_tokens=False)!r} vs "
                f"template {decode(whole[at : at + 24], skip_special_tokens=False)!r} "
                f"(after {decode(incremental[max(at - 24, 0) : at], skip_special_tokens=False)!r})"
                ". "
                "The policy would be trained on tokens it would not see in a conversation "
                "rendered by its template. A template that drops earlier reasoning once a "
                "user message follows keeps it when observations are tool messages "
                "(rollout.action_format: tool_calls); rollout.template_check: false trains "
                "on the agent's sequence regardless."
            )

    def reasons(self) -> bool:
        """Whether replies start with reasoning: a thinking template whose generation prompt
        does not already close an empty reasoning block (``enable_thinking: false``)."""
        if not self.thinks or self.enable_thinking is False:
            return False
        base = self._base_messages("task")
        prompt = self.render(base, generation_prompt=True)
        return "</think>" not in prompt[len(self.render(base, generation_prompt=False)) :]

    def _assistant_message(self, think: str, command: str | None) -> dict[str, Any]:
        if self.action_format == "bash_block":
            return {"role": "assistant", "content": think + self.action_text(command)}
        name, arguments = ("bash", {"command": command}) if command is not None else ("submit", {})
        return {
            "role": "assistant",
            "content": think,
            "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        }


class _Malformed(ValueError):
    pass


def parse_tool_call(text: str, fmt: str) -> Action:
    """One ``bash`` or ``submit`` call in ``fmt`` (``hermes`` or ``json``), checked
    strictly; anything else is an observation saying what was wrong."""
    try:
        name, arguments = _tool_call(text, fmt)
    except _Malformed as exc:
        return Action(error=str(exc))
    if name == "submit":
        if arguments:
            return Action(error="Tool call error: submit takes no arguments.")
        return Action(submit=True)
    command = arguments.get("command")
    if set(arguments) != {"command"} or not isinstance(command, str) or not command.strip():
        return Action(
            error='Tool call error: bash takes one argument, "command", a non-empty string.'
        )
    return Action(command)


def _tool_call(text: str, fmt: str) -> tuple[str, dict[str, Any]]:
    """(tool name, arguments) of the one call in ``text``; raises ``_Malformed``."""
    key = "arguments" if fmt == "hermes" else "parameters"
    if fmt == "hermes":
        calls = _HERMES.findall(text)
        if not calls and "<tool_call>" in text:
            raise _Malformed("Tool call error: <tool_call> is not closed by </tool_call>.")
        if len(calls) > 1:
            raise _Malformed(f"Tool call error: {len(calls)} tool calls; make one per turn.")
        body = calls[0] if calls else ""
    else:
        body = text
    if not body.strip():
        raise _Malformed(NO_TOOL_CALL)
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        raise _Malformed(
            f"Tool call error: the call is not valid JSON ({exc.msg} at {exc.pos})."
        ) from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise _Malformed('Tool call error: expected a JSON object with a "name".')
    extra = sorted(set(call) - {"name", key})
    if extra:
        raise _Malformed(f'Tool call error: unexpected keys {extra}; use "name" and "{key}".')
    arguments = call.get(key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise _Malformed(f'Tool call error: "{key}" must be a JSON object.')
    if call["name"] not in ("bash", "submit"):
        raise _Malformed(
            f"Tool call error: unknown tool {call['name']!r}; the tools are bash and submit."
        )
    return call["name"], arguments


def chat_format(tokenizer: ChatTokenizer, model_dir: Path | None, settings: Any) -> ChatFormat:
    """The checkpoint's format as ``settings`` (a ``RolloutConfig``, or evaluation settings
    with the same fields) asks: action and tool-call format, thinking, start-up check."""
    return ChatFormat.for_checkpoint(
        tokenizer,
        model_dir,
        check=settings.template_check,
        action_format=settings.action_format,
        tool_call_format=settings.tool_call_format,
        enable_thinking=settings.enable_thinking,
    )


def sampling_config(settings: Any, stop_token_ids: Sequence[int]) -> SamplingConfig:
    """The sampler ``settings`` names (temperature, top-p, top-k), stopping on the
    checkpoint's stop tokens."""
    return SamplingConfig(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        stop_token_ids=tuple(stop_token_ids),
    )
