"""reasoning-gym as an evaluation suite and as a run's validation set: `pacerl eval --suite
reasoning-gym:<d1>,<d2>` scores each dataset's evaluation set (the reserved seed) in
pacerl/ReasoningGym-v0 with the dataset's own scorer, and a run training on `reasoning_gym:` tasks is
evaluated on its own datasets' evaluation sets; a scripted served model makes every score exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pacerl.agents.evaluation.benchmarks import load_benchmark, suite_benchmarks
from pacerl.agents.models import build_tiny_moe
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.assembly import background_evaluator, env_factory, held_out_of_training
from pacerl.cli import main
from pacerl.config import ConfigError, config_from_dict, load_config
from pacerl.config_keys import check_keys
from pacerl.envs import Task, load_tasks
from pacerl.envs.reasoning_gym import EVALUATION_SEED, EVALUATION_SIZE
from pacerl.evaluate import main_eval
from pacerl.openai_app import create_app
from tests.helpers import ThreadServer
from tests.pacerl.helpers import TextEngine

TOKENS = ["evaluation.settings.max_new_tokens=16", "evaluation.settings.max_total_tokens=2048"]


def answering(tokenizer: Any, tasks: list[Task], wrong: frozenset[str] = frozenset()) -> TextEngine:
    """A served model that gives each task's answer in reasoning-gym's tag, "0" to datasets in `wrong`."""

    def reply(prompt: str) -> str:
        task = next(t for t in tasks if t.question in prompt)
        dataset = task.metadata["reasoning_gym"]["dataset"]
        return f"<answer>{'0' if dataset in wrong else task.answer}</answer>"

    return TextEngine(tokenizer, reply)


def test_the_family_builds_one_greedy_benchmark_per_dataset_at_the_evaluation_seed() -> None:
    arithmetic, legs = suite_benchmarks("reasoning-gym:basic_arithmetic,leg_counting")
    assert (arithmetic.name, legs.name) == ("basic_arithmetic", "leg_counting")
    assert {b.env_id for b in (arithmetic, legs)} == {"pacerl/ReasoningGym-v0"}
    assert arithmetic.eval_settings == {"samples": 1, "temperature": 0.0}
    tasks = load_benchmark(legs)
    assert [t.id for t in tasks] == [f"leg_counting-{EVALUATION_SEED}-{i}" for i in range(EVALUATION_SIZE)]
    assert [t.id for t in tasks] == [t.id for t in load_tasks("reasoning_gym:leg_counting?split=eval")]
    (small,) = suite_benchmarks("reasoning-gym:chain_sum?size=3")
    assert len(load_benchmark(small)) == 3
    with pytest.raises(ValueError, match="no dataset 'leg_countin'; did you mean leg_counting"):
        suite_benchmarks("reasoning-gym:leg_countin")


def test_pacerl_eval_suite_scores_each_dataset_with_its_own_scorer(tmp_path: Path) -> None:
    """Right on every arithmetic task, "0" on every leg count: 100 and 0, their average 50."""
    tokenizer = tiny_tokenizer()
    tasks = [
        t
        for name in ("basic_arithmetic", "leg_counting")
        for t in load_tasks(f"reasoning_gym:{name}?split=eval")
    ]
    engine = answering(tokenizer, tasks, wrong=frozenset({"leg_counting"}))
    out = tmp_path / "rg.json"
    with ThreadServer(create_app(engine, tokenizer, model_name="stub")) as server:
        served = ["engine_backend=openai", f"openai.base_url={server.url}/v1", *TOKENS]
        suite = "reasoning-gym:basic_arithmetic,leg_counting"
        assert main(["eval", "--suite", suite, "--out", str(out), *served]) == 0
    data = json.loads(out.read_text())
    arithmetic, legs = data["benchmarks"]
    assert (arithmetic["name"], arithmetic["tasks"], arithmetic["k"]) == ("basic_arithmetic", 50, 1)
    assert (arithmetic["avg_at_k"], arithmetic["maj_at_k"], legs["avg_at_k"]) == (1.0, 1.0, 0.0)
    assert data["average"]["avg_at_k"] == 0.5 and data["suite"] == suite
    assert (
        arithmetic["env_id"] == "pacerl/ReasoningGym-v0"
        and arithmetic["report"]["config"]["temperature"] == 0
    )
    assert len(engine.prompts) == 100


def test_pacerl_eval_on_the_env_follows_the_training_datasets(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    expected = load_tasks("reasoning_gym:leg_counting?split=eval")
    out = tmp_path / "env.json"
    with ThreadServer(create_app(answering(tokenizer, expected), tokenizer, model_name="stub")) as server:
        served = ["engine_backend=openai", f"openai.base_url={server.url}/v1", *TOKENS]
        trained_on = "env.tasks=reasoning_gym:leg_counting?size=300&seed=5"
        overrides = [*served, trained_on]
        assert (
            main_eval(env_id="pacerl/ReasoningGym-v0", n=1, out=str(out), max_tasks=4, overrides=overrides)
            == 0
        )
    data = json.loads(out.read_text())
    assert [t["task_id"] for t in data["per_task"]] == [t.id for t in expected[:4]]
    assert data["avg_at_k"] == 1.0 and "reasoning_gym:leg_counting?split=eval&size=50" in data["label"]


def test_a_run_evaluates_on_its_training_datasets_evaluation_sets() -> None:
    env = {"id": "pacerl/ReasoningGym-v0", "tasks": "reasoning_gym:basic_arithmetic,leg_counting?seed=4"}
    config = config_from_dict({"env": env})
    tokenizer = tiny_tokenizer()
    evaluator = background_evaluator(
        config, build_tiny_moe(config.model.tiny, tokenizer), tokenizer, 0, env_factory(config)
    )
    expected = load_tasks("reasoning_gym:basic_arithmetic,leg_counting?split=eval")
    assert [t.id for t in evaluator.tasks] == [t.id for t in expected]
    assert {t.id.split("-")[0] for t in evaluator.tasks} == {"basic_arithmetic", "leg_counting"}
    assert evaluator.extra_tasks == {}
    training = load_tasks(env["tasks"])
    assert held_out_of_training(config, training) == (training, None)  # nothing held out: it has a set
    default = background_evaluator(
        config_from_dict({"env": {"id": "pacerl/ReasoningGym-v0"}}), evaluator.engine.model, tokenizer, 0,
        env_factory(config),
    )  # fmt: skip
    assert {t.id.rpartition("-")[0] for t in default.tasks} == {f"basic_arithmetic-{EVALUATION_SEED}"}


def test_the_run_config_takes_reasoning_gym_sources() -> None:
    overrides = ["env.id=pacerl/ReasoningGym-v0", "env.tasks=reasoning_gym:basic_arithmetic?size=500&seed=3"]
    check_keys({}, overrides)
    config = load_config(None, overrides)
    assert config.env.tasks == "reasoning_gym:basic_arithmetic?size=500&seed=3"
    assert len(env_factory(config)().tasks) == 500
    bad = config_from_dict({"env": {"id": "pacerl/ReasoningGym-v0", "tasks": "reasoning_gym:nope"}})
    with pytest.raises((ConfigError, ValueError), match="reasoning-gym has no dataset 'nope'"):
        env_factory(bad)
