"""Shared machinery of the papers' comparisons in miniature: run arms of `pacerl train` at one wall-clock
budget (each in its own process, so one arm's failure or memory cannot touch the next; an arm whose run
directory already holds a finished summary is skipped, so a long sweep resumes), then read their metrics
into one table and one plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pacerl.lab.calibration import collapse_step, held_out_collapse_step
from pacerl.plots import save_png
from pacerl.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = "arm.json"  # beside the run's own summary.json


@dataclass(frozen=True)
class Arm:
    """One configuration of the comparison."""

    name: str
    """Its label in the table."""
    overrides: Mapping[str, Any]
    """Dotted config keys on top of the base config (e.g. `{"loop.mode": "sync"}`)."""
    seed: int = 0
    """Seed of the run."""
    notes: str = ""
    """What the arm stands for (a paper's baseline)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Columns carried into the table as they are (e.g. the publication lag)."""


def warm_start(
    directory: Path, env_id: str, steps: int | None, settings: Mapping[str, Any] | None = None
) -> Path:
    """The shared SFT warm start of every arm (`pacerl sft`, the run config's default warm start for
    the env unless `steps` or `settings`, dotted keys such as `sft.tasks`, say otherwise), made once."""
    if (directory / "config.json").is_file():
        return directory
    command = [sys.executable, "-m", "pacerl", "sft", "--out", str(directory), f"env.id={env_id}"]
    command += [f"sft.steps={steps}"] if steps is not None else []
    command += [f"{key}={json.dumps(value)}" for key, value in (settings or {}).items()]
    subprocess.run(command, cwd=ROOT, check=True)
    return directory


EIGHT_SUMS = ((3, 3), (2, 5), (7, 1), (4, 4), (6, 2), (1, 8), (5, 3), (9, 0))
"""The toy's RL and evaluation tasks (docs/experiments.md, docs/calibration.md): eight one-digit sums."""


def sums_tasks(directory: Path) -> tuple[Path, Path]:
    """(all 100 one-digit sums, the eight of `EIGHT_SUMS`) as `pacerl/Math-v0` task files in `directory`:
    the toy setting where the staleness and learning-rate experiments run (SFT on all, RL on eight)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = [
        {"id": f"add-{a}-{b}", "question": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(10)
        for b in range(10)
    ]
    every, eight = directory / "sums.jsonl", directory / "eight.jsonl"
    every.write_text("".join(json.dumps(row) + "\n" for row in rows))
    chosen = [row for row in rows if tuple(int(n) for n in row["id"].split("-")[1:]) in EIGHT_SUMS]
    eight.write_text("".join(json.dumps(row) + "\n" for row in chosen))
    return every, eight


def split_sums(directory: Path) -> tuple[Path, Path]:
    """(the 50 one-digit sums a + b with a + b·10 even, the other 50) as task files: RL trains on the first
    half and is evaluated on the second, which it never sees but which asks for the same skill. (A split
    off the eight sums of `EIGHT_SUMS` measures forgetting instead: RL on eight sums makes the warm start
    forget the other 92 at any stable learning rate.)"""
    directory.mkdir(parents=True, exist_ok=True)
    rows = [(a, b) for a in range(10) for b in range(10)]
    paths = []
    for name, parity in (("train-half.jsonl", 0), ("held-out-half.jsonl", 1)):
        path = directory / name
        path.write_text(
            "".join(
                json.dumps({"id": f"add-{a}-{b}", "question": f"What is {a} + {b}?", "answer": str(a + b)})
                + "\n"
                for a, b in rows
                if (a + 10 * b) % 2 == parity
            )
        )
        paths.append(path)
    return paths[0], paths[1]


def provenance() -> dict[str, Any]:
    """What made a result: the commit of this checkout (and whether tracked files differed from it), the
    command line, the date. Written into every results file."""
    import datetime

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        # Code only: the docs and the results themselves change while an experiment runs.
        "dirty": bool(
            git(
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!docs",
                ":!README.md",
                ":!*/results/*",
            )
        ),
        "command": relative_paths(" ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])),
        "date": datetime.date.today().isoformat(),
    }


def provenance_line(made: Mapping[str, Any]) -> str:
    """One markdown line naming the commit and the command of a result."""
    dirty = " with uncommitted changes" if made["dirty"] else ""
    return f"Generated at commit `{made['commit'][:12]}`{dirty} on {made['date']} by `{made['command']}`."


def run_arm(arm: Arm, base: Mapping[str, Any], runs: Path, threads: int | None = None) -> dict[str, Any]:
    """Train one arm (unless its run directory has a summary of a finished run with the same settings)
    and summarise its metrics; `threads`: torch threads of its process (None: the config's)."""
    run_dir = runs / f"{arm.name}-seed{arm.seed}"
    done = run_dir / SUMMARY
    settings = {**base, **arm.overrides, "run_dir": str(run_dir), "seed": arm.seed}
    if done.is_file() and "error" not in json.loads(done.read_text()):  # a failed arm runs again
        finished = dict(json.loads(done.read_text()))
        if finished.get("settings") != json.loads(json.dumps(settings)):
            raise SystemExit(f"{run_dir} finished with other settings: remove it to run the arm again")
        return finished
    if run_dir.exists():  # an arm interrupted mid-way starts over: a partial run is no comparison
        import shutil

        shutil.rmtree(run_dir)
    pairs = [f"{key}={json.dumps(value)}" for key, value in settings.items()]
    pairs += [] if threads is None else [f"threads={threads}"]  # how it ran, not what it is: not compared
    pairs.append("loop.require_update=false")  # an arm that trains nothing is a result, not an error
    command = [sys.executable, "-m", "pacerl", "train", *pairs]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.splitlines()[-5:])
        summary = {"arm": arm.name, "seed": arm.seed, "error": tail}
    else:
        summary = {"arm": arm.name, "seed": arm.seed, **arm.extra, **summarise(run_dir)}
    summary["settings"] = settings
    run_dir.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summarise(run_dir: Path) -> dict[str, Any]:
    """The figures the tables report, from a finished run's metrics.jsonl."""
    rows = read_metrics(run_dir)
    train = [row for row in rows if "reward" in row]
    evals = [row for row in rows if "eval/accuracy" in row]
    # Seconds count from the first record: the end of the evaluation before training.
    start = rows[0]["time"] if rows else 0.0

    def mean(key: str) -> float:
        values = [row[key] for row in train if isinstance(row.get(key), int | float)]
        return sum(values) / len(values) if values else math.nan

    gs = [sum(row.get(f"staleness/gs_hist_{b}", 0.0) for row in train) for b in range(9)]
    ws = [sum(row.get(f"staleness/ws_hist_{b}", 0.0) for row in train) for b in range(9)]
    last = train[-1] if train else {}
    rewards = [row["reward"] for row in train]
    # Emulated runs (docs/simulation.md): each version's simulated GPU-hours, from the step that made it.
    gpu_hours = {int(row["version"]): row["sim/gpu_hours"] for row in train if "sim/gpu_hours" in row}
    gpu_hours.setdefault(0, 0.0)
    emulation = run_dir / "emulation.json"
    return {
        "steps": len(train),
        "updates": int(last.get("version", 0)),
        "wall_s": (train[-1]["time"] - start) if train else 0.0,
        "eval_start": evals[0]["eval/accuracy"] if evals else math.nan,
        "eval_end": evals[-1]["eval/accuracy"] if evals else math.nan,
        "eval_curve": [
            (row["time"] - start, row["eval/version"], row["eval/accuracy"], gpu_hours.get(version))
            for row in evals
            for version in [int(row["eval/version"])]
        ],
        "gpu_hours": last.get("sim/gpu_hours"),
        "sim_s": last.get("sim/time_s"),
        "emulation": json.loads(emulation.read_text())["result"] if emulation.is_file() else None,
        "reward_curve": [(row["time"] - start, row["reward"]) for row in train],
        "mean_reward_last_quarter": _tail_mean(rewards, 0.25),
        "mean_gs": mean("staleness/mean_gs"),
        "mean_ws": mean("staleness/mean_ws"),
        "gs_hist": gs,
        "ws_hist": ws,
        "clip_fraction": mean("clip_fraction"),
        "sat_gate_rate": mean("sat_gate_rate"),
        "sat_active_rate": mean("sat_active_rate"),
        "mismatch": mean("mismatch"),
        "routing_disagreement": mean("routing_disagreement"),
        "rejected": {k.removeprefix("rejected/"): v for k, v in last.items() if k.startswith("rejected/")},
        "collapse_step": collapse_step(rewards),
        "held_out_collapse_step": held_out_collapse_step(
            [(int(row["eval/version"]), float(row["eval/accuracy"])) for row in evals]
        ),
        "staleness_mean": mean("staleness/mean_staleness"),
        "staleness_max": max((row.get("staleness/max_staleness", 0.0) for row in train), default=math.nan),
    }


def collapsed(run: Mapping[str, Any]) -> bool:
    """Whether a summarised run collapsed: by the reward detector or by its held-out evaluation."""
    return run.get("collapse_step") is not None or run.get("held_out_collapse_step") is not None


def _tail_mean(values: Sequence[float], share: float) -> float:
    tail = values[-max(1, int(len(values) * share)) :] if values else []
    return sum(tail) / len(tail) if tail else math.nan


def shares(histogram: Sequence[float], top: int = 2) -> str:
    """A histogram over versions 0, 1, ... as percentages `a/b/c` of the bins 0 .. top-1 and top or more."""
    total = sum(histogram)
    if not total:
        return "–"
    bins = [*histogram[:top], sum(histogram[top:])]
    return "/".join(f"{100 * count / total:.0f}" for count in bins)


def time_to_reach(curve: Sequence[Sequence[Any]], target: float, axis: int = 0) -> float | None:
    """The `axis` coordinate of an evaluation curve's first point at `target` accuracy or more (0:
    wall-clock seconds, 3: simulated GPU-hours), None if none reached it."""
    for point in curve:
        if point[2] >= target:
            return float(point[axis])
    return None


T_95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145)
"""Student's t quantile 0.975 for 1, 2, ... degrees of freedom (two-sided 95%); 1.96 beyond the table
is within 5% of it from 15 on."""


