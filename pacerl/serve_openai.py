"""`pacerl serve openai`: the embedded engine behind an OpenAI-compatible chat-completions API.

Routes: `GET /v1/models`, `POST /v1/chat/completions` (non-streaming; `stream: true` is refused with
HTTP 400) and `GET /health`. A request's messages and tools are rendered with the tokenizer's chat
template; the engine generates with the request's sampling (`max_completion_tokens` or `max_tokens`,
`temperature`, `top_p`, `top_k`, `stop`, `n`, `seed`), the matched stop named in the choice's
`stop_reason` (vLLM's field) and the tokenizer's special tokens kept out of `content`; vLLM's
`add_generation_prompt` and `continue_final_message` continue a final assistant message; a field the
server would otherwise ignore (`ChatRequest.unsupported`: `response_format` other than text,
penalties, `logit_bias`, ...) is a 400 naming it. `<tool_call>{json}</tool_call>` blocks in the generated
text become structured `tool_calls` (finish reason `tool_calls`) when the request offered tools, as the
Hermes tool parsers of vLLM and SGLang do, and a malformed block leaves the whole text as content.
`logprobs: true` returns each generated token's log-prob (no `top_logprobs`: the engine keeps only the
sampled token's). Every error has the API's shape, `{"error": {"message", "type", "param", "code"}}`
(`error_body`): 400 for a bad request, a prompt over the context or a completion budget (`n` times
`max_tokens`) over what it leaves, 401 for a missing or wrong API key (`--api-key-env NAME`), 404
for an unknown model or route, 500 when the engine fails, and the HTTP guard's refusals.

Hostile clients meet the guard of the sandbox and retriever servers (`pacerl.sandbox.http_guard`): the key
is checked before a byte of the body is read; bodies are capped (413), budgeted and timed (408);
headers are capped (431) and timed; connections are capped (the one waiting longest for a request is
closed to make room); at most `max_concurrency` requests are worked on at once and `max_queue` wait,
more get 503. Rendering and tokenizing (and decoding the answer) run on one worker thread, never on
the event loop; a rendered prompt of more characters than the context could hold tokens is refused
without being tokenized.

An assistant message's structured `tool_calls` are written back into its text as the model generated
them unless the tokenizer's template renders `tool_calls` itself (it mentions them), so multi-turn
conversations render the way the model saw them.

This module holds the API's shapes (requests, errors, tool calls in and out) and the command's parser;
the app and its engine are in `pacerl.openai_app`, imported only when the server starts (torch and
fastapi take seconds to import, and `pacerl --help` builds every parser).
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import pydantic

from pacerl.envs.chat_template import assistant_message
from pacerl.envs.parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from pacerl.sandbox.http_guard import MIB, HttpGuardConfig, add_guard_flags

MAX_N = 16
"""Choices one request may ask for."""
MAX_QUEUE = 64
"""Requests that may wait for one being worked on to finish, by default; more get HTTP 503."""
GUARD = HttpGuardConfig()
"""The server's HTTP limits by default: the guard's own (bodies up to 16 MiB, 64 MiB held at once)."""


class _Lenient(pydantic.BaseModel):
    """Fields this server does not know are ignored, as vLLM and SGLang ignore them."""

    model_config = pydantic.ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    name: str
    arguments: str = ""


class ToolCallIn(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    name: str = pydantic.Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(_Lenient):
    """The chat-completions request fields this server reads."""

    model: str
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = pydantic.Field(default=None, ge=1)
    max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
    temperature: float | None = pydantic.Field(default=None, ge=0, le=2)
    top_p: float | None = pydantic.Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    n: int = pydantic.Field(default=1, ge=1, le=MAX_N)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=20)
    stream: bool = False
    top_k: int | None = pydantic.Field(default=None, ge=-1)
    """vLLM's and SGLang's extension: sample among the k most likely tokens (0 or -1: all)."""
    add_generation_prompt: bool = True
    """vLLM's extension: end the rendered prompt with the template's opening of an assistant turn."""
    continue_final_message: bool = False
    """vLLM's extension: the answer continues the final (assistant) message's text in the same turn."""
    response_format: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field set to something this server would otherwise ignore:
        refused, so that a client never takes an unconstrained answer for a constrained one."""
        problems = [
            (self.response_format not in (None, {"type": "text"}), "response_format",
             "only {'type': 'text'} is supported (no JSON mode or schema-constrained decoding)"),
            (self.frequency_penalty not in (None, 0), "frequency_penalty", "penalties are not supported"),
            (self.presence_penalty not in (None, 0), "presence_penalty", "penalties are not supported"),
            (self.repetition_penalty not in (None, 1), "repetition_penalty", "penalties are not supported"),
            (self.min_p not in (None, 0), "min_p", "min_p sampling is not supported"),
            (bool(self.logit_bias), "logit_bias", "logit_bias is not supported"),
            (self.parallel_tool_calls is False, "parallel_tool_calls",
             "parallel_tool_calls=false is not supported (an answer may hold several calls)"),
            (self.include_stop_str_in_output or self.no_stop_trim, "include_stop_str_in_output",
             "stop strings are always cut from the content (the choice's stop_reason names the one)"),
            (self.continue_final_message and self.add_generation_prompt, "continue_final_message",
             "continue_final_message needs add_generation_prompt=false"),
            (self.continue_final_message and self.messages[-1].role != "assistant", "continue_final_message",
             "continue_final_message needs the last message to be the assistant's"),
        ]  # fmt: skip
        return next(((name, why) for bad, name, why in problems if bad), None)


