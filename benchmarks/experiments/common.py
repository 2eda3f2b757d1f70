"""Shared machinery of the papers' comparisons in miniature: run arms of `pacerl train` at one wall-clock
budget (each in its own process, so one arm's failure or memory cannot touch the next; an arm whose run
directory already holds a finished summary is skipped, so a long sweep resumes), then read their metrics
into one table and one plot.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pacerl.lab.calibration import collapse_step
from pacerl.plots import save_png
from trainer.metrics import read_metrics

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


def warm_start(directory: Path, env_id: str, steps: int | None) -> Path:
    """The shared SFT warm start of every arm (`pacerl sft`, the run config's default warm start for
    the env unless `steps` is given), made once."""
    if (directory / "config.json").is_file():
        return directory
    command = [sys.executable, "-m", "pacerl", "sft", "--out", str(directory), f"env.id={env_id}"]
    subprocess.run([*command, *([f"sft.steps={steps}"] if steps is not None else [])], cwd=ROOT, check=True)
    return directory


def run_arm(arm: Arm, base: Mapping[str, Any], runs: Path) -> dict[str, Any]:
    """Train one arm (unless its run directory has a summary already) and summarise its metrics."""
    run_dir = runs / f"{arm.name}-seed{arm.seed}"
    done = run_dir / SUMMARY
    if done.is_file():
        return dict(json.loads(done.read_text()))
    if run_dir.exists():  # an arm interrupted mid-way starts over: a partial run is no comparison
        import shutil

        shutil.rmtree(run_dir)
    settings = {**base, **arm.overrides, "run_dir": str(run_dir), "seed": arm.seed}
    pairs = [f"{key}={json.dumps(value)}" for key, value in settings.items()]
    command = [sys.executable, "-m", "pacerl", "train", *pairs]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.splitlines()[-5:])
        summary = {"arm": arm.name, "seed": arm.seed, "error": tail}
    else:
        summary = {"arm": arm.name, "seed": arm.seed, **arm.extra, **summarise(run_dir)}
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
    return {
        "steps": len(train),
        "updates": int(last.get("version", 0)),
        "wall_s": (train[-1]["time"] - start) if train else 0.0,
        "eval_start": evals[0]["eval/accuracy"] if evals else math.nan,
        "eval_end": evals[-1]["eval/accuracy"] if evals else math.nan,
        "eval_curve": [(row["time"] - start, row["eval/version"], row["eval/accuracy"]) for row in evals],
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
    }


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


def time_to_reach(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Seconds until an evaluation first reached `target` accuracy (None: never)."""
    for seconds, _, accuracy in curve:
        if accuracy >= target:
            return float(seconds)
    return None


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


def plot_curves(summaries: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    """Evaluation accuracy against wall-clock seconds, one line per arm and seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    for summary in summaries:
        curve = summary.get("eval_curve") or []
        if curve:
            label = f"{summary['arm']} s{summary['seed']}"
            axes.plot([p[0] for p in curve], [p[2] for p in curve], marker="o", label=label)
    axes.set_xlabel("wall-clock seconds")
    axes.set_ylabel("validation accuracy (greedy)")
    axes.set_title(title)
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


def prepare(args: argparse.Namespace, name: str, base: Mapping[str, Any]) -> tuple[str, Path, dict[str, Any]]:
    """(env slug, runs directory, base config): the shared warm start made, `--set` applied."""
    slug = args.env.split("/")[-1].lower()
    runs = ROOT / "runs" / "experiments" / f"{name}-{slug}"
    model = warm_start(runs / "warm-start", args.env, args.sft_steps)
    settings = {"model.path": str(model), "env.id": args.env, **base}
    settings["evaluation.settings.max_tasks"] = args.eval_tasks
    settings.update(dict(item.split("=", 1) for item in args.set))
    return slug, runs, settings


def run_and_report(arm: Arm, base: Mapping[str, Any], runs: Path) -> dict[str, Any]:
    """`run_arm`, with one progress line."""
    summary = run_arm(arm, base, runs)
    print(json.dumps({k: summary.get(k) for k in ("arm", "seed", "eval_end", "steps")}), flush=True)
    return summary


def write_results(
    stem: str,
    heading: str,
    title: str,
    summaries: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
) -> str:
    """`results/<stem>.{md,json,png}`; returns the markdown table."""
    out = ROOT / "benchmarks" / "experiments" / "results"
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(summaries, columns)
    (out / f"{stem}.md").write_text(f"{heading}\n\n{table}")
    (out / f"{stem}.json").write_text(json.dumps(list(summaries), indent=2) + "\n")
    plot_curves(summaries, out / f"{stem}.png", title)
    return table
