"""CodeMath's task generator: every surface form, the held-out forms kept out of training, answers checked
by an evaluator of the test's own, determinism per seed, and demonstrations the env rewards."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from pacerl.envs import Task, load_tasks
from pacerl.envs.code_math import CodeMathEnv, code_math_turns, is_easy
from pacerl.envs.tasks import (
    CODEMATH_FORMS,
    CODEMATH_NOTATIONS,
    CODEMATH_WORDINGS,
    HELDOUT_FORMS,
    TRAINING_FORMS,
    codemath_tasks,
)

# The wordings as the test reads them back, written out independently of the generator's templates.
QUESTION_RE = re.compile(
    r"^(?:Let (?P<name>[a-z]) = (?P<first>[-0-9 *+]+)\. )?"
    r"(?:What is (?P<a>.+)\?|Compute (?P<b>.+)\.|Calculate (?P<c>[^.]+)|(?P<d>.+) = \?"
    r"|Evaluate (?P<e>.+)\.|Find the value of (?P<f>.+)\.)$"
)
SAFE_RE = re.compile(r"^[-0-9a-z +*()]+$")


def independent_answer(question: str) -> int:
    """The question's value, read from its text alone: operator words and `×` become python operators,
    a sum's numbers are added, a `Let` binds its variable."""
    match = QUESTION_RE.match(question)
    assert match is not None, question
    phrase = next(match[group] for group in "abcdef" if match[group] is not None)
    if phrase.lower().startswith("the sum of "):
        return sum(int(number) for number in re.findall(r"-?\d+", phrase))
    expression = phrase.replace("×", "*")
    for word, symbol in (("times", "*"), ("plus", "+"), ("minus", "-")):
        expression = expression.replace(f" {word} ", f" {symbol} ")
    scope: dict[str, int] = {}
    if match["name"]:
        assert SAFE_RE.match(match["first"])
        scope[match["name"]] = eval(match["first"], {"__builtins__": {}})
    assert SAFE_RE.match(expression), expression
    value = eval(expression, {"__builtins__": {}}, scope)
    assert isinstance(value, int)
    return value


def test_every_form_is_generated_tagged_and_answered_correctly() -> None:
    tasks = codemath_tasks(1500, seed=11, forms=CODEMATH_FORMS)
    forms = Counter(task.metadata["form"] for task in tasks)
    assert set(forms) == set(CODEMATH_FORMS) and len(CODEMATH_FORMS) == 36
    for task in tasks:
        assert task.answer == str(independent_answer(task.question)), task
    questions = {form: [t.question for t in tasks if t.metadata["form"] == form] for form in forms}
    assert all("×" in q for q in questions["compute/cross"])
    assert all(" times " in q or " plus " in q for q in questions["evaluate/words"])
    assert all(" " not in q.removeprefix("What is ") for q in questions["what-is/tight"])
    assert all(q.startswith("Let ") for q in questions["what-is/let"])
    assert all(q.startswith("The sum of ") and q.endswith(" = ?") for q in questions["equals/sum"])
    # Negative operands, parentheses and operands of four digits all occur.
    assert any("(-" in q for q in questions["what-is/spaced"])
    assert any(re.search(r"\(\d+ \+ \d+\)", q) for q in questions["what-is/spaced"])
    assert any(re.search(r"\d{4}", t.question) for t in tasks)
    assert sum(t.answer.startswith("-") for t in tasks) > 50
    with pytest.raises(ValueError, match="unknown CodeMath forms"):
        codemath_tasks(1, seed=0, forms=["what-is/roman"])


def test_the_held_out_forms_recombine_what_training_shows() -> None:
    assert set(HELDOUT_FORMS).isdisjoint(TRAINING_FORMS)
    assert set(HELDOUT_FORMS) | set(TRAINING_FORMS) == set(CODEMATH_FORMS)
    # Each wording and each notation is held out in exactly one form and trained in all the others.
    assert sorted(form.split("/")[0] for form in HELDOUT_FORMS) == sorted(CODEMATH_WORDINGS)
    assert sorted(form.split("/")[1] for form in HELDOUT_FORMS) == sorted(CODEMATH_NOTATIONS)


def test_the_shipped_sets_keep_held_out_forms_out_of_training() -> None:
    names = ("codemath-forms-train", "codemath-heldout", "codemath-train", "codemath-val")
    forms, heldout, plain, val = (load_tasks(name) for name in names)
    assert len(forms) == 2000 and len(heldout) == 200 and len(plain) == 2000 and len(val) == 200
    assert {t.metadata["form"] for t in forms} == set(TRAINING_FORMS)
    assert {t.metadata["form"] for t in heldout} == set(HELDOUT_FORMS)
    assert not {t.question for t in [*forms, *plain]} & {t.question for t in heldout}
    # The plain sets: "What is EXPR?" with 2-3 digit operands (the what-is/spaced form, untagged).
    assert all(t.question.startswith("What is ") and "form" not in t.metadata for t in [*plain, *val])
    for task in [*forms, *heldout, *plain, *val]:
        assert task.answer == str(independent_answer(task.question)), task


def test_the_generator_is_deterministic_per_seed() -> None:
    first = codemath_tasks(200, seed=3, forms=TRAINING_FORMS)
    assert codemath_tasks(200, seed=3, forms=TRAINING_FORMS) == first
    assert codemath_tasks(200, seed=4, forms=TRAINING_FORMS) != first


@pytest.mark.parametrize("style", ["clean", "teacher"])
def test_demonstrations_solve_every_form_in_the_sandbox(style: str) -> None:
    """The teacher's code comes from the task, not from one template: each form's demonstration, played
    through the env with the real sandbox, earns reward 1."""
    pool = [*load_tasks("codemath-forms-train"), *load_tasks("codemath-heldout")]
    chosen: dict[tuple[str, bool], Task] = {}
    for task in pool:  # per form: an easy and a hard task where there is one
        chosen.setdefault((task.metadata["form"], is_easy(task)), task)
    assert {form for form, _ in chosen} == set(CODEMATH_FORMS)
    env = CodeMathEnv(tasks=list(chosen.values()))
    rng = random.Random(0)
    calls = 0
    try:
        for task in chosen.values():
            turns = env.demonstration(task, style, rng)
            env.reset(options={"task": task})
            reward, terminated = 0.0, False
            for turn in turns:
                if turn["role"] != "assistant":
                    continue
                observation, reward, terminated, _, _ = env.step(str(turn["content"]))
                if observation:
                    # The tool's real output is what the demonstration's tool turn says it returns.
                    calls += 1
                    assert observation[0]["content"].strip() == task.answer, (task, observation)
            assert terminated and reward == 1.0, (task, turns)
    finally:
        env.close()
    assert calls > len(chosen) // 3


def test_demonstrations_run_the_tasks_own_program() -> None:
    (task,) = [t for t in load_tasks("codemath-forms-train") if t.metadata["form"] == "evaluate/let"][:1]
    call = code_math_turns(task)[0]["content"]
    code = json.loads(str(call).removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]["code"]
    assert code == task.metadata["code"] and "\n" in code  # a two-step program
    plain = Task("p", "What is 12 * (-3)?", ("-36",))
    assert "print(12 * (-3))" in str(code_math_turns(plain)[0]["content"])
    with pytest.raises(ValueError, match="carries no program"):
        code_math_turns(Task("q", "Compute 12 times 3.", ("36",)))
