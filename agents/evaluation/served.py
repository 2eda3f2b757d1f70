"""Episodes of a served model, played message by message: the rollout driver (`pacerl.agents.rollout`) is
token-level, a chat-completions endpoint (`pacerl.agents.engine.openai_chat`) is message-level, so its
episodes are played here:

    reset → messages + the env's tools → chat.completions → the answer's structured `tool_calls`
    written as the env's `<tool_call>{json}</tool_call>` action → `astep` → each tool observation sent
    back as a `role: tool` message with its call's `tool_call_id` → … until the env ends the episode.

A server without a tool-call parser answers with the calls in its text; the env parses them from the
text as it would a local model's, and their observations go back as one user turn of
`<tool_response>` blocks (the convention of Hermes/Qwen chat templates). An observation of `role: user`
messages (a multi-turn env's next user turn, BFCL's) goes back as those messages, as they are; the
env's tools are asked for before each request, so a tool it adds mid-episode is offered from then on.

An env whose observations continue the assistant's text (`inline_observations`: Search-R1's
`pacerl/SearchR1-v0`) is played as the rollout driver plays it locally: each request carries the env's
`stop_strings` (`</search>`, `</answer>`) beside the client's; the stop string the server cut from the
answer (OpenAI semantics) is put back, so the env reads the turn a local engine would have produced;
the observation (`<information>...</information>`) is appended to the assistant message's text, and
the next request continues that message (`continue_final`) instead of opening a new turn. The whole
episode is then one user message and one growing assistant message.

Nothing a server answers hangs or loses an episode: a malformed call (arguments that are not a JSON
object, an unknown tool, no name) becomes an error observation the model reads (the env's own); an
empty answer, an HTTP error or an unreachable server (after the client's bounded retries) ends the
episode `failed` with its reason, counted in the report's failures.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pacerl.agents.engine.openai_chat import (
    ChatAnswer,
    ChatToolCall,
    OpenAIChatClient,
    OpenAIChatOptions,
    ServedModelError,
)
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.report import EpisodeOutcome, final_answer
from pacerl.agents.trajectory import Status
from pacerl.envs import Task, ToolEnv
from pacerl.envs.parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

NOT_RUN = (
    "Error: this call was not run (the episode's tool-call budget or the per-message cap on calls was "
    "reached)"
)
"""The observation of a structured call the env did not run, so that every `tool_call_id` is answered."""


@dataclass
class ServedEpisode:
    """One episode of a served model: the conversation as exchanged with the server, and its outcome."""

    id: str
    task_id: str
    status: Status
    status_reason: str = ""
    reward: float | None = None
    """The env's final reward (None for a failed episode)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Every message sent to or answered by the server, in order."""
    turns: int = 0
    """Assistant answers."""
    completion_tokens: int = 0
    """Tokens the model generated, all turns together (the server's usage counts)."""
    context_tokens: int = 0
    """The last answer's prompt plus completion tokens: the conversation's length so far."""
    env_info: dict[str, Any] = field(default_factory=dict)
    """The env's info of its last step."""
    answer: str | None = None
    """The final answer the env extracted from a completed episode's last answer (`final_answer`)."""

    @property
    def tool_calls(self) -> int:
        """The env's count of tool calls when it reported one, else the tool turns of the conversation."""
        calls = self.env_info.get("tool_calls")
        if isinstance(calls, int):
            return calls
        return sum(m["role"] == "tool" for m in self.messages)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (for transcripts)."""
        data = asdict(self)
        data["status"] = self.status.value
        return data

    def outcome(self) -> EpisodeOutcome:
        """What the report counts of this episode, as it counts a trajectory's."""
        return EpisodeOutcome(
            self.status,
            self.status_reason,
            self.reward,
            self.tool_calls > 0,
            self.turns,
            self.completion_tokens,
            self.answer,
        )


async def play_episode(
    client: OpenAIChatClient,
    env: ToolEnv,
    task: Task,
    config: EvalConfig,
    episode_id: str,
) -> ServedEpisode:
    """One episode of `task` on `env` with the served model; always returns a finished record."""
    observation, _ = env.reset(options={"task": task})
    episode = ServedEpisode(episode_id, task.id, Status.RUNNING, messages=[dict(m) for m in observation])
    stops = served_stop_strings(client.options, env)
    inline = bool(getattr(env, "inline_observations", False))
    while True:
        room = config.max_total_tokens - episode.context_tokens
        if room <= 0:
            return _end(episode, Status.TRUNCATED, "context budget exhausted", 0.0)
        seed = zlib.crc32(f"{config.seed}/{episode_id}/{episode.turns}".encode()) & 0x7FFFFFFF
        continuing = inline and episode.messages[-1]["role"] == "assistant"
        # Asked each request: an env may offer more tools as the episode goes (BFCL's miss_func turns).
        tools = [_openai_tool(schema) for schema in env.tool_schemas()] if client.options.tools else []
        try:
            answer = await client.complete(
                episode.messages,
                tools,
                max_tokens=min(config.max_new_tokens, room),
                temperature=config.temperature,
                top_p=config.top_p,
                seed=seed,
                stop=stops,
                continue_final=continuing,
            )
        except ServedModelError as error:
            return _end(episode, Status.FAILED, f"engine failed: {error}", None)
        answer = replace(answer, content=restore_stop(answer, stops))
        episode.turns += 1
        episode.completion_tokens += answer.completion_tokens
        episode.context_tokens = answer.prompt_tokens + answer.completion_tokens
        if continuing:
            episode.messages[-1]["content"] += answer.content
        else:
            episode.messages.append(answer.message())
        if not answer.content.strip() and not answer.tool_calls:
            return _end(episode, Status.FAILED, f"empty answer (finish_reason {answer.finish_reason})", None)
        action, spans = (answer.content, []) if inline else _action(answer)
        observation, reward, terminated, truncated, info = await env.astep(action)
        episode.env_info = info
        if terminated:
            episode.answer = final_answer(env, answer.content)
        if terminated or truncated:
            status = Status.COMPLETED if terminated else Status.TRUNCATED
            reason = "" if terminated else str(info.get("truncation_reason") or "truncated")
            return _end(episode, status, reason, float(reward))
        if observation and all(m["role"] == "user" for m in observation):  # the user's next turn (BFCL)
            episode.messages += [dict(m) for m in observation]
        elif inline:  # the observation continues the assistant's text, as the rollout driver appends it
            episode.messages[-1]["content"] += "".join(m["content"] for m in observation)
        elif answer.tool_calls:
            episode.messages += _tool_messages(env, action, spans, answer.tool_calls, observation)
        else:  # calls written in the text: the observations come back as the template would render them
            blocks = "\n".join(f"<tool_response>\n{m['content']}\n</tool_response>" for m in observation)
            episode.messages.append({"role": "user", "content": blocks})


