"""PACE in miniature: synchronous vs unfiltered async vs async + PACE, with the `max_age` and `admission`
baselines, at the same wall-clock budget (ALGORITHMS.md §6, §2; the PACE paper's Table 1 in kind).

    .venv/bin/python benchmarks/experiments/pace.py [--env pacerl/CodeMath-v0] [--budget-s 600] [--seeds 0,1]

Every arm starts from one shared SFT warm start and is evaluated greedily on held-out tasks at the
start, every few steps in the background, and at the end. The table reports the final validation
accuracy, the wall-clock time each arm needed to reach the synchronous run's final accuracy, the token
staleness (GS and WS) and the rejections; the plot shows accuracy against wall-clock. Results go to
benchmarks/experiments/results/pace-<env>.{md,json,png}; run directories to runs/experiments/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, Arm, markdown_table, plot_curves, run_arm, time_to_reach, warm_start

ARMS = {
    "sync": ({"loop.mode": "sync"}, "on-policy: generate, then train"),
    "async": ({"loop.mode": "async", "filter.name": "none"}, "unfiltered async"),
    "async+pace": ({"loop.mode": "async", "filter.name": "pace"}, "PACE: effective-staleness rejection"),
    "async+max_age": ({"loop.mode": "async", "filter.name": "max_age"}, "hard age cap (prime-rl, NeMo)"),
    "async+admission": ({"loop.mode": "async", "filter.name": "admission"}, "AReaL's capacity gate"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="pacerl/CodeMath-v0")
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-clock seconds per arm")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    parser.add_argument("--sft-steps", type=int, default=75)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-tasks", type=int, default=100)
    parser.add_argument("--set", action="append", default=[], help="extra key=value for every arm")
    args = parser.parse_args()
    slug = args.env.split("/")[-1].lower()
    runs = ROOT / "runs" / "experiments" / f"pace-{slug}"
    model = warm_start(runs / "warm-start", args.env, args.sft_steps)
    base: dict[str, Any] = {
        "model.path": str(model),
        "env.id": args.env,
        "loop.steps": 100_000,
        "loop.max_wall_s": args.budget_s,
        "loop.batch_groups": 16,
        "evaluation.every": args.eval_every,
        "evaluation.settings.max_tasks": args.eval_tasks,
    }
    base.update(dict(item.split("=", 1) for item in args.set))
    summaries = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.arms.split(","):
            overrides, notes = ARMS[name]
            summaries.append(run_arm(Arm(name, overrides, seed, notes), base, runs))
            shown = {k: summaries[-1].get(k) for k in ("arm", "seed", "eval_end", "steps")}
            print(json.dumps(shown), flush=True)
    sync_final = statistics.mean(s["eval_end"] for s in summaries if s["arm"] == "sync" and "eval_end" in s)
    for summary in summaries:
        summary["seconds_to_sync_accuracy"] = time_to_reach(summary.get("eval_curve", []), sync_final)
        summary["rejected_total"] = sum(summary.get("rejected", {}).values())
    columns = [
        ("arm", "arm"),
        ("seed", "seed"),
        ("steps", "steps"),
        ("eval_start", "val acc start"),
        ("eval_end", "val acc end"),
        ("seconds_to_sync_accuracy", "s to sync's final acc"),
        ("mean_gs", "mean GS"),
        ("mean_ws", "mean WS"),
        ("rejected_total", "rejected groups"),
        ("wall_s", "wall s"),
    ]
    out = ROOT / "benchmarks" / "experiments" / "results"
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(summaries, columns)
    heading = f"PACE comparison on {args.env}, {args.budget_s:.0f} s per arm"
    (out / f"pace-{slug}.md").write_text(f"{heading}\n\n{table}")
    (out / f"pace-{slug}.json").write_text(json.dumps(summaries, indent=2) + "\n")
    plot_curves(summaries, out / f"pace-{slug}.png", f"{args.env}: validation accuracy at equal wall-clock")
    print(table)


if __name__ == "__main__":
    main()
