"""PACE in miniature: synchronous vs unfiltered async vs async + PACE, with the `max_age` and `admission`
baselines, at the same wall-clock budget (docs/algorithms.md §6, §2; the PACE paper's Table 1 in kind).

    .venv/bin/python benchmarks/experiments/pace.py [--env pacerl/CodeMath-v0] [--budget-s 600] [--seeds 0,1]

Every arm starts from one shared SFT warm start and is evaluated greedily on held-out tasks at the
start, every few steps in the background, and at the end. The table reports the final validation
accuracy, the wall-clock time each arm needed to reach the synchronous run's final accuracy, the token
staleness (GS and WS) and the rejections; the plot shows accuracy against wall-clock. Results go to
benchmarks/experiments/results/pace-<env>.{md,json,png}; run directories to runs/experiments/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Arm, add_common_arguments, prepare, run_and_report, shares, time_to_reach, write_results

ARMS = {
    "sync": ({"loop.mode": "sync"}, "on-policy: generate, then train"),
    "async": ({"loop.mode": "async", "filter.name": "none"}, "unfiltered async"),
    "async+pace": ({"loop.mode": "async", "filter.name": "pace"}, "PACE: effective-staleness rejection"),
    "async+max_age": ({"loop.mode": "async", "filter.name": "max_age"}, "hard age cap (prime-rl, NeMo)"),
    "async+admission": ({"loop.mode": "async", "filter.name": "admission"}, "AReaL's capacity gate"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-clock seconds per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    parser.add_argument("--eval-every", type=int, default=5)
    args = parser.parse_args()
    base = {
        "loop.steps": 100_000,
        "loop.max_wall_s": args.budget_s,
        "loop.batch_groups": 16,
        "evaluation.every": args.eval_every,
    }
    slug, runs, base = prepare(args, "pace", base)
    summaries = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.arms.split(","):
            overrides, notes = ARMS[name]
            summaries.append(run_and_report(Arm(name, overrides, seed, notes), base, runs))
    sync_final = statistics.mean(s["eval_end"] for s in summaries if s["arm"] == "sync" and "eval_end" in s)
    for summary in summaries:
        summary["seconds_to_sync_accuracy"] = time_to_reach(summary.get("eval_curve", []), sync_final)
        summary["rejected_total"] = sum(summary.get("rejected", {}).values())
        summary["gs_shares"] = shares(summary.get("gs_hist", []))
        summary["ws_shares"] = shares(summary.get("ws_hist", []))
    columns = [
        ("arm", "arm"),
        ("seed", "seed"),
        ("steps", "steps"),
        ("eval_start", "val acc start"),
        ("eval_end", "val acc end"),
        ("seconds_to_sync_accuracy", "s to sync's final acc"),
        ("mean_gs", "mean GS"),
        ("mean_ws", "mean WS"),
        ("gs_shares", "tokens at GS 0/1/2+ (%)"),
        ("ws_shares", "tokens at WS 0/1/2+ (%)"),
        ("rejected_total", "rejected groups"),
        ("wall_s", "wall s"),
    ]
    heading = f"PACE comparison on {args.env}, {args.budget_s:.0f} s per arm"
    title = f"{args.env}: validation accuracy at equal wall-clock"
    print(write_results(f"pace-{slug}", heading, title, summaries, columns))


if __name__ == "__main__":
    main()