def served_stop_strings(options: OpenAIChatOptions, env: ToolEnv) -> tuple[str, ...]:
    """The stop strings of an episode's requests: the env's own (`stop_strings`, e.g. Search-R1's
    `</search>`, `</answer>`), then the client's; a ValueError past the API's four."""
    stops = tuple(dict.fromkeys([*getattr(env, "stop_strings", ()), *options.stop]))
    if len(stops) > 4:
        raise ValueError(
            f"the env's stop strings and openai.stop make {len(stops)} (the API takes at most 4): {stops}"
        )
    return stops


def restore_stop(answer: ChatAnswer, stops: Sequence[str]) -> str:
    """The answer's text with the stop string the server cut from it put back, so the env reads the
    turn as a local engine (which keeps it) would have generated it. The server's own word on which
    stop matched (`matched_stop`) decides; a server that does not say (OpenAI's API) gets the stop
    string `</tag>` whose opening `<tag>` the text leaves unclosed, the latest opened when several are.
    An answer that ended otherwise (`length`, `tool_calls`) or already ends in a stop is left as it is."""
    text = answer.content
    if answer.finish_reason != "stop" or not stops or any(text.endswith(s) for s in stops):
        return text
    if answer.matched_stop is not None:
        return text + answer.matched_stop if answer.matched_stop in stops else text
    unclosed = [
        (opened, stop)
        for stop in stops
        if stop.startswith("</") and stop.endswith(">")
        and (opened := text.rfind("<" + stop[2:])) > text.rfind(stop)
    ]  # fmt: skip
    return text + max(unclosed)[1] if unclosed else text


def _end(episode: ServedEpisode, status: Status, reason: str, reward: float | None) -> ServedEpisode:
    episode.status, episode.status_reason, episode.reward = status, reason, reward
    return episode


def _openai_tool(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`{"type": "function", "function": {...}}` whether the env gave that or the bare function schema."""
    if schema.get("type") == "function" and isinstance(schema.get("function"), Mapping):
        return dict(schema)
    return {"type": "function", "function": dict(schema)}


def _action(answer: ChatAnswer) -> tuple[str, list[tuple[int, int]]]:
    """The env's action for an answer: its text, then each structured call as a `<tool_call>` block,
    with the `[start, end)` span of each block in the action. Arguments that are not JSON go in as a
    string, which the env refuses with a message the model reads, as it refuses a bad object."""
    action = answer.content
    spans: list[tuple[int, int]] = []
    for call in answer.tool_calls:
        try:
            arguments: Any = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = call.arguments
        block = TOOL_CALL_OPEN + json.dumps({"name": call.name, "arguments": arguments}) + TOOL_CALL_CLOSE
        action += "\n" if action else ""
        spans.append((len(action), len(action) + len(block)))
        action += block
    return action, spans


def _tool_messages(
    env: ToolEnv,
    action: str,
    spans: Sequence[tuple[int, int]],
    calls: Sequence[ChatToolCall],
    observation: Sequence[Mapping[str, str]],
) -> list[dict[str, Any]]:
    """One `role: tool` message per structured call, holding the env's observations of it.

    The env answers a message's malformed calls first, then its well-formed ones, each in text order,
    and stops at its tool-call budget; the env's own parse of the action says which block each
    observation belongs to. A call the env did not run is answered with `NOT_RUN`; an observation of no
    structured call (a code block in the answer's text) is added to the last tool message."""
    parsed = env.parse(action)
    starts = [error.start for error in parsed.errors] + [call.start for call in parsed.calls]
    answers: list[list[str]] = [[] for _ in calls]
    stray: list[str] = []
    for index, message in enumerate(observation):
        owner = None
        if index < len(starts):
            owner = next((i for i, (a, b) in enumerate(spans) if a <= starts[index] < b), None)
        (stray if owner is None else answers[owner]).append(message["content"])
    messages: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": call.id, "content": "\n".join(texts) or NOT_RUN}
        for call, texts in zip(calls, answers, strict=True)
    ]
    if stray:
        messages[-1]["content"] += "\n" + "\n".join(stray)
    return messages
