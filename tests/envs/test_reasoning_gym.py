"""reasoning-gym's datasets as tasks (`reasoning_gym:` sources) and pacerl/ReasoningGym-v0, against the
real reasoning-gym package: the source syntax, stable ids, the seed discipline that keeps training off the
evaluation sets, and rewards from each dataset's own scorer."""

from __future__ import annotations

import json
import logging
import random

import gymnasium
import pytest
import reasoning_gym

from pacerl.envs import Task, load_tasks
from pacerl.envs.reasoning_gym import (
    EVALUATION_SEED,
    EVALUATION_SIZE,
    SYSTEM_PROMPT,
    ReasoningGymEnv,
    ReasoningGymSource,
    extract_answer,
    reasoning_gym_tasks,
    score_answer,
    suite_sources,
)


def test_a_source_generates_the_datasets_own_entries_with_stable_ids() -> None:
    tasks = load_tasks("reasoning_gym:basic_arithmetic?size=20&seed=3")
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=3))
    assert [t.id for t in tasks] == [f"basic_arithmetic-3-{i}" for i in range(20)]
    assert [(t.question, t.answer) for t in tasks] == [(e["question"], e["answer"]) for e in entries]
    assert tasks[5].metadata["reasoning_gym"] == {
        "dataset": "basic_arithmetic",
        "config": {},
        "entry": entries[5],
    }
    again = load_tasks("reasoning_gym:basic_arithmetic?seed=3&size=20")  # same source, other order
    assert [t.id for t in again] == [t.id for t in tasks] and again[0].question == tasks[0].question
    default = load_tasks("reasoning_gym:basic_arithmetic")
    assert len(default) == 1000 and default[0].id == "basic_arithmetic-0-0"


def test_a_mixture_is_reasoning_gyms_composite_with_unique_ids() -> None:
    tasks = load_tasks("reasoning_gym:basic_arithmetic,leg_counting?size=40&seed=2")
    names = {t.metadata["reasoning_gym"]["dataset"] for t in tasks}
    assert names == {"basic_arithmetic", "leg_counting"} and len({t.id for t in tasks}) == 40
    # each member keeps the source's seed: its entries are the ones it generates alone
    alone = {t.id: t.question for t in load_tasks("reasoning_gym:leg_counting?size=40&seed=2")}
    assert all(alone[t.id] == t.question for t in tasks if t.id.startswith("leg_counting-"))


def test_dataset_config_options_reach_the_generator_and_the_scorer() -> None:
    (task,) = load_tasks("reasoning_gym:basic_arithmetic?size=1&seed=4&min_terms=2&max_terms=2&max_digits=1")
    assert task.metadata["reasoning_gym"]["config"] == {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    assert task.metadata["reasoning_gym"]["entry"]["metadata"]["num_terms"] == 2
    assert score_answer(task, task.answer) == 1.0


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("reasoning_gym:basic_arithmetc", "no dataset 'basic_arithmetc'; did you mean basic_arithmetic"),
        ("reasoning_gym:basic_arithmetic?size=0", "size must be a positive integer"),
        ("reasoning_gym:basic_arithmetic?seed=-1", "seed must be an integer >= 0"),
        ("reasoning_gym:basic_arithmetic?size", "options are key=value"),
        ("reasoning_gym:basic_arithmetic,basic_arithmetic", "name each dataset once"),
        ("reasoning_gym:basic_arithmetic,leg_counting?max_terms=3", "need a single dataset"),
        ("reasoning_gym:basic_arithmetic?no_such_field=1", "reasoning-gym refuses the config"),
        ("reasoning_gym:basic_arithmetic?min_terms=9&max_terms=2", "reasoning-gym refuses the config"),
        ("reasoning_gym:basic_arithmetic?split=test", "split is train or eval"),
        ("reasoning_gym:basic_arithmetic?split=eval&seed=3", "name no seed"),
        (f"reasoning_gym:basic_arithmetic?seed={EVALUATION_SEED}", "reserved for evaluation"),
        (f"reasoning_gym:basic_arithmetic?seed={EVALUATION_SEED - 10}&size=11", "reserved for evaluation"),
    ],
)
def test_bad_sources_are_one_clear_error(source: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_tasks(source)


def test_training_spans_up_to_the_evaluation_seeds_but_not_into_them() -> None:
    below = ReasoningGymSource.parse(f"reasoning_gym:leg_counting?seed={EVALUATION_SEED - 10}&size=10")
    assert below.seed + below.size == EVALUATION_SEED


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "leg_counting"])
def test_training_never_asks_an_evaluation_question(dataset: str) -> None:
    """The defaults: training at seed 0 and the evaluation set at the reserved seed share no question,
    before the guard (the generators do not repeat here) and after it."""
    evaluation = load_tasks(f"reasoning_gym:{dataset}?split=eval")
    assert len(evaluation) == EVALUATION_SIZE
    assert all(t.id == f"{dataset}-{EVALUATION_SEED}-{i}" for i, t in enumerate(evaluation))
    raw = {e["question"] for e in reasoning_gym.create_dataset(dataset, size=1000, seed=0)}
    training = {t.question for t in load_tasks(f"reasoning_gym:{dataset}")}
    asked = {t.question for t in evaluation}
    assert not raw & asked and not training & asked


