"""`pacerl eval --suite`: every benchmark of a suite read from local files in its hub schema, scored in
its env with the benchmark's sampling unless the user set it, reported per benchmark and on average in
the papers' layout; a local model and a served one (`engine_backend=openai`) alike."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.openai_chat import OpenAIChatClient, OpenAIChatOptions
from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.evaluation.benchmarks import BENCHMARKS, SUITES, load_benchmark
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.play import evaluate, evaluate_served
from pacerl.agents.evaluation.served import ServedEpisode
from pacerl.agents.models import build_tiny_moe, load_model, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.config import ConfigError
from pacerl.envs.math import SYSTEM_PROMPT as MATH_SYSTEM_PROMPT
from pacerl.envs.math import MathEnv
from pacerl.envs.search import SEARCH_R1_STOP, SearchR1Env, search_r1_prompt, search_r1_question
from pacerl.evaluate import main_eval
from pacerl.openai_app import create_app
from tests.helpers import ThreadServer
from tests.pacerl.helpers import TextEngine
from tests.scripted import ScriptedEngineBase

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "suites"
ROOMY = ["evaluation.settings.max_new_tokens=4", "evaluation.settings.max_total_tokens=1024"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny_tokenizer()
    return save_model(build_tiny_moe(tokenizer=tokenizer), tokenizer, tmp_path_factory.mktemp("m") / "model")


def test_a_suite_reports_each_benchmark_and_the_average(model_dir: Path, tmp_path: Path) -> None:
    out, episodes = tmp_path / "math.json", tmp_path / "math.jsonl"
    overrides = [*ROOMY, "evaluation.settings.samples=2", "evaluation.settings.temperature=1.0"]
    code = main_eval(
        str(model_dir), out=str(out), episodes=str(episodes), overrides=overrides, suite="math",
        suite_dir=str(FIXTURES),
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    names = [b["name"] for b in data["benchmarks"]]
    assert names == list(SUITES["math"]) and data["suite"] == "math"
    for bench in data["benchmarks"]:
        assert (bench["tasks"], bench["k"]) == (3, 2)  # the user's samples beat the benchmark's (32, 4, 1)
        assert bench["report"]["config"]["temperature"] == 1.0
        assert bench["env_id"] == "pacerl/Math-v0"
    mean = sum(b["avg_at_k"] for b in data["benchmarks"]) / 4
    assert data["average"]["avg_at_k"] == pytest.approx(mean)
    assert "AIME24" in data["markdown"] and "Avg." in data["markdown"]
    lines = [json.loads(line) for line in episodes.read_text().splitlines()]
    assert len(lines) == 4 * 3 * 2 and {line["benchmark"] for line in lines} == set(names)
    assert data["run_config"]["model"]["path"] == str(model_dir)


def test_the_benchmarks_own_sampling_applies_when_the_user_sets_none(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    assert (
        main_eval(str(model_dir), out=str(out), overrides=ROOMY, suite="gsm8k", suite_dir=str(FIXTURES)) == 0
    )
    (gsm8k,) = json.loads(out.read_text())["benchmarks"]
    expected = BENCHMARKS["gsm8k"].eval_settings
    assert (
        gsm8k["k"] == expected["samples"]
        and gsm8k["report"]["config"]["temperature"] == expected["temperature"]
    )
    # Search-R1's QA: its env (its own prompt, the in-process retriever over the shipped corpus), greedy
    assert main_eval(str(model_dir), out=str(out), suite="nq", suite_dir=str(FIXTURES)) == 0
    (nq,) = json.loads(out.read_text())["benchmarks"]
    assert nq["env_id"] == "pacerl/SearchR1-v0" and nq["k"] == 1 and nq["tasks"] == 3


def test_bad_suites_fail_before_any_episode(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no suite or benchmark named 'mathh'"):
        main_eval(str(model_dir), suite="mathh", suite_dir=str(FIXTURES))
    with pytest.raises(ConfigError, match=r"--suite math: benchmark 'aime24': the mirror .* holds none of"):
        main_eval(str(model_dir), suite="math", suite_dir=str(tmp_path))


def test_a_served_model_on_a_suite(model_dir: Path, tmp_path: Path) -> None:
    """The README's two commands: `pacerl serve openai`, then `pacerl eval --suite` against it."""
    model, tokenizer = load_model(model_dir)
    out = tmp_path / "served.json"
    with ThreadServer(create_app(EmbeddedEngine(model, tokenizer), tokenizer, model_name="tiny")) as server:
        served = ["engine_backend=openai", f"openai.base_url={server.url}/v1", *ROOMY]
        assert main_eval(out=str(out), overrides=served, suite="gsm8k", suite_dir=str(FIXTURES)) == 0
    data = json.loads(out.read_text())
    (gsm8k,) = data["benchmarks"]
    assert gsm8k["tasks"] == 3 and data["run_config"]["engine_backend"] == "openai"
    assert not any(reason.startswith("failed") for reason in gsm8k["report"]["failures"])


