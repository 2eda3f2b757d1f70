"""`pacerl serve openai`: the official `openai` client against the app over the tiny MoE (rendering,
sampling, usage, log-probs, the API key, errors in the API's shape) and over a scripted engine (tool
calls parsed into structured ones, stop strings cut, multi-turn conversations rendered as the model
saw them), the command itself in a subprocess, and hostile clients (a body sent without the key, huge
prompts and budgets, floods of requests and of half-open connections, oversized headers)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import Generation, SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.envs.code_math import CodeMathEnv
from pacerl.openai_app import create_app
from pacerl.sandbox.http_guard import MIB, HttpGuardConfig
from pacerl.serve_openai import error_body, split_tool_calls
from tests.helpers import ThreadServer, free_port
from tests.hostile_http import (
    PATIENCE_S,
    GuardedServer,
    assert_oversized_headers_are_431,
    assert_slow_headers_are_closed,
    closed_by_server,
    open_silent_connections,
    read_answer,
    trickle_until_closed,
)
from tests.pacerl.helpers import TextEngine

KEY = "test-key-123"
JSON_TYPE = {"Content-Type": "application/json"}
PYTHON_TOOL = CodeMathEnv(tasks="codemath-val").tool_schemas()
QUESTION = [{"role": "user", "content": "What is 6 * 7?"}]


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[str, Any]]:
    """(url, tokenizer): the app over the tiny MoE (random weights), API key `KEY`."""
    tokenizer = tiny_tokenizer()
    engine = EmbeddedEngine(build_tiny_moe(TinyMoEConfig(), tokenizer), tokenizer)
    with ThreadServer(create_app(engine, tokenizer, model_name="tiny", api_key=KEY)) as server:
        yield server.url, tokenizer


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]], tools: Any = None) -> int:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_and_a_completion_with_tools(tiny: tuple[str, Any]) -> None:
    url, tokenizer = tiny
    api = client(url)
    assert [model.id for model in api.models.list()] == ["tiny"]
    answer = api.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        tools=PYTHON_TOOL,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    assert answer.object == "chat.completion" and answer.model == "tiny" and len(answer.choices) == 1
    usage = answer.usage
    assert usage is not None
    # The tools were rendered into the prompt by the tokenizer's template, exactly.
    assert usage.prompt_tokens == prompt_tokens(tokenizer, QUESTION, PYTHON_TOOL)
    assert usage.prompt_tokens > prompt_tokens(tokenizer, QUESTION) + 50
    assert 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_sampling_seed_n_and_logprobs(tiny: tuple[str, Any]) -> None:
    url, _ = tiny
    api = client(url)

    def ask(**extra: Any) -> Any:
        return api.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12, **extra)  # type: ignore[arg-type]

    first, again = ask(temperature=1.0, seed=7), ask(temperature=1.0, seed=7)
    assert first.choices[0].message.content == again.choices[0].message.content
    two = ask(temperature=1.0, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == first.choices[0].message.content  # choice i has seed + i
    assert two.usage is not None and first.usage is not None
    assert two.usage.completion_tokens >= first.usage.completion_tokens
    scored = ask(temperature=0, logprobs=True)
    assert scored.choices[0].logprobs is not None
    content = scored.choices[0].logprobs.content or []
    assert content and all(entry.logprob <= 0 for entry in content)
    text = "".join(entry.token for entry in content)
    assert text == scored.choices[0].message.content
    long = ask(temperature=0, max_completion_tokens=3)
    assert long.usage is not None and long.usage.completion_tokens <= 3


def test_api_key_and_errors_in_the_apis_shape(tiny: tuple[str, Any]) -> None:
    url, tokenizer = tiny
    with pytest.raises(openai.AuthenticationError) as wrong:
        client(url, key="wrong").models.list()
    assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401  # no header at all
    assert httpx.get(url + "/health").status_code == 200  # liveness needs no key
    api = client(url)
    with pytest.raises(openai.NotFoundError) as unknown:
        api.chat.completions.create(model="gpt-4o", messages=QUESTION)  # type: ignore[arg-type]
    assert unknown.value.code == "model_not_found"
    refused: list[tuple[dict[str, Any], str | None]] = [
        ({"stream": True}, "stream"),
        ({"temperature": 5}, "temperature"),
        ({"tool_choice": "required", "tools": PYTHON_TOOL}, "tool_choice"),
        ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "What is 1 + 1? " * 400}]}, "messages"),
    ]
    for fields, param in refused:
        body = {"model": "tiny", "messages": QUESTION, **fields}
        response = httpx.post(
            url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        assert response.status_code == 400, fields
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], fields
        assert error["type"] == "invalid_request_error" and error["param"] == param, fields
    too_long = [{"role": "user", "content": "What is 1 + 1? " * 400}]
    with pytest.raises(openai.BadRequestError) as long:
        api.chat.completions.create(model="tiny", messages=too_long)  # type: ignore[arg-type]
    assert long.value.code == "context_length_exceeded"
    assert prompt_tokens(tokenizer, too_long) >= 1024


@pytest.fixture
def scripted() -> Iterator[tuple[openai.OpenAI, TextEngine]]:
    """A client of the app over a `TextEngine` (no API key) whose reply a test sets."""
    tokenizer = tiny_tokenizer()
    engine = TextEngine(tokenizer, lambda prompt: "")
    with ThreadServer(create_app(engine, tokenizer, model_name="scripted")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), engine


CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'


def test_tool_calls_are_parsed_into_structured_ones(scripted: tuple[openai.OpenAI, TextEngine]) -> None:
    api, engine = scripted
    engine.reply = lambda prompt: "Let me compute.\n" + CALL
    answer = api.chat.completions.create(model="scripted", messages=QUESTION, tools=PYTHON_TOOL)  # type: ignore[arg-type]
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me compute."
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "python"
    assert json.loads(calls[0].function.arguments) == {"code": "print(6 * 7)"}
    # Without tools offered (or with tool_choice none) the text comes back as it is.
    plain = api.chat.completions.create(model="scripted", messages=QUESTION)  # type: ignore[arg-type]
    assert plain.choices[0].message.content == "Let me compute.\n" + CALL
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
    none = api.chat.completions.create(
        model="scripted",
        messages=QUESTION,
        tools=PYTHON_TOOL,
        tool_choice="none",  # type: ignore[arg-type]
    )
    assert none.choices[0].message.tool_calls is None
    # A malformed block leaves the whole text as content, as the Hermes parsers of vLLM and SGLang do.
    engine.reply = lambda prompt: '<tool_call>{"name": "python", "arguments": {</tool_call>'
    bad = api.chat.completions.create(model="scripted", messages=QUESTION, tools=PYTHON_TOOL)  # type: ignore[arg-type]
    assert bad.choices[0].message.tool_calls is None and bad.choices[0].finish_reason == "stop"
    assert bad.choices[0].message.content == '<tool_call>{"name": "python", "arguments": {</tool_call>'
    # Stop strings end the text before them (OpenAI's semantics).
    engine.reply = lambda prompt: "The answer is \\boxed{42}. Done."
    cut = api.chat.completions.create(model="scripted", messages=QUESTION, stop=". Done")  # type: ignore[arg-type]
    assert cut.choices[0].message.content == "The answer is \\boxed{42}"


def test_a_multi_turn_conversation_renders_as_the_model_saw_it(
    scripted: tuple[openai.OpenAI, TextEngine],
) -> None:
    api, engine = scripted
    engine.reply = lambda prompt: "\\boxed{42}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the tool."},
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "python", "arguments": '{"code": "print(6 * 7)"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    answer = api.chat.completions.create(model="scripted", messages=messages, tools=PYTHON_TOOL)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "\\boxed{42}"
    flat = [
        messages[0],
        messages[1],
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "42"},
    ]
    tokenizer = engine.tokenizer
    expected = tokenizer.apply_chat_template(
        flat, tools=PYTHON_TOOL, tokenize=False, add_generation_prompt=True
    )
    assert engine.prompts[-1] == expected
    assert "<tool_response>\n42\n</tool_response>" in engine.prompts[-1]
    assert split_tool_calls("no calls here") == ("no calls here", [])
    content, calls = split_tool_calls('{"name": "python", "parameters": {"code": "print(1)"}}')  # Llama 3.x
    assert content is None and [c["function"] for c in calls] == [
        {"name": "python", "arguments": '{"code": "print(1)"}'}
    ]
    half = 'a <tool_call>{"name": "python", "arguments": {}}</tool_call> <tool_call>oops</tool_call>'
    assert split_tool_calls(half) == (half, [])  # one malformed block: the whole text, no calls


def start_server(port: int, log: Path, *flags: str, open_files: int | None = None) -> subprocess.Popen[bytes]:
    """`pacerl serve openai` (the tiny model, key `KEY` from $SERVE_KEY) on `port`, once /health answers;
    with `open_files`, under that limit on open files (soft and hard)."""
    command = [sys.executable, "-m", "pacerl.cli", "serve", "openai", "--port", str(port), "--api-key-env",
               "SERVE_KEY", *flags]  # fmt: skip
    if open_files is not None:
        command = [sys.executable, "-c", WITH_OPEN_FILES, str(open_files), *command[1:]]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env={**os.environ, "SERVE_KEY": KEY}, stdout=sink, stderr=sink)
    for _ in range(600):  # a hang guard (0.1 s apart); startup imports torch and builds the model
        if process.poll() is not None:
            pytest.fail(f"the server exited: {log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.terminate()
    pytest.fail("the server did not come up")


WITH_OPEN_FILES = (
    "import os, resource, sys; limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)
"""`python -c WITH_OPEN_FILES N ARGS...`: python ARGS under a limit of N open files."""


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=30)


@pytest.mark.slow  # the server as a subprocess: start-up costs seconds; the app itself is tested above
def test_pacerl_serve_openai_command(tmp_path: Path) -> None:
    """The command on a free port with the tiny model and a key from the environment."""
    port = free_port()
    process = start_server(port, tmp_path / "server.log", "--served-model-name", "tiny-cli")
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [model.id for model in api.models.list()] == ["tiny-cli"]
        answer = api.chat.completions.create(model="tiny-cli", messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
        assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 4
    finally:
        stop(process)
    unset = subprocess.run(
        [sys.executable, "-m", "pacerl.cli", "serve", "openai", "--api-key-env", "PACERL_NO_SUCH_KEY_VAR"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert unset.returncode == 2 and "PACERL_NO_SUCH_KEY_VAR" in unset.stderr


# -- hostile clients ---------------------------------------------------------------------------------------

GUARDED_FLAGS = ["--header-timeout", "0.5", "--body-timeout", "1"]
"""The hostile-client tests' CLI server: short read timeouts, set by flags."""


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A `pacerl serve openai` subprocess with GUARDED_FLAGS and the key `KEY`: (port, process)."""
    port = free_port()
    process = start_server(port, tmp_path_factory.mktemp("guarded") / "server.log", *GUARDED_FLAGS)
    yield port, process
    stop(process)


def api_error(body: bytes) -> dict[str, Any]:
    """The `error` of an answer in the API's shape, checked to have exactly the API's fields."""
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def test_a_body_without_the_key_is_refused_before_it_is_read(
    guarded: tuple[int, subprocess.Popen[bytes]],
) -> None:
    """A request declaring 400 MB without the key (or with a wrong one) gets its 401 before a byte of
    the body is sent; what the client sends anyway is dropped, the connection is closed within the
    header timeout, and the server's memory stays where it was. (The old server read and parsed the
    whole body first: 400 MB took it from 434 MiB to 1,635 MiB.)"""
    port, process = guarded
    server = psutil.Process(process.pid)
    before = server.memory_info().rss
    for authorization in (b"", b"Authorization: Bearer wrong\r\n"):
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + authorization
            + b"Content-Length: 400000000\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S) as connection:
            connection.sendall(head)
            status, _, body = read_answer(connection)
            assert status == 401 and api_error(body)["code"] == "invalid_api_key"
            chunk = b" " * MIB
            try:
                for _ in range(100):  # 100 MB of the body, unless the server closes first
                    connection.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert trickle_until_closed(connection), "the refused body kept its connection"
    assert server.memory_info().rss - before < 50 * MIB


def test_oversized_headers_are_431_in_the_apis_shape(guarded: tuple[int, subprocess.Popen[bytes]]) -> None:
    port, _ = guarded
    for body in assert_oversized_headers_are_431(port, "/health"):
        error = api_error(body)
        assert error["message"] == "request line and headers larger than 16384 bytes"
        assert error["type"] == "invalid_request_error"


@pytest.mark.slow
def test_slow_headers_are_closed(guarded: tuple[int, subprocess.Popen[bytes]]) -> None:
    port, _ = guarded
    assert_slow_headers_are_closed(port, "/v1/chat/completions", connections=50)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


@pytest.mark.slow
def test_half_open_connections_neither_stop_health_nor_fill_the_log(tmp_path: Path) -> None:
    """1,500 connections that send nothing, against a server allowed 1,024 open files and 100
    connections: each new connection closes the one that has waited longest for a request, so /health
    still answers, and the log stays quiet. (The old server accepted connections until accept() failed,
    then logged a traceback for each failed accept, thousands a second, and answered no one: 21,000
    half-open connections wrote 141 MB of "Too many open files" in 90 s.)"""
    connections = 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = connections + 256
    assert hard == resource.RLIM_INFINITY or hard >= needed, f"this test needs {needed} open files"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    port, log = free_port(), tmp_path / "server.log"
    process = start_server(port, log, "--max-connections", "100", open_files=1024)
    silent: list[socket.socket] = []
    try:
        silent = open_silent_connections(port, connections)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=PATIENCE_S)
        assert health.status_code == 200
        assert process.poll() is None
    finally:
        for connection in silent:
            connection.close()
        stop(process)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    text = log.read_text()
    assert "Too many open files" not in text and "out of system resource" not in text, text[:2000]
    assert len(text) < 5000, text[:2000]


def test_at_the_connection_cap_the_longest_waiting_connection_is_closed() -> None:
    """With room for two connections, a third closes the older of two that never sent a request; when
    both others are busy with requests, a request on a third is 503 in the API's shape."""
    tokenizer = tiny_tokenizer()
    engine = HeldEngine(tokenizer, lambda prompt: "42")
    app = create_app(engine, tokenizer, model_name="scripted")
    with GuardedServer(app, HttpGuardConfig(max_connections=2), error_body) as server:
        first, second = open_silent_connections(server.port, 2)
        with first, second:
            assert httpx.get(f"{server.url}/health", timeout=PATIENCE_S).status_code == 200
            assert closed_by_server(first), "the longest-waiting connection was not closed"
        engine.release.clear()

        async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "scripted", "messages": QUESTION}
                held = [
                    asyncio.ensure_future(client.post(f"{server.url}/v1/chat/completions", json=body))
                    for _ in range(2)
                ]
                await engine.reach(2)
                async with httpx.AsyncClient(timeout=60) as other:
                    refused = await other.get(f"{server.url}/v1/models")
                engine.release.set()
                return list(await asyncio.gather(*held)), refused

        try:
            served, refused = asyncio.run(scenario())
        finally:
            engine.release.set()
    assert [answer.status_code for answer in served] == [200, 200]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert api_error(refused.content)["type"] == "server_error"