def mean_ci(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, half-width of its 95% t-interval, n) over the finite `values`; nan half-width for n < 2."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(finite)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(finite) / n
    if n < 2:
        return mean, math.nan, n
    sd = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1))
    return mean, (T_95[n - 2] if n - 1 <= len(T_95) else 1.96) * sd / math.sqrt(n), n


def format_ci(values: Sequence[float | None], digits: int = 3, of: int | None = None) -> str:
    """`mean ± half-width` of `values` (`mean_ci`); `(k/of)` appended when only k of `of` are finite."""
    mean, half, n = mean_ci([v for v in values if v is not None])
    if n == 0:
        return "–" if of is None else f"– (0/{of})"
    text = f"{mean:.{digits}f}" + ("" if math.isnan(half) else f" ± {half:.{digits}f}")
    return text if of is None or n == of else f"{text} ({n}/{of})"


def paired_comparison(
    summaries: Sequence[Mapping[str, Any]], arm: str, baseline: str, key: str = "eval_end"
) -> dict[str, Any] | None:
    """`arm` − `baseline` on `key`, seed by seed (the seeds both finished): the differences, their mean
    with its 95% t-interval, the relative gain over the baseline's mean, and the minimum detectable effect
    at this many seeds (`pacerl.lab.power`); None with fewer than two shared seeds."""
    from pacerl.lab.power import mean_interval, minimum_detectable_effect

    def values(name: str) -> dict[int, float]:
        return {
            int(s["seed"]): float(s[key])
            for s in summaries
            if s.get("arm") == name and "error" not in s and isinstance(s.get(key), int | float)
        }

    ours, theirs = values(arm), values(baseline)
    seeds = sorted(set(ours) & set(theirs))
    if len(seeds) < 2:
        return None
    differences = [ours[seed] - theirs[seed] for seed in seeds]
    interval = mean_interval(differences)
    base_mean = sum(theirs[seed] for seed in seeds) / len(seeds)
    return {
        "arm": arm,
        "baseline": baseline,
        "key": key,
        "seeds": seeds,
        "differences": differences,
        "mean": interval.mean,
        "half_width": interval.half_width,
        "sd": interval.sd,
        "baseline_mean": base_mean,
        "relative": interval.mean / base_mean if base_mean else math.nan,
        "mde": minimum_detectable_effect(interval.sd, len(seeds), paired=True),
    }


