"""Supervised episodes from reference solutions, in the bash agent's exact token format.

A solved episode is what the agent would produce on a perfect run: the prompt (the chat
template of system prompt + task instruction with the assistant header), action 1 = a
fenced bash block holding the solution's commands, the observation the sandbox returns for
them (``format_observation``, with the agent's chat glue and token budget), action 2 = the
``submit`` block. Actions end with ``<|im_end|>``, the stop token the engine samples, and
are the only scored tokens. ``AgentFormat`` builds each piece as ``Agent`` does; a unit
test pins the ids to a run of the real agent loop.

A Harbor task's ``solution/solve.sh`` runs as a script in /app. The agent's commands also
run in /app (both sandbox backends start every command there), so the header lines
``#!/bin/bash``, comments and ``cd /app || exit 1`` are dropped. ``export LC_ALL=C`` is
dropped too when the command still solves the task without it: the observation comes from
running the command in a fresh sandbox and the grader must then give reward 1, so every
example is a command the agent could have run, with the output it would have seen.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass

from thundersync_core.batch import Segment, Trajectory
from thundersync_core.rollout.agent import (
    AgentConfig,
    Tokenizer,
    format_observation,
    parse_action,
    truncate_tokens,
)
from thundersync_core.rollout.chat import ChatFormat
from thundersync_core.rollout.sandbox.base import ExecResult, Sandbox
from thundersync_core.rollout.tasks import TerminalTask

__all__ = [
    "SUBMIT_ACTION",
    "AgentFormat",
    "SolvedEpisode",
    "action_text",
    "solution_commands",
    "solve_task",
    "task_family",
]

SUBMIT_ACTION = "```bash\nsubmit\n```"
_HEADER_LINES = re.compile(r"^(#.*|cd /app( \|\| exit 1)?|)$")
_LOCALE_LINE = "export LC_ALL=C"
_TASK_NUMBER = re.compile(r"-\d+$")


def action_text(command: str) -> str:
    """The reply that runs ``command``; refuses commands the agent would parse differently."""
    text = f"```bash\n{command}\n```"
    if parse_action(text) != command:
        raise ValueError(f"command {command[:60]!r} does not survive the agent's block parser")
    return text


def solution_commands(solve_sh: str, *, keep_locale: bool = False) -> str:
    """The body of a ``solve.sh`` as agent commands: the script's header lines removed.

    Leading lines that are comments (the shebang included), blank or ``cd /app`` go;
    ``export LC_ALL=C`` goes unless ``keep_locale``. Everything after the first other line
    is kept verbatim (heredoc bodies may hold lines that look like header lines).
    """
    lines = solve_sh.rstrip("\n").split("\n")
    body: list[str] = []
    locale = False
    for index, line in enumerate(lines):
        if _HEADER_LINES.match(line.strip()):
            continue
        if line.strip() == _LOCALE_LINE:
            locale = True
            continue
        body = lines[index:]
        break
    command = "\n".join(body)
    return f"{_LOCALE_LINE}\n{command}" if keep_locale and locale and command else command


def task_family(task: TerminalTask) -> str:
    """``[metadata] family`` of task.toml, else the task id without its trailing number."""
    toml = task.root / "task.toml"
    if toml.is_file():
        metadata = tomllib.loads(toml.read_text()).get("metadata", {})
        family = metadata.get("family") if isinstance(metadata, dict) else None
        if isinstance(family, str) and family:
            return family
    return _TASK_NUMBER.sub("", task.task_id)


class AgentFormat:
    """Token ids of prompts, actions and observations exactly as ``Agent`` builds them."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: AgentConfig | None = None,
        *,
        chat: ChatFormat | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config or AgentConfig()
        #: The conversation format (default: bash blocks, replies ending with
        #: ``config.end_of_turn``); replies are written as it asks (``action_text``).
        self.chat = chat or ChatFormat(
            tokenizer,
            stop_token_ids=(int(tokenizer.convert_tokens_to_ids(self.config.end_of_turn)),),
            system_prompt=self.config.system_prompt,
        )
        self.end_id = self.chat.reply_stop_id
        # A thinking model's reply opens with its reasoning: the examples' is empty.
        self.reasoning = "<think>\n\n</think>\n\n" if self.chat.reasons() else ""

    def prompt_ids(self, instruction: str) -> tuple[int, ...]:
        return self.chat.prompt_ids(instruction)

    def action_ids(self, text: str) -> tuple[int, ...]:
        """The sampled ids of a reply ``text``: its tokens, then the stop token."""
        return (*self.tokenizer.encode(text, add_special_tokens=False), self.end_id)

    def observation_ids(self, text: str) -> tuple[int, ...]:
        """Glue + token-budgeted observation + glue, after an action that ended its turn."""
        body = truncate_tokens(
            self.tokenizer.encode(text, add_special_tokens=False, verbose=False),
            self.config.observation_tokens,
            self.tokenizer,
        )
        return tuple(self.chat.observation_ids(body, after=(self.end_id,)))

    def episode(self, solved: SolvedEpisode) -> Trajectory:
        """The solved episode as the learner-ready trajectory the agent would have logged."""
        if self.chat.action_format == "bash_block":
            action_text(solved.command)  # refuses a command the block parser would cut
        run, submit = self.chat.action_text(solved.command), self.chat.action_text(None)
        if self.chat.parse(self.action_ids(run)).command != solved.command:
            raise ValueError(f"command {solved.command[:60]!r} does not survive the action parser")
        segments = (
            Segment.action(self.action_ids(self.reasoning + run)),
            Segment.observation(self.observation_ids(solved.observation)),
            Segment.action(self.action_ids(self.reasoning + submit)),
        )
        return Trajectory(
            group_id=solved.task_id,
            trajectory_id=f"{solved.task_id}/reference",
            prompt_ids=self.prompt_ids(solved.instruction),
            segments=segments,
            reward=1.0,
            metadata={"task_id": solved.task_id, "family": solved.family},
        )