class HeldEngine(TextEngine):
    """A `TextEngine` whose generations wait (on a worker thread) while `release` is clear; `started`
    counts the generations begun."""

    def __init__(self, tokenizer: Any, reply: Callable[[str], str]) -> None:
        super().__init__(tokenizer, reply)
        self.release = threading.Event()
        self.release.set()
        self.started = 0

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, **_: Any) -> Generation:
        self.started += 1
        assert await asyncio.to_thread(self.release.wait, 60), "the test never released the engine"
        return await super().generate(input_ids, sampling)

    async def reach(self, started: int) -> None:
        for _ in range(1500):  # a hang guard: up to 30 s
            if self.started >= started:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{self.started} generations started, never {started}")


def test_a_full_request_queue_is_503_at_once() -> None:
    """One request generating, one waiting: a third is refused at once (the old server admitted every
    request it got: 300 at once were all queued)."""
    tokenizer = tiny_tokenizer()
    engine = HeldEngine(tokenizer, lambda prompt: "42")
    engine.release.clear()
    app = create_app(engine, tokenizer, model_name="scripted", max_concurrency=1, max_queue=1)
    gate = app.state.request_gate
    body = {"model": "scripted", "messages": QUESTION}
    with ThreadServer(app) as server:

        async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                url = f"{server.url}/v1/chat/completions"
                first = asyncio.ensure_future(client.post(url, json=body))
                await engine.reach(1)
                second = asyncio.ensure_future(client.post(url, json=body))
                for _ in range(1500):  # a hang guard: until the second request waits
                    if gate.waiting == 1:
                        break
                    await asyncio.sleep(0.02)
                third = await client.post(url, json=body)
                engine.release.set()
                return list(await asyncio.gather(first, second)), third

        try:
            served, refused = asyncio.run(scenario())
        finally:
            engine.release.set()
    assert [answer.status_code for answer in served] == [200, 200]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = api_error(refused.content)
    assert error["type"] == "server_error"
    assert error["message"] == "1 requests executing and 1 queued; try again later"


