"""Rollout throughput of `runtime = "ray"` against the local runtime on this machine, and what the actor
hops cost per rollout.

    .venv/bin/python benchmarks/ray.py [--out benchmarks/results/ray.json]

Episodes of pacerl/Math-v0 (one turn, no tool) with the run config's default rollout settings (groups
of 8, at most 40 new tokens, T = 0.7), played by the freshly initialised tiny MoE: 16 tasks, so 128
trajectories per repetition, every group in flight at once. The arms get the same torch threads in
all (`--threads`):

- `local`: one embedded engine in this process, the envs in this process.
- `ray_1`, `ray_2`: `RayRuntime` with 1 and 2 engine replicas (the threads split between them), one
  environment worker, the trainer actor idle; on a cluster of `--threads` + 2 logical CPUs.

Throughput figures are medians of `--repeats`. The hops: the median latency of a 1-token generation
through the router against the engine called in process, and of a one-step env episode (made, reset,
stepped, closed) through a `RemoteEnv`, whose step starts the episode on the worker, against a local
env; a one-turn rollout pays one of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# This file is named ray.py: its own folder must not shadow the ray package.
sys.path.remove(str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import Engine, SamplingParams
from pacerl.agents.models import moe_info
from pacerl.agents.rollout import EpisodeEnv, RolloutDriver
from pacerl.assembly import build_twin, env_factory, load_policy, training_tasks
from pacerl.config import RunConfig, load_config
from pacerl.envs import Task
from pacerl.ray_runtime.runtime import RayRuntime, RaySettings

ACTION = "The answer is \\boxed{6}"


async def throughput(
    engine: Engine,
    make_env: Callable[[], EpisodeEnv],
    config: RunConfig,
    tokenizer: Any,
    tasks: list[Task],
    repeats: int,
    num_experts: int,
) -> dict[str, float]:
    driver = RolloutDriver(engine, tokenizer, make_env, config.rollout, num_experts=num_experts)
    await driver.rollout_group(tasks[0])  # warm-up
    per_s, tokens_per_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        groups = await asyncio.gather(*(driver.rollout_group(task) for task in tasks))
        elapsed = time.perf_counter() - started
        trajectories = [t for group in groups for t in group]
        per_s.append(len(trajectories) / elapsed)
        tokens_per_s.append(sum(t.num_model_tokens for t in trajectories) / elapsed)
    return {
        "trajectories_per_s": round(statistics.median(per_s), 1),
        "generated_tokens_per_s": round(statistics.median(tokens_per_s), 1),
    }


async def hops(
    engine: Engine, make_env: Callable[[], EpisodeEnv], prompt: list[int], task: Task, samples: int
) -> dict[str, float]:
    """Median latency (ms) of one 1-token generation, and of one env episode of one step (made, reset,
    stepped, closed)."""
    one = SamplingParams(max_new_tokens=1, temperature=0.7)
    generate, step = [], []
    for i in range(samples):
        started = time.perf_counter()
        await engine.generate(prompt, one, session=f"hop-{i}")
        generate.append(time.perf_counter() - started)
        started = time.perf_counter()
        env = make_env()
        env.reset(options={"task": task})
        await env.astep(ACTION)
        env.close()
        step.append(time.perf_counter() - started)
    return {
        "generate_ms": round(1000 * statistics.median(generate), 2),
        "env_episode_ms": round(1000 * statistics.median(step), 2),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    config = load_config(None, ["env.id=pacerl/Math-v0", f"seed={args.seed}"])
    model, tokenizer = load_policy(config)
    num_experts = moe_info(model).num_experts
    make_env = env_factory(config)
    tasks = training_tasks(make_env)[: args.tasks]
    prompt = tokenizer.encode(tasks[0].question)
    arms: dict[str, Any] = {}

    engine = EmbeddedEngine(build_twin(model), tokenizer, config.engine)
    arms["local"] = await throughput(engine, make_env, config, tokenizer, tasks, args.repeats, num_experts)
    local_hops = await hops(engine, make_env, prompt, tasks[0], args.samples)
    await engine.aclose()

    ray.init(num_cpus=args.threads + 2, include_dashboard=False, log_to_driver=False)
    try:
        for replicas in (1, 2):
            overrides = [
                "runtime=ray",
                f"ray.num_engine_replicas={replicas}",
                "ray.num_env_workers=1",
                f"ray.engine_cpus={args.threads / replicas}",
            ]
            ray_config = load_config(None, ["env.id=pacerl/Math-v0", f"seed={args.seed}", *overrides])
            with tempfile.TemporaryDirectory() as run_dir:
                started = time.perf_counter()
                runtime = RayRuntime(RaySettings.of(ray_config), Path(run_dir), model, tokenizer, make_env)
                start_s = time.perf_counter() - started
                try:
                    arm = await throughput(
                        runtime.engine,
                        runtime.make_env,
                        ray_config,
                        tokenizer,
                        tasks,
                        args.repeats,
                        num_experts,
                    )
                    arm["start_s"] = round(start_s, 1)
                    if replicas == 1:
                        ray_hops = await hops(
                            runtime.engine, runtime.make_env, prompt, tasks[0], args.samples
                        )
                finally:
                    await runtime.release()
            arms[f"ray_{replicas}"] = arm
    finally:
        ray.shutdown()
    overhead = {
        "generate_hop_ms": round(ray_hops["generate_ms"] - local_hops["generate_ms"], 2),
        "env_hop_ms": round(ray_hops["env_episode_ms"] - local_hops["env_episode_ms"], 2),
    }
    overhead["per_one_turn_rollout_ms"] = round(overhead["generate_hop_ms"] + overhead["env_hop_ms"], 2)
    return {
        "machine": {"cpu_count": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2)},
        "threads": args.threads,
        "trajectories_per_repeat": args.tasks * config.rollout.group_size,
        "repeats": args.repeats,
        "throughput": arms,
        "ray_vs_local": {
            name: round(arm["trajectories_per_s"] / arms["local"]["trajectories_per_s"], 2)
            for name, arm in arms.items()
            if name != "local"
        },
        "latency": {"local": local_hops, "ray": ray_hops},
        "hop_overhead": overhead,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/ray.json")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=50, help="calls per hop latency")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report = asyncio.run(measure(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
