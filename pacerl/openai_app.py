"""The app of `pacerl serve openai` (the API's shapes and the command are in `pacerl.serve_openai`): the
embedded engine behind FastAPI routes, the HTTP guard in front, one thread rendering and tokenizing, and
the server run in the foreground."""

# No `from __future__ import annotations`: FastAPI reads the route annotations of `create_app`'s
# closures at run time.

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from pacerl.agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from pacerl.agents.engine.protocol import ContextOverflowError, FinishReason, Generation, SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, load_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.envs.chat_template import render_chat
from pacerl.envs.parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from pacerl.sandbox.http_guard import Gate, HttpGuardConfig, guard_app, guard_from_flags, run_server
from pacerl.serve_openai import (
    GUARD,
    MAX_QUEUE,
    ApiError,
    ChatRequest,
    context_error,
    error_body,
    split_tool_calls,
    template_messages,
)

_T = TypeVar("_T")


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
    artefacts = template_artefacts(tokenizer)
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
        refused = body.unsupported()
        if refused is not None:
            raise ApiError(400, f"{refused[0]}: {refused[1]}", param=refused[0])
        choice = body.tool_choice
        if choice is not None and choice not in ("auto", "none"):
            raise ApiError(400, "tool_choice supports only 'auto' and 'none'", param="tool_choice")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or not all(stops):
            raise ApiError(400, "stop holds at most 4 non-empty strings", param="stop")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
        async with gate.slot():
            prompt = await off_the_loop(
                _prompt, tokenizer, body, native_tool_calls, tools, max_context, max_prompt_chars
            )
            temperature = 1.0 if body.temperature is None else body.temperature
            budget = _completion_budget(body, len(prompt), max_context)
            samplings = [
                SamplingParams(
                    max_new_tokens=budget,
                    temperature=temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=max(0, body.top_k or 0),
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
                _choices, tokenizer, generations, eos, stops, offer_tools, body.logprobs, artefacts
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
    body: ChatRequest,
    native_tool_calls: bool,
    tools: list[dict[str, Any]] | None,
    max_context: int,
    max_chars: int | None,
) -> list[int]:
    """The request's prompt tokens (on the tokenizer thread); 400 for a prompt the context cannot hold,
    refused before tokenizing when its characters alone say so (`max_chars`). With
    `continue_final_message`, the conversation before the final assistant message is rendered with the
    generation prompt and that message's text follows as it is: exactly the text a local rollout
    continues (the template would otherwise close the turn)."""
    messages = template_messages(body.messages, native_tool_calls)
    if body.continue_final_message:
        text = _render(tokenizer, messages[:-1], tools, True) + messages[-1]["content"]
    else:
        text = _render(tokenizer, messages, tools, body.add_generation_prompt)
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
    artefacts: Sequence[str],
) -> list[dict[str, Any]]:
    """The answer's choices from the engine's generations (on the tokenizer thread): the text up to
    the first stop string (named in the choice's `stop_reason`, vLLM's field), without the template's
    special tokens (`artefacts`)."""

    choices = []
    for index, generation in enumerate(generations):
        tokens = list(generation.tokens)
        if tokens and tokens[-1] in eos and generation.finish_reason is FinishReason.STOP:
            tokens.pop()
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        found = [(i, s) for s in stops if (i := text.find(s)) != -1]
        cut, matched = min(found) if found else (-1, None)
        text = text if cut == -1 else text[:cut]
        for artefact in artefacts:
            text = text.replace(artefact, "")
        content, calls = split_tool_calls(text) if offer_tools else (text, [])
        finish = "tool_calls" if calls else generation.finish_reason.value
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        entry: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": "stop" if matched is not None and not calls else finish,
            "stop_reason": matched,
            "logprobs": None,
        }
        if logprobs:
            entry["logprobs"] = {"content": _logprobs(tokenizer, tokens, generation.logprobs)}
        choices.append(entry)
    return choices


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    generation_prompt: bool,
) -> str:

    try:
        text = render_chat(tokenizer, messages, tools, generation_prompt=generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError) as error:
        raise ApiError(
            400, f"the chat template cannot render these messages: {error}", param="messages"
        ) from None
    return text


def template_artefacts(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, ...), which a
    served answer's `content` never holds (vLLM decodes with `skip_special_tokens`); the tool-call and
    reasoning tags stay, since the parsers and envs read them."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {str(token) for token in added.values() if getattr(token, "special", False)}
    kept = {TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<think>", "</think>"}
    return tuple(sorted((t for t in special - kept if t), key=len, reverse=True))


def _logprobs(tokenizer: Any, tokens: Sequence[int], logprobs: Sequence[float]) -> list[dict[str, Any]]:
    out = []
    for token, logprob in zip(tokens, logprobs, strict=False):
        text = tokenizer.decode([token], skip_special_tokens=False)
        out.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def build_engine(model: str | None, *, seed: int = 0, max_batch: int = 64) -> tuple[Any, Any, str]:
    """(engine, tokenizer, default model name): a checkpoint directory (`pacerl.agents.models.load_model`), or
    the tiny MoE with random weights when `model` is None."""

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
