"""pacerl/SearchR1-v0: Search-R1's prompt, observations, reward and data, and its episodes through the
rollout driver with observations continuing the model's text."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import gymnasium
import pyarrow.parquet as pq
import pytest

from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.rollout import RolloutConfig, RolloutDriver
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Origin, Status
from pacerl.envs import Task, ToolEnvConfig, load_tasks
from pacerl.envs.retriever import local_retriever
from pacerl.envs.search import (
    SEARCH_R1_INVALID_ACTION,
    SEARCH_R1_STOP,
    SearchR1Env,
    _shipped_index,
    search_r1_action,
    search_r1_passages,
    search_r1_prompt,
    search_r1_question,
    search_r1_reward,
)
from tests.scripted import ScriptedEngineBase

FIXTURES = Path(__file__).parents[1] / "fixtures" / "suites"
sys.path.insert(0, str(FIXTURES))
from make_fixtures import make_prefix  # noqa: E402 (the fixture script's own copy of Search-R1's text)

KALOTER = Task("k", "Which explorer first described Kaloter", ("Orlo",))
ARDBRIDAN = Task("a", "Who founded Ardbridan", ("Galphadra",))
"""A city of the shipped Search world (envs/search_world.py) and its founder."""


def test_prompt_is_search_r1s_make_prefix_character_for_character() -> None:
    prompt = search_r1_prompt("  which explorer first described kaloter ")
    assert prompt == make_prefix("which explorer first described kaloter?")
    assert prompt.startswith(
        "Answer the given question. You must conduct reasoning inside <think> and </think>"
    )
    assert "You can search as many times as your want. If you find" in prompt  # its typo, kept
    assert prompt.endswith(
        "For example, <answer> Beijing </answer>. Question: which explorer first described kaloter?\n"
    )
    assert search_r1_prompt("Is it?") == make_prefix("Is it?")  # no second "?"
    assert search_r1_question(prompt) == "which explorer first described kaloter?"
    assert search_r1_question("Answer this: x?\n") is None


def test_actions_are_read_as_search_r1_reads_them() -> None:
    assert search_r1_action("<think>hm</think>\n<search> Kaloter explorer </search>") == (
        "search",
        "Kaloter explorer",
    )
    assert search_r1_action("<answer> Orlo </answer><search>x</search>") == (
        "answer",
        "Orlo",
    )  # the first decides
    assert search_r1_action("<search>a</search> then <answer>b</answer>") == ("search", "a")
    assert search_r1_action("I think it is Orlo.") == (None, "")
    assert search_r1_action("<search> unclosed") == (None, "")


def test_passages_keep_search_r1s_format() -> None:
    documents = [{"contents": '"Kaloter"\nKaloter is a city.'}, {"contents": "Untitled line\nfirst\nsecond"}]
    assert search_r1_passages(documents) == (
        'Doc 1(Title: "Kaloter") Kaloter is a city.\nDoc 2(Title: Untitled line) first\nsecond\n'
    )
    assert search_r1_passages([]) == ""


def test_reward_is_qa_em_over_the_whole_text() -> None:
    prompt = search_r1_prompt("Which explorer first described Kaloter")
    assert search_r1_reward(prompt + "<answer> orlo. </answer>", ["Orlo"]).breakdown() == {
        "total": 1.0,
        "correctness": 1.0,
        "format": 1.0,
        "f1": 1.0,
    }
    wrong = search_r1_reward(prompt + "<answer> Sanim </answer>", ["Orlo"], format_score=0.2)
    assert (wrong.total, wrong.correctness, wrong.format) == (0.2, 0.0, 1.0)
    # The last of at least two matches counts: the instruction holds "<answer> and </answer>" and
    # "<answer> Beijing </answer>", so without an answer of its own the model is graded on "Beijing".
    assert search_r1_reward(prompt, ["Orlo"]).total == 0.0
    assert search_r1_reward(prompt, ["Beijing"]).total == 1.0
    assert search_r1_reward("<answer> Orlo </answer>", ["Orlo"]).total == 0.0  # one match: none extracted
    two = "<answer>Sanim</answer> ... <answer> the Orlo </answer>"
    assert search_r1_reward(two, ["Orlo"]).total == 1.0


def test_an_episode_searches_reads_information_and_answers() -> None:
    with local_retriever() as url:
        env = gymnasium.make("pacerl/SearchR1-v0", retriever_url=url).unwrapped
        assert isinstance(env, SearchR1Env)
        observation, info = env.reset(options={"task": ARDBRIDAN})
        assert observation == ({"role": "user", "content": make_prefix("Who founded Ardbridan?")},)
        assert env.tool_schemas() == [] and info["tools"] == ["search"]
        observation, reward, terminated, truncated, info = env.step(
            "<think> I need to search. </think>\n<search> Ardbridan </search>"
        )
        (hits,) = _shipped_index().search(["Ardbridan"], 3)
        passages = "".join(
            f"Doc {i}(Title: {doc['contents'].split(chr(10))[0]}) {doc['contents'].split(chr(10), 1)[1]}\n"
            for i, (doc, _) in enumerate(hits, start=1)
        )
        assert observation == (
            {
                "role": "tool",
                "name": "search",
                "content": f"\n\n<information>{passages.strip()}</information>\n\n",
            },
        )
        assert observation[0]["content"].startswith('\n\n<information>Doc 1(Title: "Ardbridan") Ardbridan is')
        assert "Galphadra" in observation[0]["content"] and passages.count("Doc ") == len(hits) >= 1
        assert (reward, terminated, truncated, info["tool_calls"], info["error"]) == (
            0.0,
            False,
            False,
            1,
            False,
        )
        observation, reward, terminated, truncated, info = env.step(
            "<think> found </think>\n<answer> Galphadra </answer>"
        )
        assert (observation, reward, terminated, truncated) == ((), 1.0, True, False)
        env.close()


def test_invalid_turns_continue_and_the_last_turn_does_not_search() -> None:
    env = SearchR1Env(tasks=[KALOTER], config=ToolEnvConfig(max_turns=3, max_tool_calls=2))
    env.reset()
    observation, reward, terminated, truncated, info = env.step("I am not sure.")
    assert observation == ({"role": "tool", "name": "invalid", "content": SEARCH_R1_INVALID_ACTION},)
    assert (reward, terminated, truncated, info["tool_calls"]) == (0.0, False, False, 0)
    env.step("Still unsure.")
    # Turn 3 of 3 is Search-R1's final rollout: its search is not run, and the whole text is scored.
    observation, reward, terminated, truncated, info = env.step("<search> Kaloter </search>")
    assert (observation, terminated, truncated, info["truncation_reason"], info["tool_calls"]) == (
        (),
        False,
        True,
        "max_turns",
        0,
    )
    # The invalid-turn text holds "<answer> and </answer>": the last match, and a wrong answer.
    assert (reward, info["reward_breakdown"]["format"]) == (0.0, 1.0)
    env.close()


def test_a_failed_search_is_information_the_model_reads() -> None:
    env = SearchR1Env(tasks=[KALOTER], config=ToolEnvConfig(settings={"retriever_url": "http://127.0.0.1:9"}))
    env.reset()
    (observation,), _, terminated, truncated, info = env.step("<search> Kaloter </search>")
    assert observation["content"].startswith(
        "\n\n<information>Error: the search service at http://127.0.0.1:9"
    )
    assert observation["content"].endswith("</information>\n\n")
    assert (terminated, truncated, info["error"], info["tool_errors"]) == (False, False, True, 1)
    env.close()


def test_search_r1_parquet_rows_load_unchanged() -> None:
    path = FIXTURES / "search_r1_test.parquet"
    rows = pq.read_table(path).to_pylist()
    tasks = load_tasks(path)
    assert [t.id for t in tasks] == ["nq-test-0", "nq-test-1", "hotpotqa-test-0"]
    assert [t.answers for t in tasks] == [("Orlo",), ("1128",), ("Sanim", "the explorer Sanim")]
    env = SearchR1Env(tasks=tasks)
    for task, row in zip(tasks, rows, strict=True):
        observation, _ = env.reset(options={"task": task})
        assert list(observation) == row["prompt"]  # posed exactly as the row holds it
        assert (
            task.metadata["data_source"] == row["data_source"]
            and task.metadata["ability"] == "fact-reasoning"
        )
    assert env.score(tasks[2], "<answer> the explorer Sanim </answer>").total == 1.0
    env.close()


class SearchThenAnswer(ScriptedEngineBase):
    """Searches for the subject on the first turn and answers on the second, as Search-R1 models do;
    records what each call was given."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.inputs: list[str] = []

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None,
        return_routed_experts: bool = False, session: str | None = None,
    ) -> Generation:  # fmt: skip
        text = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)  # type: ignore[attr-defined]
        self.inputs.append(text)
        turn = "<answer> Orlo </answer>" if "<information>Doc" in text else "<search> Kaloter </search>"
        tokens = tuple(self.tokenizer.encode(turn, add_special_tokens=False))  # type: ignore[attr-defined]
        return Generation(tokens, (-0.1,) * len(tokens), (0,) * len(tokens), FinishReason.STOP)


