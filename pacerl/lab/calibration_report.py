"""What `pacerl calibrate` makes of a finished sweep: the analysis of its points (detector, cross-check,
η_max per S, Ĉ, B̂, the fits, the recommendation), calibration.md, the JSON form, and stability.png.
matplotlib is imported when the plot is drawn, not with this module."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pacerl.lab.calibration import (
    CrossCheck,
    PowerLawFit,
    Recommendation,
    Spread,
    StabilityBoundary,
    SweepPoint,
    censored_budget_floor,
    collapse_budget,
    collapse_step,
    collapse_time_fit,
    cross_check,
    held_out_collapse_step,
    lr_max_fit,
    per_seed_constants,
    recommend_lr,
    smoothed,
    stability_boundaries,
    stability_constant,
)
from pacerl.lab.power import Interval, mean_interval
from pacerl.plots import save_png

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pacerl.lab.calibrate_cli import Options

FINAL_WINDOW = 5
"""Steps whose mean training reward is the table's "final reward"."""


# --- analysis ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PointResult:
    """One run, as the report shows it."""

    point: SweepPoint
    """Its grid position and collapse step."""
    final_reward: float
    """Mean training reward of the last `FINAL_WINDOW` steps."""
    peak_reward: float
    """The running maximum of the smoothed reward the detector compares against."""
    check: CrossCheck
    """Entropy and grad-norm evidence."""
    wall_s: float
    """Seconds the run trained."""
    rewards: list[float]
    """The training reward of every step (what the detector read)."""
    collapsed_by: tuple[str, ...] = ()
    """What said it collapsed: "reward" (the detector), "held-out" (its evaluation), "entropy blow-up"."""
    staleness_mean: float | None = None
    """Token mean of the versions between the trainer and the tokens it trained on (None: not recorded)."""
    staleness_max: float | None = None
    """The largest such gap."""
    held_out: tuple[tuple[int, float], ...] = ()
    """(step, held-out accuracy) of every evaluation, the warm start's at step 0."""


@dataclass(frozen=True)
class CalibrationResult:
    """Everything the report, the JSON and the plot show."""

    points: list[PointResult]
    """Every run, in grid order."""
    boundaries: list[StabilityBoundary]
    """η_max per S."""
    c_hat: Spread | None
    """Ĉ = S·η_max over the bracketed S."""
    b_hat: Spread | None
    """B̂ = T_c·η over the collapsed runs."""
    lr_fit: PowerLawFit
    """η_max against S."""
    time_fit: PowerLawFit
    """T_c against η."""
    budget_floor: float | None
    """The largest T_max·η among the runs that never collapsed."""
    recommendations: list[Recommendation]
    """The recommended η per S of the grid, at the horizon."""
    c_hat_seeds: Interval | None = None
    """Ĉ of each seed alone, as a mean with its 95% t-interval (None: no seed brackets η_max)."""
    c_hat_bracket: tuple[float, float] | None = None
    """Ĉ's grid bracket: the median over bracketed S of S·η_max and of S·η_collapse."""
    b_hat_interval: Interval | None = None
    """T_c·η over the collapsed runs with a step, as a mean with its 95% t-interval."""