# search-r1's seven benchmarks take seconds each: `make test` runs it, the inner loop nq-hotpotqa's two.
@pytest.mark.parametrize(
    "suite",
    [
        pytest.param(suite, marks=pytest.mark.slow) if suite == "search-r1" else suite
        for suite in sorted(set(SUITES) - {"math", "bfcl-multi-turn", "bfcl"})  # tests/envs/test_bfcl*.py
    ],
)
def test_every_named_suite_evaluates_on_its_fixtures(suite: str, model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / f"{suite}.json"
    greedy = [*ROOMY, "evaluation.settings.samples=1", "evaluation.settings.temperature=0"]
    assert (
        main_eval(str(model_dir), out=str(out), overrides=greedy, suite=suite, suite_dir=str(FIXTURES)) == 0
    )
    data = json.loads(out.read_text())
    assert [b["name"] for b in data["benchmarks"]] == list(SUITES[suite])
    assert all(b["tasks"] == 3 and b["k"] == 1 for b in data["benchmarks"])
    assert all(BENCHMARKS[b["name"]].env_id == b["env_id"] for b in data["benchmarks"])


class SearchR1Stub(ScriptedEngineBase):
    """A Search-R1 policy, as a real engine runs it: each turn cut after the first stop string it
    holds (kept, as engines keep it). It searches the question, over-generating made-up passages past
    `</search>`; it answers only when the retrieved `<information>` continues its own turn, the way
    Search-R1 poses it (not after a new turn)."""

    def __init__(self, tokenizer: Any, answers: dict[str, str]) -> None:
        self.tokenizer, self.answers = tokenizer, answers

    def reply(self, prompt: str) -> str:
        question = next(q for q in self.answers if f"Question: {q}" in prompt)
        if prompt.endswith("</information>\n\n"):
            return f"<think>Found it.</think>\n<answer> {self.answers[question]} </answer> Done."
        if "<information>" in prompt.partition(f"Question: {question}")[2]:
            return "<answer> lost </answer>"
        return f"<think>I lack knowledge.</think>\n<search> {question} </search>\n\n<information>made up"

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, **_: Any) -> Generation:
        text = self.reply(self.tokenizer.decode(list(input_ids), skip_special_tokens=False))
        found = [(i + len(s), s) for s in sampling.stop_strings if (i := text.find(s)) != -1]
        end = [self.tokenizer.eos_token_id] if not found else []
        text = text[: min(found)[0]] if found else text
        tokens = (*self.tokenizer.encode(text, add_special_tokens=False), *end)
        return Generation(tokens, (-0.25,) * len(tokens), (0,) * len(tokens), FinishReason.STOP)


