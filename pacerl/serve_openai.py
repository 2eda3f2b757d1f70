"""`pacerl serve openai`: the embedded engine behind an OpenAI-compatible chat-completions API.

Routes: `GET /v1/models`, `POST /v1/chat/completions` (non-streaming; `stream: true` is refused with
HTTP 400) and `GET /health`. A request's messages and tools are rendered with the tokenizer's chat
template; the engine generates with the request's sampling (`max_completion_tokens` or `max_tokens`,
`temperature`, `top_p`, `stop`, `n`, `seed`); `<tool_call>{json}</tool_call>` blocks in the generated
text become structured `tool_calls` (finish reason `tool_calls`) when the request offered tools, as the
Hermes tool parsers of vLLM and SGLang do, and a malformed block leaves the whole text as content.
`logprobs: true` returns each generated token's log-prob (no `top_logprobs`: the engine keeps only the
sampled token's). Every error has the API's shape, `{"error": {"message", "type", "param", "code"}}`
(`error_body`): 400 for a bad request, a prompt over the context or a completion budget (`n` times
`max_tokens`) over what it leaves, 401 for a missing or wrong API key (`--api-key-env NAME`), 404
for an unknown model or route, 500 when the engine fails, and the HTTP guard's refusals.

Hostile clients meet the guard of the sandbox and retriever servers (`sandbox.http_guard`): the key
is checked before a byte of the body is read; bodies are capped (413), budgeted and timed (408);
headers are capped (431) and timed; connections are capped (the one waiting longest for a request is
closed to make room); at most `max_concurrency` requests are worked on at once and `max_queue` wait,
more get 503. Rendering and tokenizing (and decoding the answer) run on one worker thread, never on
the event loop; a rendered prompt of more characters than the context could hold tokens is refused
without being tokenized.

An assistant message's structured `tool_calls` are written back into its text as the model generated
them unless the tokenizer's template renders `tool_calls` itself (it mentions them), so multi-turn
conversations render the way the model saw them.

This module imports fastapi only when an app is built: the CLI parser (`add_serve_openai_parser`) is
built on every `pacerl` call.
"""

# No `from __future__ import annotations`: FastAPI reads the route annotations of `create_app`'s
# closures, which name fastapi, imported inside it.

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import pydantic

from envs.chat_template import assistant_message, render_chat
from envs.parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from sandbox.http_guard import MIB, HttpGuardConfig, add_guard_flags, guard_from_flags

MAX_N = 16
"""Choices one request may ask for."""
MAX_QUEUE = 64
"""Requests that may wait for one being worked on to finish, by default; more get HTTP 503."""
GUARD = HttpGuardConfig()
"""The server's HTTP limits by default: the guard's own (bodies up to 16 MiB, 64 MiB held at once)."""