def analyse(records: Sequence[Mapping[str, Any]], options: Options) -> CalibrationResult:
    """Detector, cross-check, boundaries and fits over the sweep's records."""
    results = []
    for record in records:
        rewards = record["reward"]
        held_out = tuple((int(step), float(accuracy)) for step, accuracy in record.get("held_out", ()))
        check = cross_check(record["entropy"], record["grad_norm"])
        by_reward, by_held_out = collapse_step(rewards), held_out_collapse_step(held_out)
        evidence = {
            "reward": by_reward is not None,
            "held-out": by_held_out is not None,
            "entropy blow-up": "entropy blow-up" in check.signals,
        }
        # T_c is the detector's step; a collapse only the evaluation saw is dated by the evaluation.
        step = by_reward if by_reward is not None else by_held_out
        point = SweepPoint(
            record["sync_interval"],
            record["lr"],
            record["seed"],
            record["steps"],
            None if step is None else max(1, min(step, record["steps"])),
            unstable=evidence["entropy blow-up"],
        )
        tail = rewards[-FINAL_WINDOW:]
        results.append(
            PointResult(
                point=point,
                final_reward=sum(tail) / len(tail),
                peak_reward=max(smoothed(rewards)),
                check=check,
                wall_s=record["wall_s"],
                rewards=list(rewards),
                collapsed_by=tuple(name for name, hit in evidence.items() if hit),
                staleness_mean=record.get("staleness_mean"),
                staleness_max=record.get("staleness_max"),
                held_out=held_out,
            )
        )
    points = [result.point for result in results]
    boundaries = stability_boundaries(points)
    c_hat, b_hat = stability_constant(boundaries), collapse_budget(points)
    seeds = list(per_seed_constants(points).values())
    brackets = [b for b in boundaries if b.bracketed and b.lr_max is not None and b.lr_collapse is not None]
    budgets = [p.collapse_step * p.lr for p in points if p.collapse_step is not None]
    return CalibrationResult(
        points=results,
        boundaries=boundaries,
        c_hat=c_hat,
        b_hat=b_hat,
        lr_fit=lr_max_fit(boundaries),
        time_fit=collapse_time_fit(points),
        budget_floor=censored_budget_floor(points),
        recommendations=[
            recommend_lr(c_hat, b_hat, b.sync_interval, options.horizon, options.safety, boundary=b)
            for b in boundaries
        ],
        c_hat_seeds=mean_interval(seeds) if seeds else None,
        c_hat_bracket=(
            (
                statistics.median(b.sync_interval * (b.lr_max or 0.0) for b in brackets),
                statistics.median(b.sync_interval * (b.lr_collapse or 0.0) for b in brackets),
            )
            if brackets
            else None
        ),
        b_hat_interval=mean_interval(budgets) if budgets else None,
    )


# --- report --------------------------------------------------------------------------------------------


def _g(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}g}" if abs(value) < 1e-2 or abs(value) >= 1e3 else f"{value:.{digits + 1}g}"


def _spread_text(name: str, value: Spread | None, missing: str) -> str:
    if value is None:
        return f"- {name}: not estimated ({missing})."
    return (
        f"- {name}: median {value.median:.3g}, range {value.low:.3g} – {value.high:.3g} "
        f"(max/min {value.ratio:.2f}, {value.count} value{'s' if value.count != 1 else ''})."
    )


def _fit_text(name: str, fit: PowerLawFit) -> str:
    if fit.exponent is None:
        return f"- {name}: no fit ({fit.note})."
    error = f" ± {fit.stderr:.2f}" if fit.stderr is not None else f" ({fit.note})"
    return f"- {name}: exponent {fit.exponent:.2f}{error} over {fit.points} points (the law: −1)."


def _braces(values: Iterable[object]) -> str:
    return "{" + ", ".join(str(value) for value in values) + "}"


