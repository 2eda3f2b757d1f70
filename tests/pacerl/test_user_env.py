"""A user's env in their own module, outside the package, registered as `module:Name-v0`: the CLI
evaluates it and trains on it with no edit to pacerl, and what it lacks (demonstrations, a validation
set, default tasks) is either done without (no validation set: a seeded tenth of the training tasks is
held out of training and evaluated on, and the log says so) or named in one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pacerl.agents.models import build_tiny_moe, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.assembly import env_factory, held_out_of_training, training_tasks
from pacerl.config import ConfigError, config_from_dict
from pacerl.envs import Task
from pacerl.envs.registry import env_class
from pacerl.envs.tasks import hold_out

ROOT = Path(__file__).resolve().parents[2]

USER_MODULE = '''
"""A word-reversal quiz with a host-side tool: a user's env, registered when this module is imported."""
import gymnasium

from pacerl.envs import Task, ToolEnv, tool
from pacerl.envs.rewards import Reward, exact_match


@tool
def reverse(text: str) -> str:
    """Reverse a piece of text.

    Args:
        text: The text to reverse.
    """
    return text[::-1]


WORDS = ["abc", "pacerl", "tool", "quiz"]
TASKS = [Task(f"w{i}", f"Reverse {word}", (word[::-1],)) for i, word in enumerate(WORDS)]


class ReverseQuizEnv(ToolEnv):
    tool_names = ("reverse",)

    def __init__(self, tasks=TASKS, config=None, render_mode=None):
        super().__init__(tasks, config, render_mode)

    def initial_messages(self, task):
        return self.pose("Use the reverse tool, then answer with the reversed word.", task.question)

    def score(self, task, final_message):
        correct = exact_match(final_message, task.answers)
        return Reward(total=correct, correctness=correct, format=1.0)


class NoTasksEnv(ReverseQuizEnv):
    def __init__(self, tasks, config=None, render_mode=None):
        super().__init__(tasks, config, render_mode)


