"""PNG plots of a training run, redrawn from its `metrics.jsonl` (`pacerl plot RUN_DIR`).

    paths = plot_run(Path("runs/exp1"))  # runs/exp1/plots/{reward,staleness,pool,sat}.png

- `reward.png`: training reward and accuracy per step with a trailing mean, and the evaluation points
  (any `eval/` key) labelled by the policy version they measured.
- `staleness.png`: token-mean generation (GS) and waiting (WS) staleness stacked per step with the
  maximum, and the GS and WS histograms per step as token shares.
- `pool.png`: pool occupancy and in-flight groups (with PACE's target when `config.json` names one), the
  cumulative rejections by reason, and the cumulative learner skips and dropped groups.
- `sat.png`: SAT gate rate with the clip fraction, SAT's mean contraction, the log-prob mismatch (all
  tokens, current-version tokens) and the routing disagreement; steps that skipped the update are marked.

The x axis is the step, with the elapsed seconds on a second scale above (an emulated run's simulated
seconds, `sim/time_s`). A panel whose keys no row records says so instead of failing, so runs from older
versions (or the sync loop) still plot. Drawn on
matplotlib's Agg canvas without pyplot: no display, no global backend switch, safe inside a training
process.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from numpy.typing import ArrayLike

from pacerl.envs.jsonl import read_jsonl

# trainer.metrics.METRICS_FILE (a test keeps them equal): importing `trainer` pulls in torch and
# transformers, seconds of start-up that `pacerl plot` has no use for.
METRICS_FILE = "metrics.jsonl"
PLOTS_DIR = "plots"
_DPI = 100
_HIST_KEY = re.compile(r"staleness/(gs|ws)_hist_(\d+)")

Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class RunMetrics:
    """A run's scalars as columns over its steps. Rows sharing a step are merged (a later row's keys
    win), so an evaluation written as its own row lands on the step it measured."""

    steps: npt.NDArray[np.int64]
    """The distinct steps, ascending."""
    columns: Mapping[str, Floats]
    """Each numeric key's values per step: NaN where a row lacks the key or recorded it as non-finite."""

    def has(self, key: str) -> bool:
        """Whether any row records `key` (even as a non-finite value)."""
        return key in self.columns

    def column(self, key: str) -> Floats:
        """`key` per step, NaN where absent; all NaN for a key no row records."""
        found = self.columns.get(key)
        return np.full(self.steps.size, np.nan) if found is None else found

    def keys(self, prefix: str) -> list[str]:
        """The recorded keys starting with `prefix`, sorted."""
        return sorted(key for key in self.columns if key.startswith(prefix))


def load_run_metrics(run_dir: Path) -> RunMetrics:
    """Read `run_dir/metrics.jsonl`. A last line without its newline is skipped (the run is still writing
    it); any other line that is not a JSON object with an integer `step` is a `ValueError` naming it."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{run_dir} has no {METRICS_FILE}; is it a run directory?")
    merged: dict[int, dict[str, object]] = {}
    # A live run flushes whole lines only: a last line without its newline is still being written.
    for number, row in read_jsonl(path, skip_partial_last=True):
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{path}:{number}: not a metrics row (no integer 'step')")
        merged.setdefault(step, {}).update(row)
    if not merged:
        raise ValueError(f"{path} has no rows yet")
    steps = np.array(sorted(merged), dtype=np.int64)
    columns: dict[str, Floats] = {}
    for index, step in enumerate(steps):
        for key, value in merged[int(step)].items():
            # `nonfinite` lists the keys written as null; those stay NaN.
            if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
                column = columns.setdefault(key, np.full(steps.size, np.nan))
                column[index] = np.nan if value is None else float(value)
    return RunMetrics(steps=steps, columns=columns)


def smooth(values: ArrayLike, window: int) -> Floats:
    """Trailing mean over the last `window` values (fewer at the start), NaNs skipped; NaN where the whole
    window is NaN. `values`: shape [n]; returns shape [n]."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    array = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(array)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, array, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    end = np.arange(1, array.size + 1)
    start = np.maximum(end - window, 0)
    count = counts[end] - counts[start]
    total = sums[end] - sums[start]
    smoothed: Floats = np.divide(total, count, out=np.full(array.size, np.nan), where=count > 0)
    return smoothed


