"""Served models through the OpenAI chat-completions API: a client on the official `openai` package
and a message-level episode player, so any compatible server (SGLang, vLLM, `pacerl serve openai`,
a hosted API) is evaluated on pacerl's tool envs with the same report as a local model.

The rollout driver (`agents.rollout`) is token-level; a chat-completions endpoint is message-level, so
episodes of a served model are played here instead:

    reset → messages + the env's tools → chat.completions → the answer's structured `tool_calls`
    written as the env's `<tool_call>{json}</tool_call>` action → `astep` → each tool observation sent
    back as a `role: tool` message with its call's `tool_call_id` → … until the env ends the episode.

A server without a tool-call parser answers with the calls in its text; the env parses them from the
text as it would a local model's, and their observations go back as one user turn of
`<tool_response>` blocks (the convention of Hermes/Qwen chat templates).

Nothing a server answers hangs or loses an episode: a malformed call (arguments that are not a JSON
object, an unknown tool, no name) becomes an error observation the model reads (the env's own); an
empty answer, an HTTP error or an unreachable server (after the client's bounded retries) ends the
episode `failed` with its reason, counted in the report's failures.

    client = OpenAIChatClient(OpenAIChatOptions(base_url="http://127.0.0.1:8000/v1"))
    report = await evaluate_served(client, make_env, load_tasks("codemath-val"), EvalConfig(samples=4))
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import openai

from agents.evaluation import EpisodeOutcome, EvalConfig, EvalReport, build_report
from agents.trajectory import Status
from envs import Task, ToolEnv
from envs.parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

NOT_RUN = (
    "Error: this call was not run (the episode's tool-call budget or the per-message cap on calls was "
    "reached)"
)
"""The observation of a structured call the env did not run, so that every `tool_call_id` is answered."""


@dataclass(frozen=True)
class OpenAIChatOptions:
    """How to reach one OpenAI-compatible chat-completions server."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """The API's base URL, `/v1` included (what `openai.AsyncOpenAI(base_url=...)` takes)."""
    model: str = ""
    """The model name sent with each request; "" asks the server (`/v1/models`) and takes its only model."""
    api_key_env: str = ""
    """Name of the environment variable holding the API key, sent as `Authorization: Bearer <key>`; "":
    no key (a placeholder is sent). A named variable that is unset or empty is an error at once."""
    timeout_s: float = 600.0
    """Seconds one request may take (each attempt)."""
    max_retries: int = 2
    """Further attempts the `openai` client makes after a connection error, a timeout, HTTP 408, 409,
    429 or 5xx, with its own backoff; then the episode fails."""
    tools: bool = True
    """Send the env's tool schemas as the request's `tools` (the server's template renders them)."""
    stop: tuple[str, ...] = ()
    """Stop sequences of every request. OpenAI semantics cut them from the answer, so `</tool_call>`
    here would break a server's tool-call parser: the defaults send none."""
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    """Extra JSON fields of every request, for what a server adds to the API (vLLM's and SGLang's
    `top_k`, `chat_template_kwargs`)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.base_url.startswith(("http://", "https://")):
            problems.append(f"base_url must be http(s)://..., got {self.base_url!r}")
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            problems.append(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if isinstance(self.max_retries, bool) or not 0 <= self.max_retries <= 20:
            problems.append(f"max_retries must be in 0..20, got {self.max_retries!r}")
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop holds at most 4 non-empty strings (the API's limit), got {self.stop!r}")
        if problems:
            raise ValueError("invalid OpenAI chat options: " + "; ".join(problems))

    def api_key(self) -> str | None:
        """The key from `api_key_env` (None when no variable is named); ValueError when it is unset."""
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ValueError(
                f"api_key_env names {self.api_key_env!r}, but that environment variable is unset"
            )
        return key


class ServedModelError(RuntimeError):
    """A request the server did not answer usefully (unreachable, HTTP error, no choice)."""


@dataclass(frozen=True)
class ChatToolCall:
    """One structured tool call of an answer, as the server sent it."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (not necessarily valid: the env judges them)."""