@dataclass(frozen=True)
class SolvedEpisode:
    task_id: str
    family: str
    instruction: str
    command: str
    observation: str


def solve_task(
    task: TerminalTask, sandbox_factory: Callable[[], Sandbox], *, timeout_s: float = 10.0
) -> tuple[SolvedEpisode | None, str]:
    """Run the reference commands as the agent would; the episode if the grader gives 1.

    Tries the commands without ``export LC_ALL=C`` first, then with it. Returns
    ``(None, reason)`` when neither variant solves the task from a fresh sandbox.
    """
    solve_sh = task.root / "solution" / "solve.sh"
    if not solve_sh.is_file():
        return None, "no solution/solve.sh"
    script = solve_sh.read_text()
    reason = "empty solution"
    for command in _variants(script):
        try:
            action_text(command)
        except ValueError as exc:
            return None, str(exc)
        result, reward, why = _run_and_grade(task, command, sandbox_factory, timeout_s)
        if reward == 1.0:
            solved = SolvedEpisode(
                task.task_id,
                task_family(task),
                task.instruction,
                command,
                format_observation(result),
            )
            return solved, "solved"
        reason = f"reward {reward:g}: {why}"
    return None, reason


def _variants(script: str) -> list[str]:
    bare = solution_commands(script)
    with_locale = solution_commands(script, keep_locale=True)
    return [c for c in dict.fromkeys([bare, with_locale]) if c.strip()]


def _run_and_grade(
    task: TerminalTask,
    command: str,
    sandbox_factory: Callable[[], Sandbox],
    timeout_s: float,
) -> tuple[ExecResult, float, str]:
    with sandbox_factory() as sandbox:
        task.setup(sandbox)
        result = sandbox.exec(command, timeout_s=timeout_s)
        grade = task.grade(sandbox)
    return result, float(grade.reward), grade.reason
