"""How much a few seeds can tell: the 95% t-interval of a mean, and the minimum detectable effect (MDE) of
a comparison at a number of seeds, from the spread the seeds showed (docs/experiments.md). Pure functions
of numbers; no scipy: Student's t quantiles come from a table (exact to the third decimal) up to 30
degrees of freedom and the normal's beyond (4% below t's 0.975 quantile at 31, less after)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
"""Student's t 0.975 quantile for 1 … 30 degrees of freedom."""
_T_80 = (
    1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879,
    0.876, 0.873, 0.870, 0.868, 0.866, 0.865, 0.863, 0.862, 0.861, 0.860,
    0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854,
)  # fmt: skip
"""Student's t 0.80 quantile for 1 … 30 degrees of freedom."""
_NORMAL = {0.975: 1.960, 0.8: 0.8416}
_TABLES = {0.975: _T_975, 0.8: _T_80}


def t_quantile(probability: float, df: int) -> float:
    """Student's t quantile at `probability` (0.975: a two-sided 95% interval; 0.8: 80% power) with `df`
    degrees of freedom (>= 1)."""
    if probability not in _TABLES:
        raise ValueError(f"probability must be one of {sorted(_TABLES)}, got {probability}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    table = _TABLES[probability]
    return table[df - 1] if df <= len(table) else _NORMAL[probability]


@dataclass(frozen=True)
class Interval:
    """A mean with the half-width of its two-sided 95% t-interval."""

    mean: float
    """The mean of the values."""
    half_width: float
    """t(0.975, n − 1) · sd / √n; NaN for fewer than two values."""
    count: int
    """How many values."""
    sd: float
    """Their sample standard deviation (n − 1); NaN for fewer than two."""

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def text(self, digits: int = 3) -> str:
        """`mean ± half-width` (the mean alone for one value)."""
        if math.isnan(self.half_width):
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def mean_interval(values: Sequence[float]) -> Interval:
    """The mean of `values` (at least one, all finite) and its 95% t-interval."""
    if not values:
        raise ValueError("the interval of no values")
    if not all(math.isfinite(value) for value in values):
        raise ValueError(f"values must be finite, got {list(values)}")
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, math.nan, n, math.nan)
    sd = statistics.stdev(values)
    return Interval(mean, t_quantile(0.975, n - 1) * sd / math.sqrt(n), n, sd)


def minimum_detectable_effect(sd: float, seeds: int, *, paired: bool) -> float:
    """The smallest true difference of means that a two-sided test at α = 0.05 detects with 80% power
    with `seeds` seeds per arm, when the per-seed values spread with standard deviation `sd`.

    Paired (each seed runs both arms; `sd` is that of the per-seed differences): (t₀.₉₇₅ + t₀.₈)(n − 1)·sd/√n.
    Unpaired (`sd` is one arm's): (t₀.₉₇₅ + t₀.₈)(2n − 2)·sd·√(2/n)."""
    if seeds < 2:
        raise ValueError(f"a detectable effect needs at least 2 seeds, got {seeds}")
    if not sd >= 0 or not math.isfinite(sd):
        raise ValueError(f"sd must be finite and >= 0, got {sd}")
    df = seeds - 1 if paired else 2 * seeds - 2
    scale = sd / math.sqrt(seeds) if paired else sd * math.sqrt(2 / seeds)
    return (t_quantile(0.975, df) + t_quantile(0.8, df)) * scale


def seeds_needed(effect: float, sd: float, *, paired: bool, limit: int = 10_000) -> int | None:
    """The fewest seeds per arm (>= 2) whose `minimum_detectable_effect` is at most `effect` (> 0); None
    when even `limit` seeds are not enough."""
    if not effect > 0:
        raise ValueError(f"effect must be > 0, got {effect}")
    for seeds in range(2, limit + 1):
        if minimum_detectable_effect(sd, seeds, paired=paired) <= effect:
            return seeds
    return None


def fisher_exact_greater(hits: int, trials: int, other_hits: int, other_trials: int) -> float:
    """One-sided Fisher exact test: the probability, were both arms alike, that the first of two arms would
    show `hits` or more of the pooled hits (collapses in `hits` of `trials` seeds against `other_hits` of
    `other_trials`). Small values say the first arm is really worse; 3 seeds against 3 can reach no
    smaller than 0.05 (3 of 3 against 0 of 3)."""
    if not (0 <= hits <= trials and 0 <= other_hits <= other_trials) or min(trials, other_trials) < 1:
        raise ValueError(
            f"need 0 <= hits <= trials >= 1 for both arms, got {hits}/{trials}, {other_hits}/{other_trials}"
        )
    pooled, total = hits + other_hits, trials + other_trials
    ways = math.comb(total, pooled)
    tail = sum(
        math.comb(trials, k) * math.comb(other_trials, pooled - k)
        for k in range(hits, min(trials, pooled) + 1)
        if pooled - k <= other_trials
    )
    return tail / ways
