"""The per-task scores of an evaluation: avg@k and the unbiased pass@k of Chen et al. 2021, "Evaluating
Large Language Models Trained on Code" (arXiv:2107.03374), from a task's n sampled episodes, c of them
correct. Pure functions, tested against hand-computed numbers."""

from __future__ import annotations

import math


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