def comparison_line(comparison: Mapping[str, Any] | None) -> str:
    """One markdown line of a `paired_comparison`."""
    if comparison is None:
        return ""
    c = comparison
    return (
        f"- {c['arm']} − {c['baseline']} ({c['key']}, paired over {len(c['seeds'])} seeds): "
        f"{c['mean']:+.3f} ± {c['half_width']:.3f} (95% t-interval; {100 * c['relative']:+.1f}% of the "
        f"baseline's {c['baseline_mean']:.3f}); minimum detectable effect at these seeds {c['mde']:.3f} "
        f"(α 0.05, power 0.8, from the seeds' spread sd {c['sd']:.3f}).\n"
    )


def run_arms(arms: Sequence[Arm], base: Mapping[str, Any], runs: Path, parallel: int) -> list[dict[str, Any]]:
    """`run_and_report` for every arm, `parallel` processes at a time with the CPUs divided among them;
    the summaries in the order of `arms`."""
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // parallel)
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(lambda arm: run_and_report(arm, base, runs, threads), arms))


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A markdown table of `rows`; `columns` are (key, header) pairs; floats at 3 decimals."""

    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(k)) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_curves(summaries: Sequence[Mapping[str, Any]], path: Path, title: str, axis: int = 0) -> None:
    """Evaluation accuracy against wall-clock seconds (`axis` 0), updates (1) or simulated GPU-hours (3),
    one colour per arm and one line per seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    colours: dict[str, str] = {}
    for summary in summaries:
        curve = [p for p in summary.get("eval_curve") or [] if p[axis] is not None]
        if curve:
            arm = str(summary["arm"])
            first = arm not in colours
            colours.setdefault(arm, f"C{len(colours) % 10}")
            xs, ys = [p[axis] for p in curve], [p[2] for p in curve]
            axes.plot(xs, ys, marker="o", markersize=3, color=colours[arm], label=arm if first else None)
    labels = {
        0: "wall-clock seconds",
        1: "policy version (updates)",
        3: "simulated GPU-hours (emulated cluster)",
    }
    axes.set_xlabel(labels.get(axis, f"column {axis}"))
    axes.set_ylabel("validation accuracy (greedy)")
    axes.set_title(title, fontsize=8)
    axes.legend(fontsize=7)
    figure.tight_layout()
    save_png(figure, Path(path), dpi=110)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every comparison takes."""
    parser.add_argument("--env", default="pacerl/CodeMath-v0")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--sft-steps", type=int, default=None, help="default: the config's warm start")
    parser.add_argument("--eval-tasks", type=int, default=100)
    parser.add_argument("--set", action="append", default=[], help="extra key=value for every arm")


def add_cluster_arguments(parser: argparse.ArgumentParser, trainer_gpus: int = 8) -> None:
    """The emulated cluster's options (docs/simulation.md): by default AReaL's cost models with 96
    inference GPUs and a trainer too small to keep up, turns stretched 100× to a preset's lengths."""
    parser.add_argument("--preset", default="areal")
    parser.add_argument("--inference-gpus", type=int, default=96)
    parser.add_argument("--trainer-gpus", type=int, default=trainer_gpus)
    parser.add_argument("--token-scale", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=2, help="arms trained at a time")


