"""The multi-turn rollout driver: episodes of an env against an engine, recorded token-exactly.

reset → render the chat template → generate until a tool call closes or the turn ends → `astep` →
append the tool response → … until the env terminates or truncates. The tokens the model generated
are kept as they are (never re-tokenized); each tool response is tokenized once, as the chat
template renders it, so the record decodes to exactly the rendered conversation.

Generated tokens become model segments, one per run of a single policy version: an engine that
finishes a request under new weights reports the switch in its per-token versions, and an engine
that aborts for a weight update (SGLang) is resumed with the accumulated tokens, which again starts a
new segment. Failures never kill the batch: a trajectory ends `failed` with its reason, the group
policy keeps or drops its group, and every outcome is counted. An env or engine that lost an episode's
state for good (a distributed worker that died and could not replay it) raises `pacerl.envs.EpisodeLost`: the
episode is played again from its start under the same id (requeued), never counted twice.

An env whose `inline_observations` attribute is true (Search-R1's `pacerl/SearchR1-v0`) gets the
generated text as it is, and its observations continue the assistant's text: their contents are
tokenized and appended as they are, with no chat turn around them.

Routes (R3) are recorded for the whole sequence, as slime and Megatron replay it: each engine call
asks for the rows of the positions the record does not hold yet (`routed_experts_start_len`), which
are those of the prompt or tool response its prefill computed, then those of its own tokens; the
former are attached to the prompt or tool segment, the latter go with the new model segments.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, cast

import numpy as np

from pacerl.agents.engine.protocol import (
    ContextOverflowError,
    Engine,
    EngineWithRoutesStart,
    FinishReason,
    Generation,
    SamplingParams,
)
from pacerl.agents.routing import RoutedExperts
from pacerl.agents.trajectory import Origin, Status, Trajectory
from pacerl.envs import EpisodeLost, Message, Task
from pacerl.envs.chat_template import assistant_message, render_chat, split_reasoning, takes_reasoning

log = logging.getLogger(__name__)

_LOST = "episode lost"
"""The start of the failure reason of an episode whose env or engine raised `EpisodeLost`."""
_SENTINEL = "\x00pacerl-turn\x00"
"""The content of a stand-in assistant message that finds where a template ends a finished turn."""


class EpisodeEnv(Protocol):
    """What the driver needs of an env: a `ToolEnv`, or a proxy of one living elsewhere (a Ray worker)."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]: ...

    def tool_schemas(self) -> list[dict[str, Any]]: ...

    async def astep(self, action: str) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are sampled."""

    group_size: int = 8
    """Responses sampled per prompt (one group, for group-relative advantages)."""
    sampling: SamplingParams = field(
        default_factory=lambda: SamplingParams(
            max_new_tokens=64, temperature=1.0, stop_strings=("</tool_call>",)
        )
    )
    """Sampling of each assistant turn; `max_new_tokens` is per turn."""
    max_total_tokens: int = 1024
    """Context budget of a whole episode (prompt, generations and tool responses)."""
    engine_retries: int = 2
    """Times a failed engine call is retried before the trajectory ends `failed`."""
    engine_backoff_s: float = 0.5
    """Seconds before the first retry of a failed engine call, doubling with each further failure of
    the same call up to `ENGINE_BACKOFF_CAP_S` (`retry_delay`), so that a server that is down or
    restarting is not hammered. >= 0 (0: retry at once)."""
    on_failure: Literal["keep", "drop_group"] = "drop_group"
    """A group with a failed trajectory: keep the others, or drop the whole group (its advantages
    would otherwise be computed over fewer samples than the rest)."""
    record_routes: bool = True
    """Ask the engine for routed experts (R3) when the model is a MoE."""
    tool_schemas_in_prompt: bool = True
    """Render the env's tool schemas into the system turn; off for a model that learned its tools by
    SFT (the schemas cost a tiny model's prompt hundreds of tokens)."""

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_total_tokens < 2 or self.engine_retries < 0:
            raise ValueError("group_size >= 1, max_total_tokens >= 2 and engine_retries >= 0 are required")
        if not (math.isfinite(self.engine_backoff_s) and self.engine_backoff_s >= 0):
            raise ValueError(f"engine_backoff_s must be finite and >= 0, got {self.engine_backoff_s!r}")
        if self.on_failure not in ("keep", "drop_group"):
            raise ValueError(f"on_failure must be keep or drop_group, got {self.on_failure!r}")


ENGINE_BACKOFF_CAP_S = 8.0
"""The longest wait before retrying a failed engine call."""


def retry_delay(failures: int, base_s: float, cap_s: float = ENGINE_BACKOFF_CAP_S) -> float:
    """Seconds to wait before retrying a call that failed `failures` times in a row (>= 1):
    min(cap, base·2^(failures − 1)), exponential backoff."""
    if failures < 1:
        raise ValueError(f"failures must be >= 1, got {failures}")
    return min(cap_s, base_s * 2.0 ** min(failures - 1, 64))


class RolloutDriver:
    """Plays episodes of `make_env()` environments with `engine`, many at once on one loop."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        make_env: Callable[[], EpisodeEnv],
        config: RolloutConfig | None = None,
        *,
        num_experts: int = 0,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.config = config or RolloutConfig()
        self.num_experts = num_experts
        """Experts per MoE layer of the engine's model (0 for a dense model: no routes recorded)."""
        self._routes_from = "routed_experts_start_len" in inspect.signature(engine.generate).parameters
        """Whether the engine is an `EngineWithRoutesStart`; one that is not (a proxy that does not
        forward the argument) answers every row of the stream, of which the driver keeps the new
        ones: the same record, only more bytes on the way."""
        self.on_episode: Callable[[Trajectory], None] | None = None
        """Called with each episode's finished record (an evaluation's progress display)."""
        self.last_failure = ""
        """The reason of the latest trajectory that ended `failed` ("" while none has)."""
        self.counts: Counter[str] = Counter()
        """Outcomes so far: `status:<status>`, `reason:<reason>`, `resumed`, `dropped_groups`,
        `engine_errors` (engine calls that failed, each retried after `retry_delay` or ending its
        trajectory),
        `resumed_from_checkpoint`, `resume_tool_output_changed`, `requeued`, and
        `assistant_rerendered`: tool turns after an assistant turn that the template writes differently
        once more follows it (Qwen3 drops an empty `<think>` block from a turn that is no longer last);
        the record keeps the generated tokens and appends only the template's rendering of the new turn."""
        self._groups: dict[str, dict[str, Trajectory]] = {}
        self._ids = itertools.count()
        self._eos_text = tokenizer.eos_token or ""
        self._reasoning_field = takes_reasoning(getattr(tokenizer, "chat_template", None))
        """Whether the template reads `reasoning_content` (Qwen3): a `<think>` block goes there."""
        probe = self._render([{"role": "assistant", "content": "\x00"}], None, generation_prompt=False)
        self._assistant_tail = probe[probe.index("\x00") + 1 :]
        """What the template writes after an assistant message's content (e.g. `<|im_end|>\n`)."""

    async def rollout_group(
        self, task: Task, group_id: str | None = None, resume: Mapping[str, Trajectory] | None = None
    ) -> list[Trajectory]:
        """`group_size` episodes on one task. A failed member drops the group if so configured.

        `resume` maps member ids (`<group_id>/<i>`) to records saved from an earlier run (see
        `in_flight`): a finished one is returned as it is, a running one is resumed where it stopped.
        """
        group = group_id or f"group-{next(self._ids)}"
        saved = dict(resume or {})
        strangers = set(saved) - {f"{group}/{i}" for i in range(self.config.group_size)}
        if strangers:
            raise ValueError(f"resume records that are not members of {group!r}: {sorted(strangers)}")
        self._groups[group] = members = {}
        try:
            episodes = []
            for i in range(self.config.group_size):
                member = f"{group}/{i}"
                record = saved.pop(member, None)
                if record is not None and record.status is not Status.RUNNING:
                    members[member] = record
                    episodes.append(_done(record))
                else:
                    episodes.append(self.rollout(task, group, member, partial=record))
            trajectories = list(await asyncio.gather(*episodes))
        finally:
            del self._groups[group]
        if self.config.on_failure == "drop_group" and any(t.status is Status.FAILED for t in trajectories):
            self.counts["dropped_groups"] += 1
            return []
        return trajectories

    def in_flight(self) -> dict[str, list[Trajectory]]:
        """The groups being played now: group id -> its members' records so far (running ones are
        partial, finished ones wait for the rest of their group). Copies, safe to serialise while the
        episodes go on; members not started yet are absent."""
        return {
            group: [Trajectory.from_json(t.to_json()) for t in members.values()]
            for group, members in self._groups.items()
        }

    async def rollout(
        self, task: Task, group_id: str, trajectory_id: str, partial: Trajectory | None = None
    ) -> Trajectory:
        """One episode; always returns a finished trajectory (failures included). `partial`: a running
        record of this episode from an earlier run, continued in place: its turns are replayed into a
        fresh env (tools run again) and generation goes on from its last token. An episode whose env
        or engine raises `EpisodeLost` starts over (at most `engine_retries` times, then it fails)."""
        for attempt in itertools.count():
            env = self.make_env()
            try:
                trajectory = await self._play(env, task, group_id, trajectory_id, partial)
            finally:
                env.close()
            lost = trajectory.status is Status.FAILED and trajectory.status_reason.startswith(_LOST)
            if not lost or attempt >= self.config.engine_retries:
                break
            log.warning("%s: %s; playing it again from the start", trajectory_id, trajectory.status_reason)
            self.counts["requeued"] += 1
            partial = None
        self.counts[f"status:{trajectory.status.value}"] += 1
        if trajectory.status is not Status.COMPLETED:
            self.counts[f"reason:{trajectory.status_reason}"] += 1
        if trajectory.status is Status.FAILED:
            self.last_failure = trajectory.status_reason
        if self.on_episode is not None:
            self.on_episode(trajectory)
        return trajectory

    async def _play(
        self, env: EpisodeEnv, task: Task, group_id: str, trajectory_id: str, partial: Trajectory | None
    ) -> Trajectory:
        observation, _ = env.reset(options={"task": task})
        messages: list[Message] = list(observation)
        tools = (env.tool_schemas() if self.config.tool_schemas_in_prompt else None) or None
        prompt = self._encode(self._render(messages, tools, generation_prompt=True))
        trajectory = partial or Trajectory.start(trajectory_id, group_id, task.id, prompt)
        if (trajectory.id, trajectory.group_id, trajectory.task_id) != (trajectory_id, group_id, task.id):
            raise ValueError(f"record {trajectory.id!r} ({trajectory.task_id!r}) is not this episode")
        if group_id in self._groups:
            self._groups[group_id][trajectory_id] = trajectory
        try:
            return await self._turns(env, trajectory, prompt, messages, tools, resuming=partial is not None)
        except EpisodeLost as lost:
            return self._finish(trajectory, Status.FAILED, f"{_LOST}: {lost}", 0.0)

    async def _turns(
        self,
        env: EpisodeEnv,
        trajectory: Trajectory,
        prompt: list[int],
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        *,
        resuming: bool,
    ) -> Trajectory:
        """The episode's turns until it ends (after replaying a saved record's turns if `resuming`)."""
        pending: tuple[list[int], bool] = ([], False)
        inline = bool(getattr(env, "inline_observations", False))
        if resuming:
            replayed = await self._replay(env, trajectory, prompt, messages, tools)
            if isinstance(replayed, str):
                return self._finish(trajectory, Status.FAILED, replayed, 0.0)
            pending = replayed
            self.counts["resumed_from_checkpoint"] += 1
        while True:
            produced, complete = pending
            pending = ([], False)
            turn = produced if complete else await self._generate_turn(trajectory, produced)
            if isinstance(turn, str):  # why the turn could not be generated
                status = Status.TRUNCATED if turn.startswith("context") else Status.FAILED
                return self._finish(trajectory, status, turn, 0.0)
            content = self._decode_content(turn)
            observation, reward, terminated, truncated, info = await env.astep(
                content if inline else _action(content)
            )
            if terminated or truncated:
                status = Status.COMPLETED if terminated else Status.TRUNCATED
                reason = "" if terminated else str(info.get("truncation_reason") or "truncated")
                return self._finish(trajectory, status, reason, float(reward), info)
            tool_turn = (
                self._inline_turn(observation)
                if inline
                else self._tool_turn(messages, content, observation, tools, turn)
            )
            if tool_turn is None:
                return self._finish(trajectory, Status.FAILED, "chat template is not prefix-stable", 0.0)
            trajectory.append_tool(tool_turn)
            messages += [self._assistant(content), *observation]

    def _tool_turn(
        self,
        messages: list[Message],
        content: str,
        observation: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        turn: Sequence[int],
    ) -> list[int] | None:
        """The tool turn's tokens: exactly what the template renders between this assistant message
        (given to it as `assistant_message` structures it) and the next generation prompt, tokenized
        once; None if the template's rendering of the new turn cannot be told apart from the turn before.

        The generated tokens are never replaced: a template that writes the finished turn differently
        once more follows it (Qwen3 without reasoning) is asked for the new turn after a stand-in
        assistant message instead, so the record stays the model's tokens plus the template's turns."""
        assistant = self._assistant(content)
        before = self._render([*messages, assistant], tools, generation_prompt=False)
        after = self._render([*messages, assistant, *observation], tools, generation_prompt=True)
        if after.startswith(before):
            new_turn = after[len(before) :]
        else:
            stand_in: Message = {"role": "assistant", "content": _SENTINEL}
            probe = self._render([*messages, stand_in, *observation], tools, generation_prompt=True)
            tail = probe.partition(_SENTINEL)[2]
            if probe.count(_SENTINEL) != 1 or not tail.startswith(self._assistant_tail):
                return None
            new_turn = tail[len(self._assistant_tail) :]
            self.counts["assistant_rerendered"] += 1
        generated_text = self.tokenizer.decode(list(turn), skip_special_tokens=False)
        already = generated_text[len(content) :]  # the part of the closing the model emitted itself
        closing = self._assistant_tail.removeprefix(already)
        return self._encode(closing + new_turn)

    def _inline_turn(self, observation: Sequence[Message]) -> list[int]:
        """An inline observation's tokens: its contents as they are, continuing the assistant's text."""
        return self._encode("".join(message["content"] for message in observation))

    def _assistant(self, content: str) -> Message:
        """The generated `content` as the template expects it (structured calls, reasoning field)."""
        message: Message = assistant_message(content, reasoning_field=self._reasoning_field)
        return message

    async def _replay(
        self,
        env: EpisodeEnv,
        trajectory: Trajectory,
        prompt: list[int],
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
    ) -> tuple[list[int], bool] | str:
        """Bring a fresh env to where a saved running record stopped: every completed turn is stepped
        again (its tools rerun; the record keeps the tool tokens the model saw). Returns the tokens of
        the unfinished last turn and whether its generation had already ended, or why not resumable."""
        if trajectory.status is not Status.RUNNING:
            return f"cannot resume a {trajectory.status} trajectory"
        if list(trajectory.segments[0].tokens) != prompt:
            return "cannot resume: the prompt renders differently now"
        turn: list[int] = []
        last_reason = ""
        inline = bool(getattr(env, "inline_observations", False))
        for segment in trajectory.segments[1:]:
            if segment.origin is Origin.MODEL:
                turn += segment.tokens
                last_reason = segment.finish_reason or ""
                continue
            content = self._decode_content(turn)
            observation, _, terminated, truncated, _ = await env.astep(
                content if inline else _action(content)
            )
            if terminated or truncated:
                return "cannot resume: the replayed episode ended before the record did"
            replayed = (
                self._inline_turn(observation)
                if inline
                else self._tool_turn(messages, content, observation, tools, turn)
            )
            if replayed != list(segment.tokens):
                self.counts["resume_tool_output_changed"] += 1  # the model saw the recorded one
            messages += [self._assistant(content), *observation]
            turn = []
        ended = bool(turn) and last_reason in (FinishReason.STOP.value, FinishReason.LENGTH.value)
        return turn, ended or len(turn) >= self.config.sampling.max_new_tokens

    async def _generate_turn(self, trajectory: Trajectory, produced: list[int]) -> list[int] | str:
        """Generate one assistant turn into `trajectory` (resuming across aborts), continuing after
        `produced` (its tokens already in the record); the turn's tokens, or why not."""
        produced = list(produced)
        budget = self.config.sampling.max_new_tokens
        failures = 0
        while True:
            room = self.config.max_total_tokens - len(trajectory.tokens)
            if room <= 0:
                return "context budget exhausted"
            sampling = replace(self.config.sampling, max_new_tokens=max(1, min(budget - len(produced), room)))
            started, version_before = time.time(), self.engine.version
            try:
                generation = await self._call_engine(trajectory, sampling)
            except ContextOverflowError as error:
                return f"context overflow: {error}"
            except (RuntimeError, OSError, TimeoutError) as error:
                failures += 1
                self.counts["engine_errors"] += 1
                errors = self.counts["engine_errors"]
                if errors & (errors - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: a dead server is not a flood
                    log.warning("engine call failed (%d engine errors so far): %s", errors, error)
                if failures > self.config.engine_retries:
                    return f"engine failed: {error}"
                await asyncio.sleep(retry_delay(failures, self.config.engine_backoff_s))
                continue
            append_generation(
                trajectory, generation, num_experts=self.num_experts, started_at=started, ended_at=time.time()
            )
            produced += generation.tokens
            if generation.finish_reason is not FinishReason.ABORT:
                return produced
            if self.engine.version == version_before:  # aborted, but not for new weights
                failures += 1
                self.counts["engine_errors"] += 1
                if failures > self.config.engine_retries:
                    return "engine aborted the request"
                await asyncio.sleep(retry_delay(failures, self.config.engine_backoff_s))
            self.counts["resumed"] += 1  # interrupted: continue (under the new version, if any)
            if len(produced) >= budget:
                return produced

    async def _call_engine(self, trajectory: Trajectory, sampling: SamplingParams) -> Generation:
        """Generate from the record's tokens, asking for the routes the record lacks."""
        tokens = list(trajectory.tokens)
        if not (self.num_experts > 0 and self.config.record_routes):
            return await self.engine.generate(tokens, sampling, session=trajectory.id)
        if not self._routes_from:
            return await self.engine.generate(
                tokens, sampling, return_routed_experts=True, session=trajectory.id
            )
        return await cast(EngineWithRoutesStart, self.engine).generate(
            tokens,
            sampling,
            return_routed_experts=True,
            routed_experts_start_len=trajectory.routed_length,
            session=trajectory.id,
        )

    def _finish(
        self,
        trajectory: Trajectory,
        status: Status,
        reason: str,
        reward: float,
        info: dict[str, Any] | None = None,
    ) -> Trajectory:
        env_info = _jsonable(info or {})
        reward_value: float | None = reward if status in (Status.COMPLETED, Status.TRUNCATED) else None
        trajectory.finish(
            status,
            reason=reason,
            reward=reward_value,
            env_info=env_info,
            completed_version=max([self.engine.version, *trajectory.versions]),
            completed_at=time.time(),
        )
        return trajectory

    def _render(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None, *, generation_prompt: bool
    ) -> str:
        return render_chat(self.tokenizer, messages, tools, generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _decode_content(self, tokens: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(tokens), skip_special_tokens=False)
        return text.removesuffix(self._eos_text) if self._eos_text else text


def append_generation(
    trajectory: Trajectory, generation: Generation, *, num_experts: int, started_at: float, ended_at: float
) -> None:
    """Record one engine call into a running trajectory: the routes its prefill computed for the
    prompt or tool segments that lacked them, then one model segment per run of a single version
    (`finish_reason` on the last, `weight_update` on the others), with their tokens' routes.

    The generation's routes must start at or before the record's `routed_length` (the call asked for
    `routed_experts_start_len` = `routed_length`, or for everything) and cover its input positions up
    to the last computed one; `num_experts` is the experts per MoE layer."""
    tokens, versions = generation.tokens, generation.versions
    rows = _new_routes(trajectory, generation, num_experts)
    reason = generation.finish_reason.value
    start = 0
    for version, run in itertools.groupby(range(len(tokens)), key=lambda i: versions[i]):
        end = start + len(list(run))
        experts = None
        if rows is not None:
            experts = RoutedExperts.from_array(rows[start:end], num_experts=num_experts)
        trajectory.append_model(
            tokens[start:end],
            generation.logprobs[start:end],
            version=version,
            started_at=started_at,
            ended_at=ended_at,
            routed_experts=experts,
            finish_reason=reason if end == len(tokens) else "weight_update",
        )
        start = end


def _new_routes(trajectory: Trajectory, generation: Generation, num_experts: int) -> np.ndarray | None:
    """Attach the rows of the positions before the generated tokens that the record lacks, and return
    the rows of the generated tokens (None when the engine sent no routes or no tokens)."""
    routes = generation.routed_experts
    if routes is None:
        return None
    held, start = trajectory.routed_length, generation.routed_experts_start
    context = len(trajectory.tokens) - 1  # input positions before the one that produced the first token
    if start > held or len(routes) != max(0, context + len(generation.tokens) - start):
        raise ValueError(
            f"the engine sent {len(routes)} rows from input position {start} for {context + 1} prompt and "
            f"{len(generation.tokens)} generated tokens; the record holds the rows of inputs before {held}"
        )
    if context > held:
        prefill = RoutedExperts.from_array(routes[held - start : context - start], num_experts)
        trajectory.attach_routes(prefill, held)
    return routes[context - start :] if generation.tokens else None


def _action(content: str) -> str:
    """What the env acts on: the assistant's message without a leading `<think>` block, as reasoning
    parsers (SGLang's, vLLM's) hand it over: calls and answers inside the reasoning do not count."""
    reasoning, answer = split_reasoning(content)
    return content if reasoning is None else answer


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    return str(value)


async def _done(trajectory: Trajectory) -> Trajectory:
    return trajectory