_T = TypeVar("_T")


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
    """The API's error shape for the HTTP guard's refusals (`sandbox.http_guard.ErrorBody`): 401 is
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
    finds (`envs.chat_template.assistant_message`: `<tool_call>` blocks, or a whole-message Llama or
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


def create_app(
    engine: Any,
    tokenizer: Any,
    *,
    model_name: str = "pacerl",
    api_key: str | None = None,
    close_engine: bool = True,
    guard: HttpGuardConfig = GUARD,
    max_concurrency: int = 64,
    max_queue: int | None = MAX_QUEUE,
) -> Any:
    """The ASGI app (a `fastapi.FastAPI`) serving `engine` (an `EmbeddedEngine`, driven from the app's
    event loop) under `model_name`; with `api_key`, every request but `GET /health` wants
    `Authorization: Bearer <api_key>`, checked before its body is read. `guard` caps and times bodies;
    at most `max_concurrency` chat requests are worked on at once, `max_queue` more wait (None: no
    cap), more get HTTP 503. `close_engine`: close the engine when the app shuts down."""
    import fastapi
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    from agents.engine.protocol import ContextOverflowError, FinishReason, Generation, SamplingParams
    from sandbox.http_guard import Gate, guard_app

    native_tool_calls = "tool_calls" in str(getattr(tokenizer, "chat_template", "") or "")
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(getattr(engine, "model", None), "config", None), "eos_token_id", None)
    eos |= {configured} if isinstance(configured, int) else set(configured or [])
    max_context = int(getattr(engine, "max_context", 1 << 30))
    # No token stands for more characters than the vocabulary's longest entry (byte-level BPE: one
    # character per byte; SentencePiece: one per character), so a rendered prompt longer than this
    # holds more tokens than the context, and is refused without the cost of tokenizing it.
    longest_token = max((len(entry) for entry in tokenizer.get_vocab()), default=0)
    max_prompt_chars = max_context * longest_token if longest_token else None
    created = int(time.time())
    gate = Gate(max_concurrency, max_queue, "requests")
    # One thread renders, tokenizes and decodes for every request: off the event loop, and one at a
    # time, as Hugging Face's fast tokenizers are not safe to share between threads (vLLM does the same).
    tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pacerl-tokenizer")

    async def off_the_loop(work: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(
            tokenizer_thread, functools.partial(work, *args)
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            if close_engine:
                await engine.aclose()

    app = fastapi.FastAPI(title="pacerl OpenAI-compatible server", description=__doc__, lifespan=lifespan)
    app.state.request_gate = gate

    @app.exception_handler(ApiError)
    async def api_error(request: fastapi.Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: fastapi.Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        if first.get("type") == "json_invalid":
            reason = (first.get("ctx") or {}).get("error", "")
            bad_json = ApiError(400, f"the request body is not valid JSON: {reason}".rstrip(": "))
            return JSONResponse(bad_json.body(), status_code=400)
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(map(str, p.get('loc', ())[1:]))}: {p.get('msg')}" for p in problems)
        return JSONResponse(ApiError(400, message or "invalid request", param=where).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: fastapi.Request, error: HTTPException) -> JSONResponse:
        """FastAPI's own refusals (no route, wrong method, a body its parser gives up on) and the
        request queue's 503, in the API's shape."""
        message = str(error.detail)
        if error.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif error.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        body = ApiError(error.status_code, message).body()
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def server_error(request: fastapi.Request, error: Exception) -> JSONResponse:
        """A bug: the traceback goes to the log (Starlette re-raises), the client gets a 500."""
        return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}").body(), status_code=500)

    expected = f"Bearer {api_key}".encode()

    def authorize(scope: Mapping[str, Any]) -> str | None:
        if scope["path"] == "/health":
            return None
        given = next((value for name, value in scope["headers"] if name.lower() == b"authorization"), b"")
        return None if hmac.compare_digest(given, expected) else "Incorrect or missing API key."

    guard_app(app, guard, error_body=error_body, authorize=authorize if api_key is not None else None)

    @app.get("/health")
    async def health() -> fastapi.Response:
        """200 while the engine accepts requests."""
        return fastapi.Response(status_code=200 if await engine.health() else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The one model served."""
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "pacerl"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest) -> dict[str, Any]:
        """One non-streaming chat completion with `n` choices."""
        if body.model != model_name:
            raise ApiError(
                404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found"
            )
        if body.stream:
            raise ApiError(
                400, "streaming is not supported by this server; send stream=false", param="stream"
            )
        if body.top_logprobs:
            raise ApiError(
                400,
                "top_logprobs is not supported (only the sampled token's log-prob is kept)",
                param="top_logprobs",
            )
        choice = body.tool_choice
        if choice is not None and choice not in ("auto", "none"):
            raise ApiError(400, "tool_choice supports only 'auto' and 'none'", param="tool_choice")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or not all(stops):
            raise ApiError(400, "stop holds at most 4 non-empty strings", param="stop")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
        async with gate.slot():
            prompt = await off_the_loop(
                _prompt, tokenizer, body.messages, native_tool_calls, tools, max_context, max_prompt_chars
            )
            temperature = 1.0 if body.temperature is None else body.temperature
            budget = _completion_budget(body, len(prompt), max_context)
            samplings = [
                SamplingParams(
                    max_new_tokens=budget,
                    temperature=temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    stop_strings=tuple(stops),
                    seed=None if body.seed is None else body.seed + i,
                )
                for i in range(body.n)
            ]
            try:
                generations: list[Generation] = list(
                    await asyncio.gather(*(engine.generate(prompt, s) for s in samplings))
                )
            except ContextOverflowError as error:
                raise context_error(str(error), "messages") from None
            except RuntimeError as error:
                raise ApiError(500, f"the engine failed: {error}") from None
            if any(generation.finish_reason is FinishReason.ABORT for generation in generations):
                raise ApiError(503, "the engine aborted the request (shutting down?)")
            offer_tools = bool(tools) and choice != "none"
            choices = await off_the_loop(
                _choices, tokenizer, generations, eos, stops, offer_tools, body.logprobs
            )
        completion = sum(len(g.tokens) for g in generations)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
            },
        }

    return app


def _prompt(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    native_tool_calls: bool,
    tools: list[dict[str, Any]] | None,
    max_context: int,
    max_chars: int | None,
) -> list[int]:
    """The request's prompt tokens (on the tokenizer thread); 400 for a prompt the context cannot hold,
    refused before tokenizing when its characters alone say so (`max_chars`)."""
    text = _render(tokenizer, template_messages(messages, native_tool_calls), tools)
    if max_chars is not None and len(text) > max_chars:
        raise context_error(
            f"This model's maximum context length is {max_context} tokens. However, your messages "
            f"resulted in more: {len(text)} characters, and no token stands for more than "
            f"{max_chars // max_context}.",
            "messages",
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # JSON may carry lone surrogates ("\\ud800"); no tokenizer takes them
        raise ApiError(400, f"the messages are not valid Unicode text: {error}", param="messages") from None
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) >= max_context:
        raise context_error(
            f"This model's maximum context length is {max_context} tokens. However, your messages "
            f"resulted in {len(ids)} tokens.",
            "messages",
        )
    return ids


