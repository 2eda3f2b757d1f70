"""A real pretrained model learns to use the sandboxed Python tool: SmolLM2-135M-Instruct on CodeMath
(docs/real-model.md).

    .venv/bin/python benchmarks/experiments/real_model.py [--seeds 0,1,2] [--eval-tasks 100]

Greedy accuracy on `codemath-val` and on the question forms no training task is written in
(`codemath-heldout`) of four models: SmolLM2 answering without the tool, SmolLM2 with the tool as it
ships, after the warm start alone and after RL. The last two come from one run of the named job
(`configs/smollm2-codemath.toml`, `make demo-real`) per seed: its evaluation after the warm start and
before the first RL step, and its last one. Results (mean ± 95% t-interval over the seeds, then every
run) go to benchmarks/experiments/results/real_model-smollm2.{md,json,png}; run directories to
runs/experiments/real_model-smollm2/ (a sweep resumes: a finished seed is not run again).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, Arm, format_ci, markdown_table, run_and_report, write_results

from pacerl.trainer.metrics import read_metrics

CONFIG = ROOT / "configs" / "smollm2-codemath.toml"
SETS = {"val": "codemath-val", "heldout": "codemath-heldout"}
NO_TOOL = {  # the question alone, and a call ends the episode unanswered
    "env.system_prompt": "Give the final answer as \\boxed{...}.",
    "env.max_tool_calls": 0,
}


def flattened(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A TOML config as the dotted `key=value` overrides `pacerl train` takes."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def baseline(name: str, overrides: Mapping[str, Any], eval_tasks: int, out: Path) -> dict[str, float]:
    """Greedy accuracy of the shipped model on each set (`pacerl eval` with the job's config)."""
    accuracy = {}
    for label, tasks in SETS.items():
        report = out / f"{name}-{label}.json"
        if not report.is_file():
            command = [sys.executable, "-m", "pacerl", "eval", "--config", str(CONFIG), "--tasks", tasks]
            command += [
                "--temperature",
                "0",
                "--n",
                "1",
                "--max-tasks",
                str(eval_tasks),
                "--out",
                str(report),
            ]
            command += [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
            # exit 2 when every episode failed (e.g. each called the tool it was denied): still a score
            subprocess.run(command, cwd=ROOT, check=False)
        accuracy[label] = float(json.loads(report.read_text())["avg_at_k"])
    return accuracy


def evaluations(run_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """(after the warm start, after RL): each set's accuracy at the run's first and last evaluation."""
    rows = [row for row in read_metrics(run_dir) if "eval/accuracy" in row]
    keys = {"val": "eval/accuracy", "heldout": "eval/heldout/accuracy"}
    first, last = rows[0], rows[-1]
    return {k: first[key] for k, key in keys.items()}, {k: last[key] for k, key in keys.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one run of the job each")
    parser.add_argument("--eval-tasks", type=int, default=100, help="tasks of each set evaluated")
    args = parser.parse_args()
    runs = ROOT / "runs" / "experiments" / "real_model-smollm2"
    runs.mkdir(parents=True, exist_ok=True)
    base = flattened(tomllib.loads(CONFIG.read_text()))
    base["evaluation.settings.max_tasks"] = args.eval_tasks
    without_tool = baseline("no-tool", NO_TOOL, args.eval_tasks, runs)
    untrained = baseline("tool-untrained", {}, args.eval_tasks, runs)
    summaries = []
    for seed in (int(s) for s in args.seeds.split(",") if s):  # "": the baselines alone
        summary = run_and_report(
            Arm("smollm2-codemath", {}, seed, "warm start, then SAT-GSPO + PACE"), base, runs
        )
        if "error" not in summary:
            run_dir = runs / f"smollm2-codemath-seed{seed}"
            warm, final = evaluations(run_dir)
            own = json.loads((run_dir / "summary.json").read_text())
            summary |= {f"warm_{k}": v for k, v in warm.items()} | {f"rl_{k}": v for k, v in final.items()}
            summary["rl_gain_heldout"] = final["heldout"] - warm["heldout"]
            summary["job_s"] = own["seconds"]
            summary["sft_s"] = own.get("warm_start", {}).get("sft/seconds")
            summary["peak_rss_gb"] = own.get("peak_rss_gb")
        summaries.append(summary)
    done = [s for s in summaries if "error" not in s]

    def row(model: str, values: Mapping[str, list[float]]) -> dict[str, str]:
        return {"model": model, **{label: format_ci(values[label]) for label in SETS}}

    table = [
        row("SmolLM2, no tool", {k: [v] for k, v in without_tool.items()}),
        row("SmolLM2 + tool, untrained", {k: [v] for k, v in untrained.items()}),
        row("after the warm start", {k: [s[f"warm_{k}"] for s in done] for k in SETS}),
        row("after RL", {k: [s[f"rl_{k}"] for s in done] for k in SETS}),
    ]
    gain = format_ci([100 * s["rl_gain_heldout"] for s in done], digits=1)
    job = format_ci([s["job_s"] / 60 for s in done], digits=1)
    before = markdown_table(
        table, [("model", "model"), ("val", "codemath-val"), ("heldout", "held-out forms")]
    )
    before += f"\nRL over the warm start on the held-out forms: {gain} points; the job: {job} minutes.\n"
    columns = [
        ("seed", "seed"),
        ("warm_val", "val, warm start"),
        ("rl_val", "val, after RL"),
        ("warm_heldout", "held-out, warm start"),
        ("rl_heldout", "held-out, after RL"),
        ("steps", "RL steps"),
        ("sft_s", "warm start s"),
        ("job_s", "job s"),
        ("peak_rss_gb", "peak RSS GB"),
        ("mean_gs", "mean GS"),
        ("mean_ws", "mean WS"),
    ]
    heading = (
        f"SmolLM2-135M-Instruct on pacerl/CodeMath-v0, greedy accuracy on {args.eval_tasks} tasks of each "
        f"set, seeds {args.seeds}"
    )
    print(
        write_results(
            "real_model-smollm2",
            heading,
            "SmolLM2 on CodeMath: validation accuracy",
            summaries,
            columns,
            before=before,
        )
    )


if __name__ == "__main__":
    main()