def markdown_report(result: CalibrationResult, options: Options) -> str:
    """calibration.md: the grid table, then η_max per S, Ĉ, B̂, the exponents and the recommendation."""
    how = (
        "vanilla GRPO, every batch generated by the weights exactly S updates old"
        if options.exact_lag
        else "vanilla async GRPO, weights published every S updates"
    )
    lines = [
        f"# Calibration of S and η ({how})",
        "",
        f"{len(result.points)} runs of {options.steps} steps: S ∈ {_braces(options.sync_intervals)} × "
        f"η ∈ {_braces(f'{lr:g}' for lr in options.lrs)} × seeds {_braces(options.seeds)}"
        + (f"; overrides: `{' '.join(options.overrides)}`" if options.overrides else "")
        + ". Collapse: the EMA-smoothed training reward (span 10) below half its running maximum without "
        "climbing back to 80% of it (docs/algorithms.md §8); runs that never collapse are censored at "
        f"{options.steps} steps. A run also counts as collapsed when its held-out accuracy falls below half "
        "the best it reached without coming back to 80% of it (dated by that evaluation), or when its "
        "entropy blows up (the cross-check). Staleness: versions between the trainer and the tokens it "
        "trained on, token mean / max over the run.",
        "",
        "| S | η | seed | collapsed | by | T_c | T_c·η | staleness | held-out acc | final reward "
        "| peak reward (EMA) | max grad-norm | entropy drop | cross-check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result.points:
        point, check = row.point, row.check
        budget = None if point.collapse_step is None else point.collapse_step * point.lr
        staleness = (
            "–" if row.staleness_mean is None else f"{row.staleness_mean:.2f} / {_g(row.staleness_max)}"
        )
        held_out = f"{row.held_out[0][1]:.3f} → {row.held_out[-1][1]:.3f}" if len(row.held_out) >= 2 else "–"
        lines.append(
            f"| {point.sync_interval} | {point.lr:g} | {point.seed} | {'yes' if point.collapsed else 'no'} "
            f"| {', '.join(row.collapsed_by) or '–'} | {point.collapse_step or '–'} | {_g(budget)} "
            f"| {staleness} | {held_out} | {row.final_reward:.3f} "
            f"| {row.peak_reward:.3f} | {_g(check.max_grad_norm)} | {_g(check.entropy_drop)} "
            f"| {', '.join(check.signals) or '–'} |"
        )
    lines += ["", "## η_max per S", ""]
    for boundary in result.boundaries:
        if boundary.lr_collapse is None:
            text = f"≥ {boundary.lr_max:g} (no η collapsed: censored, a lower bound)"
        elif boundary.lr_max is None:
            text = f"< {boundary.lr_collapse:g} (the smallest η collapsed)"
        else:
            text = f"{boundary.lr_max:g} (collapsed from {boundary.lr_collapse:g})"
        if boundary.non_monotone:
            text += "; a larger η stayed stable: noisy"
        lines.append(f"- S = {boundary.sync_interval}: η_max {text}")
    lines += ["", "## The laws", ""]
    lines.append(_spread_text("Ĉ = S·η_max", result.c_hat, "no S has both a stable and a collapsing η"))
    if result.c_hat_bracket is not None:
        low, high = result.c_hat_bracket
        lines.append(
            f"  - The grid brackets it: the true S·η_max lies between {low:.3g} and {high:.3g} (median over "
            "S of S·η_max and of S times the smallest collapsing η)."
        )
    if result.c_hat_seeds is not None:
        lines.append(
            f"  - Seed by seed: {result.c_hat_seeds.text(4)} (mean ± 95% t-interval over "
            f"{result.c_hat_seeds.count} seed{'s' if result.c_hat_seeds.count != 1 else ''})."
        )
    lines.append(_fit_text("η_max ∝ S^k", result.lr_fit))
    lines.append(_spread_text("B̂ = T_c·η", result.b_hat, "no run collapsed"))
    if result.b_hat_interval is not None:
        lines.append(
            f"  - Mean over the collapsed runs: {result.b_hat_interval.text(4)} (95% t-interval, "
            f"{result.b_hat_interval.count} runs)."
        )
    lines.append(_fit_text("T_c ∝ η^k (collapsed runs, all S)", result.time_fit))
    if result.budget_floor is not None:
        above = result.b_hat is not None and result.budget_floor > result.b_hat.median
        lines.append(
            f"- Censored runs: the largest T_max·η that never collapsed is {result.budget_floor:.3g}"
            + (
                ", above B̂: no single cumulative budget T·η explains both the collapsed runs and the "
                "surviving ones."
                if above
                else "."
            )
        )
    lines += [
        "",
        f"## Recommended η for a {options.horizon}-step run (κ = {options.safety:g})",
        "",
        "η = κ·min(Ĉ/S, B̂/T), and at most κ·η_max where the sweep measured η_max at that S.",
        "",
        "| S | Ĉ/S | η_max measured | B̂/T | η | binding |",
        "|---|---|---|---|---|---|",
    ]
    for advice in result.recommendations:
        lines.append(
            f"| {advice.sync_interval} | {_g(advice.staleness_limit)} | {_g(advice.measured_limit)} "
            f"| {_g(advice.budget_limit)} | {_g(advice.lr)} | {advice.binding or '–'} |"
        )
    return "\n".join(lines) + "\n"


def jsonable(value: Any) -> Any:
    """Dataclasses as dicts with their properties (collapsed, bracketed, ratio), NaN and infinities as
    null (strict JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        data = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
        for name in dir(type(value)):
            if isinstance(getattr(type(value), name, None), property):
                data[name] = getattr(value, name)
        return jsonable(data)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --- plot ----------------------------------------------------------------------------------------------


def plot_stability(result: CalibrationResult, path: Path) -> None:
    """stability.png: left, the S × η map (stable ○, collapsed ×, some seeds collapsed ◐, with T_c
    beside each collapse) with the boundary Ĉ/S and the fitted η_max(S); right, T_c against η for
    the collapsed runs with B̂/η."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    _stability_map(left, result)
    _collapse_times(right, result)
    figure.tight_layout()
    save_png(figure, path, dpi=110)


def _stability_map(ax: Axes, result: CalibrationResult) -> None:
    cells: dict[tuple[int, float], list[SweepPoint]] = {}
    for row in result.points:
        cells.setdefault((row.point.sync_interval, row.point.lr), []).append(row.point)
    styles: dict[str, tuple[str, str]] = {
        "stable": ("o", "tab:green"),
        "collapsed": ("X", "tab:red"),
        "some seeds collapsed": ("D", "tab:orange"),
    }
    shown: set[str] = set()
    for (interval, lr), members in sorted(cells.items()):
        collapsed = [p for p in members if p.collapsed]
        kind = (
            "stable"
            if not collapsed
            else "collapsed"
            if len(collapsed) == len(members)
            else "some seeds collapsed"
        )
        marker, colour = styles[kind]
        ax.scatter(
            [interval],
            [lr],
            marker=marker,
            color=colour,
            s=90,
            label=None if kind in shown else kind,
            zorder=3,
        )
        shown.add(kind)
        if collapsed:
            times = sorted(p.collapse_step for p in collapsed if p.collapse_step is not None)
            ax.annotate(f"T_c={','.join(map(str, times))}", (interval, lr), textcoords="offset points",
                        xytext=(7, -3), fontsize=7)  # fmt: skip
    intervals = sorted({s for s, _ in cells})
    span = [intervals[0] / 1.3, intervals[-1] * 1.3]
    if result.c_hat is not None:
        c = result.c_hat.median
        ax.plot(span, [c / s for s in span], "k--", label=f"Ĉ/S, Ĉ = {c:.3g}")
    fit = result.lr_fit
    if fit.exponent is not None and fit.prefactor is not None:
        ax.plot(span, [fit.prefactor * s**fit.exponent for s in span], ":", color="tab:blue",
                label=f"fit: η_max ∝ S^{fit.exponent:.2f}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.minorticks_off()  # the grid's own values label the axes
    ax.set_xticks(intervals, [str(s) for s in intervals])
    rates = sorted({lr for _, lr in cells})
    ax.set_yticks(rates, [f"{lr:g}" for lr in rates])
    ax.set_xlabel("S (publication interval, updates)")
    ax.set_ylabel("η (learning rate)")
    ax.set_title("stability map")
    ax.legend(fontsize=7, loc="best")


def _collapse_times(ax: Axes, result: CalibrationResult) -> None:
    collapsed = [row.point for row in result.points if row.point.collapse_step is not None]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("η (learning rate)")
    ax.set_ylabel("T_c (collapse step)")
    ax.set_title("collapse time of the collapsed runs")
    if not collapsed:
        ax.text(0.5, 0.5, "no run collapsed", transform=ax.transAxes, ha="center", va="center")
        return
    # Runs at different S often share (η, T_c): smaller S are drawn larger and first, so each shows.
    for order, interval in enumerate(sorted({p.sync_interval for p in collapsed})):
        members = [p for p in collapsed if p.sync_interval == interval]
        ax.scatter(
            [p.lr for p in members],
            [p.collapse_step or 0 for p in members],
            label=f"S = {interval}",
            marker="osD^v<>"[order % 7],
            s=max(20, 130 - 30 * order),
            zorder=3 + order,
        )
    rates = sorted({p.lr for p in collapsed})
    times = sorted({p.collapse_step or 0 for p in collapsed})
    ax.minorticks_off()
    ax.set_xticks(rates, [f"{lr:g}" for lr in rates])
    ax.set_yticks(times, [str(t) for t in times])
    if result.b_hat is not None:
        span = [rates[0] / 1.5, rates[-1] * 1.5]
        ax.plot(
            span,
            [result.b_hat.median / lr for lr in span],
            "k--",
            label=f"B̂/η, B̂ = {result.b_hat.median:.3g}",
        )
    ax.legend(fontsize=7, loc="best")
