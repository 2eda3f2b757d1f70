"""`pacerl serve openai`: the official `openai` client against the app over the tiny MoE (rendering,
sampling, usage, log-probs, the API key, errors in the API's shape) and over a scripted engine (tool
calls parsed into structured ones, stop strings cut, multi-turn conversations rendered as the model
saw them), and the command itself in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
import openai
import pytest

from agents.engine import EmbeddedEngine, FinishReason, Generation, SamplingParams
from agents.models import TinyMoEConfig, build_tiny_moe
from agents.tokenizer import tiny_tokenizer
from envs.code_math import CodeMathEnv
from pacerl.serve_openai import create_app, split_tool_calls
from tests.helpers import ThreadServer, free_port
from tests.scripted import ScriptedEngineBase

KEY = "test-key-123"
PYTHON_TOOL = CodeMathEnv(tasks="codemath-val").tool_schemas()
QUESTION = [{"role": "user", "content": "What is 6 * 7?"}]


class TextEngine(ScriptedEngineBase):
    """Answers each prompt with `reply(decoded prompt)` and the end-of-sequence token; keeps every prompt."""

    def __init__(self, tokenizer: Any, reply: Callable[[str], str]) -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.prompts: list[str] = []

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, **_: Any) -> Generation:
        prompt = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)
        self.prompts.append(prompt)
        text = self.reply(prompt)
        tokens = (*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id)
        return Generation(tokens, (-0.25,) * len(tokens), (0,) * len(tokens), FinishReason.STOP)


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


def test_pacerl_serve_openai_command(tmp_path: Any) -> None:
    """The command on a free port with the tiny model and a key from the environment."""
    port = free_port()
    env = {**os.environ, "SERVE_KEY": KEY}
    command = [sys.executable, "-m", "pacerl.cli", "serve", "openai", "--port", str(port), "--api-key-env",
               "SERVE_KEY", "--served-model-name", "tiny-cli"]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        for _ in range(600):  # a hang guard (0.1 s apart); startup imports torch and builds the model
            if process.poll() is not None:
                pytest.fail(f"the server exited: {process.stdout.read().decode() if process.stdout else ''}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail("the server did not come up")
        assert [model.id for model in api.models.list()] == ["tiny-cli"]
        answer = api.chat.completions.create(model="tiny-cli", messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
        assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 4
    finally:
        process.terminate()
        process.wait(timeout=30)
    unset = subprocess.run(
        [sys.executable, "-m", "pacerl.cli", "serve", "openai", "--api-key-env", "PACERL_NO_SUCH_KEY_VAR"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert unset.returncode == 2 and "PACERL_NO_SUCH_KEY_VAR" in unset.stderr
