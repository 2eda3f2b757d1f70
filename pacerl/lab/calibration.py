"""Calibrating the publication interval S and the learning rate η of vanilla async GRPO from a coarse
sweep (docs/algorithms.md §8, after the staleness–learning-rate paper, arXiv 2607.01083).

The paper's two laws: the largest stable learning rate scales as 1/S (S·η_max ≈ C), and among runs that
collapse the collapse time scales as 1/η (T_c·η ≈ B, a cumulative learning-rate budget). Its rule picks
η = κ·min(C/S, B/T) for a horizon of T steps. Everything here is a pure function of numbers:

    step = collapse_step(rewards)                     # T_c, or None: censored at the run's length
    boundaries = stability_boundaries(points)         # η_max per S
    c_hat = stability_constant(boundaries)            # Ĉ = median S·η_max, with its range
    b_hat = collapse_budget(points)                   # B̂ = median T_c·η, with its range
    lr_law, time_law = lr_max_fit(boundaries), collapse_time_fit(points)   # exponents, expected ≈ −1
    advice = recommend_lr(c_hat, b_hat, sync_interval=4, horizon=200, safety=0.5)

`pacerl calibrate` runs the sweep and reports these.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal


def smoothed(rewards: Sequence[float], window: int = 10) -> list[float]:
    """The exponential moving average of `rewards` with span `window` (α = 2/(window+1)), started at
    the first reward: the curve the collapse detector reads."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    alpha = 2 / (window + 1)
    curve: list[float] = []
    for reward in rewards:
        curve.append(reward if not curve else alpha * reward + (1 - alpha) * curve[-1])
    return curve


def collapse_step(
    rewards: Sequence[float], window: int = 10, fall: float = 0.5, recover: float = 0.8
) -> int | None:
    """docs/algorithms.md §8's reconstruction of the collapse detector: the first step (1-based) where the
    smoothed reward (`smoothed`, span `window`) falls below `fall` × its running maximum and never climbs
    back to `recover` × that maximum for the rest of the run; None if it never does (the run is
    censored at its length). A reward that never rose above zero cannot collapse."""
    if not 0 < fall < recover <= 1:
        raise ValueError(f"need 0 < fall < recover <= 1, got {fall}, {recover}")
    peak, fell = -math.inf, None
    for step, value in enumerate(smoothed(rewards, window), start=1):
        peak = max(peak, value)
        if fell is None and peak > 0 and value < fall * peak:
            fell = step
        elif fell is not None and value >= recover * peak:
            fell = None
    return fell


def held_out_collapse_step(
    curve: Sequence[tuple[int, float]], fall: float = 0.5, recover: float = 0.8
) -> int | None:
    """The first evaluation step where held-out accuracy fell below `fall` × the best it had reached
    (the warm start's included) and never came back to `recover` × that best at any later evaluation;
    None if it never did. `curve` is (step, accuracy) in step order. A training reward can hold while the
    policy forgets what it is not trained on: this reads the evaluation the detector does not."""
    if not 0 < fall < recover <= 1:
        raise ValueError(f"need 0 < fall < recover <= 1, got {fall}, {recover}")
    steps = [step for step, _ in curve]
    if steps != sorted(steps):
        raise ValueError(f"the curve's steps must be in order, got {steps}")
    best, fell = -math.inf, None
    for step, accuracy in curve:
        best = max(best, accuracy)
        if fell is None and accuracy < fall * best:  # never below a best of zero
            fell = step
        elif fell is not None and accuracy >= recover * best:
            fell = None
    return fell


@dataclass(frozen=True)
class CrossCheck:
    """What a run's entropy and gradient norms say, beside the reward detector: docs/algorithms.md §8 asks for
    a cross-check "with grad-norm spikes or entropy collapse". A collapse the reward shows but neither
    signal does deserves a look at the run before it shapes a recommendation."""

    entropy_drop: float
    """1 − (mean entropy over the last `window` updates) / (mean over the first): positive when the
    policy sharpened, negative when it spread out; NaN with fewer than two updates."""
    max_grad_norm: float
    """The largest pre-clip gradient norm of the run (NaN without updates)."""
    grad_norm_spike: float
    """The largest gradient norm over the run's median (NaN without updates)."""
    signals: tuple[str, ...]
    """Which thresholds were crossed: "entropy collapse", "entropy blow-up", "grad-norm spike"."""


