"""`pacerl simulate`: the async pipeline at cluster scale in simulated time (`pacerl.lab.engine`), next to
its synchronous baseline on the same GPUs; prints a table and writes `simulation.json` and PNG plots.

    pacerl simulate --inference-gpus 96 --trainer-gpus 32 --filter pace --steps 1000 --out runs/sim
    pacerl simulate --preset areal --out runs/sim-areal      # AReaL's published setup, vs its 2.77×

Settings come from, in order: the built-in defaults or `--preset`, then `--config FILE` (TOML or JSON with
the fields of `SimConfig`; nested sections `workload`, `inference`, `trainer`, `filter`), then the flags.
Bad input is one line naming the option, exit code 2. The trainer package (and torch with it) and
matplotlib are imported only when a simulation runs: `pacerl` builds this parser for every subcommand.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from pacerl.lab.engine import ModeResult, Preset, SimConfig, SimResult

FILTERS = ("none", "max_age", "admission", "pace")
"""trainer.pool.FILTER_NAMES (a test keeps them equal): listed here so the parser imports no torch."""
PRESET_NAMES = ("areal", "verl", "pacerl-cpu")
"""pacerl.lab.engine.PRESETS' names (a test keeps them equal)."""
SIMULATION_FILE = "simulation.json"
_DPI = 100


