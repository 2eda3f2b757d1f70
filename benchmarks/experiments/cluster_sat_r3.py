"""Experiment (b), SAT and R3 on an emulated cluster: GSPO vs SAT-GSPO, each with and without R3 routing
replay, at publication lag 1 and 8, with the engine's routers perturbed (a stand-in for the kernel and
precision differences between an inference engine and the trainer) and a learning rate near the
stability edge (docs/experiments.md; the SAT paper's Table 1 in kind).

    .venv/bin/python benchmarks/experiments/cluster_sat_r3.py [--seeds 0,1,2] [--lr 1e-3] [--router-noise 0.1]

The toy setting of docs/calibration.md: the tiny MoE warm-started by SFT on all one-digit sums, then
async RL on eight of them (`pacerl/Math-v0`), greedy accuracy on the eight every few steps, under the
emulated clock (`emulation.preset`, `--inference-gpus` + `--trainer-gpus`, `--token-scale`), so the
staleness of each arm is a cluster's, not this CPU's. The table over seeds reports the final accuracy
and the reward of the last quarter of the steps (mean ± 95% t-interval), how many seeds collapsed
(docs/algorithms.md §8's detector), the mismatch |log π_θ − log μ|, the routing disagreement R3 removes,
the clip fraction and the SAT gate rate. Results go to (`--name`, by default)
benchmarks/experiments/results/cluster_sat_r3-math-v0.{md,json,png}; runs to runs/experiments/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    ROOT,
    Arm,
    add_cluster_arguments,
    cluster_label,
    cluster_settings,
    format_ci,
    markdown_table,
    run_arms,
    sums_tasks,
    warm_start,
    write_results,
)
from sat_r3 import arms  # the same eight arms as the CPU-clock comparison

ENV = "pacerl/Math-v0"


def over_seeds(summaries: list[dict[str, Any]], names: list[str], seeds: int) -> str:
    """One row per arm: mean ± 95% interval over its seeds."""
    rows = []
    for name in names:
        runs = [s for s in summaries if s["arm"] == name and "error" not in s]
        first = runs[0] if runs else {}

        def column(key: str, runs: list[dict[str, Any]] = runs) -> str:
            return format_ci([s.get(key) for s in runs])

        rows.append(
            {
                "loss": first.get("loss", name),
                "r3": first.get("r3"),
                "lag": first.get("lag"),
                "runs": f"{len(runs)}/{seeds}",
                "eval_end": column("eval_end"),
                "reward_tail": column("mean_reward_last_quarter"),
                "collapsed": f"{sum(s.get('collapse_step') is not None for s in runs)}/{len(runs)}",
                "mismatch": column("mismatch"),
                "routing_disagreement": column("routing_disagreement"),
                "clip_fraction": column("clip_fraction"),
                "sat_gate_rate": column("sat_gate_rate"),
                "sat_active_rate": column("sat_active_rate"),
                "mean_ws": column("mean_ws"),
            }
        )
    columns = [
        ("loss", "loss"),
        ("r3", "R3"),
        ("lag", "lag"),
        ("runs", "runs"),
        ("eval_end", "final acc (8 sums)"),
        ("reward_tail", "reward, last quarter"),
        ("collapsed", "collapsed"),
        ("mismatch", "mismatch"),
        ("routing_disagreement", "routing disagreement"),
        ("clip_fraction", "clip fraction"),
        ("sat_gate_rate", "SAT gate rate"),
        ("sat_active_rate", "SAT changed the loss (share)"),
        ("mean_ws", "mean WS"),
    ]
    return markdown_table(rows, columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lags", default="1,8")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (near the toy's edge)")
    parser.add_argument("--router-noise", type=float, default=0.1, help="engine.router_noise")
    parser.add_argument("--sft-steps", type=int, default=60)
    add_cluster_arguments(parser)
    parser.add_argument("--set", action="append", default=[], help="extra key=value for every arm")
    parser.add_argument("--name", default="cluster_sat_r3-math-v0", help="results' stem and runs' directory")
    args = parser.parse_args()
    runs = ROOT / "runs" / "experiments" / args.name
    shared = ROOT / "runs" / "experiments" / "cluster_sat_r3-math-v0"  # one warm start for every --name
    every, eight = sums_tasks(shared / "tasks")
    sft = {"sft.tasks": str(every), "sft.batch_size": 32}
    model = warm_start(shared / "warm-start", ENV, args.sft_steps, sft)
    base: dict[str, Any] = {
        "model.path": str(model),
        "env.id": ENV,
        "env.tasks": str(eight),
        "evaluation.tasks": str(eight),
        "evaluation.settings.max_tasks": 8,
        "evaluation.every": 5,
        "learner.lr": args.lr,
        "engine.router_noise": args.router_noise,
        "loop.mode": "async",
        "loop.steps": args.steps,
        "loop.batch_groups": 4,
        "filter.name": "none",
        "filter.max_concurrent_groups": 8,
        **cluster_settings(args),
    }
    base.update(dict(item.split("=", 1) for item in args.set))
    chosen = arms([int(lag) for lag in args.lags.split(",")])
    seeds = [int(s) for s in args.seeds.split(",")]
    plan = [Arm(name, overrides, seed, extra=extra) for seed in seeds for name, overrides, extra in chosen]
    summaries = run_arms(plan, base, runs, args.parallel)
    columns = [
        ("loss", "loss"),
        ("r3", "R3"),
        ("lag", "lag"),
        ("seed", "seed"),
        ("eval_start", "acc start"),
        ("eval_end", "acc end"),
        ("mean_reward_last_quarter", "reward, last quarter"),
        ("mismatch", "mismatch"),
        ("routing_disagreement", "routing disagreement"),
        ("clip_fraction", "clip fraction"),
        ("sat_gate_rate", "SAT gate rate"),
        ("mean_gs", "mean GS"),
        ("mean_ws", "mean WS"),
        ("collapse_step", "collapse step"),
    ]
    cluster = cluster_label(args)
    heading = (
        f"SAT and R3 on an emulated cluster, {ENV} (eight sums): {cluster}, "
        f"{args.steps} steps, lr {args.lr:g}, "
        f"router noise {args.router_noise:g}, seeds {args.seeds}"
    )
    table = over_seeds(summaries, [name for name, _, _ in chosen], len(seeds))
    title = f"{ENV}: GSPO vs SAT-GSPO, with and without R3 ({cluster})"
    print(write_results(args.name, heading, title, summaries, columns, before=table, axis=3))


if __name__ == "__main__":
    main()