def cross_check(
    entropy: Sequence[float],
    grad_norm: Sequence[float],
    window: int = 5,
    entropy_factor: float = 2.0,
    spike_ratio: float = 10.0,
) -> CrossCheck:
    """The entropy and gradient-norm evidence of one run, from its updates in order (steps that skipped
    the update left out; every value finite). Entropy collapse: the last `window` updates' mean entropy
    at most 1/`entropy_factor` of the first `window`'s; blow-up: at least `entropy_factor` times it
    (a diverging policy on the tiny model spreads out rather than sharpens). Grad-norm spike: the
    largest norm at least `spike_ratio` × the median. The windows shrink to half the run when it is
    short, so they never overlap."""
    if window < 1 or entropy_factor <= 1 or spike_ratio <= 1:
        raise ValueError(f"need window >= 1, entropy_factor > 1, spike_ratio > 1, got {window}, "
                         f"{entropy_factor}, {spike_ratio}")  # fmt: skip
    if not all(math.isfinite(value) for value in (*entropy, *grad_norm)):
        raise ValueError("entropy and grad_norm must be finite (leave out the steps that skipped the update)")
    signals: list[str] = []
    entropy_drop = math.nan
    if len(entropy) >= 2:
        span = min(window, len(entropy) // 2)
        first, last = statistics.fmean(entropy[:span]), statistics.fmean(entropy[-span:])
        if first > 0:
            entropy_drop = 1 - last / first
            if last * entropy_factor <= first:
                signals.append("entropy collapse")
            elif last >= entropy_factor * first:
                signals.append("entropy blow-up")
    max_norm = spike = math.nan
    if grad_norm:
        max_norm, median = max(grad_norm), statistics.median(grad_norm)
        spike = max_norm / median if median > 0 else math.inf
        if spike >= spike_ratio:
            signals.append("grad-norm spike")
    return CrossCheck(entropy_drop, max_norm, spike, tuple(signals))


@dataclass(frozen=True)
class SweepPoint:
    """One finished run of the sweep, reduced to what the laws need."""

    sync_interval: int
    """S: the weights reached the rollout engine every S updates."""
    lr: float
    """η, the learning rate."""
    seed: int
    """The run's seed."""
    steps: int
    """Steps the run trained: T_max, where a run that never collapsed is censored."""
    collapse_step: int | None
    """T_c (`collapse_step`), or None: no collapse within `steps` (or none with a step to name)."""
    unstable: bool = False
    """Collapsed by other evidence than a step: the cross-check's entropy blow-up with the reward and the
    held-out evaluation still standing."""

    def __post_init__(self) -> None:
        if self.sync_interval < 1 or not self.lr > 0 or self.steps < 1:
            raise ValueError(
                f"need S >= 1, lr > 0, steps >= 1, got {self.sync_interval}, {self.lr}, {self.steps}"
            )
        if self.collapse_step is not None and not 1 <= self.collapse_step <= self.steps:
            raise ValueError(f"collapse_step {self.collapse_step} lies outside the run's {self.steps} steps")

    @property
    def collapsed(self) -> bool:
        """Whether the run collapsed within its steps."""
        return self.collapse_step is not None or self.unstable


@dataclass(frozen=True)
class StabilityBoundary:
    """Where the learning rates tested at one S turn from stable to collapsing."""

    sync_interval: int
    """S."""
    lr_max: float | None
    """η_max(S): the largest tested η below every η at which a run at this S collapsed (conservative:
    a stable η above a collapsing one does not count); None when the smallest tested η collapsed."""
    lr_collapse: float | None
    """The smallest tested η at which some run at this S collapsed; None when none did, so `lr_max` is
    only a lower bound of the true η_max (censored)."""
    non_monotone: bool
    """Some η above `lr_collapse` stayed stable in every run: the sweep is noisy at this S."""

    @property
    def bracketed(self) -> bool:
        """Both a stable and a collapsing η were seen: η_max lies between `lr_max` and `lr_collapse`."""
        return self.lr_max is not None and self.lr_collapse is not None


def stability_boundaries(points: Iterable[SweepPoint]) -> list[StabilityBoundary]:
    """η_max per S, in increasing S. A learning rate counts as collapsing at S when any of its runs
    (seeds) collapsed."""
    by_interval: dict[int, dict[float, bool]] = {}
    for point in points:
        rates = by_interval.setdefault(point.sync_interval, {})
        rates[point.lr] = rates.get(point.lr, False) or point.collapsed
    boundaries = []
    for interval in sorted(by_interval):
        rates = by_interval[interval]
        collapsing = sorted(lr for lr, collapsed in rates.items() if collapsed)
        lowest = collapsing[0] if collapsing else math.inf
        below = [lr for lr in rates if lr < lowest]
        above_stable = any(lr > lowest and not collapsed for lr, collapsed in rates.items())
        boundaries.append(
            StabilityBoundary(
                sync_interval=interval,
                lr_max=max(below) if below else None,
                lr_collapse=collapsing[0] if collapsing else None,
                non_monotone=above_stable,
            )
        )
    return boundaries


@dataclass(frozen=True)
class Spread:
    """A median with the range of the values it summarises."""

    median: float
    """The median."""
    low: float
    """The smallest value."""
    high: float
    """The largest value."""
    count: int
    """How many values."""

    @property
    def ratio(self) -> float:
        """high / low: 1 when the values agree; the law "≈ constant" is as good as this is close to 1."""
        return self.high / self.low if self.low > 0 else math.inf


def spread(values: Sequence[float]) -> Spread:
    """The median and range of `values` (at least one)."""
    if not values:
        raise ValueError("spread of no values")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def stability_constant(boundaries: Sequence[StabilityBoundary]) -> Spread | None:
    """Ĉ = median over S of S·η_max(S), from the bracketed boundaries only (a censored S gives a lower
    bound, not a value); None when no S is bracketed."""
    values = [b.sync_interval * b.lr_max for b in boundaries if b.bracketed and b.lr_max is not None]
    return spread(values) if values else None


def collapse_budget(points: Iterable[SweepPoint]) -> Spread | None:
    """B̂ = median of T_c·η over the collapsed runs; None when none collapsed."""
    values = [p.collapse_step * p.lr for p in points if p.collapse_step is not None]
    return spread(values) if values else None


def per_seed_constants(points: Iterable[SweepPoint]) -> dict[int, float]:
    """Ĉ of each seed's runs alone (`stability_constant` over that seed's boundaries), for the seeds whose
    runs bracket η_max at some S: the spread over seeds is Ĉ's sampling noise."""
    by_seed: dict[int, list[SweepPoint]] = {}
    for point in points:
        by_seed.setdefault(point.seed, []).append(point)
    constants = {}
    for seed, runs in sorted(by_seed.items()):
        value = stability_constant(stability_boundaries(runs))
        if value is not None:
            constants[seed] = value.median
    return constants


def censored_budget_floor(points: Iterable[SweepPoint]) -> float | None:
    """The largest T_max·η among runs that never collapsed: were every collapse set by the cumulative
    budget alone, B would exceed it. A floor above B̂ says those collapses were set by the staleness
    term S·η instead (the paper's conditional law). None when every run collapsed."""
    values = [p.steps * p.lr for p in points if not p.collapsed]
    return max(values) if values else None


@dataclass(frozen=True)
class PowerLawFit:
    """y ≈ prefactor · x^exponent, fitted by least squares on log y against log x."""

    exponent: float | None
    """The slope of the log-log fit; None with fewer than two distinct x."""
    stderr: float | None
    """The slope's standard error, sqrt(RSS/(n−2) / Σ(log x − mean)²); None with fewer than three points."""
    prefactor: float | None
    """exp(intercept); None with the exponent."""
    points: int
    """Points fitted."""
    note: str
    """Why the exponent or its standard error is missing ("" when neither is)."""


def power_law_fit(xs: Sequence[float], ys: Sequence[float]) -> PowerLawFit:
    """Ordinary least squares of log y on log x (both positive)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    if any(not value > 0 for value in (*xs, *ys)):
        raise ValueError("a power-law fit needs positive x and y")
    n = len(xs)
    if len(set(xs)) < 2:
        return PowerLawFit(None, None, None, n, f"too few points: {len(set(xs))} distinct x, a slope needs 2")
    log_x, log_y = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mean_x, mean_y = statistics.fmean(log_x), statistics.fmean(log_y)
    sxx = sum((x - mean_x) ** 2 for x in log_x)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(log_x, log_y, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    if n < 3:
        return PowerLawFit(slope, None, math.exp(intercept), n, "two points: no standard error")
    rss = sum((y - intercept - slope * x) ** 2 for x, y in zip(log_x, log_y, strict=True))
    return PowerLawFit(slope, math.sqrt(rss / (n - 2) / sxx), math.exp(intercept), n, "")


def lr_max_fit(boundaries: Sequence[StabilityBoundary]) -> PowerLawFit:
    """η_max against S over the bracketed boundaries (the law: exponent ≈ −1)."""
    pairs = [(b.sync_interval, b.lr_max) for b in boundaries if b.bracketed and b.lr_max is not None]
    return power_law_fit([float(s) for s, _ in pairs], [lr for _, lr in pairs])


def collapse_time_fit(points: Iterable[SweepPoint]) -> PowerLawFit:
    """T_c against η over the collapsed runs, every S pooled (the law: exponent ≈ −1)."""
    pairs = [(p.lr, float(p.collapse_step)) for p in points if p.collapse_step is not None]
    return power_law_fit([lr for lr, _ in pairs], [steps for _, steps in pairs])


Limit = Literal["staleness", "measured", "budget"]


@dataclass(frozen=True)
class Recommendation:
    """The calibrated learning rate for one S and horizon: η = κ·min(Ĉ/S, η_max(S) measured, B̂/T)."""

    sync_interval: int
    """S the recommendation is for."""
    horizon: int
    """T, the steps the run is meant to train."""
    safety: float
    """κ, the safety factor."""
    staleness_limit: float | None
    """Ĉ/S (None without Ĉ)."""
    measured_limit: float | None
    """η_max measured at this very S when the sweep bracketed it (None otherwise)."""
    budget_limit: float | None
    """B̂/T (None without B̂)."""
    lr: float | None
    """κ × the smallest known limit; None when none is known."""
    binding: Limit | None
    """Which limit set `lr`."""


def recommend_lr(
    c_hat: Spread | None,
    b_hat: Spread | None,
    sync_interval: int,
    horizon: int,
    safety: float = 0.5,
    boundary: StabilityBoundary | None = None,
) -> Recommendation:
    """docs/algorithms.md §8 step 4: η = κ·min(Ĉ/S, B̂/T), the medians of Ĉ and B̂; a limit whose constant the
    sweep could not estimate is left out (and shows as None). Ĉ/S is the law's interpolation; where the
    sweep bracketed η_max at this S (`boundary`), the measured value caps it too, so that a law that
    fits badly cannot recommend a rate at or past a collapse seen at this very S."""
    if sync_interval < 1 or horizon < 1 or not 0 < safety <= 1:
        raise ValueError(
            f"need S >= 1, horizon >= 1, 0 < safety <= 1, got {sync_interval}, {horizon}, {safety}"
        )
    if boundary is not None and boundary.sync_interval != sync_interval:
        raise ValueError(f"the boundary is for S = {boundary.sync_interval}, not S = {sync_interval}")
    staleness = None if c_hat is None else c_hat.median / sync_interval
    measured = boundary.lr_max if boundary is not None and boundary.bracketed else None
    budget = None if b_hat is None else b_hat.median / horizon
    candidates: tuple[tuple[float | None, Limit], ...] = (
        (staleness, "staleness"),
        (measured, "measured"),
        (budget, "budget"),
    )
    limits = [(value, name) for value, name in candidates if value is not None]
    if not limits:
        return Recommendation(sync_interval, horizon, safety, None, None, None, None, None)
    limit, binding = min(limits, key=lambda pair: pair[0])
    return Recommendation(
        sync_interval, horizon, safety, staleness, measured, budget, safety * limit, binding
    )