def add_simulate_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pacerl simulate` to the CLI's subcommands. Every value is parsed by `main_simulate`, so a bad
    one is a one-line error naming its option rather than argparse's usage block."""
    parser = commands.add_parser(
        "simulate",
        help="simulate the async pipeline at cluster scale vs its synchronous baseline",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add = parser.add_argument
    add("--preset", metavar="NAME", help=f"a calibrated setup: {', '.join(PRESET_NAMES)}")
    add("--config", metavar="FILE", help="TOML or JSON with SimConfig's fields (applied after --preset)")
    add("--inference-gpus", metavar="N", help="GPUs running inference engines")
    add("--trainer-gpus", metavar="M", help="GPUs training")
    add("--filter", metavar="NAME", help=f"the pool's staleness filter: {', '.join(FILTERS)}")
    add("--sync-interval", metavar="S", help="publish weights every S updates")
    add("--steps", metavar="N", help="trainer steps to simulate (async)")
    add("--sync-steps", metavar="N", help="steps of the sync baseline (default: min(steps, 100))")
    add("--batch-groups", metavar="B", help="groups per batch (also sets the in-flight cap to 8B and "
        "PACE's target to B unless given)")  # fmt: skip
    add("--group-size", metavar="G", help="trajectories per group")
    add("--max-concurrent-groups", metavar="N", help="groups in flight at most")
    add("--max-offpolicyness", metavar="ETA", help="admission: AReaL's η")
    add("--max-age", metavar="K", help="max_age: the oldest token version gap allowed")
    add("--target-groups", metavar="P", help="pace: the target pool occupancy in groups")
    add("--sync-baseline", metavar="KIND", help="colocated (every GPU generates, then trains) or split")
    add("--interrupt", metavar="KIND", help="reprefill (AReaL) or continue (PipelineRL)")
    add(
        "--trace", metavar="FILE", help="trajectory JSONL whose lengths, turns and tool latencies to resample"
    )
    add("--seed", metavar="N", help="seed of every sample")
    add("--out", metavar="DIR", default="runs/simulate", help="where simulation.json and the plots go")
    add("--plots", action=argparse.BooleanOptionalAction, default=True, help="write the PNG plots")
    parser.set_defaults(handler=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    """`pacerl simulate ...`."""
    return main_simulate(args)


def _integer(option: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{option} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{option} must be >= {minimum}, got {value}")
    return value


def _choice(option: str, raw: str, choices: Sequence[str]) -> str:
    if raw not in choices:
        raise ValueError(f"{option} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as a nested settings mapping, each value checked with its option's name."""
    data: dict[str, Any] = {}
    filter_: dict[str, Any] = {}
    integers = (
        ("inference_gpus", "--inference-gpus", 1),
        ("trainer_gpus", "--trainer-gpus", 1),
        ("sync_interval", "--sync-interval", 1),
        ("steps", "--steps", 1),
        ("sync_steps", "--sync-steps", 1),
        ("batch_groups", "--batch-groups", 1),
        ("seed", "--seed", 0),
    )
    for key, option, minimum in integers:
        raw = getattr(args, key)
        if raw is not None:
            data[key] = _integer(option, raw, minimum)
    for key, option, minimum in (
        ("max_concurrent_groups", "--max-concurrent-groups", 1),
        ("max_offpolicyness", "--max-offpolicyness", 0),
        ("max_age", "--max-age", 0),
        ("target_groups", "--target-groups", 1),
    ):
        raw = getattr(args, key)
        if raw is not None:
            filter_[key] = _integer(option, raw, minimum)
    if args.filter is not None:
        filter_["name"] = _choice("--filter", args.filter, FILTERS)
    if "batch_groups" in data:
        filter_.setdefault("max_concurrent_groups", 8 * data["batch_groups"])
        filter_.setdefault("target_groups", data["batch_groups"])
    if filter_:
        data["filter"] = filter_
    if args.group_size is not None:
        data["workload"] = {"group_size": _integer("--group-size", args.group_size, 1)}
    if args.sync_baseline is not None:
        data["sync_baseline"] = _choice("--sync-baseline", args.sync_baseline, ("colocated", "split"))
    if args.interrupt is not None:
        data["interrupt"] = _choice("--interrupt", args.interrupt, ("reprefill", "continue"))
    return data


def _read_config(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--config {path}: {error.strerror}") from None
    try:
        data = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--config {path} does not parse: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a table of settings")
    return data


def build_config(args: argparse.Namespace) -> tuple[SimConfig, Preset | None]:
    """The simulation config from the preset, the config file and the flags (ValueError naming the
    option on bad input)."""
    preset_name = None if args.preset is None else _choice("--preset", args.preset, PRESET_NAMES)
    overrides = _overrides(args)  # checked before the heavy import below
    file_data = _read_config(args.config) if args.config is not None else None

    from pacerl.lab.engine import PRESETS, SimConfig, config_from_dict, workload_from_trace

    preset = PRESETS[preset_name]() if preset_name is not None else None
    config = preset.config if preset is not None else SimConfig()
    if file_data is not None:
        try:
            config = config_from_dict(config, file_data)
        except ValueError as error:
            raise ValueError(f"--config {args.config}: {error}") from None
    if args.trace is not None:
        from agents.trajectory import load_jsonl

        try:
            workload = workload_from_trace(
                load_jsonl(args.trace), overrides.get("workload", {}).get("group_size")
            )
        except (OSError, ValueError) as error:
            raise ValueError(f"--trace {args.trace}: {error}") from None
        # the trace's own lengths pick the record-token block, not the preset's
        config = dataclasses.replace(config, workload=workload, token_block=None)
    try:
        config = config_from_dict(config, overrides)
    except ValueError as error:
        raise ValueError(
            f"the options do not make a valid setup: {_name_options(str(error), args)}"
        ) from None
    return config, preset


def _name_options(message: str, args: argparse.Namespace) -> str:
    """`message` with each setting the user gave as a flag called by its option (`--inference-gpus`
    for `inference_gpus`), so the error names what to change."""
    for key, value in sorted(vars(args).items(), key=lambda item: -len(item[0])):
        if value is not None and key not in (
            "out",
            "plots",
            "handler",
            "command",
            "preset",
            "config",
            "trace",
        ):
            message = re.sub(rf"(?<![\w.-]){key}\b", "--" + key.replace("_", "-"), message)
    return message


def main_simulate(args: argparse.Namespace) -> int:
    """Build the config, simulate both modes, print the table, write the JSON and the plots."""
    config, preset = build_config(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before the run: a bad --out fails in a second, not minutes
    from pacerl.lab.engine import simulate

    result = simulate(config)
    data = result.to_json()
    data["preset"] = None
    if preset is not None:
        data["preset"] = {
            "name": args.preset,
            "description": preset.description,
            "published": None if preset.published is None else vars(preset.published),
            "sources": list(preset.sources),
        }
    _write_json(out / SIMULATION_FILE, data)
    written = [out / SIMULATION_FILE]
    if args.plots:
        written += write_plots(result, out)
    print_report(result, preset, args.preset)
    for path in written:
        print(f"wrote {path}")
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(partial, path)


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
        _save(_throughput_figure(result), out / "throughput.png"),
        _save(_staleness_figure(result), out / "staleness.png"),
        _save(_utilization_figure(result), out / "utilization.png"),
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
        target = result.config.filter.target_groups
        pool_ax.axhline(target, color="grey", linestyle=":", label=f"PACE target ({target})")
    pool_ax.set_xlabel("step")
    pool_ax.set_ylabel("groups waiting at the draw")
    pool_ax.set_ylim(bottom=0)
    pool_ax.legend(loc="best", fontsize="small")
    return figure


def _save(figure: Figure, path: Path) -> Path:
    """Write the PNG beside its final name and rename it, so a viewer never reads half a file."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    partial = path.with_name(f".{path.name}.partial")
    figure.savefig(partial, format="png", dpi=_DPI)
    os.replace(partial, path)
    return path
