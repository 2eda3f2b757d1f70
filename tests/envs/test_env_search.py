"""pacerl/Search-v0 played by scripted policies against a real retriever on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from pacerl.envs.base import ToolEnvConfig
from pacerl.envs.retriever import BM25Index, create_app
from pacerl.envs.search import SearchEnv
from pacerl.envs.tasks import DATA_DIR, Task, load_tasks
from tests.helpers import ThreadServer, free_port, record_http_requests

ARDBRIDAN = Task("ardbridan", "Who founded Ardbridan?", ("Galphadra",))


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The shipped corpus behind a retriever on a thread of this process."""
    app = create_app(BM25Index.from_jsonl(DATA_DIR / "search-corpus.jsonl"))
    with ThreadServer(app) as server:
        yield server.url


def search_call(query: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'search', 'arguments': {'query': query}})}</tool_call>"


FACTS = {
    "founder": r"founded in \d+ by (\w+)",
    "founded": r"founded in (\d+)",
    "river": r"on the river (\w+)",
    "birthplace": r"born in (\w+)",
    "born": r"born in \w+ in (\d+)",
    "teacher": r"taught by (\w+)",
}
"""Where each relation's value stands in a passage of the shipped world (envs/search_world.py)."""


def read_answer(task: Task, passages: str) -> str | None:
    """The scripted policy's reading of a single-hop question: the fact it asks for, from the passage
    of the entity it is about."""
    (entity,), (relation,) = task.metadata["queries"], task.metadata["relations"]
    passage = re.search(rf"^Doc \d+\(Title: {entity}\) (.*)$", passages, flags=re.MULTILINE)
    if passage is None:
        return None
    found = re.search(FACTS[relation], passage.group(1))
    return found.group(1) if found else None


def single_hop(tasks: list[Task]) -> list[Task]:
    return [task for task in tasks if task.metadata["hops"] == 1]


def test_scripted_policy_solves_val_episodes(url: str) -> None:
    env = gymnasium.make("pacerl/Search-v0", tasks="search-val", retriever_url=url)
    tasks = single_hop(load_tasks("search-val"))[:25]
    assert {task.metadata["relations"][0] for task in tasks} == set(FACTS)
    for task in tasks:
        observation, info = env.reset(options={"task_id": task.id})
        assert [m["role"] for m in observation] == ["system", "user"] and info["tools"] == ["search"]
        assert observation[1]["content"] == task.question and "<answer>" in observation[0]["content"]
        observation, reward, terminated, truncated, info = env.step(
            f"<think>I need to look this up.</think>\n{search_call(task.question)}"
        )
        assert (reward, terminated, truncated, info["error"], info["tool_calls"]) == (
            0.0,
            False,
            False,
            False,
            1,
        )
        (message,) = observation
        assert message["role"] == "tool" and message["name"] == "search"
        assert message["content"].startswith("Doc 1(Title: ") and len(message["content"].splitlines()) == 3
        answer = read_answer(task, message["content"])
        assert answer == task.answer, message["content"]
        observation, reward, terminated, truncated, info = env.step(
            f"It says so.\n<answer> {answer} </answer>"
        )
        assert (observation, reward, terminated, truncated) == ((), 1.0, True, False)
        assert info["reward_breakdown"] == {"total": 1.0, "correctness": 1.0, "format": 1.0, "f1": 1.0}
    env.close()


@pytest.mark.parametrize(
    ("final", "total", "correctness", "formatted", "f1"),
    [
        ("<answer>Galphadra</answer>", 1.0, 1.0, 1.0, 1.0),
        ("<answer>the galphadra.</answer>", 1.0, 1.0, 1.0, 1.0),  # SQuAD normalization
        ("<answer>Briwyn</answer>", 0.0, 0.0, 1.0, 0.0),
        ("<answer>founder Galphadra</answer>", 0.0, 0.0, 1.0, 2 / 3),  # partial credit shows only in F1
        ("<answer>Briwyn</answer> no wait <answer>Galphadra</answer>", 1.0, 1.0, 1.0, 1.0),  # the last tag
        ("The founder was Galphadra.", 0.0, 0.0, 0.0, 0.0),  # no tag, no reward
        ("<answer>Galphadra", 0.0, 0.0, 0.0, 0.0),  # unclosed
        ("<answer>  </answer>", 0.0, 0.0, 0.0, 0.0),
    ],
)
def test_rewards_exact_match_with_f1_reported(
    url: str, final: str, total: float, correctness: float, formatted: float, f1: float
) -> None:
    env = SearchEnv(tasks=[ARDBRIDAN], retriever_url=url)
    env.reset(seed=0)
    env.step(search_call("Ardbridan founder"))
    observation, reward, terminated, truncated, info = env.step(final)
    assert (observation, reward, terminated, truncated) == ((), total, True, False)
    breakdown = info["reward_breakdown"]
    assert breakdown == {
        "total": total,
        "correctness": correctness,
        "format": formatted,
        "f1": pytest.approx(f1),
    }
    env.close()


def test_format_weight_rewards_a_well_formed_wrong_answer(url: str) -> None:
    env = SearchEnv(tasks=[ARDBRIDAN], config=ToolEnvConfig(tool_formats=("hermes",), format_weight=0.1))
    for final, reward in [
        ("<answer>Briwyn</answer>", 0.1),
        ("Briwyn", 0.0),
        ("<answer>Galphadra</answer>", 1.0),
    ]:
        env.reset()
        assert env.step(final)[1] == pytest.approx(reward), final
    env.close()