def test_a_generator_that_repeats_questions_loses_them_from_training_not_from_evaluation() -> None:
    tiny = 'min_terms=2&max_terms=2&max_digits=1&operators=["+"]'  # one-digit sums: 190 questions at most
    training = load_tasks(f"reasoning_gym:basic_arithmetic?size=300&{tiny}")
    evaluation = load_tasks(f"reasoning_gym:basic_arithmetic?split=eval&{tiny}")
    raw = [e["question"] for e in reasoning_gym.create_dataset(
        "basic_arithmetic", size=300, seed=0, min_terms=2, max_terms=2, max_digits=1, operators=("+",)
    )]  # fmt: skip
    asked = {t.question for t in evaluation}
    assert len(evaluation) == EVALUATION_SIZE  # the evaluation set stays whole
    assert sum(q in asked for q in raw) > 0  # the generator does repeat them
    assert len(training) == sum(q not in asked for q in raw) and not {t.question for t in training} & asked
    assert {t.id for t in training} <= {f"basic_arithmetic-0-{i}" for i in range(300)}


def test_validation_follows_the_training_datasets_at_the_reserved_seed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert ReasoningGymEnv.validation_tasks == "reasoning_gym:basic_arithmetic?split=eval&size=50"
    assert ReasoningGymEnv.validation_tasks_for(None) == ReasoningGymEnv.validation_tasks
    assert ReasoningGymEnv.validation_tasks_for("codemath-train") == ReasoningGymEnv.validation_tasks
    follows = ReasoningGymEnv.validation_tasks_for("reasoning_gym:leg_counting,chain_sum?size=500&seed=7")
    assert follows == "reasoning_gym:leg_counting,chain_sum?split=eval&size=50"
    options = ReasoningGymEnv.validation_tasks_for("reasoning_gym:basic_arithmetic?max_terms=3&seed=2")
    assert options == "reasoning_gym:basic_arithmetic?split=eval&size=50&max_terms=3"
    assert all(t.id.startswith(f"basic_arithmetic-{EVALUATION_SEED}-") for t in load_tasks(options))
    with caplog.at_level(logging.WARNING, logger="pacerl.envs.reasoning_gym"):
        ReasoningGymEnv.validation_tasks_for("reasoning_gym:leg_counting?split=eval")
    assert "is an evaluation set: the run trains on what it evaluates on" in caplog.text