class WatchedTokenizer:
    """The tiny tokenizer, logging each `encode` in `events` (shared with the test); while `release` is
    clear, an encode waits for it on whatever thread called it."""

    def __init__(self) -> None:
        self.inner = tiny_tokenizer()
        self.events: list[str] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, **options: Any) -> list[int]:
        self.events.append(f"encode {len(text)} characters")
        self.entered.set()
        assert self.release.wait(60), "the test never released the tokenizer"
        ids: list[int] = self.inner.encode(text, **options)
        self.events.append("encoded")
        return ids


class SizedEngine(TextEngine):
    """A `TextEngine` with a context of `max_context` tokens that keeps the sampling of each generation."""

    def __init__(self, tokenizer: Any, max_context: int) -> None:
        super().__init__(tokenizer, lambda prompt: "42")
        self.max_context = max_context
        self.samplings: list[SamplingParams] = []

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, **_: Any) -> Generation:
        self.samplings.append(sampling)
        return await super().generate(input_ids, sampling)


def test_tokenization_runs_off_the_event_loop() -> None:
    """While a prompt is being tokenized, /health answers (the old server tokenized on the event loop:
    an 8-million-character prompt stopped it for 21.7 s)."""
    tokenizer = WatchedTokenizer()
    tokenizer.release.clear()
    app = create_app(TextEngine(tokenizer.inner, lambda prompt: "42"), tokenizer, model_name="scripted")
    body = {"model": "scripted", "messages": [{"role": "user", "content": "What is 6 * 7? " * 1000}]}
    with ThreadServer(app) as server:

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as client:
                chat = asyncio.ensure_future(client.post(f"{server.url}/v1/chat/completions", json=body))
                assert await asyncio.to_thread(tokenizer.entered.wait, 30), "no tokenization began"
                health = await client.get(f"{server.url}/health", timeout=PATIENCE_S)
                tokenizer.events.append(f"health {health.status_code}")
                tokenizer.release.set()
                return await chat

        try:
            answer = asyncio.run(scenario())
        finally:
            tokenizer.release.set()
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "42"
    prompt = [event for event in tokenizer.events if event.startswith("encode ")]
    assert tokenizer.events == [*prompt, "health 200", "encoded"]


