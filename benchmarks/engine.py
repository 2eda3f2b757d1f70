"""Embedded engine throughput, side by side in one run.

    .venv/bin/python benchmarks/engine.py [--out benchmarks/results/engine.json]
    .venv/bin/python benchmarks/engine.py --model smollm2-135m --batch 16 --requests 32 --max-tokens 128 \
        --repeats 3 --threads 2 --out benchmarks/results/engine_smollm2.json

- decode tokens/s of the embedded engine (continuous batching, `--batch` rows, 32 by default) against
  transformers' `generate` on the same model (the tiny MoE, or `--model`: anything `load_model` takes,
  such as the shipped SmolLM2-135M), over `--requests` requests with long-tailed output lengths:
  `generate` runs static batches of `--batch`, each until its longest request is done; the engine
  refills rows as requests finish.
  Both count only the tokens each request asked for. The two run in turn `--repeats` times; the
  figures are medians (of the speeds, and of each round's ratio), with the ratio of process CPU
  times besides the wall-clock one: on a machine shared with other work it moves less;
- the cost of routed-expert capture (R3) on the engine (an MoE only);
- the cost of an interrupt-and-resume: a weight update with `--batch` requests in flight, under both
  interruption policies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pacerl.agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, load_model, parameter_count
from pacerl.agents.tokenizer import tiny_tokenizer


def workload(requests: int, seed: int = 0, longest: int = 256) -> list[tuple[list[int], int]]:
    """Prompts of 16-64 tokens and long-tailed output lengths (lognormal, 8-`longest` tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        prompt = [rng.randrange(10, 300) for _ in range(rng.randint(16, 64))]
        length = int(min(longest, max(8, rng.lognormvariate(3.4, 0.8))))
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


async def interrupt_cost(model: Any, policy: str, jobs: list[tuple[list[int], int]], batch: int) -> float:
    """Seconds a weight update takes with `batch` requests in flight."""
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_batch=batch, interrupt=policy))  # type: ignore[arg-type]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    jobs_64 = [(prompt, 64) for prompt, _ in jobs[:batch]]
    running = asyncio.get_running_loop().create_task(engine_generate(engine, jobs_64, routes=False))
    for _ in range(1_000_000):
        if len(engine._rows) == len(jobs_64) and all(len(r.tokens) >= 8 for r in engine._rows):
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
    if args.model is None:
        model = build_tiny_moe(TinyMoEConfig(), tiny_tokenizer())
    else:
        model, _ = load_model(args.model)
    batch = args.batch
    jobs = workload(args.requests, longest=args.max_tokens)
    useful = sum(n for _, n in jobs)
    hf_generate(model, jobs[:4], 4)  # warm up both paths
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_batch=batch))
    await engine_generate(engine, jobs[:4], routes=False)
    arms = ("hf", "plain", "routes") if engine.is_moe else ("hf", "plain")

    async def hf() -> None:
        hf_generate(model, jobs, batch)

    rounds: list[dict[str, tuple[float, float]]] = []
    engine_steps = 0
    for _ in range(args.repeats):
        steps = engine.steps
        runs: dict[str, Callable[[], Awaitable[Any]]] = {
            "hf": hf,
            "plain": lambda: engine_generate(engine, jobs, routes=False),
            "routes": lambda: engine_generate(engine, jobs, routes=True),
        }
        rounds.append({arm: await timed(runs[arm]()) for arm in arms})
        engine_steps = (engine.steps - steps) // (len(arms) - 1)
    await engine.aclose()

    def median(arm: str, cpu: bool = False) -> float:
        return statistics.median(r[arm][cpu] for r in rounds)

    ratios = [r["hf"][0] / r["plain"][0] for r in rounds]
    report: dict[str, Any] = {
        "model": args.model or "tiny-moe",
        "torch_threads": args.threads,
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "model_parameters": parameter_count(model),
        "batch": batch,
        "requests": len(jobs),
        "useful_tokens": useful,
        "repeats": args.repeats,
        "hf_generate_forwards": sum(
            max(n for _, n in jobs[i : i + batch]) for i in range(0, len(jobs), batch)
        ),
        "engine_forwards": engine_steps,
        "hf_generate_tok_per_s": round(useful / median("hf"), 1),
        "engine_tok_per_s": round(useful / median("plain"), 1),
        "engine_vs_hf": round(statistics.median(ratios), 2),
        "engine_vs_hf_runs": [round(ratio, 2) for ratio in ratios],
        "engine_vs_hf_cpu_time": round(statistics.median(r["hf"][1] / r["plain"][1] for r in rounds), 2),
    }
    if "routes" in arms:
        report["engine_with_routes_tok_per_s"] = round(useful / median("routes"), 1)
        report["routed_expert_capture_overhead"] = round(
            statistics.median(r["routes"][0] / r["plain"][0] - 1 for r in rounds), 3
        )
    for policy in ("reprefill", "continue"):
        seconds = await interrupt_cost(model, policy, jobs, batch)
        report[f"interrupt_{policy}_ms_{batch}_requests"] = round(1000 * seconds, 1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/engine.json")
    parser.add_argument(
        "--model",
        help="a checkpoint directory, .gguf file or shipped name (load_model); default the tiny MoE",
    )
    parser.add_argument("--batch", type=int, default=32, help="engine rows and generate's batch size")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256, help="the longest output of the long tail")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the throughput comparison")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest for the tiny model)"
    )
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
