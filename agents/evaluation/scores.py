"""The per-task scores of an evaluation: avg@k and the unbiased pass@k of Chen et al. 2021, "Evaluating
Large Language Models Trained on Code" (arXiv:2107.03374), from a task's n sampled episodes, c of them
correct; maj@k from the answers the episodes gave. Pure functions, tested against hand-computed numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. 2021 (arXiv:2107.03374, section 2.1): the chance
    that at least one of k samples drawn without replacement from n, of which c are correct, is correct.

    1 − C(n−c, k) / C(n, k), computed as 1 − ∏_{i=n−c+1}^{n} (1 − k/i): the binomials overflow floats
    for large n, the product does not. Example: n=4, c=2, k=2 gives 1 − 1/6 = 5/6.
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(n: int, c: int) -> float:
    """avg@k: the mean correctness of the n = k samples of one task, c of them correct (the expected
    pass@1, estimated from all k samples)."""
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"avg@k needs n >= 1 and 0 <= c <= n; got n={n}, c={c}")
    return c / n


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """maj@k of one task (self-consistency, Wang et al. 2022, arXiv:2203.11171): the k samples vote
    with their extracted final answers; the task counts as solved when the most frequent answer is a
    correct one. Samples without an answer (None) do not vote; no votes at all is incorrect.

    Answers are compared after collapsing whitespace (`" 1/2 "` and `"1/2"` agree; `"0.5"` does not).
    A tie goes to the answer given first (the lowest sample index), so the result does not depend on
    hashing or dict order. The winner is correct when a sample that gave it is (equal answers score
    alike). Example: answers 4, 5, 5, 4, None with only the 4s correct: 4 and 5 tie at two votes, 4
    came first, so the task is solved.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj@k needs one correctness per answer; got {len(answers)} and {len(correct)}")
    keys = [None if answer is None else " ".join(answer.split()) for answer in answers]
    votes: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, key in enumerate(keys):
        if key is not None:
            votes[key] = votes.get(key, 0) + 1
            first.setdefault(key, index)
    if not votes:
        return False
    winner = min(votes, key=lambda key: (-votes[key], first[key]))
    return any(ok for key, ok in zip(keys, correct, strict=True) if key == winner)
