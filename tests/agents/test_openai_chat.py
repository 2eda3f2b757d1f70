"""Served models: the episode player's mapping between structured tool calls and the env (scripted
answers, the local sandbox), malformed and failed answers counted, and `evaluate_served` through the
real `openai` client against `pacerl serve openai`'s app (a scripted engine that solves CodeMath with
its tool, the random tiny MoE, a dead port)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.openai_chat import ChatAnswer, ChatToolCall, OpenAIChatClient, OpenAIChatOptions
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.play import evaluate_served
from pacerl.agents.evaluation.served import (
    NOT_RUN,
    ServedEpisode,
    play_episode,
    restore_stop,
    served_stop_strings,
)
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Status
from pacerl.envs import Task, ToolEnvConfig, load_tasks
from pacerl.envs.code_math import CodeMathEnv
from pacerl.envs.search import SEARCH_R1_STOP, SearchR1Env
from pacerl.openai_app import create_app
from tests.helpers import ThreadServer, free_port
from tests.pacerl.helpers import TextEngine

TASK = Task("t", "What is 6 * 7?", ("42",))
CONFIG = EvalConfig(samples=1, temperature=0.0, max_new_tokens=64, max_total_tokens=4096)


class ScriptedClient(OpenAIChatClient):
    """Answers each turn from a script and keeps the conversation each request carried."""

    def __init__(self, answers: Sequence[ChatAnswer]) -> None:
        super().__init__(OpenAIChatOptions(model="scripted"))
        self.answers = list(answers)
        self.requests: list[tuple[list[dict[str, Any]], list[Mapping[str, Any]]]] = []

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], **_: Any
    ) -> ChatAnswer:
        self.requests.append(([dict(m) for m in messages], list(tools)))
        return self.answers.pop(0)


def answer(content: str = "", *calls: tuple[str, str, str]) -> ChatAnswer:
    tool_calls = tuple(ChatToolCall(*call) for call in calls)
    return ChatAnswer(content, tool_calls, "tool_calls" if calls else "stop", 10, 5)


async def play(client: ScriptedClient, config: ToolEnvConfig | None = None) -> ServedEpisode:
    env = CodeMathEnv(tasks=[TASK], config=config or ToolEnvConfig(max_turns=3))
    try:
        return await play_episode(client, env, TASK, CONFIG, "episode")
    finally:
        env.close()


async def test_structured_calls_reach_the_env_and_each_answer_its_id() -> None:
    client = ScriptedClient(
        [
            answer(
                "Computing.",
                ("a", "python", '{"code": "print(6 *'),  # arguments that are not JSON
                ("b", "calc", '{"x": 1}'),  # a tool the env does not have
                ("c", "python", '{"code": "print(6 * 7)"}'),
            ),
            answer("\\boxed{42}"),
        ]
    )
    episode = await play(client)
    assert (episode.status, episode.reward, episode.turns) == (Status.COMPLETED, 1.0, 2)
    messages, tools = client.requests[1]
    assert tools == [
        {"type": "function", "function": CodeMathEnv(tasks=[TASK]).tool_schemas()[0]["function"]}
    ]
    assistant, *replies = messages[2:]
    assert assistant["role"] == "assistant" and assistant["content"] == "Computing."
    assert [c["id"] for c in assistant["tool_calls"]] == ["a", "b", "c"]
    assert [(m["role"], m["tool_call_id"]) for m in replies] == [("tool", "a"), ("tool", "b"), ("tool", "c")]
    assert replies[0]["content"].startswith("Error:") and "not a JSON object" in replies[0]["content"]
    assert replies[1]["content"].startswith("Error: unknown tool 'calc'")
    assert replies[2]["content"] == "42"
    assert episode.env_info["tool_calls"] == 2 and episode.tool_calls == 2
    assert episode.messages[-1] == {"role": "assistant", "content": "\\boxed{42}"}
    assert episode.completion_tokens == 10 and episode.context_tokens == 15


async def test_calls_the_env_does_not_run_are_still_answered() -> None:
    nine = [(f"id{i}", "nope", "{}") for i in range(9)]  # one more than a message may hold
    client = ScriptedClient([answer("", *nine), answer("\\boxed{1}")])
    episode = await play(client, ToolEnvConfig(max_turns=3, max_tool_calls=20))
    replies = client.requests[1][0][3:]
    assert [m["tool_call_id"] for m in replies] == [f"id{i}" for i in range(9)]
    assert all("unknown tool 'nope'" in m["content"] for m in replies[:8])
    assert replies[8]["content"] == NOT_RUN
    assert "at most 8 tool calls" in "".join(m["content"] for m in replies)
    assert episode.status is Status.COMPLETED and episode.reward == 0.0


async def test_calls_in_the_text_get_tool_responses_in_a_user_turn() -> None:
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    client = ScriptedClient([answer(call), answer("\\boxed{42}")])
    episode = await play(client)
    assert client.requests[1][0][-1] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert episode.reward == 1.0 and episode.tool_calls == 1


async def test_an_empty_answer_is_a_counted_failure_and_budgets_truncate() -> None:
    empty = await play(ScriptedClient([answer("  ")]))
    assert (empty.status, empty.status_reason, empty.reward) == (
        Status.FAILED,
        "empty answer (finish_reason stop)",
        None,
    )
    looping = ScriptedClient([answer("", ("x", "python", '{"code": "print(1)"}'))] * 2)
    cut = await play(looping, ToolEnvConfig(max_turns=2))
    assert (cut.status, cut.status_reason, cut.reward) == (Status.TRUNCATED, "max_turns", 0.0)


def test_options_validate_and_read_the_key_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACERL_TEST_OPENAI_KEY", raising=False)
    with pytest.raises(ValueError, match="PACERL_TEST_OPENAI_KEY"):
        OpenAIChatClient(OpenAIChatOptions(api_key_env="PACERL_TEST_OPENAI_KEY"))
    monkeypatch.setenv("PACERL_TEST_OPENAI_KEY", "k")
    assert OpenAIChatOptions(api_key_env="PACERL_TEST_OPENAI_KEY").api_key() == "k"
    assert OpenAIChatOptions().api_key() is None
    for bad in ({"base_url": "localhost:8000"}, {"max_retries": -1}, {"timeout_s": 0}, {"stop": ("",)}):
        with pytest.raises(ValueError, match="invalid OpenAI chat options"):
            OpenAIChatOptions(**bad)  # type: ignore[arg-type]


def solve(prompt: str) -> str:
    """CodeMath with its tool: call python on the question's expression, then box what it printed."""
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.DOTALL)
    if responses:
        return f"\\boxed{{{responses[-1]}}}"
    expression = re.findall(r"What is ([0-9 +*()-]+)\?", prompt)[-1]
    call = {"name": "python", "arguments": {"code": f"print({expression})"}}
    return f"Let me compute.\n<tool_call>{json.dumps(call)}</tool_call>"


