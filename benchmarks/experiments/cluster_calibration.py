"""Experiment (c), the staleness × learning-rate laws under emulated timing: `pacerl calibrate`'s S × η
sweep of vanilla async GRPO (docs/calibration.md) on the toy of docs/experiments.md, every point trained
under the clock of an emulated cluster, so that each token's staleness is the cluster's and the
publication interval's rather than this CPU's. Does S·η_max stay roughly constant, and T_c·η?

    .venv/bin/python benchmarks/experiments/cluster_calibration.py [--seeds 0,1,2] [--sync-intervals 1,2,4,8]

The report (the grid, η_max per S, Ĉ = S·η_max and B̂ = T_c·η with their ranges, the fitted exponents
with their standard errors) is `pacerl calibrate`'s, copied with its plot to
benchmarks/experiments/results/cluster_calibration-math-v0.{md,json,png}; the sweep's runs stay in
runs/experiments/cluster_calibration-math-v0/ (a second call resumes it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, add_cluster_arguments, cluster_label, cluster_settings, relative_paths, sums_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--sync-intervals", default="1,2,4,8")
    parser.add_argument("--lrs", default="5e-4,1e-3,2e-3,4e-3")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument(
        "--in-flight",
        type=int,
        default=4,
        help="groups generating at once (filter.max_concurrent_groups): one batch keeps the pool from "
        "piling up, so that the staleness is S's and not the pool's",
    )
    parser.add_argument(
        "--name", default="cluster_calibration-math-v0", help="results' stem and sweep's directory"
    )
    add_cluster_arguments(parser)
    args = parser.parse_args()
    out = ROOT / "runs" / "experiments" / args.name
    every, eight = sums_tasks(out / "tasks")
    settings = {
        "env.id": "pacerl/Math-v0",
        "env.tasks": str(eight),
        "sft.tasks": str(every),
        "sft.steps": args.sft_steps,
        "sft.batch_size": 32,
        "loop.batch_groups": 4,
        "filter.max_concurrent_groups": args.in_flight,
        **cluster_settings(args),
    }
    command = [sys.executable, "-m", "pacerl", "calibrate", "--out", str(out), "--steps", str(args.steps)]
    command += ["--sync-intervals", args.sync_intervals, "--lrs", args.lrs, "--seeds", args.seeds]
    command += ["--parallel", str(args.parallel)]
    command += [f"{key}={json.dumps(value)}" for key, value in settings.items()]
    subprocess.run(command, cwd=ROOT, check=True)
    results = ROOT / "benchmarks" / "experiments" / "results"
    stem = args.name
    report = (out / "calibration.md").read_text()
    heading = (
        f"Staleness × learning rate under emulated timing ({cluster_label(args)}, {args.in_flight} groups in "
        f"flight), seeds {args.seeds}"
    )
    (results / f"{stem}.md").write_text(relative_paths(f"{heading}\n\n{report}"))
    (results / f"{stem}.json").write_text(relative_paths((out / "calibration.json").read_text()))
    shutil.copyfile(out / "stability.png", results / f"{stem}.png")
    print(f"wrote {results / stem}.{{md,json,png}}")


if __name__ == "__main__":
    main()
