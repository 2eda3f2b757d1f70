"""A run evaluates the env's further validation sets (CodeMath's held-out question forms) beside its main
one and reports each on its own: in the metrics, the summary and the lines `pacerl train` ends with."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pacerl.agents.models import build_tiny_moe
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.assembly import background_evaluator, env_factory
from pacerl.config import ConfigError, config_from_dict
from pacerl.envs import Task, load_tasks
from pacerl.envs.tasks import HELDOUT_FORMS
from pacerl.train import report
from pacerl.trainer import evaluator as evaluator_module


def evaluator_for(evaluation: dict[str, Any]) -> evaluator_module.BackgroundEvaluator:
    config = config_from_dict({"evaluation": evaluation})
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(config.model.tiny, tokenizer)
    return background_evaluator(config, model, tokenizer, 0, env_factory(config))


def test_each_set_is_scored_and_written_under_its_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[Task]] = []

    async def scripted(
        engine: Any, tokenizer: Any, make_env: Any, tasks: Sequence[Task], *_: Any, **__: Any
    ) -> SimpleNamespace:
        # A stand-in that scores the share of held-out forms, so each scalar shows which set it scored.
        seen.append(list(tasks))
        share = sum(t.metadata.get("form") in HELDOUT_FORMS for t in tasks) / len(tasks)
        return SimpleNamespace(avg_at_k=share, mean_reward=share, tool_call_rate=0.5, pass_at_k={1: share})

    monkeypatch.setattr(evaluator_module, "evaluate", scripted)
    evaluator = evaluator_for({})
    written: list[tuple[int, dict[str, float]]] = []
    metrics = SimpleNamespace(write=lambda step, scalars: written.append((step, scalars)))
    run = SimpleNamespace(step=0, learner=SimpleNamespace(version=0), metrics=metrics)

    async def now() -> None:
        try:
            await evaluator.now(run)  # type: ignore[arg-type]
        finally:
            await evaluator.aclose()

    asyncio.run(now())
    assert [task.id for task in seen[0]] == [task.id for task in load_tasks("codemath-val")]
    assert [task.id for task in seen[1]] == [task.id for task in load_tasks("codemath-heldout")]
    ((step, scalars),) = written
    assert step == 0
    assert scalars["eval/accuracy"] == 0.0 and scalars["eval/heldout/accuracy"] == 1.0
    assert scalars["eval/heldout/pass_at_1"] == 1.0 and scalars["eval/heldout/tool_call_rate"] == 0.5
    assert evaluator.reports == [{"step": 0, "version": 0, **scalars}]


def test_the_sets_come_from_the_env_unless_the_config_names_them(tmp_path: Path) -> None:
    assert list(evaluator_for({}).extra_tasks) == ["heldout"]
    assert evaluator_for({"extra_tasks": {}}).extra_tasks == {}
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"id": "m1", "question": "What is 2 * 3?", "answer": "6"}\n')
    named = evaluator_for({"extra_tasks": {"mine": str(mine)}}).extra_tasks
    assert list(named) == ["mine"] and [t.id for t in named["mine"]] == ["m1"]
    with pytest.raises(ValueError, match="without '/'"):
        evaluator_for({"extra_tasks": {"a/b": str(mine)}})
    with pytest.raises(ConfigError, match="extra_tasks"):
        config_from_dict({"evaluation": {"extra_tasks": ["codemath-heldout"]}})


def test_pacerl_train_ends_with_each_sets_accuracy() -> None:
    first = {"step": 0, "eval/accuracy": 0.06, "eval/heldout/accuracy": 0.04, "eval/heldout/pass_at_1": 0.04}
    last = {"step": 40, "eval/accuracy": 0.6, "eval/heldout/accuracy": 0.52, "eval/heldout/pass_at_1": 0.52}
    summary = {"step": 40, "version": 38, "seconds": 400.0, "evaluations": [first, last]}
    lines = report(summary, Path("runs/x")).splitlines()
    assert lines[1] == "validation accuracy 0.060 (step 0) -> 0.600 (step 40), +54.0 points"
    assert lines[2] == "  heldout: 0.040 -> 0.520, +48.0 points"
