"""RL on the generated Search world, over seeds: one shared SFT warm start (150 clean steps on the first
9,600 training questions), then, per seed, `--steps` synchronous RL steps on the whole training set, with
greedy accuracy on the first `--eval-tasks` validation questions (about entities no training question
names) before and after (docs/experiments.md, "RL on the generated Search world").

    .venv/bin/python benchmarks/experiments/search_rl.py [--seeds 0,1,2] [--steps 30] [--eval-tasks 200]

Writes benchmarks/experiments/results/search_rl-search-v0.{md,json,png}: the gain over seeds (mean ± 95%
t-interval of the paired after − before), each seed's row, under a line naming the commit and command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, Arm, format_ci, markdown_table, run_arms, warm_start, write_results

from pacerl.lab.power import mean_interval, minimum_detectable_effect

ENV = "pacerl/Search-v0"
DATA = ROOT / "envs" / "data" / "search-train.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--sft-questions", type=int, default=9600, help="training questions the SFT sees")
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=1, help="seeds trained at a time")
    parser.add_argument("--name", default="search_rl-search-v0", help="results' stem and runs' directory")
    args = parser.parse_args()
    runs = ROOT / "runs" / "experiments" / args.name
    runs.mkdir(parents=True, exist_ok=True)
    sft_tasks = runs / "sft-questions.jsonl"
    lines = DATA.read_text(encoding="utf-8").splitlines(keepends=True)[: args.sft_questions]
    sft_tasks.write_text("".join(lines), encoding="utf-8")
    model = warm_start(runs / "warm-start", ENV, args.sft_steps, {"sft.tasks": str(sft_tasks)})
    base: dict[str, Any] = {
        "model.path": str(model),
        "env.id": ENV,
        "loop.mode": "sync",
        "loop.steps": args.steps,
        "evaluation.every": 0,
        "evaluation.at_start": True,
        "evaluation.at_end": True,
        "evaluation.settings.max_tasks": args.eval_tasks,
    }
    seeds = [int(s) for s in args.seeds.split(",")]
    summaries = run_arms([Arm("sync RL", {}, seed) for seed in seeds], base, runs, args.parallel)
    done = [s for s in summaries if "error" not in s]
    gains = [s["eval_end"] - s["eval_start"] for s in done]
    for summary, gain in zip(done, gains, strict=True):
        summary["gain"] = gain
    interval = mean_interval(gains) if gains else None
    row = {
        "seeds": f"{len(done)}/{len(seeds)}",
        "eval_start": format_ci([s["eval_start"] for s in done]),
        "eval_end": format_ci([s["eval_end"] for s in done]),
        "gain": interval.text(3) if interval else "–",
        "reward": format_ci([s["mean_reward_last_quarter"] for s in done]),
        "mde": (
            f"{minimum_detectable_effect(interval.sd, interval.count, paired=True):.3f}"
            if interval and interval.count >= 2
            else "–"
        ),
    }
    table = markdown_table(
        [row],
        [
            ("seeds", "seeds"),
            ("eval_start", f"greedy acc before ({args.eval_tasks} val)"),
            ("eval_end", "after"),
            ("gain", "gain (paired)"),
            ("reward", "training reward, last quarter"),
            ("mde", "MDE of the gain at these seeds"),
        ],
    )
    columns = [
        ("seed", "seed"),
        ("steps", "steps"),
        ("eval_start", "acc before"),
        ("eval_end", "acc after"),
        ("gain", "gain"),
        ("mean_reward_last_quarter", "reward, last quarter"),
        ("wall_s", "wall s"),
    ]
    heading = (
        f"RL on the generated Search world: {args.sft_steps} SFT steps on {args.sft_questions} questions, "
        f"then {args.steps} sync RL steps (the run config's defaults), greedy accuracy on the first "
        f"{args.eval_tasks} of search-val, seeds {args.seeds}"
    )
    print(
        write_results(
            args.name, heading, "Search: greedy validation accuracy", summaries, columns, before=table
        )
    )


if __name__ == "__main__":
    main()