async def test_the_driver_appends_information_to_the_models_own_text() -> None:
    tokenizer = tiny_tokenizer()
    engine = SearchThenAnswer(tokenizer)
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0, stop_strings=SEARCH_R1_STOP)
    config = RolloutConfig(group_size=1, sampling=sampling, max_total_tokens=4096, on_failure="keep")
    with local_retriever() as url:
        driver = RolloutDriver(
            engine, tokenizer, lambda: SearchR1Env(tasks=[KALOTER], retriever_url=url), config
        )
        (trajectory,) = await driver.rollout_group(KALOTER, group_id="g")
        observation = SearchR1Env(tasks=[KALOTER], retriever_url=url)
        observation.reset()
        (information,), *_ = await observation.astep("<search> Kaloter </search>")
        observation.close()
    assert (trajectory.status, trajectory.reward) == (Status.COMPLETED, 1.0)
    assert [s.origin for s in trajectory.segments] == [Origin.PROMPT, Origin.MODEL, Origin.TOOL, Origin.MODEL]
    user = make_prefix("Which explorer first described Kaloter?")
    prompt = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    expected = prompt + "<search> Kaloter </search>" + information["content"] + "<answer> Orlo </answer>"
    assert tokenizer.decode(list(trajectory.tokens), skip_special_tokens=False) == expected
    # The second call continued the assistant's text: no turn was closed, none opened.
    assert engine.inputs[1] == prompt + "<search> Kaloter </search>" + information["content"]
    assert engine.inputs[1].count("<|im_start|>") == 2


@pytest.mark.parametrize("turn", ["<search>", "plain text"])
def test_parse_reports_only_search_calls(turn: str) -> None:
    env = SearchR1Env(tasks=[KALOTER])
    assert not env.parse(turn).attempted
    assert env.parse("<search> q </search>").calls[0].arguments == {"query": "q"}