gymnasium.register(id="quiz/ReverseQuiz-v0", entry_point=ReverseQuizEnv)
gymnasium.register(id="quiz/NoTasks-v0", entry_point=NoTasksEnv)
'''

ENV_ID = "user_quiz:quiz/ReverseQuiz-v0"


@pytest.fixture(scope="module")
def user_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding `user_quiz.py`, put on sys.path here and on PYTHONPATH for the CLI."""
    root = tmp_path_factory.mktemp("user")
    (root / "user_quiz.py").write_text(textwrap.dedent(USER_MODULE))
    (root / "quiz.jsonl").write_text(
        "".join(json.dumps({"id": f"q{i}", "question": f"Reverse {w}", "answer": w[::-1]}) + "\n"
                for i, w in enumerate(["up", "on"]))
    )  # fmt: skip
    sys.path.insert(0, str(root))
    return root


def cli(user_module: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_module), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "pacerl", *arguments],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )


def test_the_module_form_resolves_a_users_env_and_names_what_is_wrong(user_module: Path) -> None:
    cls = env_class(ENV_ID)
    assert cls.__name__ == "ReverseQuizEnv" and cls.warm_start_steps == {} and cls.validation_tasks is None
    env = env_factory(config_from_dict({"env": {"id": ENV_ID}}))()
    try:
        observation, _ = env.reset(seed=0)
        assert observation[-1]["content"].startswith("Reverse ")
        call = '<tool_call>{"name": "reverse", "arguments": {"text": "abc"}}</tool_call>'
        (response,), _, terminated, _, info = env.step(call)
        assert response["content"] == "cba" and not terminated and info["tool_calls"] == 1
    finally:
        env.close()
    with pytest.raises(ConfigError, match="has no default tasks: name a task file"):
        env_factory(config_from_dict({"env": {"id": "user_quiz:quiz/NoTasks-v0"}}))
    with pytest.raises(ConfigError, match=r"env 'quiz/Nope-v0' is not registered .*quiz/ReverseQuiz-v0"):
        env_factory(config_from_dict({"env": {"id": "user_quiz:quiz/Nope-v0"}}))
    with pytest.raises(ValueError, match="writes no demonstrations"):
        config_from_dict({"sft": {"style": "clean"}}).sft.resolved(ENV_ID)
    assert config_from_dict({}).sft.resolved(ENV_ID) == ("", 0)  # auto: no warm start


@pytest.mark.slow
def test_the_cli_evaluates_and_trains_a_users_env(user_module: Path, tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    model = save_model(build_tiny_moe(tokenizer=tokenizer), tokenizer, tmp_path / "model")
    tasks = str(user_module / "quiz.jsonl")
    # No validation set: the tasks a run holds out of training (1 of the 4, by the seed), said so.
    held_report = tmp_path / "held.json"
    held = cli(user_module, "eval", "--model", str(model), "--env", ENV_ID, "--out", str(held_report))
    assert held.returncode == 0, held.stderr
    assert (
        "ships no validation set: evaluating on 1 of its 4 tasks held out of training, seed 0" in held.stderr
    )
    held_out = json.loads(held_report.read_text())
    assert held_out["tasks"] == 1 and held_out["episodes"] == 4
    report = tmp_path / "eval.json"
    evaluated = cli(
        user_module, "eval", "--model", str(model), "--env", ENV_ID, "--tasks", tasks, "--n", "2",
        "--out", str(report),
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(report.read_text())["episodes"] == 4
    run_dir = tmp_path / "run"
    settings = [
        f"env.id={ENV_ID}", f"run_dir={run_dir}", "loop.steps=2", "loop.batch_groups=2",
        "rollout.group_size=2", "filter.pace.target_groups=2", "filter.max_concurrent_groups=2",
        "evaluation.every=0", "evaluation.at_start=false",
    ]  # fmt: skip
    trained = cli(user_module, "train", *settings)
    assert "evaluating on 1 of its 4 training tasks, held out of training (seed 0" in trained.stderr
    # A random-init model with no warm start draws reward 0 everywhere: every step is skipped, so the run
    # writes its outputs and report, then exits 2 naming it (a pipeline must not take it for success).
    assert trained.returncode == 2, trained.stderr
    assert trained.stderr.strip().splitlines()[-1].startswith("pacerl: error: trained nothing: all 2 steps")
    assert "trained 2 steps (policy version 0)" in trained.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failure"].startswith("trained nothing") and summary["updated_steps"] == 0
    assert summary["step"] == 2 and summary["evaluations"][-1]["step"] == 2
    assert 0.0 <= summary["evaluations"][-1]["eval/accuracy"] <= 1.0
    assert not (run_dir / "warm_start").exists()  # nothing to demonstrate: no warm start
    assert (run_dir / "model" / "config.json").exists()


def test_hold_out_keeps_a_seeded_tenth_of_the_tasks_out_of_training() -> None:
    tasks = [Task(f"t{i}", f"q{i}", ("a",)) for i in range(30)]
    kept, held = hold_out(tasks, seed=3)
    assert len(held) == 3 and len(kept) == 27  # a tenth
    assert {t.id for t in kept} | {t.id for t in held} == {t.id for t in tasks}
    assert not {t.id for t in kept} & {t.id for t in held}
    assert kept == sorted(kept, key=tasks.index) and held == sorted(held, key=tasks.index)  # own order
    assert hold_out(tasks, seed=3) == (kept, held) and hold_out(tasks, seed=4)[1] != held
    assert len(hold_out(tasks[:4], seed=0)[1]) == 1  # at least one
    assert len(hold_out(tasks * 30, seed=0, most=64)[1]) == 64  # at most `most`
    with pytest.raises(ValueError, match="at least 2 tasks"):
        hold_out(tasks[:1], seed=0)


def test_a_run_without_a_validation_set_trains_on_what_it_does_not_evaluate(user_module: Path) -> None:
    config = config_from_dict({"env": {"id": ENV_ID}, "seed": 5})
    every = training_tasks(env_factory(config))
    kept, held = held_out_of_training(config, every)
    assert held is not None and len(held) == 1 and held == hold_out(every, 5)[1]
    assert not {t.id for t in kept} & {t.id for t in held} and len(kept) == 3
    quiet = config_from_dict(
        {"env": {"id": ENV_ID}, "evaluation": {"every": 0, "at_start": False, "at_end": False}}
    )
    assert held_out_of_training(quiet, every) == (every, None)  # no evaluation: every task trains
    named = config_from_dict({"env": {"id": ENV_ID}, "evaluation": {"tasks": "codemath-val"}})
    assert held_out_of_training(named, every) == (every, None)  # a named set: nothing held out


def test_a_group_of_one_is_refused_as_a_run_that_cannot_learn() -> None:
    with pytest.raises(ConfigError, match=r"rollout.group_size=1: every advantage estimator .* use rollout"):
        config_from_dict({"rollout": {"group_size": 1}})
    assert config_from_dict({"rollout": {"group_size": 2}}).rollout.group_size == 2