@pytest.fixture
def solver(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The URL of the app over a `TextEngine` that `solve`s, wanting the key in PACERL_TEST_OPENAI_KEY."""
    monkeypatch.setenv("PACERL_TEST_OPENAI_KEY", "sekret")
    tokenizer = tiny_tokenizer()
    app = create_app(TextEngine(tokenizer, solve), tokenizer, model_name="solver", api_key="sekret")
    with ThreadServer(app) as server:
        yield server.url + "/v1"


async def test_evaluate_served_through_the_openai_client_to_a_report(solver: str) -> None:
    client = OpenAIChatClient(OpenAIChatOptions(base_url=solver, api_key_env="PACERL_TEST_OPENAI_KEY"))
    tasks = load_tasks("codemath-val")[:3]
    groups: list[Sequence[ServedEpisode]] = []
    config = EvalConfig(samples=2, ks=(1,), max_total_tokens=2048, max_new_tokens=64)
    try:
        report = await evaluate_served(
            client, lambda: CodeMathEnv(tasks=tasks), tasks, config, label="solver", on_group=groups.append
        )
    finally:
        await client.aclose()
    assert await client.model() == "solver"  # asked of /v1/models, since none was configured
    assert [(r.task_id, r.samples, r.correct) for r in report.per_task] == [(t.id, 2, 2) for t in tasks]
    assert (report.tasks, report.episodes, report.samples, report.policy_version) == (3, 6, 2, 0)
    assert report.avg_at_k == 1.0 and report.pass_at_k == {1: 1.0, 2: 1.0}
    assert report.tool_call_rate == 1.0 and report.mean_turns == 2.0 and report.failures == {}
    assert report.mean_reward == 1.0 and report.mean_generated_tokens > 10
    assert report.config.stop_strings == () and report.config.tool_schemas_in_prompt
    assert "avg@2" in report.table() and json.dumps(report.to_json())
    # groups reach on_group as they finish, in any order: take the first task's
    episode = next(group[0] for group in groups if group[0].task_id == tasks[0].id)
    call = episode.messages[2]["tool_calls"][0]
    assert episode.messages[3] == {"role": "tool", "tool_call_id": call["id"], "content": tasks[0].answer}
    assert json.dumps(episode.to_json())


async def test_evaluate_served_with_the_tiny_model_finishes_every_episode() -> None:
    tokenizer = tiny_tokenizer()
    engine = EmbeddedEngine(build_tiny_moe(TinyMoEConfig(), tokenizer), tokenizer)
    tasks = load_tasks("codemath-val")[:2]
    with ThreadServer(create_app(engine, tokenizer, model_name="tiny")) as server:
        client = OpenAIChatClient(OpenAIChatOptions(base_url=server.url + "/v1", model="tiny"))
        config = EvalConfig(samples=2, max_new_tokens=12, max_total_tokens=1024)
        env = ToolEnvConfig(max_turns=2)
        report = await evaluate_served(client, lambda: CodeMathEnv(tasks=tasks, config=env), tasks, config)
        await client.aclose()
    assert report.episodes == 4 and sum(r.samples for r in report.per_task) == 4
    assert 1 <= report.mean_turns <= 2 and report.mean_generated_tokens > 0
    # Whatever random weights say, each episode ended with a status (no failure beyond the env's own).
    assert all(not key.startswith("failed: engine") for key in report.failures)


async def test_a_dead_server_and_http_errors_are_counted_failures() -> None:
    tasks = [TASK, Task("u", "What is 1 + 1?", ("2",))]
    dead = OpenAIChatClient(
        OpenAIChatOptions(base_url=f"http://127.0.0.1:{free_port()}/v1", model="x", max_retries=0)
    )
    config = EvalConfig(samples=2, max_total_tokens=2048)
    report = await evaluate_served(dead, lambda: CodeMathEnv(tasks=tasks), tasks, config)
    [(reason, count)] = report.failures.items()
    assert reason.startswith("failed: engine failed: cannot reach http://127.0.0.1:") and count == 4
    assert report.avg_at_k == 0.0 and report.mean_turns == 0.0
    with pytest.raises(Exception, match="cannot list the models"):
        await OpenAIChatClient(dead.options.__class__(base_url=dead.options.base_url, max_retries=0)).model()
    tokenizer = tiny_tokenizer()
    app = create_app(TextEngine(tokenizer, solve), tokenizer, model_name="solver")
    with ThreadServer(app) as server:
        wrong = OpenAIChatClient(OpenAIChatOptions(base_url=server.url + "/v1", model="other", max_retries=0))
        refused = await evaluate_served(wrong, lambda: CodeMathEnv(tasks=tasks), tasks, config)
        await wrong.aclose()
    [(reason, count)] = refused.failures.items()
    assert reason == "failed: engine failed: HTTP 404: The model `other` does not exist." and count == 4


def test_the_trimmed_stop_string_is_put_back() -> None:
    """The server's word on the matched stop decides; without it, the stop `</tag>` that closes the
    text's last unclosed `<tag>`; answers cut for length, already ending in a stop, or stopped by the
    end of sequence are left alone."""
    stops = SEARCH_R1_STOP

    def stopped(content: str, matched: str | None = None, finish: str = "stop") -> str:
        return restore_stop(ChatAnswer(content, (), finish, 1, 1, matched), stops)

    assert stopped("<think>x</think> <search> Paris ") == "<think>x</think> <search> Paris </search>"
    assert stopped("<search> a </search> <answer> b ") == "<search> a </search> <answer> b </answer>"
    assert stopped("<answer> b ", matched="</answer>") == "<answer> b </answer>"
    assert stopped("no tags", matched="</search>") == "no tags</search>"  # the server said so
    assert stopped("<search> a ", matched="<|im_end|>") == "<search> a "  # not one of ours
    assert stopped("<answer> b </answer>") == "<answer> b </answer>"
    assert stopped("<search> a </search>") == "<search> a </search>"
    assert stopped("<search> a ", finish="length") == "<search> a "
    assert stopped("plain text") == "plain text"
    assert restore_stop(ChatAnswer("<search> a ", (), "stop", 1, 1), ()) == "<search> a "
    env = SearchR1Env(tasks=[TASK])
    assert served_stop_strings(OpenAIChatOptions(), env) == SEARCH_R1_STOP
    assert served_stop_strings(OpenAIChatOptions(stop=("</answer>", "STOP")), env) == (
        *SEARCH_R1_STOP,
        "STOP",
    )
    assert served_stop_strings(OpenAIChatOptions(stop=("x",)), CodeMathEnv(tasks=[TASK])) == ("x",)
    with pytest.raises(ValueError, match="the API takes at most 4"):
        served_stop_strings(OpenAIChatOptions(stop=("a", "b", "c")), env)
    env.close()


async def test_search_r1_turns_continue_one_assistant_message() -> None:
    """A scripted server that trims stops and does not say which: each turn continues the assistant's
    text, with the passages appended as the env wrote them, and the episode scores its answer."""
    client = ScriptedClient([answer("<search> Orlo "), answer("<think>ok</think> <answer> 42 ")])
    env = SearchR1Env(tasks=[TASK], retriever_url="http://127.0.0.1:1")  # unreachable: an error passage
    try:
        episode = await play_episode(client, env, TASK, CONFIG, "episode")
    finally:
        env.close()
    assert (episode.status, episode.reward, episode.turns) == (Status.COMPLETED, 1.0, 2)
    first, second = (messages for messages, _ in client.requests)
    assert [m["role"] for m in first] == ["user"] and [m["role"] for m in second] == ["user", "assistant"]
    assert second[1]["content"].startswith("<search> Orlo </search>\n\n<information>Error: ")
    assert second[1]["content"].endswith("</information>\n\n")
    assert episode.messages[-1]["content"] == second[1]["content"] + "<think>ok</think> <answer> 42 </answer>"