def cluster_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `emulation.*` keys of `add_cluster_arguments`' options."""
    return {
        "emulation.clock": "emulated",
        "emulation.preset": args.preset,
        "emulation.inference_gpus": args.inference_gpus,
        "emulation.trainer_gpus": args.trainer_gpus,
        "emulation.token_scale": args.token_scale,
    }


def cluster_label(args: argparse.Namespace) -> str:
    """The emulated cluster in words, for headings and titles."""
    gpus = f"{args.inference_gpus} + {args.trainer_gpus} GPUs"
    return f"{args.preset} clock, {gpus}, token scale {args.token_scale}"


def prepare(
    args: argparse.Namespace, name: str, base: Mapping[str, Any], sft: Mapping[str, Any] | None = None
) -> tuple[str, Path, dict[str, Any]]:
    """(env slug, runs directory, base config): the shared warm start made (with the `sft` settings,
    e.g. `sft.style`), `--set` applied."""
    slug = args.env.split("/")[-1].lower()
    runs = ROOT / "runs" / "experiments" / f"{name}-{slug}"
    tasks = {"env.tasks": base["env.tasks"]} if "env.tasks" in base else {}
    model = warm_start(runs / "warm-start", args.env, args.sft_steps, {**tasks, **(sft or {})})
    settings = {"model.path": str(model), "env.id": args.env, **base}
    settings["evaluation.settings.max_tasks"] = args.eval_tasks
    settings.update(dict(item.split("=", 1) for item in args.set))
    return slug, runs, settings


def run_and_report(
    arm: Arm, base: Mapping[str, Any], runs: Path, threads: int | None = None
) -> dict[str, Any]:
    """`run_arm`, with one progress line."""
    summary = run_arm(arm, base, runs, threads)
    print(json.dumps({k: summary.get(k) for k in ("arm", "seed", "eval_end", "steps")}), flush=True)
    return summary


def relative_paths(text: str) -> str:
    """`text` with this checkout's absolute paths made relative to its root (results are committed)."""
    return text.replace(f"{ROOT}{os.sep}", "").replace(str(ROOT), ".")


def write_results(
    stem: str,
    heading: str,
    title: str,
    summaries: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    *,
    before: str = "",
    axis: int = 0,
) -> str:
    """`results/<stem>.{md,json,png}`: `before` (e.g. the table over seeds) above the per-run table,
    the plot against `plot_curves`' `axis`; returns the markdown written."""
    out = ROOT / "benchmarks" / "experiments" / "results"
    out.mkdir(parents=True, exist_ok=True)
    made = provenance()
    text = f"{heading}\n\n{provenance_line(made)}\n\n" + (f"{before}\n" if before else "")
    text += markdown_table(summaries, columns)
    (out / f"{stem}.md").write_text(relative_paths(text))
    data = {"provenance": made, "runs": list(summaries)}
    (out / f"{stem}.json").write_text(relative_paths(json.dumps(data, indent=2) + "\n"))
    plot_curves(summaries, out / f"{stem}.png", title, axis)
    return text