def test_a_prompt_over_the_context_is_400_and_one_that_cannot_fit_is_not_tokenized() -> None:
    """A prompt of more characters than the context could hold tokens (each token stands for at most
    as many characters as the vocabulary's longest) is refused before it is tokenized; a shorter one
    over the context once tokenized. Both 400 `context_length_exceeded` in the API's shape."""
    tokenizer = WatchedTokenizer()
    engine = SizedEngine(tokenizer.inner, max_context=256)
    longest = max(len(token) for token in tokenizer.inner.get_vocab())
    with ThreadServer(create_app(engine, tokenizer, model_name="scripted")) as server:

        def ask(content: str) -> httpx.Response:
            body = {"model": "scripted", "messages": [{"role": "user", "content": content}]}
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)

        huge = ask("x" * (256 * longest + 1))
        assert huge.status_code == 400, huge.text
        error = api_error(huge.content)
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert tokenizer.events == [], "a prompt that cannot fit was tokenized"
        over = ask("What is 1 + 1? " * 100)
        assert over.status_code == 400 and api_error(over.content)["code"] == "context_length_exceeded"
        assert len(tokenizer.events) == 2, tokenizer.events  # tokenized, then refused
    assert engine.samplings == []


def test_completion_budgets_over_the_context_are_400() -> None:
    """n times max_tokens (or max_completion_tokens) over what the context leaves after the prompt is
    refused, not cut (the old server cut it and ran: n=16 with max_tokens=1e9 took 276 s); without a
    budget, the n choices share the room."""
    tokenizer = tiny_tokenizer()
    engine = SizedEngine(tokenizer, max_context=256)
    room = 256 - prompt_tokens(tokenizer, QUESTION)
    with ThreadServer(create_app(engine, tokenizer, model_name="scripted")) as server:

        def ask(**fields: Any) -> httpx.Response:
            body = {"model": "scripted", "messages": QUESTION, **fields}
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)

        for fields, param in [
            ({"max_tokens": room + 1}, "max_tokens"),
            ({"max_completion_tokens": room + 1}, "max_completion_tokens"),
            ({"max_tokens": room // 2 + 1, "n": 2}, "max_tokens"),
            ({"max_tokens": 10**9, "n": 16}, "max_tokens"),
        ]:
            refused = ask(**fields)
            assert refused.status_code == 400, (fields, refused.text)
            error = api_error(refused.content)
            assert error["code"] == "context_length_exceeded" and error["param"] == param, (fields, error)
        assert engine.samplings == [], "a refused request reached the engine"
        assert ask(max_tokens=room).status_code == 200
        assert ask(max_tokens=room // 2, n=2).status_code == 200
        assert ask(n=3).status_code == 200
    assert [s.max_new_tokens for s in engine.samplings] == [room, room // 2, room // 2, *[room // 3] * 3]


def test_every_error_has_the_apis_shape(scripted: tuple[openai.OpenAI, TextEngine]) -> None:
    """Unknown routes, wrong methods, bodies that are not JSON (or too deep, or not Unicode) and the
    guard's refusals all answer `{"error": {"message", "type", "param", "code"}}`."""
    api, _ = scripted
    url = str(api.base_url).rstrip("/").removesuffix("/v1")
    unknown = httpx.get(f"{url}/v1/nothing-here", timeout=30)
    assert unknown.status_code == 404
    assert api_error(unknown.content)["message"] == "Invalid URL (GET /v1/nothing-here)"
    wrong_method = httpx.get(f"{url}/v1/chat/completions", timeout=30)
    assert wrong_method.status_code == 405 and api_error(wrong_method.content)["param"] is None
    lone_surrogate = b'{"model": "scripted", "messages": [{"role": "user", "content": "\\ud800"}]}'
    for content in (b"{bad", b"[" * 100_000, lone_surrogate):
        answer = httpx.post(f"{url}/v1/chat/completions", content=content, headers=JSON_TYPE, timeout=30)
        assert answer.status_code == 400, (content[:20], answer.text)
        error = api_error(answer.content)
        assert error["type"] == "invalid_request_error" and error["param"] in (None, "messages"), error
    chunked = httpx.post(
        f"{url}/v1/chat/completions", content=iter([b" " * (17 * MIB)]), headers=JSON_TYPE, timeout=30
    )
    assert chunked.status_code == 413
    assert api_error(chunked.content)["message"] == f"request body larger than {16 * MIB} bytes"


def test_what_the_server_cannot_honour_is_refused(scripted: tuple[openai.OpenAI, TextEngine]) -> None:
    """A request field this server would otherwise ignore is a 400 in the API's shape naming it, so a
    client never takes a free answer for a constrained one; `{"type": "text"}` and defaults pass."""
    api, engine = scripted
    engine.reply = lambda prompt: "fine"
    refused = {
        "response_format": {"type": "json_object"},
        "frequency_penalty": 0.5,
        "presence_penalty": -1.0,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "logit_bias": {"7": 10},
        "parallel_tool_calls": False,
        "include_stop_str_in_output": True,
    }
    for name, value in refused.items():
        with pytest.raises(openai.BadRequestError) as error:
            api.chat.completions.create(model="scripted", messages=QUESTION, extra_body={name: value})  # type: ignore[arg-type]
        assert error.value.status_code == 400 and isinstance(error.value.body, dict)
        assert error.value.body["param"] == name and error.value.body["type"] == "invalid_request_error"
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match=re.escape("only {'type': 'text'} is supported")):
        api.chat.completions.create(model="scripted", messages=QUESTION, response_format=schema)  # type: ignore[arg-type]
    samplings: list[SamplingParams] = []
    generate = engine.generate

    async def recording(input_ids: Sequence[int], sampling: SamplingParams, **kwargs: Any) -> Generation:
        samplings.append(sampling)
        return await generate(input_ids, sampling, **kwargs)

    engine.generate = recording  # type: ignore[method-assign]
    fine = api.chat.completions.create(
        model="scripted", messages=QUESTION, response_format={"type": "text"}, frequency_penalty=0,  # type: ignore[arg-type]
        extra_body={"top_k": 5},
    )  # fmt: skip
    assert fine.choices[0].message.content == "fine" and [s.top_k for s in samplings] == [5]


def test_template_artefacts_are_stripped_and_the_matched_stop_named(
    scripted: tuple[openai.OpenAI, TextEngine],
) -> None:
    api, engine = scripted
    engine.reply = lambda prompt: "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n<|pad|>"
    answer = api.chat.completions.create(model="scripted", messages=QUESTION)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "assistant\nThe answer is 42.\n"
    engine.reply = lambda prompt: "<search> capital of France </search> made up"
    cut = api.chat.completions.create(model="scripted", messages=QUESTION, stop=["</answer>", "</search>"])  # type: ignore[arg-type]
    choice = cut.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("<search> capital of France ", "stop")
    assert getattr(choice, "stop_reason", None) == "</search>"  # vLLM's field


def test_the_final_assistant_message_can_be_continued(scripted: tuple[openai.OpenAI, TextEngine]) -> None:
    """vLLM's `continue_final_message`: the prompt is the conversation before it with the generation
    prompt, then its text as it is (no end of turn), as a local rollout continues inline observations."""
    api, engine = scripted
    engine.reply = lambda prompt: " more"
    so_far = {"role": "assistant", "content": "<search> q </search>\n\n<information>Doc 1</information>\n\n"}
    continued = {"continue_final_message": True, "add_generation_prompt": False}
    api.chat.completions.create(model="scripted", messages=[*QUESTION, so_far], extra_body=continued)  # type: ignore[arg-type]
    opened = engine.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert engine.prompts[-1] == opened + so_far["content"]
    for messages, body in (([*QUESTION, so_far], {"continue_final_message": True}), (QUESTION, continued)):
        with pytest.raises(openai.BadRequestError, match="continue_final_message needs"):
            api.chat.completions.create(model="scripted", messages=messages, extra_body=body)  # type: ignore[arg-type]
    closing = {"add_generation_prompt": False}
    api.chat.completions.create(model="scripted", messages=QUESTION, extra_body=closing)  # type: ignore[arg-type]
    closed = engine.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=False)
    assert engine.prompts[-1] == closed