def smoothing_window(steps: int) -> int:
    """A tenth of the run, at least 3 steps."""
    return max(3, steps // 10)


def plot_run(run_dir: Path) -> list[Path]:
    """Redraw the run's plots into `run_dir/plots/` and return their paths (reward, staleness, pool, sat).
    Raises `ValueError` for a directory without a readable `metrics.jsonl`."""
    run_dir = Path(run_dir)
    metrics = load_run_metrics(run_dir)
    out = run_dir / PLOTS_DIR
    out.mkdir(exist_ok=True)
    drawers: tuple[tuple[str, Callable[[RunMetrics, Path], Figure]], ...] = (
        ("reward", _reward_figure),
        ("staleness", _staleness_figure),
        ("pool", _pool_figure),
        ("sat", _sat_figure),
    )
    written = []
    for name, draw in drawers:
        figure = draw(metrics, run_dir)
        figure.suptitle(f"{run_dir.resolve().name}: {name}")
        written.append(save_png(figure, out / f"{name}.png"))
    return written


# --- figures -------------------------------------------------------------------------------------------


def _reward_figure(metrics: RunMetrics, run_dir: Path) -> Figure:
    figure, axes = _grid(metrics, 3, 1)
    window = smoothing_window(metrics.steps.size)
    for ax, key in zip(axes[:2], ("reward", "accuracy"), strict=True):
        if not _recorded(ax, metrics, [key]):
            continue
        values = metrics.column(key)
        ax.plot(metrics.steps, values, ".", alpha=0.35, label=key)
        ax.plot(metrics.steps, smooth(values, window), label=f"trailing mean ({window} steps)")
        ax.set_ylabel(key)
        ax.legend(loc="best", fontsize="small")
    ax = axes[2]
    ax.set_title("evaluation", fontsize="medium")
    evals = _recorded(ax, metrics, [key for key in metrics.keys("eval/") if key != "eval/version"], "eval/*")
    # The version an evaluation measured: its own `eval/version` when it logs one, else the step's.
    versions = metrics.column("eval/version") if metrics.has("eval/version") else metrics.column("version")
    for key in evals:
        values = metrics.column(key)
        at = np.isfinite(values)
        ax.plot(metrics.steps[at], values[at], "o-", label=key)
        for step, value, version in zip(metrics.steps[at], values[at], versions[at], strict=True):
            if np.isfinite(version):
                label = f"v{int(version)}"
                ax.annotate(label, (step, value), textcoords="offset points", xytext=(0, 6), fontsize=7)
    if evals:
        ax.margins(y=0.15)  # room for the version labels
        ax.legend(loc="best", fontsize="small")
    return figure


def _staleness_figure(metrics: RunMetrics, run_dir: Path) -> Figure:
    figure, axes = _grid(metrics, 3, 1)
    ax = axes[0]
    ax.set_title("token-mean staleness (versions)", fontsize="medium")
    layers = {"staleness/mean_gs": "mean GS (generation)", "staleness/mean_ws": "mean WS (waiting)"}
    recorded = _recorded(ax, metrics, list(layers))
    if recorded:
        base = np.zeros(metrics.steps.size)
        for key in recorded:  # GS below WS: their sum is the mean staleness
            top = base + metrics.column(key)
            ax.fill_between(metrics.steps, base, top, step="mid", alpha=0.6, label=layers[key])
            base = top
        if metrics.has("staleness/max_staleness"):
            ax.step(metrics.steps, metrics.column("staleness/max_staleness"), "k--", where="mid", label="max")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # headroom: the legend sits above the curves
        ax.legend(loc="upper left", fontsize="small", ncols=3)
    for ax, kind, title in ((axes[1], "gs", "GS histogram"), (axes[2], "ws", "WS histogram")):
        ax.set_title(f"{title} (token share per step)", fontsize="medium")
        keys = [key for key in metrics.columns if (m := _HIST_KEY.fullmatch(key)) and m[1] == kind]
        if not _recorded(ax, metrics, keys, f"staleness/{kind}_hist_<k>"):
            continue
        bins = sorted(int(key.rsplit("_", 1)[1]) for key in keys)
        counts = np.stack([metrics.column(f"staleness/{kind}_hist_{b}") for b in bins])
        totals = counts.sum(axis=0)
        share = np.ma.masked_invalid(
            np.divide(counts, totals, out=np.full(counts.shape, np.nan), where=totals > 0)
        )
        y_edges = np.arange(len(bins) + 1) - 0.5
        mesh = ax.pcolormesh(_edges(metrics.steps), y_edges, share, vmin=0, vmax=1, shading="flat")
        ax.set_yticks(range(len(bins)), [*map(str, bins[:-1]), f"{bins[-1]}+"])
        ax.set_ylabel("versions")
        figure.colorbar(mesh, ax=ax, label="token share", pad=0.01)
    return figure


def _pool_figure(metrics: RunMetrics, run_dir: Path) -> Figure:
    figure, axes = _grid(metrics, 3, 1)
    ax = axes[0]
    ax.set_title("groups", fontsize="medium")
    occupancy = _recorded(ax, metrics, ["pool_groups", "in_flight_groups"])
    if occupancy:
        for key in occupancy:
            ax.step(metrics.steps, metrics.column(key), where="post", label=key)
        target = _pace_target(run_dir)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", label=f"PACE target ({target})")
        ax.set_ylim(bottom=0)
        ax.legend(loc="best", fontsize="small")
    # The loop logs running counters: a reason's key first appears with its first count and stays, so a
    # step before that counted zero (unlike a loss key missing from a skipped step).
    panels = (
        (axes[1], "rejected groups by reason (cumulative)", metrics.keys("rejected/"), "rejected/<reason>"),
        (
            axes[2],
            "skips and dropped groups (cumulative)",
            [*metrics.keys("skipped/"), "dropped_groups"],
            "skipped/<reason>, dropped_groups",
        ),
    )
    for ax, title, keys, wanted in panels:
        ax.set_title(title, fontsize="medium")
        recorded = _recorded(ax, metrics, keys, wanted)
        for key in recorded:
            ax.step(metrics.steps, np.nan_to_num(metrics.column(key), nan=0.0), where="post", label=key)
        if recorded:
            ax.set_ylim(bottom=0)
            ax.legend(loc="upper left", fontsize="small")
    return figure


def _sat_figure(metrics: RunMetrics, run_dir: Path) -> Figure:
    figure, grid = _grid(metrics, 2, 2)
    panels: tuple[tuple[Axes, str, list[str]], ...] = (
        (
            grid[0],
            "SAT gate and active rates, clip fraction",
            ["sat_gate_rate", "sat_active_rate", "clip_fraction"],
        ),
        (grid[1], "SAT mean contraction", ["sat_contraction"]),
        (grid[2], "mismatch |log π_θ − log μ|", ["mismatch", "mismatch_fresh"]),
        (grid[3], "routing disagreement (share of routes)", ["routing_disagreement"]),
    )
    skipped = metrics.steps[metrics.column("updated") == 0]
    for ax, title, keys in panels:
        ax.set_title(title, fontsize="medium")
        recorded = _recorded(ax, metrics, keys)
        if not recorded:
            continue
        for key in recorded:
            label = "mismatch_fresh (current-version tokens)" if key == "mismatch_fresh" else key
            ax.plot(metrics.steps, metrics.column(key), ".-", label=label)
        for step in skipped:
            ax.axvline(step, color="grey", alpha=0.25, linewidth=3)
        if skipped.size:
            ax.plot([], [], color="grey", alpha=0.25, linewidth=3, label="step skipped")
        ax.legend(loc="best", fontsize="small")
    return figure


# --- helpers -------------------------------------------------------------------------------------------


def _grid(metrics: RunMetrics, rows: int, cols: int) -> tuple[Figure, list[Axes]]:
    """A figure of `rows` × `cols` panels sharing the step axis (elapsed seconds above the top row),
    flattened row by row."""
    figure = Figure(figsize=(6 * cols, 2.8 * rows + 0.6), dpi=_DPI, layout="constrained")
    axes = figure.subplots(rows, cols, sharex=True, squeeze=False)
    flat: list[Axes] = list(axes.ravel())
    for ax in flat:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[0]:
        _add_elapsed_scale(ax, metrics)
    return figure, flat


def _recorded(ax: Axes, metrics: RunMetrics, keys: Sequence[str], wanted: str = "") -> list[str]:
    """Those of `keys` some row records; when none, the panel says "not recorded" (naming `wanted`, by
    default the keys) instead."""
    present = [key for key in keys if metrics.has(key)]
    if not present:
        text = "not recorded: " + (wanted or ", ".join(keys))
        ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.set_yticks([])
    return present


def _edges(steps: npt.NDArray[np.int64]) -> Floats:
    """Cell edges around each step: midpoints between neighbours, half a step beyond the ends."""
    centres = steps.astype(np.float64)
    if centres.size == 1:
        return np.array([centres[0] - 0.5, centres[0] + 0.5])
    middle = (centres[1:] + centres[:-1]) / 2
    return np.concatenate([[centres[0] - (middle[0] - centres[0])], middle, [2 * centres[-1] - middle[-1]]])


def _elapsed(metrics: RunMetrics) -> tuple[Floats, str] | None:
    """Seconds per step for the second scale, and its label: an emulated run's simulated seconds
    (`sim/time_s`, the clock of `pacerl.lab.emulated`), else the loop's `elapsed_s` when it rises
    throughout, else the row times since the first step (a resumed run restarts `elapsed_s`); None when
    none rises."""
    candidates = (
        (metrics.column("sim/time_s"), "simulated s (emulated cluster)"),
        (metrics.column("elapsed_s"), "elapsed s"),
        (metrics.column("time") - metrics.column("time")[0], "elapsed s"),
    )
    for seconds, label in candidates:
        if seconds.size >= 2 and bool(np.all(np.diff(seconds) > 0)):
            return seconds, label
    return None


def _add_elapsed_scale(ax: Axes, metrics: RunMetrics) -> None:
    found = _elapsed(metrics)
    if found is None:
        return
    seconds, label = found
    steps = metrics.steps.astype(np.float64)

    def to_seconds(x: ArrayLike) -> ArrayLike:
        return _interp(x, steps, seconds)

    def to_steps(s: ArrayLike) -> ArrayLike:
        return _interp(s, seconds, steps)

    ax.secondary_xaxis("top", functions=(to_seconds, to_steps)).set_xlabel(label)


def _interp(x: ArrayLike, xp: Floats, fp: Floats) -> Floats:
    """Piecewise-linear `fp(x)` through the points (`xp` rising, at least two), continued past both ends
    along the end segments, so the second scale's ticks stay evenly spaced beyond the data."""
    at = np.asarray(x, dtype=np.float64)
    left = (fp[1] - fp[0]) / (xp[1] - xp[0])
    right = (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    inside = np.interp(at, xp, fp)
    below = np.where(at < xp[0], fp[0] + (at - xp[0]) * left, inside)
    result: Floats = np.where(at > xp[-1], fp[-1] + (at - xp[-1]) * right, below)
    return result


def _pace_target(run_dir: Path) -> int | None:
    """PACE's target occupancy from the run's saved config, when the run used PACE."""
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    section = json.loads(path.read_text(encoding="utf-8")).get("filter")
    if not isinstance(section, dict) or section.get("name") != "pace":
        return None
    pace = section.get("pace")
    target = pace.get("target_groups") if isinstance(pace, dict) else None
    return target if isinstance(target, int) else None


def save_png(figure: Figure, path: Path, *, dpi: int = _DPI) -> Path:
    """The project's one way to write a figure: the PNG is written beside its final name and renamed,
    so a viewer never reads half a file (a figure made without pyplot gets its Agg canvas here)."""
    FigureCanvasAgg(figure)
    partial = path.with_name(f".{path.name}.partial")
    figure.savefig(partial, format="png", dpi=dpi)
    os.replace(partial, path)
    return path
