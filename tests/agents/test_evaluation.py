"""Evaluation: pass@k against hand-computed numbers, a scripted policy with known outcomes scored per
episode, and `pacerl eval`'s body on a tiny saved model in each env."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.play import evaluate
from pacerl.agents.evaluation.scores import avg_at_k, pass_at_k
from pacerl.agents.models import build_tiny_moe, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.assembly import env_factory
from pacerl.cli import add_eval_parser
from pacerl.config import ConfigError, config_from_dict
from pacerl.envs import ENV_IDS, Task, ToolEnvConfig
from pacerl.envs.code_math import CodeMathEnv
from pacerl.envs.registry import env_class
from pacerl.envs.retriever import local_retriever
from pacerl.evaluate import main_eval, with_settings
from tests.scripted import ScriptedEngineBase


def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 − C(2,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 − C(3,3)/C(5,3)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # n − c < k: every pair holds a correct sample
    assert pass_at_k(1000, 1, 1000) == 1.0 and pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    # Stable where the binomials overflow a float: C(2000, 1000) ≈ 2e600.
    assert pass_at_k(2000, 1000, 1000) == pytest.approx(1 - math.comb(1000, 1000) / math.comb(2000, 1000))
    assert avg_at_k(4, 1) == 0.25 and avg_at_k(2, 2) == 1.0
    for n, c, k in [(4, 1, 5), (4, 1, 0), (4, 5, 1), (0, 0, 1), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_eval_config_validates_and_always_reports_k_equals_samples() -> None:
    assert EvalConfig(samples=4, ks=(2, 1)).all_ks == (1, 2, 4)
    assert EvalConfig(samples=1, temperature=0.0).all_ks == (1,)
    assert replace(EvalConfig(samples=8), samples=2).all_ks == (1, 2)
    for bad in (
        {"samples": 2, "temperature": 0.0},
        {"samples": 2, "ks": (3,)},
        {"samples": 0},
        {"max_tasks": 0},
    ):
        with pytest.raises(ValueError, match="invalid eval config"):
            EvalConfig(**bad)


A = Task("a", "What is 12 * 34?", ("408",))
B = Task("b", "What is 5 * 6?", ("30",))
C = Task("c", "What is 7 * 8?", ("56",))
END = "<|im_end|>"
CALL_A = '<tool_call>{"name": "python", "arguments": {"code": "print(12 * 34)"}}</tool_call>'
CALL_B = '<tool_call>{"name": "python", "arguments": {"code": "print(5)"}}</tool_call>'
SCRIPT = {  # question -> each sample's turns (the k-th first turn asked for a question starts sample k)
    A.question: [[CALL_A, "It is \\boxed{408}." + END], ["\\boxed{999}" + END]],
    B.question: [["\\boxed{7}" + END], [CALL_B, CALL_B]],  # the second is cut at max_turns=2
    C.question: [],  # the engine fails on it: both episodes end `failed`
}


class ScriptedEngine(ScriptedEngineBase):
    """Answers each episode from SCRIPT by the conversation it is given (the driver plays episodes
    concurrently, so the order of calls says nothing)."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.started: Counter[str] = Counter()
        self._version = 3

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None,
        return_routed_experts: bool = False, session: str | None = None,
    ) -> Generation:  # fmt: skip
        text = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)  # type: ignore[attr-defined]
        question = next(q for q in SCRIPT if q in text)
        if not SCRIPT[question]:
            raise RuntimeError("boom")
        turn = text.count("<|im_start|>assistant") - 1  # the last one is the generation prompt
        if turn == 0:
            sample = self.started[question]
            self.started[question] += 1
        else:
            sample = next(i for i, turns in enumerate(SCRIPT[question]) if turns[0] in text)
        tokens = tuple(self.tokenizer.encode(SCRIPT[question][sample][turn], add_special_tokens=False))  # type: ignore[attr-defined]
        return Generation(tokens, (-0.5,) * len(tokens), (3,) * len(tokens), FinishReason.STOP)


