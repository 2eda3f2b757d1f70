"""Embedded engine throughput, side by side in one run.

    .venv/bin/python benchmarks/engine.py [--out benchmarks/results/engine.json]

- decode tokens/s of the embedded engine (continuous batching, 32 rows) against transformers'
  `generate` on the same tiny MoE, over 128 requests with long-tailed output lengths: `generate` runs
  batches of 32, each until its longest request is done; the engine refills rows as requests finish.
  Both count only the tokens each request asked for. The two run in turn `--repeats` times; the
  figures are medians (of the speeds, and of each round's ratio), with the ratio of process CPU
  times besides the wall-clock one: on a machine shared with other work it moves less;
- the cost of routed-expert capture (R3) on the engine;
- the cost of an interrupt-and-resume: a weight update with 32 requests in flight, under both
  interruption policies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.engine import EmbeddedEngine, EmbeddedEngineConfig, SamplingParams
from agents.models import TinyMoEConfig, build_tiny_moe, parameter_count
from agents.tokenizer import tiny_tokenizer


def workload(requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts of 16-64 tokens and long-tailed output lengths (lognormal, 8-256 tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        prompt = [rng.randrange(10, 300) for _ in range(rng.randint(16, 64))]
        length = int(min(256, max(8, rng.lognormvariate(3.4, 0.8))))
        out.append((prompt, length))
    return out


def hf_generate(model: Any, jobs: list[tuple[list[int], int]], batch: int) -> float:
    """Seconds for transformers' generate over `jobs` in static batches (left padding)."""
    pad = int(model.config.pad_token_id)
    started = time.perf_counter()
    for first in range(0, len(jobs), batch):
        chunk = jobs[first : first + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        steps = max(n for _, n in chunk)
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            pad_token_id=pad,
        )  # fmt: skip
    return time.perf_counter() - started


async def engine_generate(engine: EmbeddedEngine, jobs: list[tuple[list[int], int]], routes: bool) -> float:
    started = time.perf_counter()
    await asyncio.gather(
        *(
            engine.generate(
                p,
                SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True),
                return_routed_experts=routes,
            )
            for p, n in jobs
        )
    )
    return time.perf_counter() - started


async def interrupt_cost(model: Any, policy: str, jobs: list[tuple[list[int], int]]) -> float:
    """Seconds a weight update takes with 32 requests in flight."""
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_batch=32, interrupt=policy))  # type: ignore[arg-type]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    jobs_64 = [(prompt, 64) for prompt, _ in jobs[:32]]
    running = asyncio.get_running_loop().create_task(engine_generate(engine, jobs_64, routes=False))
    for _ in range(1_000_000):
        if len(engine._rows) == 32 and all(len(r.tokens) >= 8 for r in engine._rows):  # ignore_eos: all stay
            break
        await asyncio.sleep(0)
    started = time.perf_counter()
    await engine.update_weights(state, version=1)
    elapsed = time.perf_counter() - started
    await running
    await engine.aclose()
    return elapsed


async def timed(run: Any) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of awaiting `run`."""
    cpu, wall = time.process_time(), time.perf_counter()
    await run
    return time.perf_counter() - wall, time.process_time() - cpu


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    jobs = workload(args.requests)
    useful = sum(n for _, n in jobs)
    hf_generate(model, jobs[:4], 4)  # warm up both paths
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_batch=32))
    await engine_generate(engine, jobs[:4], routes=False)

    async def hf() -> None:
        hf_generate(model, jobs, 32)

    rounds: list[dict[str, tuple[float, float]]] = []
    engine_steps = 0
    for _ in range(args.repeats):
        steps = engine.steps
        rounds.append(
            {
                "hf": await timed(hf()),
                "plain": await timed(engine_generate(engine, jobs, routes=False)),
                "routes": await timed(engine_generate(engine, jobs, routes=True)),
            }
        )
        engine_steps = (engine.steps - steps) // 2
    await engine.aclose()

    def median(arm: str, cpu: bool = False) -> float:
        return statistics.median(r[arm][cpu] for r in rounds)

    ratios = [r["hf"][0] / r["plain"][0] for r in rounds]
    return {
        "torch_threads": args.threads,
        "model_parameters": parameter_count(model),
        "requests": len(jobs),
        "useful_tokens": useful,
        "repeats": args.repeats,
        "hf_generate_forwards": sum(max(n for _, n in jobs[i : i + 32]) for i in range(0, len(jobs), 32)),
        "engine_forwards": engine_steps,
        "hf_generate_tok_per_s": round(useful / median("hf"), 1),
        "engine_tok_per_s": round(useful / median("plain"), 1),
        "engine_vs_hf": round(statistics.median(ratios), 2),
        "engine_vs_hf_runs": [round(ratio, 2) for ratio in ratios],
        "engine_vs_hf_cpu_time": round(statistics.median(r["hf"][1] / r["plain"][1] for r in rounds), 2),
        "engine_with_routes_tok_per_s": round(useful / median("routes"), 1),
        "routed_expert_capture_overhead": round(
            statistics.median(r["routes"][0] / r["plain"][0] - 1 for r in rounds), 3
        ),
        "interrupt_reprefill_ms_32_requests": round(1000 * await interrupt_cost(model, "reprefill", jobs), 1),
        "interrupt_continue_ms_32_requests": round(1000 * await interrupt_cost(model, "continue", jobs), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/engine.json")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the throughput comparison")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest for a tiny model)"
    )
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
