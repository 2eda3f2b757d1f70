"""What `pacerl simulate` shows of a result: the async-vs-sync table on the terminal (with the published
figure a preset is checked against) and the PNG plots of throughput, staleness and utilization.
matplotlib and rich are imported when a report is made, not with this module."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pacerl.plots import save_png

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from pacerl.lab.presets import Preset
    from pacerl.lab.results import ModeResult, SimResult

_DPI = 100


# -- the table -----------------------------------------------------------------------------------------


def _hist(counts: Sequence[int]) -> str:
    total = sum(counts)
    if not total:
        return "-"
    shares = [c / total for c in counts]
    labels = [*map(str, range(len(counts) - 1)), f"{len(counts) - 1}+"]
    return " ".join(
        f"{label}:{share:.0%}" for label, share in zip(labels, shares, strict=True) if share >= 0.005
    )


def _rows(run: ModeResult) -> list[str]:
    rejected = ", ".join(f"{k} {v}" for k, v in run.rejected_groups.items()) or "0"
    waste = run.wasted_tokens / run.generated_tokens if run.generated_tokens else 0.0
    return [
        f"{run.steps}",
        f"{run.simulated_s:,.0f} s",
        f"{run.trajectories_per_s:,.2f}",
        f"{run.steady_trajectories_per_s:,.2f}",
        f"{run.step_time_s:,.2f} s (p90 {run.step_time_p90_s:,.2f})",
        f"{run.inference_utilization:.0%}",
        f"{run.trainer_utilization:.0%}",
        f"{run.gpu_utilization:.0%}",
        f"{run.mean_running_rows:,.1f}",
        f"{run.staleness.mean_gs:.2f} / {run.staleness.mean_ws:.2f} (max {run.staleness.max_staleness})",
        _hist(run.staleness.gs_hist),
        _hist(run.staleness.ws_hist),
        f"{rejected} ({run.rejected_trajectories} traj.)",
        f"{waste:.1%}",
        f"{run.interruptions:,} / {run.retractions:,}",
        f"{run.model_segments_per_trajectory:.2f}",
    ]


_LABELS = (
    "steps simulated",
    "simulated time",
    "trajectories/s",
    "trajectories/s, 2nd half",
    "time per step",
    "inference utilization",
    "trainer utilization",
    "GPU utilization (all)",
    "mean rows per engine batch",
    "staleness GS / WS (token mean)",
    "GS histogram (token share)",
    "WS histogram (token share)",
    "rejected groups by reason",
    "generated tokens wasted",
    "interrupted / retracted",
    "model segments per trajectory",
)


def print_report(result: SimResult, preset: Preset | None, preset_name: str | None) -> None:
    """The async-vs-sync table, the speed-up and, for a preset, the published figure it is checked
    against."""
    from rich.console import Console
    from rich.table import Table

    config = result.config
    console = Console()
    batch = f"B={config.batch_groups}×{config.workload.group_size}"
    title = (
        f"{config.inference_gpus} inference + {config.trainer_gpus} trainer GPUs, filter "
        f"{config.filter.name}, S={config.sync_interval}, {batch}"
    )
    if preset_name:
        title = f"{preset_name}: {title}"
    table = Table(title=title)
    table.add_column("")
    table.add_column("async", justify="right")
    table.add_column(f"sync ({config.sync_baseline}, same GPUs)", justify="right")
    for label, left, right in zip(_LABELS, _rows(result.async_run), _rows(result.sync_run), strict=True):
        table.add_row(label, left, right)
    console.print(table)
    bounds = result.bounds
    console.print(
        f"async speed-up over sync: [bold]{result.speedup:.2f}×[/] "
        f"(2nd halves: {result.steady_speedup:.2f}×); upper bounds from the means (no tails): generation "
        f"{bounds.generation_trajectories_per_s:,.1f}, training {bounds.training_trajectories_per_s:,.1f} "
        "trajectories/s"
    )
    held = result.async_run.pool_cap_held_s
    if held:
        console.print(
            f"note: the pool sat at the simulator's cap of {config.pool_cap} groups for "
            f"{held / result.async_run.simulated_s:.0%} of the run, holding the producer back (generation "
            "outpaces training; the real loop would let the pool, and its waiting staleness, grow)"
        )
    if preset is not None and preset.published is not None:
        published = preset.published
        sync, async_ = result.sync_run.step_time_s, result.async_run.step_time_s
        console.print(
            f"published: {published.speedup:.2f}×, sync {published.sync_step_s:.1f} s and async "
            f"{published.async_step_s:.1f} s per step ({published.source})\n"
            f"simulated: {result.speedup:.2f}× (2nd halves {result.steady_speedup:.2f}×), sync {sync:.1f} s "
            f"and async {async_:.1f} s per step"
        )
    console.print(f"simulated in {result.wall_s:.1f} s of wall-clock time")


# -- plots ---------------------------------------------------------------------------------------------


def write_plots(result: SimResult, out: Path) -> list[Path]:
    """`throughput.png`, `staleness.png` and `utilization.png` in `out`."""
    return [
        save_png(_throughput_figure(result), out / "throughput.png", dpi=_DPI),
        save_png(_staleness_figure(result), out / "staleness.png", dpi=_DPI),
        save_png(_utilization_figure(result), out / "utilization.png", dpi=_DPI),
    ]


def _figure(rows: int, cols: int, title: str) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6 * cols, 2.9 * rows + 0.6), dpi=_DPI, layout="constrained")
    axes = figure.subplots(rows, cols, squeeze=False)
    flat: list[Axes] = list(axes.ravel())
    for ax in flat:
        ax.grid(alpha=0.3)
    figure.suptitle(title)
    return figure, flat


def _title(result: SimResult, what: str) -> str:
    config = result.config
    return (
        f"{what}: {config.inference_gpus}+{config.trainer_gpus} GPUs, filter {config.filter.name}, "
        f"async {result.speedup:.2f}× sync"
    )


def _throughput_figure(result: SimResult) -> Figure:
    figure, (ax, steps_ax) = _figure(2, 1, _title(result, "throughput"))
    for run, style in ((result.async_run, "-"), (result.sync_run, "--")):
        trained = [0, *_cumulative(run)]
        ends = [0.0, *run.step_end_s]
        ax.plot(ends, trained, style, label=f"{run.mode}: {run.trajectories_per_s:,.2f} traj/s")
        gaps = [b - a for a, b in itertools.pairwise(ends)]
        steps_ax.plot(
            range(1, len(gaps) + 1), gaps, style, label=f"{run.mode}: mean {run.step_time_s:,.2f} s"
        )
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("trajectories trained")
    ax.legend(loc="upper left", fontsize="small")
    steps_ax.set_xlabel("step")
    steps_ax.set_ylabel("seconds per step")
    steps_ax.set_ylim(bottom=0)
    steps_ax.legend(loc="best", fontsize="small")
    return figure


def _cumulative(run: ModeResult) -> list[int]:
    total, sums = 0, []
    for count in run.step_trajectories:
        total += count
        sums.append(total)
    return sums


def _staleness_figure(result: SimResult) -> Figure:
    import numpy as np

    figure, (gs_ax, ws_ax, step_ax) = _figure(3, 1, _title(result, "staleness"))
    bins = np.arange(len(result.async_run.staleness.gs_hist))
    labels = [*map(str, bins[:-1]), f"{bins[-1]}+"]
    for ax, key, name in (
        (gs_ax, "gs_hist", "Generation Staleness"),
        (ws_ax, "ws_hist", "Waiting Staleness"),
    ):
        for offset, run in ((-0.2, result.async_run), (0.2, result.sync_run)):
            counts = np.asarray(getattr(run.staleness, key), dtype=np.float64)
            shares = counts / counts.sum() if counts.sum() else counts
            ax.bar(bins + offset, shares, width=0.4, label=run.mode)
        ax.set_xticks(bins, labels)
        ax.set_title(f"{name} (token share, versions)", fontsize="medium")
        ax.set_ylim(0, 1)
        ax.legend(loc="upper right", fontsize="small")
    run = result.async_run
    steps = range(1, len(run.step_mean_gs) + 1)
    step_ax.plot(steps, run.step_mean_gs, label="async mean GS")
    step_ax.plot(steps, run.step_mean_ws, label="async mean WS")
    step_ax.set_xlabel("step")
    step_ax.set_ylabel("versions")
    step_ax.set_ylim(bottom=0)
    step_ax.legend(loc="best", fontsize="small")
    return figure


def _utilization_figure(result: SimResult) -> Figure:
    import numpy as np

    figure, (bar_ax, pool_ax) = _figure(2, 1, _title(result, "utilization"))
    kinds = ("inference_utilization", "trainer_utilization", "gpu_utilization")
    positions = np.arange(len(kinds))
    for offset, run in ((-0.2, result.async_run), (0.2, result.sync_run)):
        bar_ax.bar(positions + offset, [getattr(run, k) for k in kinds], width=0.4, label=run.mode)
    bar_ax.set_xticks(positions, ["inference", "trainer", "all GPUs"])
    bar_ax.set_ylim(0, 1)
    bar_ax.set_ylabel("busy share")
    bar_ax.legend(loc="upper right", fontsize="small")
    run = result.async_run
    pool_ax.step(
        range(1, len(run.step_pool_groups) + 1), run.step_pool_groups, where="post", label="async pool"
    )
    if result.config.filter.name == "pace":
        target = result.config.filter.pace.target_groups
        pool_ax.axhline(target, color="grey", linestyle=":", label=f"PACE target ({target})")
    pool_ax.set_xlabel("step")
    pool_ax.set_ylabel("groups waiting at the draw")
    pool_ax.set_ylim(bottom=0)
    pool_ax.legend(loc="best", fontsize="small")
    return figure
