"""Experiment (a), PACE on an emulated cluster: sync vs unfiltered async vs async + PACE, `max_age` and
`admission`, trained for real under the clock of a GPU cluster whose trainer is the bottleneck (so the
pool overfills and the filters act), every arm given the same simulated GPU-hours (docs/experiments.md;
the PACE paper's Table 1 in kind; the emulated clock: docs/simulation.md).

    .venv/bin/python benchmarks/experiments/cluster_pace.py [--seeds 0,1,2] [--gpu-hours 4] [--parallel 2]

Every arm starts from one shared SFT warm start (by default the teacher's 300 steps on `codemath-train`,
the recipe these results were measured with); the clock is `emulation.preset` (AReaL's cost models)
with `--inference-gpus` + `--trainer-gpus`, turns stretched by `--token-scale`. Greedy accuracy on
held-out tasks at the start and every `--eval-every` steps. The table over seeds reports each arm's final
accuracy (mean ± 95% t-interval), the simulated GPU-hours it needed to reach the sync arm's mean final
accuracy, its staleness and rejections; the plot shows accuracy against simulated GPU-hours. Results go
to benchmarks/experiments/results/cluster_pace-<env>.{md,json,png}; runs to runs/experiments/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Arm,
    add_cluster_arguments,
    add_common_arguments,
    cluster_label,
    cluster_settings,
    comparison_line,
    format_ci,
    markdown_table,
    paired_comparison,
    plot_curves,
    prepare,
    run_arms,
    shares,
    time_to_reach,
    write_results,
)
from pace import ARMS  # the same five arms as the CPU-clock comparison


def over_seeds(summaries: list[dict[str, Any]], arms: list[str], seeds: int) -> str:
    """One row per arm: mean ± 95% interval over its seeds."""
    rows = []
    for arm in arms:
        runs = [s for s in summaries if s["arm"] == arm and "error" not in s]

        def column(key: str, digits: int = 3, runs: list[dict[str, Any]] = runs) -> str:
            return format_ci([s.get(key) for s in runs], digits)

        rows.append(
            {
                "arm": arm,
                "runs": f"{len(runs)}/{seeds}",
                "steps": column("steps", 1),
                "gpu_hours": column("gpu_hours", 2),
                "eval_end": column("eval_end"),
                "reward_tail": column("mean_reward_last_quarter"),
                "gpu_hours_to_sync": format_ci([s.get("gpu_hours_to_sync") for s in runs], 2, of=len(runs)),
                "mean_gs": column("mean_gs", 2),
                "mean_ws": column("mean_ws", 2),
                "rejected_total": column("rejected_total", 1),
            }
        )
    columns = [
        ("arm", "arm"),
        ("runs", "runs"),
        ("steps", "steps"),
        ("gpu_hours", "GPU-hours"),
        ("eval_end", "final val acc"),
        ("reward_tail", "training reward, last quarter"),
        ("gpu_hours_to_sync", "GPU-hours to sync's final acc (runs that got there)"),
        ("mean_gs", "mean GS"),
        ("mean_ws", "mean WS"),
        ("rejected_total", "rejected groups"),
    ]
    return markdown_table(rows, columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.set_defaults(seeds="0,1,2", eval_tasks=50)
    parser.add_argument("--gpu-hours", type=float, default=4.0, help="simulated GPU-hours per arm")
    add_cluster_arguments(parser)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--tasks", default="codemath-train", help="training tasks (env.tasks)")
    parser.add_argument("--sft-style", default="teacher", help="style of the shared warm start")
    args = parser.parse_args()
    base = {
        **cluster_settings(args),
        "emulation.max_gpu_hours": args.gpu_hours,
        "loop.steps": 100_000,
        "loop.batch_groups": 16,
        "evaluation.every": args.eval_every,
        "env.tasks": args.tasks,
    }
    slug, runs, base = prepare(args, "cluster_pace", base, {"sft.style": args.sft_style})
    names = args.arms.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = [Arm(name, ARMS[name][0], seed, ARMS[name][1]) for seed in seeds for name in names]
    summaries = run_arms(arms, base, runs, args.parallel)
    sync_final = statistics.mean(s["eval_end"] for s in summaries if s["arm"] == "sync" and "eval_end" in s)
    for summary in summaries:
        summary["gpu_hours_to_sync"] = time_to_reach(summary.get("eval_curve", []), sync_final, axis=3)
        summary["rejected_total"] = sum(summary.get("rejected", {}).values())
        summary["gs_shares"] = shares(summary.get("gs_hist", []))
        summary["ws_shares"] = shares(summary.get("ws_hist", []))
    columns = [
        ("arm", "arm"),
        ("seed", "seed"),
        ("steps", "steps"),
        ("gpu_hours", "GPU-hours"),
        ("eval_start", "val acc start"),
        ("eval_end", "val acc end"),
        ("gpu_hours_to_sync", "GPU-hours to sync's final acc"),
        ("mean_gs", "mean GS"),
        ("mean_ws", "mean WS"),
        ("gs_shares", "tokens at GS 0/1/2+ (%)"),
        ("ws_shares", "tokens at WS 0/1/2+ (%)"),
        ("rejected_total", "rejected groups"),
        ("interruptions", "interrupted turns"),
        ("wall_s", "wall s"),
    ]
    for summary in summaries:
        summary["interruptions"] = (summary.get("emulation") or {}).get("interruptions")
    cluster = cluster_label(args)
    heading = (
        f"PACE on an emulated cluster, {args.env}: {cluster}, "
        f"{args.gpu_hours:g} simulated GPU-hours per arm, "
        f"seeds {args.seeds}; sync's mean final accuracy {sync_final:.3f}"
    )
    table = over_seeds(summaries, names, len(seeds)) + "\n"
    for arm in names:
        if arm != "async" and arm != "sync":
            table += comparison_line(paired_comparison(summaries, arm, "async"))
    title = f"{args.env}: validation accuracy at equal simulated GPU-hours ({cluster})"
    stem = f"cluster_pace-{slug}"
    print(write_results(stem, heading, title, summaries, columns, before=table, axis=3))
    # The same curves against updates: what each step learnt, apart from what a step cost.
    results = Path(__file__).resolve().parent / "results"
    plot_curves(
        summaries, results / f"{stem}-steps.png", f"{args.env}: validation accuracy per update", axis=1
    )


if __name__ == "__main__":
    main()
