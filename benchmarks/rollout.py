"""Rollout throughput: CodeMath episodes/s with the embedded engine and the local sandbox.

    .venv/bin/python benchmarks/rollout.py [--out benchmarks/results/rollout.json]

The tiny MoE is freshly initialised (no warm start yet), so its episodes are mostly one turn of
generation; the figure measures the driver, engine and env machinery, not a trained policy's mix of
tool calls. Groups of 8 on 16 validation tasks (128 episodes), 48 new tokens per turn at most.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pacerl.agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe
from pacerl.agents.rollout import RolloutConfig, RolloutDriver
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.envs import load_tasks
from pacerl.envs.code_math import CodeMathEnv


async def run(tasks: int, group: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # fastest for the tiny model; the sandbox gets the other core
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    engine = EmbeddedEngine(model, tokenizer, config=EmbeddedEngineConfig(max_batch=64))
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0, stop_strings=("</tool_call>",))
    config = RolloutConfig(group_size=group, sampling=sampling, max_total_tokens=768)
    driver = RolloutDriver(
        engine, tokenizer, lambda: CodeMathEnv(tasks="codemath-val"), config, num_experts=8
    )
    chosen = load_tasks("codemath-val")[:tasks]
    await driver.rollout_group(chosen[0])  # warm up
    started = time.perf_counter()
    groups = await asyncio.gather(*(driver.rollout_group(task) for task in chosen))
    elapsed = time.perf_counter() - started
    await engine.aclose()
    trajectories = [t for g in groups for t in g]
    generated = sum(t.num_model_tokens for t in trajectories)
    return {
        "episodes": len(trajectories),
        "seconds": round(elapsed, 2),
        "episodes_per_s": round(len(trajectories) / elapsed, 1),
        "generated_tokens_per_s": round(generated / elapsed, 1),
        "mean_turns": round(sum(t.num_turns for t in trajectories) / len(trajectories), 2),
        "tool_calls": sum(int(t.env_info.get("tool_calls", 0)) for t in trajectories),
        "outcomes": dict(driver.counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/rollout.json")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()
    report = asyncio.run(run(args.tasks, args.group))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