def test_the_suites_sources_are_evaluation_sets() -> None:
    assert suite_sources("basic_arithmetic,leg_counting") == {
        "basic_arithmetic": "reasoning_gym:basic_arithmetic?split=eval&size=50",
        "leg_counting": "reasoning_gym:leg_counting?split=eval&size=50",
    }
    assert suite_sources("chain_sum?size=8") == {"chain_sum": "reasoning_gym:chain_sum?split=eval&size=8"}
    with pytest.raises(ValueError, match="name no seed"):
        suite_sources("chain_sum?seed=3")
    with pytest.raises(ValueError, match="no dataset 'nope'"):
        suite_sources("chain_sum,nope")


def test_the_reward_is_the_datasets_own_score_of_the_answer_tag() -> None:
    env = gymnasium.make("pacerl/ReasoningGym-v0", tasks="reasoning_gym:basic_arithmetic,leg_counting?size=6")
    tasks = env.unwrapped.tasks  # type: ignore[attr-defined]
    for task in tasks:
        (system, user), info = env.reset(options={"task_id": task.id})
        assert system == {"role": "system", "content": SYSTEM_PROMPT} and user["content"] == task.question
        reply = f"Working...\n<answer>{task.answer}</answer>"
        _, reward, terminated, truncated, info = env.step(reply)
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert env.unwrapped.final_answer(reply) == task.answer  # type: ignore[attr-defined]
    env.reset(options={"task_id": tasks[0].id})
    assert env.step("no tag: 42")[1:3] == (0.0, True)
    env.reset(options={"task_id": tasks[0].id})
    _, reward, _, _, info = env.step("<answer>not a number</answer>")
    assert reward == 0.0 and info["reward_breakdown"]["format"] == 1.0
    env.close()


def test_partial_credit_is_kept_as_the_reward() -> None:
    """reasoning-gym's default scorer gives len(oracle)/len(answer) when the answer contains the oracle."""
    (task,) = load_tasks("reasoning_gym:leg_counting?size=1&seed=9")
    env = ReasoningGymEnv(tasks=[task])
    env.reset()
    padded = f"{task.answer} legs"
    reward = env.step(f"<answer>{padded}</answer>")[1]
    assert reward == pytest.approx(len(task.answer) / len(padded)) and 0.0 < reward < 1.0
    env.close()


def test_answers_are_read_as_reasoning_gym_reads_them() -> None:
    assert extract_answer("<answer> 1 </answer> then <answer>\n2\n</answer>") == "2"
    assert extract_answer("no tag") is None


def test_tasks_survive_a_checkpoint_round_trip_and_score_the_same() -> None:
    """A run's checkpoint keeps in-flight tasks as JSON rows (`Task.to_row`); a resumed task scores as
    the generated one does."""
    for task in reasoning_gym_tasks("reasoning_gym:basic_arithmetic,leg_counting?size=10"):
        back = Task.from_row(json.loads(json.dumps(task.to_row())))
        assert back.id == task.id and back.question == task.question
        for answer in (task.answer, "0", f"{task.answer}0"):
            assert score_answer(back, answer) == score_answer(task, answer)


def test_a_task_without_an_entry_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="holds no reasoning-gym entry"):
        score_answer(Task("t", "What is 2 + 2?", ("4",)), "4")


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "leg_counting", "letter_counting"])
def test_an_answer_demonstration_scores_full_marks_and_makes_no_call(dataset: str) -> None:
    """The warm start's one style: the dataset's answer between the tags its scorer reads, so SFT
    teaches the format a pretrained model lacks; any other style is refused."""
    tasks = load_tasks(f"reasoning_gym:{dataset}?size=20&seed=5")
    env = ReasoningGymEnv(tasks=tasks)
    try:
        assert dict(ReasoningGymEnv.warm_start_steps) == {"answer": 30}
        for task in tasks:
            (turn,) = env.demonstration(task, "answer", random.Random(0))
            assert turn["role"] == "assistant" and not env.parse(turn["content"]).attempted
            assert env.score(task, turn["content"]).total == 1.0, (task.id, turn)
        with pytest.raises(ValueError, match="writes answer demonstrations, not 'teacher'"):
            env.demonstration(tasks[0], "teacher", random.Random(0))
    finally:
        env.close()
