"""The multi-turn bash agent: the policy writes a command, the sandbox runs it, repeat.

A trajectory is the chat-formatted prompt (system + task instruction), then turns of
(assistant action -> sandbox executes -> observation). An action must hold a fenced bash
block whose closing fence is on its own line; the first such block is run. A turn with no
block gets a parse-error observation; a block that is exactly ``submit`` ends the
trajectory. Limits on turns, tokens per turn, total action tokens and context length end a
trajectory with a recorded finish reason. Observations are cut to a token budget, keeping
head and tail around an elision marker.

The conversation format (prompt, the template's glue around observations, stop tokens, bash
blocks or native tool calls, thinking) is the checkpoint's own: see ``chat.py``.

Episodes run concurrently, in one of two loops. ``rounds`` (the default): each round sends
every live trajectory's next request to the engine in one batched ``generate`` call, then
runs their commands in parallel sandboxes; the next round starts when every command of this
one has returned, so the engine and the sandboxes take turns. ``overlapped``: an episode's
command runs in the sandbox pool while the engine generates for the others. With an engine
that batches continuously (``submit`` and ``collect``: vLLM) each request joins the running
batch the moment its episode is ready and its reply is taken the step it ends; new weights
are loaded only while no request is in the engine (a pending swap holds new requests back
until it drains). With another engine each ``generate`` call takes every episode ready
since the last call. Seeds are per request in both, but which requests share a batch then
depends on timing, and an engine whose numerics depend on the batch may sample otherwise:
``rounds`` keeps two runs of the same policy on the same tokens (sync and thundersync
compared step by step).
``stream`` yields events as they happen: a ``TurnReady`` after each action (with the
trajectory so far, for a teacher to score) and each graded ``Trajectory`` as soon as its
grader returns, while the other episodes keep going; grading overlaps the next rounds.
Between rounds a hook may swap the engine's weights (in-flight updates): every action
records the policy version that sampled it.
Action tokens are exactly the sampled ids; the observation segment carries the chat glue
(end of the assistant message, the user message, the next assistant header), never scored.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from thundersync_core.batch import Segment, Trajectory, Turn
from thundersync_core.rollout.chat import (
    BASH_SYSTEM_PROMPT,
    NO_BLOCK,
    Action,
    ChatFormat,
    parse_action,
)
from thundersync_core.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingConfig,
    request_seed,
)
from thundersync_core.rollout.grading import GraderError, GradeResult
from thundersync_core.rollout.sandbox.base import ExecResult, Sandbox

if TYPE_CHECKING:
    from thundersync_core.config import RolloutConfig

SYSTEM_PROMPT = BASH_SYSTEM_PROMPT
PARSE_ERROR = NO_BLOCK
__all__ = [
    "PARSE_ERROR",
    "SYSTEM_PROMPT",
    "Agent",
    "AgentConfig",
    "EpisodeSpec",
    "TurnReady",
    "parse_action",
]


def grader_pool(max_workers: int, cores: Sequence[int] = ()) -> ThreadPoolExecutor:
    """The graders' threads; with ``cores`` each pins itself there first, and a verifier
    process it starts inherits that (a thread's affinity passes to what it forks)."""
    if not cores:
        return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grader")
    return ThreadPoolExecutor(
        max_workers=max_workers,
        thread_name_prefix="grader",
        initializer=os.sched_setaffinity,  # pid 0: the calling thread only
        initargs=(0, set(cores)),
    )


class AgentTask(Protocol):
    @property
    def task_id(self) -> str: ...
    @property
    def instruction(self) -> str: ...

    def setup(self, sandbox: Sandbox) -> None: ...

    def grade(self, sandbox: Sandbox) -> GradeResult: ...


class Tokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...
    def encode(self, text: str, add_special_tokens: bool = ..., **kwargs: Any) -> list[int]: ...
    def decode(self, ids: Any, skip_special_tokens: bool = ...) -> str: ...
    def convert_tokens_to_ids(self, token: str) -> Any: ...


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 8
    max_tokens_per_turn: int = 128
    max_total_tokens: int = 1024
    max_context_tokens: int = 4096
    observation_tokens: int = 256
    command_timeout_s: float = 10.0
    system_prompt: str = SYSTEM_PROMPT
    end_of_turn: str = "<|im_end|>"

    @classmethod
    def of(cls, rollout: RolloutConfig) -> AgentConfig:
        """The limits a training config's ``rollout`` section sets (context: the engine's
        ``max_model_len``)."""
        return cls(
            max_turns=rollout.max_turns,
            max_tokens_per_turn=rollout.max_tokens_per_turn,
            max_total_tokens=rollout.max_total_tokens,
            max_context_tokens=rollout.max_model_len,
            observation_tokens=rollout.observation_tokens,
            command_timeout_s=rollout.command_timeout_s,
        )


@dataclass(frozen=True)
class EpisodeSpec:
    task: AgentTask
    group_id: str
    trajectory_id: str


@dataclass(frozen=True)
class TurnReady:
    """An action turn just sampled: the trajectory so far, ready for a teacher to score."""

    turn: Turn
    task_id: str


@dataclass
class _Live:
    spec: EpisodeSpec
    sandbox: Sandbox
    prompt_ids: tuple[int, ...]
    segments: list[Segment] = field(default_factory=list)
    new_turn: Turn | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    action_logprobs: list[list[float]] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    action_tokens: int = 0
    finish_reason: str | None = None

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + sum(len(s.ids) for s in self.segments)

    def context(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(i for s in self.segments for i in s.ids)

    def mark(self, kind: str, **info: Any) -> None:
        self.events.append({"event": kind, "time": time.time(), **info})


#: How episodes share the engine and the sandboxes (see the module's docstring).
AgentLoop = Literal["rounds", "overlapped"]


@dataclass
class _Overlap:
    """The overlapped loop's episodes by where they are."""

    starting: set[Future[_Live]] = field(default_factory=set)
    ready: list[_Live] = field(default_factory=list)  # waiting for their next action
    running: dict[Future[str | None], tuple[_Live, tuple[int, ...]]] = field(
        default_factory=dict
    )  # commands under way, with the reply that wrote them
    grading: set[Future[Trajectory]] = field(default_factory=set)
    #: Requests in a stepping engine's running batch, by request id.
    asked: dict[str, _Live] = field(default_factory=dict)

    @property
    def busy(self) -> bool:
        return bool(self.starting or self.ready or self.running or self.grading or self.asked)

    @property
    def live_count(self) -> int:
        """Episodes counted against ``max_live``: starting, ready, generating or executing."""
        return len(self.starting) + len(self.ready) + len(self.running) + len(self.asked)

    def futures(self) -> set[Future[Any]]:
        return self.starting | set(self.running) | self.grading

    def abandon(self) -> None:
        """A stream left early: cancel what has not started, close every sandbox (a set-up
        under way closes its own once made)."""
        for future in self.futures():
            future.cancel()
        for future in self.starting:
            future.add_done_callback(_close_started)
        live = [*self.ready, *(e for e, _ in self.running.values()), *self.asked.values()]
        for episode in live:
            episode.sandbox.close()


def _close_started(future: Future[_Live]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().sandbox.close()


def _admitted(
    pending: deque[EpisodeSpec], room: int | None, admit: Callable[[EpisodeSpec], bool] | None
) -> list[EpisodeSpec]:
    """Pop the specs that may start now: at most ``room``, in order, while ``admit`` allows."""
    out: list[EpisodeSpec] = []
    while pending and (room is None or len(out) < room):
        if admit is not None and not admit(pending[0]):
            break
        out.append(pending.popleft())
    return out


def truncate_tokens(ids: list[int], budget: int, tokenizer: Tokenizer) -> list[int]:
    """Keep head and tail of ``ids`` within ``budget`` tokens around an elision marker."""
    if len(ids) <= budget:
        return ids
    marker = tokenizer.encode(
        f"\n[... {len(ids)} tokens, middle elided ...]\n", add_special_tokens=False
    )
    keep = max(budget - len(marker), 2)
    head, tail = ids[: keep // 2], ids[len(ids) - (keep - keep // 2) :]
    return head + marker + tail


def format_observation(result: ExecResult) -> str:
    parts = [f"exit code: {result.exit_code}"]
    if result.killed_reason:
        parts.append(f"killed: {result.killed_reason}")
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    return "\n".join(parts)


class Agent:
    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Tokenizer,
        sandbox_factory: Callable[[], Sandbox],
        *,
        config: AgentConfig | None = None,
        sampling: SamplingConfig | None = None,
        base_seed: int = 0,
        max_workers: int = 8,
        grader_cores: Sequence[int] = (),
        chat: ChatFormat | None = None,
        loop: AgentLoop = "rounds",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.sandbox_factory = sandbox_factory
        self.config = config or AgentConfig()
        #: The checkpoint's conversation format; by default fenced bash blocks in the
        #: template of ``tokenizer``, replies ending with ``config.end_of_turn``.
        self.chat = chat or ChatFormat(
            tokenizer,
            stop_token_ids=(int(tokenizer.convert_tokens_to_ids(self.config.end_of_turn)),),
            system_prompt=self.config.system_prompt,
        )
        self.sampling = sampling or SamplingConfig(stop_token_ids=self.chat.stop_token_ids)
        self.base_seed = base_seed
        if loop not in ("rounds", "overlapped"):
            raise ValueError(f"agent loop must be 'rounds' or 'overlapped', got {loop!r}")
        self.loop = loop
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sandbox")
        # Graders get their own threads: a finished trajectory's reward must not wait
        # behind the next round's commands (its release time is when the reward lands).
        self.graders = grader_pool(max_workers, grader_cores)
        # Episodes started and not yet handed out (generating, executing or being graded).
        self._in_flight: dict[str, _Live] = {}

    # -- driver ----------------------------------------------------------------------------
    def run(self, specs: Sequence[EpisodeSpec]) -> list[Trajectory]:
        """Run every episode to its end, grade it, and return trajectories in ``specs`` order."""
        done = {t.trajectory_id: t for t in self.stream(specs) if isinstance(t, Trajectory)}
        return [done[s.trajectory_id] for s in specs]

    def stream(
        self,
        specs: Iterable[EpisodeSpec],
        *,
        max_live: int | None = None,
        admit: Callable[[EpisodeSpec], bool] | None = None,
        before_round: Callable[[], None] | None = None,
        swap_pending: Callable[[], bool] | None = None,
    ) -> Iterator[Trajectory | TurnReady]:
        """Run episodes, yielding each action turn and each graded trajectory as it happens.

        At most ``max_live`` episodes run at once; the next spec starts only when ``admit``
        returns True for it (a staleness bound holds rollouts back this way).
        ``before_round`` runs before every generation round (in-flight weight swaps); with
        an engine that batches continuously, only while no request is in it, and while
        ``swap_pending`` says new weights wait, no new request is added so it drains.
        """
        if self.loop == "overlapped":
            yield from self._stream_overlapped(specs, max_live, admit, before_round, swap_pending)
            return
        pending = deque(specs)
        live: list[_Live] = []
        grading: set[Future[Trajectory]] = set()
        try:
            while pending or live or grading:
                starting = _admitted(pending, max_live - len(live) if max_live else None, admit)
                started = list(self.pool.map(self._start, starting))
                self._in_flight.update((e.spec.trajectory_id, e) for e in started)
                live.extend(started)
                if before_round is not None:
                    before_round()
                if live:
                    self._round(live)
                    yield from self._take_turns(live)
                    for episode in [e for e in live if e.finish_reason is not None]:
                        live.remove(episode)
                        grading.add(self.graders.submit(self._finish_and_close, episode))
                if grading:
                    # Block on graders only when there is nothing to generate; poll while
                    # ``admit`` holds specs back.
                    timeout = 0.0 if live else (0.05 if pending else None)
                    finished, grading = wait(grading, timeout, FIRST_COMPLETED)
                    for future in finished:
                        trajectory = future.result()
                        self._in_flight.pop(trajectory.trajectory_id, None)
                        yield trajectory
                elif pending and not live:
                    time.sleep(0.01)
        finally:
            self._in_flight.clear()
            for episode in live:
                episode.sandbox.close()
            for future in grading:
                future.cancel()

    def _stream_overlapped(
        self,
        specs: Iterable[EpisodeSpec],
        max_live: int | None,
        admit: Callable[[EpisodeSpec], bool] | None,
        before_round: Callable[[], None] | None,
        swap_pending: Callable[[], bool] | None,
    ) -> Iterator[Trajectory | TurnReady]:
        """``stream`` with generation and tool execution overlapped: set-ups and commands
        run in the sandbox pool as futures; ready episodes' requests join the engine's
        running batch (``submit``/``collect``) or, without one, one ``generate`` call."""
        pending = deque(specs)
        state = _Overlap()
        # An engine that takes requests into its running batch (``submit``/``collect``):
        # each request is added the moment its episode is ready.
        stepping = callable(getattr(self.engine, "submit", None))
        try:
            while pending or state.busy:
                room = max_live - state.live_count if max_live else None
                for spec in _admitted(pending, room, admit):
                    state.starting.add(self.pool.submit(self._start, spec))
                if state.ready and stepping:
                    self._submit(state, before_round, swap_pending)
                elif state.ready:
                    self._call(state, before_round)
                if stepping and state.asked:
                    # One engine step; the replies done there go to the sandboxes at once.
                    for result in self.engine.collect():  # type: ignore[attr-defined]
                        episode = state.asked.pop(result.request_id)
                        self._run_commands(state, [self._reply(episode, result)])
                waiting = state.futures()
                if not waiting:
                    if pending and not state.asked:  # ``admit`` holds the next spec back
                        if before_round is not None:
                            before_round()  # the engine is empty: new weights may admit it
                        time.sleep(0.01)
                    continue
                timeout = 0.0 if state.asked else (0.05 if pending else None)
                finished, _ = wait(waiting, timeout, FIRST_COMPLETED)
                for future in finished:
                    yield from self._settle(state, future)
        finally:
            self._in_flight.clear()
            if state.asked:  # left early: the engine drops what it still generates
                self.engine.cancel()  # type: ignore[attr-defined]
            state.abandon()

    def _call(self, state: _Overlap, before_round: Callable[[], None] | None) -> None:
        """One batched ``generate`` call for every ready episode; their commands start."""
        if before_round is not None:
            before_round()
        asking, state.ready = state.ready, []
        commands = self._generate(asking)
        self._run_commands(state, commands)
        asked = {id(episode) for episode, _, _ in commands}
        for episode in asking:  # ended by a limit before it could ask
            if id(episode) not in asked:
                self._grade(state, episode)

    def _settle(self, state: _Overlap, future: Future[Any]) -> list[Trajectory | TurnReady]:
        """A finished future of the overlapped loop: a set-up makes its episode ready; an
        executed action completes its turn (handed out, as in a round, once its observation
        is in and it is known whether the episode ends) and the episode is ready again or
        sent to a grader; a grade is handed out."""
        if future in state.starting:
            state.starting.remove(future)
            episode: _Live = future.result()
            self._in_flight[episode.spec.trajectory_id] = episode
            state.ready.append(episode)
            return []
        if future in state.running:
            episode, reply = state.running.pop(future)
            self._observe(episode, future.result(), reply)
            turns: list[Trajectory | TurnReady] = list(self._take_turns([episode]))
            if episode.finish_reason is None:
                state.ready.append(episode)
            else:
                self._grade(state, episode)
            return turns
        state.grading.remove(future)
        trajectory: Trajectory = future.result()
        self._in_flight.pop(trajectory.trajectory_id, None)
        return [trajectory]

    def _submit(
        self,
        state: _Overlap,
        before_round: Callable[[], None] | None,
        swap_pending: Callable[[], bool] | None,
    ) -> None:
        """The ready episodes' requests into the engine's running batch. New weights are
        taken (``before_round``) only while no request is in the engine, so a reply is
        sampled by one version; a pending swap holds new requests back until the engine
        has drained."""
        if state.asked and swap_pending is not None and swap_pending():
            return
        if before_round is not None and not state.asked:
            before_round()
        for episode in state.ready:
            request = self._request(episode)
            if request is None:  # ended by a limit before it could ask
                self._grade(state, episode)
                continue
            self.engine.submit(request, self.sampling)  # type: ignore[attr-defined]
            state.asked[request.request_id] = episode
        state.ready = []

    def _run_commands(
        self, state: _Overlap, commands: list[tuple[_Live, Action, tuple[int, ...]]]
    ) -> None:
        for episode, action, reply in commands:
            state.running[self.pool.submit(self._execute, episode, action)] = (episode, reply)

    def _grade(self, state: _Overlap, episode: _Live) -> None:
        state.grading.add(self.graders.submit(self._finish_and_close, episode))

    def in_flight_events(self) -> list[list[dict[str, Any]]]:
        """The event lists so far of the episodes under way (started, not yet handed out):
        what the rollout is doing now, for a step that closes while they run."""
        return [list(episode.events) for episode in list(self._in_flight.values())]

    @staticmethod
    def _take_turns(live: list[_Live]) -> Iterator[TurnReady]:
        for episode in live:
            if episode.new_turn is not None:
                turn, episode.new_turn = episode.new_turn, None
                last = episode.finish_reason is not None
                yield TurnReady(replace(turn, last=last), episode.spec.task.task_id)

    def prompt_ids(self, instruction: str) -> tuple[int, ...]:
        """The chat-formatted prompt of a task: what every trajectory of its group starts with."""
        return self.chat.prompt_ids(instruction)

    def _start(self, spec: EpisodeSpec) -> _Live:
        setup_start = time.time()
        sandbox = self.sandbox_factory()
        try:
            spec.task.setup(sandbox)
        except BaseException:
            sandbox.close()
            raise
        episode = _Live(spec, sandbox, self.prompt_ids(spec.task.instruction))
        episode.events.append({"event": "setup_start", "time": setup_start})
        episode.mark("start")
        return episode

    def _round(self, active: list[_Live]) -> None:
        commands = self._generate(active)
        observations = list(self.pool.map(lambda c: self._execute(c[0], c[1]), commands))
        for (episode, _, reply), observation in zip(commands, observations, strict=True):
            self._observe(episode, observation, reply)

    def _generate(self, active: list[_Live]) -> list[tuple[_Live, Action, tuple[int, ...]]]:
        """One batched ``generate`` call for the episodes' next actions; each reply becomes
        an action segment and a new turn. Returns (episode, parsed action, reply ids)."""
        asked = [(e, r) for e in active if (r := self._request(e)) is not None]
        requests = [r for _, r in asked]
        results = self.engine.generate(requests, self.sampling) if requests else []
        return [self._reply(e, result) for (e, _), result in zip(asked, results, strict=True)]

    def _request(self, episode: _Live) -> GenerationRequest | None:
        """The episode's next request; None (its finish reason set) when no budget is left."""
        budget = self._turn_budget(episode)
        if budget <= 0:
            return None
        turn = len(episode.turn_versions)
        seed = request_seed(self.base_seed, episode.spec.group_id, episode.spec.trajectory_id, turn)
        episode.mark("generate_start", turn=turn)
        return GenerationRequest(
            f"{episode.spec.trajectory_id}/{turn}",
            episode.context(),
            budget,
            seed,
            group_id=episode.spec.group_id,
        )

    def _reply(
        self, episode: _Live, result: GenerationResult
    ) -> tuple[_Live, Action, tuple[int, ...]]:
        """A generated reply into the episode: an action segment and a new turn."""
        episode.mark(
            "generate_end", turn=len(episode.turn_versions), policy_version=result.policy_version
        )
        episode.segments.append(Segment.action(result.token_ids))
        episode.action_logprobs.append(list(result.logprobs))
        episode.new_turn = Turn(
            group_id=episode.spec.group_id,
            trajectory_id=episode.spec.trajectory_id,
            prompt_ids=episode.prompt_ids,
            index=len(episode.turn_versions),
            segments=tuple(episode.segments),
            teacher_logprobs=(),
            last=False,
            policy_version=result.policy_version,
            behaviour_logprobs=tuple(result.logprobs),
        )
        episode.turn_versions.append(result.policy_version)
        episode.action_tokens += len(result.token_ids)
        reply = tuple(result.token_ids)
        return episode, self.chat.parse(result.token_ids), reply

    def _observe(self, episode: _Live, observation: str | None, reply: Sequence[int]) -> None:
        """An executed action's observation into the episode; sets its finish reason when
        a limit ends it."""
        if observation is not None:
            self._append_observation(episode, observation, reply)
        if episode.finish_reason is None and len(episode.turn_versions) >= self.config.max_turns:
            episode.finish_reason = "max_turns"
        if episode.finish_reason is None:
            self._turn_budget(episode)  # sets the finish reason when no budget is left

    def _turn_budget(self, episode: _Live) -> int:
        """Tokens the next action may use; 0 (with a finish reason set) when none are left."""
        cfg = self.config
        left_total = cfg.max_total_tokens - episode.action_tokens
        left_context = cfg.max_context_tokens - episode.context_len
        if left_total <= 0:
            episode.finish_reason = "max_total_tokens"
            return 0
        if left_context <= 0:
            episode.finish_reason = "context_length"
            return 0
        return min(cfg.max_tokens_per_turn, left_total, left_context)

    def _execute(self, episode: _Live, action: Action) -> str | None:
        if action.error is not None:
            return action.error
        if action.submit:
            episode.finish_reason = "submitted"
            return None
        command = action.command or ""
        if "\x00" in command:
            # No shell can take a NUL byte; the policy hears why instead of the batch failing.
            return "exit code: 127\nstderr:\nthe command contains a NUL byte and was not run"
        episode.mark("exec_start", turn=len(episode.turn_versions) - 1)
        result = episode.sandbox.exec(command, timeout_s=self.config.command_timeout_s)
        episode.mark(
            "exec_end",
            turn=len(episode.turn_versions) - 1,
            exit_code=result.exit_code,
            duration_s=result.duration_s,
        )
        return format_observation(result)

    def _append_observation(self, episode: _Live, text: str, reply: Sequence[int]) -> None:
        body = truncate_tokens(
            # verbose=False: outputs longer than the model's context are expected here.
            self.tokenizer.encode(text, add_special_tokens=False, verbose=False),
            self.config.observation_tokens,
            self.tokenizer,
        )
        ids = self.chat.observation_ids(body, after=reply)
        if episode.context_len + len(ids) > self.config.max_context_tokens:
            episode.finish_reason = "context_length"
            return
        episode.segments.append(Segment.observation(ids))

    def _finish_and_close(self, episode: _Live) -> Trajectory:
        try:
            trajectory = self._finish(episode)
        finally:
            episode.sandbox.close()
        episode.mark("closed")  # into the event list the trajectory's metadata holds
        return trajectory

    def _finish(self, episode: _Live) -> Trajectory:
        episode.mark("grade_start")
        try:
            grade = episode.spec.task.grade(episode.sandbox)
        except Exception as exc:
            spec = episode.spec
            raise GraderError(
                f"grading trajectory {spec.trajectory_id} of task {spec.task.task_id} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        episode.mark("reward", reward=grade.reward)
        return Trajectory(
            group_id=episode.spec.group_id,
            trajectory_id=episode.spec.trajectory_id,
            prompt_ids=episode.prompt_ids,
            segments=tuple(episode.segments),
            reward=float(grade.reward),
            policy_version=episode.turn_versions[0]
            if episode.turn_versions
            else self.engine.policy_version,
            behaviour_logprobs=tuple(q for turn in episode.action_logprobs for q in turn),
            metadata={
                "task_id": episode.spec.task.task_id,
                "finish_reason": episode.finish_reason,
                "reward_reason": grade.reason,
                "turn_versions": episode.turn_versions,
                "action_logprobs": episode.action_logprobs,
                "events": episode.events,
            },
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.graders.shutdown(wait=True)