async def test_search_r1_served_scores_as_local() -> None:
    """HotpotQA through Search-R1's env: the served model gets the env's stop strings, its trimmed stop
    is put back, and the passages continue its turn as `<information>`, so it scores as the local path
    does, with or without `openai.stop` set."""
    tokenizer = tiny_tokenizer()
    tasks = load_benchmark("hotpotqa", mirror=FIXTURES)
    stub = SearchR1Stub(
        tokenizer, {str(search_r1_question(search_r1_prompt(t.question))): t.answer for t in tasks}
    )
    config = EvalConfig(
        samples=1, temperature=0.0, stop_strings=SEARCH_R1_STOP, max_new_tokens=64, max_total_tokens=4096
    )
    with SearchR1Env.services({}) as service:

        def make_env() -> SearchR1Env:
            return SearchR1Env(tasks=tasks, retriever_url=service["retriever_url"])

        local = await evaluate(stub, tokenizer, make_env, tasks, config)
        with ThreadServer(create_app(stub, tokenizer, model_name="stub")) as server:
            served = {}
            for stop in ((), SEARCH_R1_STOP):
                client = OpenAIChatClient(OpenAIChatOptions(base_url=f"{server.url}/v1", stop=stop))
                groups: list[Sequence[ServedEpisode]] = []
                served[stop] = await evaluate_served(client, make_env, tasks, config, on_group=groups.append)
                await client.aclose()
    assert local.avg_at_k == 1.0 and local.mean_turns == 2.0
    for report in served.values():
        assert [r.correct for r in report.per_task] == [r.correct for r in local.per_task]
        assert report.avg_at_k == local.avg_at_k and report.mean_turns == local.mean_turns
        assert report.config.stop_strings == SEARCH_R1_STOP
    # groups reach on_group as they finish, in any order: take the first task's
    episode = next(group[0] for group in groups if group[0].task_id == tasks[0].id)
    user, assistant = episode.messages
    assert user["role"] == "user" and assistant["role"] == "assistant"
    searched, _, rest = assistant["content"].partition("</search>\n\n<information>Doc 1(Title: ")
    assert "<search>" in searched and rest.endswith(
        f"</information>\n\n<think>Found it.</think>\n<answer> {tasks[0].answer} </answer>"
    )
    assert "made up" not in assistant["content"] and "<tool_response>" not in assistant["content"]


def test_the_math_suites_pose_problems_as_papers_do(tmp_path: Path) -> None:
    """`--suite gsm8k`: no system prompt, the problem then DeepSeek-R1's and Qwen's directive
    ("Please reason step by step, and put your final answer within \\boxed{}.") in the user turn;
    Math-v0 outside a suite keeps its own system prompt."""
    tokenizer = tiny_tokenizer()
    engine = TextEngine(tokenizer, lambda prompt: "\\boxed{7}")
    out = tmp_path / "gsm8k.json"
    with ThreadServer(create_app(engine, tokenizer, model_name="text")) as server:
        served = ["engine_backend=openai", f"openai.base_url={server.url}/v1", *ROOMY]
        assert main_eval(out=str(out), overrides=served, suite="gsm8k", suite_dir=str(FIXTURES)) == 0
    (gsm8k,) = json.loads(out.read_text())["benchmarks"]
    assert gsm8k["avg_at_k"] == pytest.approx(1 / 3)  # the first problem's answer is 7
    question = load_benchmark("gsm8k", mirror=FIXTURES)[0].question
    user = f"{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    posed = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    assert posed in engine.prompts and len(engine.prompts) == 3  # the tasks run concurrently
    assert not any(MATH_SYSTEM_PROMPT in prompt for prompt in engine.prompts)
    env = MathEnv(tasks=load_benchmark("gsm8k", mirror=FIXTURES))
    (system, _), _ = env.reset()
    assert system == {"role": "system", "content": MATH_SYSTEM_PROMPT}
    env.close()


def test_settings_a_benchmark_cannot_take_are_refused_before_any_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two samples for the whole math suite: GSM8K is greedy (temperature 0), where samples must be 1."""

    def no_model(*_: Any) -> Any:
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr("pacerl.evaluate._load", no_model)
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "suites"
    with pytest.raises(
        ConfigError, match=r"^--suite math: gsm8k: invalid eval config: temperature 0 is greedy"
    ):
        main_eval(
            "smollm2-135m", suite="math", suite_dir=str(fixtures), overrides=["evaluation.settings.samples=2"]
        )
