"""Reward functions: pure, no I/O, each tested against hand-worked cases."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from pacerl.envs.parsing import extract_boxed, extract_tag


@dataclass(frozen=True)
class Reward:
    """A reward and its parts (what `info["reward_breakdown"]` reports)."""

    total: float
    correctness: float
    format: float
    extra: Mapping[str, float] = field(default_factory=dict)
    """Further measures an env reports without rewarding them (e.g. F1 next to exact match)."""

    def breakdown(self) -> dict[str, float]:
        return {"total": self.total, "correctness": self.correctness, "format": self.format, **self.extra}


def math_equal(answer: str, gold: str) -> bool:
    """Mathematical equivalence by math-verify (so `0.5`, `1/2` and `\\frac{1}{2}` agree), not strings."""
    if not answer.strip():
        return False
    plain = _plain_number(answer), _plain_number(gold)
    if None not in plain:  # both plain numerals: exact rational comparison, 2 us instead of ~7 ms
        return plain[0] == plain[1]
    if _too_costly(answer, gold):
        return False
    from math_verify import parse, verify  # imported late: it pulls in sympy, seconds at start-up

    try:
        parsed_gold = parse(f"${gold}$")
        parsed_answer = parse(f"${answer}$")
        return bool(parsed_gold and parsed_answer and verify(parsed_gold, parsed_answer))
    except Exception:  # math-verify raises on some pathological inputs; such an answer is wrong
        return False


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_HUGE_EXPONENT = re.compile(r"\d\s*[eE]\s*[+-]?\s*\d{4,}|\^\s*\{?\s*[+-]?\s*\d{4,}")


def _too_costly(answer: str, gold: str) -> bool:
    """An answer math-verify could spend minutes on, and that cannot equal `gold` anyway: far longer
    than it, more nested powers than it, or an exponent of 1,000 or more that `gold` lacks (a policy's
    `898898888899899E9989999` made sympy build a ten-million-digit rational, hanging the run)."""
    if len(answer) > 4 * len(gold) + 200 or answer.count("^") > gold.count("^") + 3:
        return True
    return bool(_HUGE_EXPONENT.search(answer)) and not _HUGE_EXPONENT.search(gold)


def _plain_number(text: str) -> Fraction | None:
    """The value of an integer, decimal or fraction numeral like `-12`, `0.5` or `3/4`; None for
    anything else (LaTeX, units, thousands separators), which goes to math-verify."""
    text = text.strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except ZeroDivisionError:
        return None


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(answer: str, golds: Sequence[str]) -> float:
    """1.0 if the normalized answer equals any normalized gold answer."""
    normalized = normalize_answer(answer)
    return float(any(normalized == normalize_answer(g) for g in golds))


def f1_score(answer: str, golds: Sequence[str]) -> float:
    """The best token-level F1 against the gold answers."""
    predicted = normalize_answer(answer).split()
    best = 0.0
    for gold in golds:
        truth = normalize_answer(gold).split()
        common = sum((Counter(predicted) & Counter(truth)).values())
        if common:
            precision, recall = common / len(predicted), common / len(truth)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def outcome_reward(correct: float, formatted: bool, format_weight: float = 0.0) -> Reward:
    """Correctness (0..1) when the answer is well-formed; an optional small bonus for the format alone.

    Nothing for a missing or malformed answer, so format cannot be gamed into reward without content.
    """
    if not formatted:
        return Reward(0.0, 0.0, 0.0)
    return Reward(correct + format_weight * (1.0 - correct), correct, 1.0)


def boxed_math_reward(final_message: str, answers: Sequence[str], format_weight: float = 0.0) -> Reward:
    r"""The reward of a math answer given as the last `\boxed{}` of the final message."""
    answer = extract_boxed(final_message)
    correct = answer is not None and any(math_equal(answer, gold) for gold in answers)
    return outcome_reward(float(correct), answer is not None, format_weight)


def answer_tag_reward(final_message: str, answers: Sequence[str], format_weight: float = 0.0) -> Reward:
    """Exact match of the last `<answer>` (Search-R1), F1 reported alongside; 0 without the tag."""
    answer = extract_tag(final_message, "answer")
    if not answer:  # no tag, or an empty one: nothing to grade
        return Reward(0.0, 0.0, 0.0, extra={"f1": 0.0})
    reward = outcome_reward(exact_match(answer, answers), True, format_weight)
    return Reward(reward.total, reward.correctness, reward.format, extra={"f1": f1_score(answer, answers)})