def _completion_budget(body: ChatRequest, prompt_tokens: int, max_context: int) -> int:
    """Tokens each of the `n` choices may generate: the request's `max_completion_tokens` or
    `max_tokens`, 400 when `n` of them do not fit in what the context leaves after the prompt (the
    request's work is bounded by one context); without either, that room shared by the choices."""
    room, n = max_context - prompt_tokens, body.n
    asked, param = body.max_completion_tokens, "max_completion_tokens"
    if asked is None:
        asked, param = body.max_tokens, "max_tokens"
    if asked is None:
        if room < n:
            raise context_error(
                f"This model's maximum context length is {max_context} tokens. However, your messages "
                f"resulted in {prompt_tokens} tokens, which leaves room for fewer than n={n} tokens.",
                "n",
            )
        return room // n
    if n * asked > room:
        completion = f"{asked} in the completion" if n == 1 else f"{n} x {asked} in the completions"
        raise context_error(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens + n * asked} tokens ({prompt_tokens} in the messages, {completion}). "
            f"Please reduce the length of the messages, {param} or n.",
            param,
        )
    return asked


def _choices(
    tokenizer: Any,
    generations: Sequence[Any],
    eos: set[int],
    stops: Sequence[str],
    offer_tools: bool,
    logprobs: bool,
) -> list[dict[str, Any]]:
    """The answer's choices from the engine's generations (on the tokenizer thread)."""
    from agents.engine.protocol import FinishReason

    choices = []
    for index, generation in enumerate(generations):
        tokens = list(generation.tokens)
        if tokens and tokens[-1] in eos and generation.finish_reason is FinishReason.STOP:
            tokens.pop()
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        cut = min((i for i in (text.find(s) for s in stops) if i != -1), default=-1)
        text = text if cut == -1 else text[:cut]
        content, calls = split_tool_calls(text) if offer_tools else (text, [])
        finish = "tool_calls" if calls else generation.finish_reason.value
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        entry: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": finish,
            "logprobs": None,
        }
        if logprobs:
            entry["logprobs"] = {"content": _logprobs(tokenizer, tokens, generation.logprobs)}
        choices.append(entry)
    return choices


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    from jinja2 import TemplateError

    try:
        text = render_chat(tokenizer, messages, tools, generation_prompt=True)
    except (TemplateError, ValueError, TypeError, KeyError) as error:
        raise ApiError(
            400, f"the chat template cannot render these messages: {error}", param="messages"
        ) from None
    return text


def _logprobs(tokenizer: Any, tokens: Sequence[int], logprobs: Sequence[float]) -> list[dict[str, Any]]:
    out = []
    for token, logprob in zip(tokens, logprobs, strict=False):
        text = tokenizer.decode([token], skip_special_tokens=False)
        out.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def build_engine(model: str | None, *, seed: int = 0, max_batch: int = 64) -> tuple[Any, Any, str]:
    """(engine, tokenizer, default model name): a checkpoint directory (`agents.models.load_model`), or
    the tiny MoE with random weights when `model` is None."""
    from agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from agents.models import TinyMoEConfig, build_tiny_moe, load_model
    from agents.tokenizer import tiny_tokenizer

    tokenizer: Any
    if model is None:
        tokenizer = tiny_tokenizer()
        weights = build_tiny_moe(TinyMoEConfig(), tokenizer)
        name = "pacerl-tiny"
    else:
        weights, tokenizer = load_model(model)
        name = os.path.basename(os.path.normpath(model)) or model
    engine = EmbeddedEngine(weights, tokenizer, EmbeddedEngineConfig(seed=seed, max_batch=max_batch))
    return engine, tokenizer, name


def serve(args: argparse.Namespace) -> int:
    """Run the server in the foreground until interrupted."""
    from sandbox.http_guard import run_server

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env, "")
        if not api_key:
            raise ValueError(
                f"--api-key-env names {args.api_key_env!r}, but that environment variable is unset"
            )
    guard = guard_from_flags(args, GUARD)
    engine, tokenizer, name = build_engine(args.model, seed=args.seed, max_batch=args.max_batch)
    concurrency = args.max_batch if args.max_concurrency is None else args.max_concurrency
    app = create_app(
        engine, tokenizer, model_name=args.served_model_name or name, api_key=api_key, guard=guard,
        max_concurrency=concurrency, max_queue=args.max_queue,
    )  # fmt: skip
    run_server(app, args.host, args.port, guard, error_body=error_body, log_level="warning")
    return 0


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
    parser.set_defaults(handler=serve)
