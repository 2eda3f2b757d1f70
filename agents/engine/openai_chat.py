"""Served models through the OpenAI chat-completions API: a client on the official `openai` package for
any compatible server (SGLang, vLLM, `pacerl serve openai`, a hosted API). Episodes of a served model are
played message by message in the evaluation room (`pacerl.agents.evaluation.served`).

A failed request (an HTTP error, an unreachable server after the client's bounded retries, no choice)
raises `ServedModelError` with the server's own message, which the episode player records as the
episode's failure.

    client = OpenAIChatClient(OpenAIChatOptions(base_url="http://127.0.0.1:8000/v1"))
    answer = await client.complete(messages, tools, max_tokens=256, temperature=0.0)
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai


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
    matched_stop: str | None = None
    """The stop string that ended the answer when the server says (vLLM's `stop_reason`, SGLang's
    `matched_stop`); OpenAI semantics cut it from `content`."""

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
        stop: Sequence[str] | None = None,
        continue_final: bool = False,
    ) -> ChatAnswer:
        """One chat completion (n = 1); ServedModelError when none came after the bounded retries.
        `stop`: this request's stop strings (None: the options'). `continue_final`: the answer continues
        the final assistant message's text in the same turn (vLLM's `continue_final_message` with
        `add_generation_prompt` off, which `pacerl serve openai` reads too), as a local rollout continues
        an env's inline observation."""
        extra: dict[str, Any] = {}
        if tools:
            extra["tools"] = list(tools)
        stops = self.options.stop if stop is None else tuple(stop)
        if stops:
            extra["stop"] = list(stops)
        if seed is not None:
            extra["seed"] = seed
        if top_p < 1:
            extra["top_p"] = top_p
        body = dict(self.options.extra_body)
        if continue_final:
            body.update(continue_final_message=True, add_generation_prompt=False)
        model = await self.model()
        try:
            response = await self._api().chat.completions.create(
                model=model,
                messages=list(messages),  # type: ignore[arg-type]  # plain dicts of the API's shape
                max_tokens=max_tokens,
                temperature=temperature,
                extra_body=body or None,
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
        matched = getattr(choice, "stop_reason", None) or getattr(choice, "matched_stop", None)
        return ChatAnswer(
            content=choice.message.content or "",
            tool_calls=calls,
            finish_reason=str(choice.finish_reason),
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            matched_stop=matched if isinstance(matched, str) else None,  # a stop token's id is an int
        )

    async def aclose(self) -> None:
        """Close the HTTP connections. Idempotent."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


def _brief(error: Exception) -> str:
    """The server's own message when its error body has one (the API's `{"error": {"message"}}`)."""
    body = getattr(error, "body", None)
    text = body.get("message") if isinstance(body, dict) else None
    if not isinstance(text, str) or not text:
        text = getattr(error, "message", None) or str(error) or type(error).__name__
    return text if len(text) <= 300 else text[:300] + "..."
