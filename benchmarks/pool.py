"""PACE selection time against pool size: `TrajectoryPool.select` with the `pace` filter (trainer/pool.py).

    .venv/bin/python benchmarks/pool.py [--out benchmarks/results/pool.json]

Pools of 1,000 and 10,000 trajectories (groups of 8, so 125 and 1,250 groups), and 80,000 (10,000
groups). Each trajectory has about 60 tokens: a 24-token prompt, a 14-token model turn, an 8-token tool
response and a 14-token model turn; versions vary so that about half the trajectories span more than
one version (GS > 0) and completions trail v_now by 0-3 versions. Two timings per size, each the median
of `--repeats` selects of 16 groups:

- `cached`: every drift score already cached at v_now (`refresh_drift`, untimed): the ranking itself;
- `scored`: a new trainer version on every repetition, so select hands every member to a trivial
  drift scorer that returns random floats: the pool's side of re-scoring, without the forward pass.

P* is one batch below the pool's size and β = 0, so every select rejects exactly 16 groups (K_t = 16)
and draws 16. After each timed select the drawn and rejected groups are re-added (untimed), so every
repetition sees the same pool. `select_ms_*` is the median wall-clock time, `*_min` the fastest
repetition and `select_cpu_ms_*` the median process CPU time, steadier than wall-clock on a shared
machine (the run records the load average and core count it saw). The target is under 10 ms at
10,000 trajectories.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pacerl.agents.trajectory import Status, Trajectory
from pacerl.trainer.pool import FilterConfig, PaceSettings, TrajectoryPool

GROUP = 8
BATCH_GROUPS = 16
V_NOW = 100


def make_groups(count: int, seed: int) -> list[list[Trajectory]]:
    """`count` finished groups of `GROUP` trajectories of 60 tokens with varied versions."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(count):
        members = []
        for i in range(GROUP):
            v_done = V_NOW - int(rng.integers(0, 4))
            first = v_done - int(rng.choice([0, 0, 0, 1, 2, 3]))  # half the turns start at v_done
            second = int(rng.integers(first, v_done + 1))
            t = Trajectory.start(f"g{g}/{i}", f"g{g}", f"task{g}", list(range(24)))
            for turn, version in enumerate((first, second)):
                if turn:
                    t.append_tool(list(range(8)))
                t.append_model(
                    list(range(14)),
                    -rng.random(14),
                    version=version,
                    started_at=0.0,
                    ended_at=1.0,
                    finish_reason="stop",
                )
            t.finish(Status.COMPLETED, reason="", reward=1.0, completed_version=v_done, completed_at=1.0)
            members.append(t)
        groups.append(members)
    return groups


def random_drift(batch: Sequence[Trajectory]) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.random.default_rng(len(batch)).random(len(batch))


def cached_only(batch: Sequence[Trajectory]) -> list[float]:
    raise RuntimeError(f"the cache should cover every member, yet {len(batch)} were sent for scoring")


def measure(groups: list[list[Trajectory]], repeats: int, scored: bool) -> dict[str, float]:
    """Median select time (ms) over `repeats`, on a pool refilled to the same size after each one."""
    # β = 0 and P* one batch below the pool: K_t = ceil((B/P)·P) = B on every repetition, so each one
    # does the same work (B groups rejected, B drawn) instead of following the EMA's warm-up.
    config = FilterConfig(name="pace", pace=PaceSettings(target_groups=len(groups) - BATCH_GROUPS, ema=0.0))
    pool = TrajectoryPool(config)
    started = time.perf_counter()
    for group in groups:
        pool.add_group(group)
    add_s = time.perf_counter() - started
    by_id = {group[0].group_id: group for group in groups}
    samples, cpu_samples, rejected, sent = [], [], [], []
    for repeat in range(repeats + 1):  # the first is a warm-up
        v_now = V_NOW + repeat if scored else V_NOW
        if not scored:
            pool.refresh_drift(v_now, random_drift)
        before_rejected, before_sent = sum(pool.rejections.values()), pool.counts["drift_scored"]
        started, cpu_started = time.perf_counter(), time.process_time()
        batch = pool.select(BATCH_GROUPS, v_now, random_drift if scored else cached_only)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        if len(batch) != BATCH_GROUPS:
            raise RuntimeError(f"drew {len(batch)} groups, expected {BATCH_GROUPS}")
        if repeat:
            samples.append(elapsed * 1e3)
            cpu_samples.append(cpu * 1e3)
            rejected.append(sum(pool.rejections.values()) - before_rejected)
            sent.append(pool.counts["drift_scored"] - before_sent)
        for group_id, group in by_id.items():
            if group_id not in pool:
                pool.add_group(group)
    return {
        "median_ms": round(statistics.median(samples), 3),
        "min_ms": round(min(samples), 3),
        "cpu_median_ms": round(statistics.median(cpu_samples), 3),
        "rejected_groups_per_select": round(statistics.mean(rejected), 1),
        "scored_per_select": round(statistics.mean(sent), 1),
        "add_us_per_trajectory": round(add_s / (len(groups) * GROUP) * 1e6, 2),
    }


def run(sizes: list[int], repeats: int) -> dict[str, Any]:
    pools = []
    for trajectories in sizes:
        groups = make_groups(trajectories // GROUP, seed=trajectories)
        stale = sum(t.generation_staleness() > 0 for group in groups for t in group)
        cached = measure(groups, repeats, scored=False)
        scored = measure(groups, repeats, scored=True)
        pools.append(
            {
                "trajectories": trajectories,
                "groups": len(groups),
                "trajectories_with_gs": stale,
                "select_ms_cached": cached["median_ms"],
                "select_ms_cached_min": cached["min_ms"],
                "select_cpu_ms_cached": cached["cpu_median_ms"],
                "select_ms_scored": scored["median_ms"],
                "select_ms_scored_min": scored["min_ms"],
                "select_cpu_ms_scored": scored["cpu_median_ms"],
                "scored_per_select": scored["scored_per_select"],
                "rejected_groups_per_select": cached["rejected_groups_per_select"],
                "add_us_per_trajectory": cached["add_us_per_trajectory"],
            }
        )
    at_10k = [p["select_ms_cached"] for p in pools if p["trajectories"] == 10_000]
    return {
        "filter": "pace",
        "group_size": GROUP,
        "tokens_per_trajectory": 60,
        "batch_groups": BATCH_GROUPS,
        "pace.target_groups": "pool groups - batch_groups (beta = 0: 16 rejected per select)",
        "repetitions": repeats,
        "pools": pools,
        "cpus": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "target_ms_at_10k": 10.0,
        "meets_target_at_10k": bool(at_10k) and at_10k[0] < 10.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/pool.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 80_000])
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    if args.repeats < 20:
        parser.error("--repeats must be >= 20")
    report = run(args.sizes, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
