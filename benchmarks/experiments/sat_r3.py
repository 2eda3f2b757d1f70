"""SAT and R3 in miniature: GSPO vs SAT-GSPO, each with and without R3 routing replay, at publication lag
1 and 8 (the weights reach the engine every S = 1 or 8 updates), async, the same number of steps
(docs/algorithms.md §5, §4; the SAT paper's Table 1 in kind).

    .venv/bin/python benchmarks/experiments/sat_r3.py [--env pacerl/CodeMath-v0] [--steps 60] [--seeds 0]

The table reports validation accuracy at the start and the end, the mismatch (mean |log π_θ − log μ|),
the routing disagreement R3 removes, the clip fraction, the SAT gate rate and whether and when the run
collapsed (docs/algorithms.md §8's detector: the smoothed reward below half its running maximum without
recovering). Results go to benchmarks/experiments/results/sat_r3-<env>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Arm, add_common_arguments, prepare, run_and_report, write_results


def arms(
    lags: list[int], r3_only: bool = False, lag_key: str = "loop.sync_interval"
) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, overrides, table columns) of every arm: GSPO and SAT-GSPO (only GSPO with `r3_only`), each
    with and without R3, at each lag, set as `lag_key` (async's publication interval, or `loop.lag`)."""
    found = []
    for lag in lags:
        for loss, sat in (("gspo", False), ("sat-gspo", True)):
            for r3 in (False, True):
                if r3_only and sat:
                    continue
                name = f"{loss}{'+r3' if r3 else ''}-lag{lag}"
                overrides = {
                    "learner.loss.name": "gspo",
                    "learner.loss.sat": sat,
                    "learner.routing_replay": r3,
                    lag_key: lag,
                }
                found.append((name, overrides, {"lag": lag, "loss": loss, "r3": r3}))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lags", default="1,8")
    args = parser.parse_args()
    base = {
        "loop.mode": "async",
        "loop.steps": args.steps,
        "loop.batch_groups": 16,
        "evaluation.every": max(1, args.steps // 6),
    }
    slug, runs, base = prepare(args, "sat_r3", base)
    summaries = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, overrides, extra in arms([int(lag) for lag in args.lags.split(",")]):
            summaries.append(run_and_report(Arm(name, overrides, seed, extra=extra), base, runs))
    columns = [
        ("loss", "loss"),
        ("r3", "R3"),
        ("lag", "lag"),
        ("seed", "seed"),
        ("eval_start", "val acc start"),
        ("eval_end", "val acc end"),
        ("mismatch", "mismatch"),
        ("routing_disagreement", "routing disagreement"),
        ("clip_fraction", "clip fraction"),
        ("sat_gate_rate", "SAT gate rate"),
        ("collapse_step", "collapse step"),
    ]
    heading = f"SAT and R3 on {args.env}, {args.steps} steps per arm"
    title = f"{args.env}: GSPO vs SAT-GSPO, with and without R3"
    print(write_results(f"sat_r3-{slug}", heading, title, summaries, columns))


if __name__ == "__main__":
    main()