class ApiError(Exception):
    """An answer in the API's error shape; `kind` (the error's `type`) defaults by status."""

    def __init__(
        self, status: int, message: str, *, kind: str | None = None, param: str | None = None,
        code: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_body(status: int, message: str) -> bytes:
    """The API's error shape for the HTTP guard's refusals (`pacerl.sandbox.http_guard.ErrorBody`): 401 is
    OpenAI's `invalid_api_key`."""
    code = "invalid_api_key" if status == 401 else None
    return json.dumps(ApiError(status, message, code=code).body()).encode()


def context_error(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="context_length_exceeded")


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != "text" or part.text is None for part in content):
        raise ApiError(400, f"{where}: only text content parts are supported", param="messages")
    return "".join(part.text or "" for part in content)


def _template_call(call: ToolCallIn) -> dict[str, Any]:
    arguments = _arguments(call.function.arguments)
    return {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return text


def template_messages(messages: Sequence[ChatMessage], native_tool_calls: bool) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them: `developer` is `system`; an assistant
    message's tool calls go into its text as `<tool_call>` blocks unless the template renders
    `tool_calls` itself (`native_tool_calls`)."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        content = _text(message.content, f"messages[{index}]")
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": content}
        if role == "tool" and message.name:
            item["name"] = message.name
        calls = message.tool_calls or []
        if role == "assistant" and calls:
            if native_tool_calls:
                item["tool_calls"] = [_template_call(c) for c in calls]
            else:
                blocks = [
                    TOOL_CALL_OPEN
                    + json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)})
                    + TOOL_CALL_CLOSE
                    for c in calls
                ]
                item["content"] = "\n".join([content, *blocks] if content else blocks)
        out.append(item)
    return out


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of generated text in the API's shape: the calls the project's parser
    finds (`pacerl.envs.chat_template.assistant_message`: `<tool_call>` blocks, or a whole-message Llama or
    Mistral JSON call) with their arguments as JSON text, removed from the content; a malformed
    `<tool_call>` block leaves the text whole, without calls (as the Hermes parsers of vLLM and SGLang
    do)."""
    message = assistant_message(text, reasoning_field=False)
    if "tool_calls" not in message or TOOL_CALL_OPEN in message["content"]:
        return text, []
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": call["function"]["name"],
                "arguments": json.dumps(call["function"]["arguments"]),
            },
        }
        for call in message["tool_calls"]
    ]
    return message["content"].strip() or None, calls


def add_serve_openai_parser(serve_commands: Any) -> None:
    """`pacerl serve openai`, added to the `pacerl serve` subcommands."""
    parser = serve_commands.add_parser(
        "openai", help="OpenAI-compatible /v1/chat/completions over the embedded engine (no streaming)"
    )
    parser.add_argument(
        "--model", default=None, help="a model directory (default: the tiny MoE, random weights)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients send (default: the directory's)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key-env", default=None, metavar="NAME",
        help="environment variable holding the API key every request but /health must bear (default: none)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's samplers")
    parser.add_argument("--max-batch", type=int, default=64, help="requests decoded together at most")
    parser.add_argument(
        "--max-concurrency", type=int, default=None, metavar="N",
        help="chat requests worked on at once (default: --max-batch)",
    )  # fmt: skip
    parser.add_argument(
        "--max-queue", type=int, default=MAX_QUEUE, metavar="N",
        help="chat requests waiting for one of those; more get HTTP 503 (default: %(default)s)",
    )  # fmt: skip
    budget = (f"{GUARD.max_body_bytes // MIB} MiB", f"{GUARD.body_budget_bytes // MIB} MiB")
    add_guard_flags(parser, budget)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from pacerl.openai_app import serve

    return serve(args)