def test_retriever_down_is_an_observation_and_the_episode_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    env = SearchEnv(tasks=[ARDBRIDAN], retriever_url=dead, render_mode="ansi")
    env.reset()
    sent = record_http_requests(monkeypatch)
    observation, reward, terminated, truncated, info = env.step(search_call("Ardbridan"))
    # One attempt, refused (ConnectError below, not a timeout): the step did not wait or retry.
    assert [str(request.url) for request in sent] == [f"{dead}/retrieve"]
    assert (reward, terminated, truncated, info["error"], info["tool_errors"]) == (0.0, False, False, True, 1)
    assert observation[0]["content"] == (
        f"Error: the search service at {dead}/retrieve is unreachable (ConnectError)"
    )
    assert info["step_errors"] == [observation[0]["content"].removeprefix("Error: ")]
    _, reward, terminated, _, info = env.step("<answer>Galphadra</answer>")  # the model answers anyway
    assert (reward, terminated, info["error"]) == (1.0, True, False)
    assert "unreachable" in (env.render() or "")
    env.close()

    truncating = SearchEnv(
        tasks=[ARDBRIDAN],
        config=ToolEnvConfig(tool_formats=("hermes",), on_tool_error="truncate"),
        retriever_url=dead,
    )
    truncating.reset()
    observation, reward, terminated, truncated, info = truncating.step(search_call("Ardbridan"))
    assert (reward, terminated, truncated, info["truncation_reason"]) == (0.0, False, True, "tool_error")
    assert observation[0]["content"].startswith("Error: the search service")
    with pytest.raises(RuntimeError, match="reset"):
        truncating.step("<answer>Galphadra</answer>")
    truncating.close()


def test_unconfigured_retriever_and_bad_calls_are_observations() -> None:
    env = SearchEnv(tasks=[ARDBRIDAN])
    env.reset()
    observation, _, terminated, _, info = env.step(search_call("Ardbridan"))
    assert not terminated and info["error"]
    assert "no search service is configured" in observation[0]["content"]
    observation, _, _, _, info = env.step(
        '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    )
    assert observation[0]["content"] == "Error: unknown tool 'python'; available: search"
    # Fenced code is not a call here (Hermes calls only), so this message is a (wrong) final answer.
    _, reward, terminated, _, _ = env.step("```python\nprint(1)\n```")
    assert (reward, terminated) == (0.0, True)
    env.close()


def test_settings_and_the_retriever_url_argument(url: str) -> None:
    config = ToolEnvConfig(tool_formats=("hermes",), settings={"retriever_url": "http://127.0.0.1:9", "x": 1})
    env = SearchEnv(tasks=[ARDBRIDAN], config=config, retriever_url=url)
    assert env.config.settings == {"retriever_url": url, "x": 1} and env.config.tool_formats == ("hermes",)
    assert config.settings["retriever_url"] == "http://127.0.0.1:9"  # the caller's config is not changed
    env.reset()
    observation, *_ = env.step(search_call("Ardbridan"))
    assert observation[0]["content"].startswith("Doc 1(Title: Ardbridan)")
    env.close()

    from_settings = SearchEnv(tasks=[ARDBRIDAN], config=ToolEnvConfig(settings={"retriever_url": url}))
    from_settings.reset()
    assert from_settings.step(search_call("Ardbridan"))[0][0]["content"].startswith("Doc 1(Title: Ardbridan)")
    from_settings.close()

    default = SearchEnv()
    assert len(default.tasks) == 16_000 and default.tasks[0].id.startswith("search-train-")
    assert [schema["function"]["name"] for schema in default.tool_schemas()] == ["search"]
    default.close()


async def test_many_episodes_step_concurrently_on_one_loop(url: str) -> None:
    tasks = single_hop(load_tasks("search-val"))[:32]
    environments = [SearchEnv(tasks=tasks, retriever_url=url) for _ in tasks]

    async def play(env: SearchEnv, task: Task) -> float:
        env.reset(options={"task": task})
        observation, *_ = await env.astep(search_call(task.question))
        answer = read_answer(task, observation[0]["content"])
        _, reward, terminated, _, _ = await env.astep(f"<answer>{answer}</answer>")
        assert terminated
        return reward

    rewards = await asyncio.gather(*(play(env, task) for env, task in zip(environments, tasks, strict=True)))
    assert rewards == [1.0] * len(tasks)
    for env in environments:
        env.close()


def test_gymnasium_env_checker_passes(url: str) -> None:
    env = gymnasium.make("pacerl/Search-v0", retriever_url=url, render_mode="ansi")
    try:
        check_env(env.unwrapped, skip_render_check=False)
    finally:
        env.close()


def test_search_r1_search_tags_are_calls_too(url: str) -> None:
    env = SearchEnv(tasks=[ARDBRIDAN], retriever_url=url)
    env.reset()
    observation, _, terminated, _, info = env.step(
        "<search> Ardbridan founder </search> and " + search_call("Ardbridan river")
    )
    assert not terminated and info["tool_calls"] == 2 and not info["error"]
    assert [m["name"] for m in observation] == ["search", "search"]
    assert all(m["content"].startswith("Doc 1(Title: Ardbridan)") for m in observation)
    env.close()


def test_a_refused_query_tells_the_model_why(url: str) -> None:
    env = SearchEnv(tasks=[ARDBRIDAN], config=ToolEnvConfig(), retriever_url=url)
    env.reset()
    observation, _, terminated, _, info = env.step(search_call("Ardbridan " * 200))  # over the length cap
    content = observation[0]["content"]
    assert not terminated and info["error"], observation
    assert "HTTP 422" in content and "512" in content, content  # the cap it broke, not just a code
    env.close()
