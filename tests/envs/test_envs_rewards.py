"""Reward functions against hand-worked cases."""

from __future__ import annotations

import pytest

from pacerl.envs.rewards import (
    Reward,
    answer_tag_reward,
    boxed_math_reward,
    exact_match,
    f1_score,
    math_equal,
    normalize_answer,
    outcome_reward,
)


@pytest.mark.parametrize(
    ("answer", "gold", "equal"),
    [
        ("44826", "44826", True),
        ("44,826", "44826", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "0.5", True),
        ("x^2+2x+1", "(x+1)^2", True),
        ("44827", "44826", False),
        ("", "1", False),
        ("\\frac{1}{", "1", False),
    ],
)
def test_math_equal(answer: str, gold: str, equal: bool) -> None:
    assert math_equal(answer, gold) is equal


def test_normalization_exact_match_and_f1_by_hand() -> None:
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert exact_match("the Eiffel Tower", ["eiffel tower", "paris"]) == 1.0
    assert exact_match("Eiffel", ["eiffel tower"]) == 0.0
    # predicted {eiffel, tower, paris}, gold {eiffel, tower}: precision 2/3, recall 1 -> F1 0.8
    assert f1_score("Eiffel Tower Paris", ["Eiffel Tower"]) == pytest.approx(0.8)
    # best over golds: "tower" alone vs gold "tower": 1.0
    assert f1_score("tower", ["eiffel tower", "tower"]) == pytest.approx(1.0)
    assert f1_score("", ["x"]) == 0.0


def test_outcome_reward_format_weight() -> None:
    assert outcome_reward(1.0, True, 0.1) == Reward(1.0, 1.0, 1.0)
    assert outcome_reward(0.0, True, 0.1) == Reward(0.1, 0.0, 1.0)
    assert outcome_reward(1.0, False, 0.1) == Reward(0.0, 0.0, 0.0)


def test_boxed_and_answer_tag_rewards() -> None:
    assert boxed_math_reward("so \\boxed{6}", ["6"]).total == 1.0
    assert boxed_math_reward("so 6", ["6"]) == Reward(0.0, 0.0, 0.0)
    tagged = answer_tag_reward("<answer>explorer Orlo</answer>", ["Orlo"])
    assert (tagged.total, tagged.breakdown()["f1"]) == (0.0, pytest.approx(2 / 3))
    assert answer_tag_reward("<answer> </answer>", ["x"]).breakdown()["f1"] == 0.0


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("606", "620"),
        ("620", "620"),
        ("2.0", "2"),
        ("-3", "3"),
        ("-3", "-3"),
        ("3/4", "0.75"),
        ("0.1", "1/3"),
    ],
)
def test_plain_numerals_agree_with_math_verify(answer: str, gold: str) -> None:
    """Plain numerals take a fast exact path; its verdict is math-verify's."""
    from math_verify import parse, verify

    assert math_equal(answer, gold) is bool(verify(parse(f"${gold}$"), parse(f"${answer}$")))


@pytest.mark.parametrize(
    "answer",
    [
        "898898888899899E9989999user991",  # a collapsed policy's answer that hung sympy for 20 minutes
        "10^{99999}",
        "2^{2^{2^{2^{2^{2}}}}}",
        "1" + "+1" * 400,
    ],
)
def test_answers_math_verify_could_hang_on_are_wrong_without_parsing(
    answer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's output must never hang a run: answers far longer than the gold, with more nested
    powers, or with an exponent of 1,000 or more are wrong before math-verify sees them."""
    import math_verify

    def refuse(*_: object, **__: object) -> object:
        raise AssertionError("math-verify was asked to parse a pathological answer")

    monkeypatch.setattr(math_verify, "parse", refuse)
    assert math_equal(answer, "9") is False


def test_large_exponents_still_compare_when_the_gold_has_one() -> None:
    assert math_equal("2^{10}", "1024") is True
    assert math_equal("10^{1000}", "10^{1000}") is True  # the gold has such an exponent: parsed