async def test_scripted_policy_is_scored_per_episode() -> None:
    tokenizer = tiny_tokenizer()
    engine = ScriptedEngine(tokenizer)
    config = EvalConfig(samples=2, max_total_tokens=1024, max_new_tokens=64)
    report = await evaluate(
        engine,
        tokenizer,
        lambda: CodeMathEnv(tasks=[A, B, C], config=ToolEnvConfig(max_turns=2)),
        [A, B, C],
        config,
        label="scripted",
    )
    # A: right after a tool call (2 turns, counted once) and wrong; B: wrong, and cut at max_turns;
    # C: two engine failures, which count as wrong samples, not as missing ones.
    assert [(r.task_id, r.samples, r.correct) for r in report.per_task] == [
        ("a", 2, 1),
        ("b", 2, 0),
        ("c", 2, 0),
    ]
    assert (report.tasks, report.episodes, report.samples) == (3, 6, 2)
    assert report.avg_at_k == pytest.approx((1 / 2 + 0 + 0) / 3)
    assert report.pass_at_k == pytest.approx({1: 1 / 6, 2: 1 / 3})
    assert report.mean_reward == pytest.approx(1 / 6)
    assert report.tool_call_rate == pytest.approx(2 / 6)  # A's first sample and B's second
    assert report.mean_turns == pytest.approx((2 + 1 + 1 + 2 + 0 + 0) / 6)
    generated = sum(
        len(tokenizer.encode(turn, add_special_tokens=False))
        for turns in (*SCRIPT[A.question], *SCRIPT[B.question])
        for turn in turns
    )
    assert report.mean_generated_tokens == pytest.approx(generated / 6)
    assert report.failures == {"failed: engine failed: boom": 2, "truncated: max_turns": 1}
    assert report.policy_version == 3 and report.label == "scripted" and report.wall_seconds > 0
    data = json.loads(json.dumps(report.to_json()))
    assert data["pass_at_k"] == {"1": pytest.approx(1 / 6), "2": pytest.approx(1 / 3)}
    assert data["per_task"][0] == {"task_id": "a", "samples": 2, "correct": 1, "majority_correct": True}
    # maj@2 with CodeMath's boxed answers: A's 408 and 999 tie and 408 came first (solved); B's only vote
    # is 7 (the truncated sample gave none); C's failed episodes gave none (unsolved).
    assert [r.majority_correct for r in report.per_task] == [True, False, False]
    assert report.maj_at_k == pytest.approx(1 / 3)
    assert data["config"]["samples"] == 2
    table = report.table()
    assert "scripted" in table and "avg@2" in table and "pass@2" in table and "0.333" in table
    assert "truncated: max_turns" in table


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny_tokenizer()
    return save_model(
        build_tiny_moe(tokenizer=tokenizer), tokenizer, tmp_path_factory.mktemp("eval") / "model"
    )


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_main_eval_writes_a_report_on_each_env(
    env_id: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "reports" / "eval.json"
    # Search-R1's fixed instruction alone is ~300 tokens of the tiny tokenizer: room for a turn after it
    budget = ["evaluation.settings.max_total_tokens=1024"]
    assert main_eval(str(model_dir), env_id, 2, None, str(out), max_tasks=2, overrides=budget) == 0
    data = json.loads(out.read_text())
    assert data["label"] == f"{model_dir} on {env_id} ({env_class(env_id).validation_tasks})"
    assert (data["tasks"], data["episodes"], data["samples"], data["policy_version"]) == (2, 4, 2, 0)
    assert set(data["pass_at_k"]) == {"1", "2"}
    rates = [data["avg_at_k"], *data["pass_at_k"].values(), data["mean_reward"], data["tool_call_rate"]]
    assert all(0.0 <= value <= 1.0 for value in rates)
    assert data["pass_at_k"]["1"] == pytest.approx(data["avg_at_k"])
    assert data["pass_at_k"]["2"] >= data["pass_at_k"]["1"]
    assert 1 <= data["mean_turns"] <= 3 and 1 <= data["mean_generated_tokens"] <= 3 * 40
    assert sum(data["failures"].values()) <= 4 and not any(k.startswith("failed") for k in data["failures"])
    assert [t["samples"] for t in data["per_task"]] == [2, 2]
    assert all(0 <= t["correct"] <= 2 for t in data["per_task"])
    assert "pass@2" in capsys.readouterr().out


def test_search_envs_made_by_the_training_path_reach_the_in_process_retriever() -> None:
    make_env = env_factory(config_from_dict({"env": {"id": "pacerl/Search-v0", "tasks": "search-val"}}))
    with local_retriever() as url:
        env = with_settings(make_env, {"retriever_url": url})()
        env.reset(options={"task": Task("k", "Who founded Ardbridan?", ("Galphadra",))})
        call = '<tool_call>{"name": "search", "arguments": {"query": "Ardbridan"}}</tool_call>'
        (response,), _, _, _, info = env.step(call)
        env.close()
    assert not info["error"] and info["tool_calls"] == 1
    assert response["content"].startswith("Doc 1(Title: Ardbridan)") and "Galphadra" in response["content"]


def test_main_eval_rejects_bad_input_before_running(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"no model directory or .gguf file at {tmp_path / 'missing'}"):
        main_eval(str(tmp_path / "missing"), "pacerl/Math-v0")
    with pytest.raises(
        ConfigError,
        match=r"--env: env 'pacerl/Nope-v0' is not registered \(registered tool envs: .*pacerl/Math-v0",
    ):
        main_eval(str(tmp_path), "pacerl/Nope-v0")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        main_eval(str(tmp_path), "no_such_module:Thing-v0")
    with pytest.raises(ConfigError, match="is not a pacerl ToolEnv"):
        main_eval(str(tmp_path), "CartPole-v1")
    with pytest.raises(ValueError, match="temperature 0 is greedy"):
        main_eval(str(tmp_path), "pacerl/Math-v0", 2, temperature=0.0)


def test_eval_subcommand_parses_into_main_eval_arguments() -> None:
    assert all(env_class(env_id).validation_tasks for env_id in ENV_IDS)
    parser = argparse.ArgumentParser(prog="pacerl")
    eval_parser = add_eval_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "eval",
            "--model",
            "m",
            "--env",
            "pacerl/Search-v0",
            "--n",
            "8",
            "--max-tasks",
            "5",
            "--temperature",
            "1",
        ]
    )
    assert (args.model, args.env, args.n, args.max_tasks, args.temperature) == (
        "m",
        "pacerl/Search-v0",
        8,
        5,
        1.0,
    )
    assert (args.tasks, args.out, args.retriever_url, args.seed) == (None, None, None, None)
    assert args.handler.__name__ == "cmd_eval"
    defaults = EvalConfig()
    help_text = eval_parser.format_help()
    assert f"default {defaults.samples})" in help_text and f"default {defaults.seed})" in help_text
    assert "module:Name-v0" in help_text  # any registered id parses; main_eval checks it
    assert parser.parse_args(["eval", "--model", "m", "--env", "my_envs:Quiz-v0"]).env == "my_envs:Quiz-v0"