@dataclass(frozen=True)
class ChatAnswer:
    """One chat completion's first choice and its token counts."""

    content: str
    tool_calls: tuple[ChatToolCall, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    def message(self) -> dict[str, Any]:
        """The assistant message to send back in the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return message


class OpenAIChatClient:
    """Chat completions through `openai.AsyncOpenAI`, built on first use in the loop that uses it."""

    def __init__(self, options: OpenAIChatOptions | None = None) -> None:
        self.options = options or OpenAIChatOptions()
        self._key = self.options.api_key()  # fail fast on an unset variable
        self._client: openai.AsyncOpenAI | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._model = self.options.model

    def _api(self) -> openai.AsyncOpenAI:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # connections belong to one loop
            self._client = openai.AsyncOpenAI(
                base_url=self.options.base_url,
                api_key=self._key or "EMPTY",  # the client insists on one; servers without keys ignore it
                timeout=self.options.timeout_s,
                max_retries=self.options.max_retries,
            )
            self._loop = loop
        return self._client

    async def model(self) -> str:
        """The model name requests carry: the configured one, else the server's only model."""
        if self._model:
            return self._model
        try:
            listed = [model.id async for model in self._api().models.list()]
        except openai.OpenAIError as error:
            raise ServedModelError(
                f"cannot list the models of {self.options.base_url}: {_brief(error)}"
            ) from None
        if len(listed) != 1:
            raise ServedModelError(
                f"{self.options.base_url} serves {len(listed)} models {listed}; name one (model=...)"
            )
        self._model = listed[0]
        return self._model

    async def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> ChatAnswer:
        """One chat completion (n = 1); ServedModelError when none came after the bounded retries."""
        extra: dict[str, Any] = {}
        if tools:
            extra["tools"] = list(tools)
        if self.options.stop:
            extra["stop"] = list(self.options.stop)
        if seed is not None:
            extra["seed"] = seed
        if top_p < 1:
            extra["top_p"] = top_p
        model = await self.model()
        try:
            response = await self._api().chat.completions.create(
                model=model,
                messages=list(messages),  # type: ignore[arg-type]  # plain dicts of the API's shape
                max_tokens=max_tokens,
                temperature=temperature,
                extra_body=dict(self.options.extra_body) or None,
                **extra,
            )
        except openai.APIStatusError as error:
            raise ServedModelError(f"HTTP {error.status_code}: {_brief(error)}") from None
        except openai.APIConnectionError as error:  # a timeout included
            raise ServedModelError(f"cannot reach {self.options.base_url}: {_brief(error)}") from None
        if not response.choices:
            raise ServedModelError("the server answered no choice")
        choice = response.choices[0]
        calls = tuple(
            ChatToolCall(call.id, call.function.name, call.function.arguments or "")
            for call in choice.message.tool_calls or ()
            if call.type == "function"
        )
        usage = response.usage
        return ChatAnswer(
            content=choice.message.content or "",
            tool_calls=calls,
            finish_reason=str(choice.finish_reason),
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
        )

    async def aclose(self) -> None:
        """Close the HTTP connections. Idempotent."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


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
    tools = [_openai_tool(schema) for schema in env.tool_schemas()] if client.options.tools else []
    while True:
        room = config.max_total_tokens - episode.context_tokens
        if room <= 0:
            return _end(episode, Status.TRUNCATED, "context budget exhausted", 0.0)
        seed = zlib.crc32(f"{config.seed}/{episode_id}/{episode.turns}".encode()) & 0x7FFFFFFF
        try:
            answer = await client.complete(
                episode.messages,
                tools,
                max_tokens=min(config.max_new_tokens, room),
                temperature=config.temperature,
                top_p=config.top_p,
                seed=seed,
            )
        except ServedModelError as error:
            return _end(episode, Status.FAILED, f"engine failed: {error}", None)
        episode.turns += 1
        episode.completion_tokens += answer.completion_tokens
        episode.context_tokens = answer.prompt_tokens + answer.completion_tokens
        episode.messages.append(answer.message())
        if not answer.content.strip() and not answer.tool_calls:
            return _end(episode, Status.FAILED, f"empty answer (finish_reason {answer.finish_reason})", None)
        action, spans = _action(answer)
        observation, reward, terminated, truncated, info = await env.astep(action)
        episode.env_info = info
        if terminated or truncated:
            status = Status.COMPLETED if terminated else Status.TRUNCATED
            reason = "" if terminated else str(info.get("truncation_reason") or "truncated")
            return _end(episode, status, reason, float(reward))
        if answer.tool_calls:
            episode.messages += _tool_messages(env, action, spans, answer.tool_calls, observation)
        else:  # calls written in the text: the observations come back as the template would render them
            blocks = "\n".join(f"<tool_response>\n{m['content']}\n</tool_response>" for m in observation)
            episode.messages.append({"role": "user", "content": blocks})


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


async def evaluate_served(
    client: OpenAIChatClient,
    make_env: Callable[[], ToolEnv],
    tasks: Sequence[Task],
    config: EvalConfig | None = None,
    *,
    label: str = "",
    on_group: Callable[[Sequence[ServedEpisode]], None] | None = None,
    on_episode: Callable[[int], None] | None = None,
) -> EvalReport:
    """`agents.evaluation.evaluate` for a served model: `config.samples` episodes of each task (the first
    `max_tasks`), scored per episode into the same `EvalReport`; `on_episode` gets each episode's
    generated tokens as it ends. From `config` it takes samples,
    temperature, max_new_tokens (per answer), max_total_tokens (the conversation's tokens, from the
    server's usage counts), ks, success_threshold, max_tasks, seed (each request's seed derives from it)
    and max_concurrent_tasks; the stop strings and tools are the client's (`OpenAIChatOptions`), and the
    report's config says so. `policy_version` is 0: a served model has no version pacerl knows. The
    client is left open."""
    config = config or EvalConfig()
    chosen = list(tasks[: config.max_tasks] if config.max_tasks is not None else tasks)
    if not chosen:
        raise ValueError("there are no tasks to evaluate")
    if len({task.id for task in chosen}) != len(chosen):
        raise ValueError("task ids must be unique: each task's samples are one group named by its id")
    await client.model()  # a wrong URL or key fails here, once, not in every episode
    slots = asyncio.Semaphore(config.max_concurrent_tasks)

    async def episode(task: Task, index: int) -> ServedEpisode:
        env = make_env()
        try:
            played = await play_episode(client, env, task, config, f"eval/{task.id}/{index}")
        finally:
            env.close()
        if on_episode is not None:
            on_episode(played.completion_tokens)
        return played

    async def group(task: Task) -> list[ServedEpisode]:
        async with slots:
            played = list(await asyncio.gather(*(episode(task, i) for i in range(config.samples))))
        if on_group is not None:
            on_group(played)
        return played

    started = time.perf_counter()
    groups = await asyncio.gather(*(group(task) for task in chosen))
    wall = time.perf_counter() - started
    ran = replace(config, stop_strings=client.options.stop, tool_schemas_in_prompt=client.options.tools)
    return served_report(chosen, groups, ran, label, wall)


def served_report(
    tasks: Sequence[Task],
    groups: Sequence[Sequence[ServedEpisode]],
    config: EvalConfig,
    label: str,
    wall: float,
) -> EvalReport:
    """The `EvalReport` of served episodes, computed as `evaluate` computes it from trajectories."""
    outcomes = [
        [EpisodeOutcome(e.status, e.status_reason, e.reward, e.tool_calls > 0, e.turns, e.completion_tokens)
         for e in played]
        for played in groups
    ]  # fmt: skip
    return build_report(tasks, outcomes, config, 0, label, wall)


def _brief(error: Exception) -> str:
    """The server's own message when its error body has one (the API's `{"error": {"message"}}`)."""
    body = getattr(error, "body", None)
    text = body.get("message") if isinstance(body, dict) else None
    if not isinstance(text, str) or not text:
        text = getattr(error, "message", None) or str(error) or type(error).__name__
    return text if len(text) <= 300 else text[:300] + "..."
