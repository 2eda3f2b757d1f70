"""Environment overheads, side by side in one run.

    .venv/bin/python benchmarks/envs.py [--out benchmarks/results/envs.json]

- step overhead without a tool: a step whose call names an unknown tool (parse, dispatch, error
  observation, bookkeeping) through the sync `step` and the async `astep`; and a final-answer step
  including the math-verify check;
- parser throughput on realistic assistant messages;
- CodeMath episodes/s with a scripted policy (one python call, then the boxed answer) against the
  local sandbox, sequential and with 8 episodes in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pacerl.envs import Task, ToolEnvConfig, load_tasks, parse_actions
from pacerl.envs.code_math import CodeMathEnv

UNKNOWN_TOOL = '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>'
MESSAGES = [
    'Let me compute.\n<tool_call>{"name": "python", "arguments": {"code": "print(482 * 93)"}}</tool_call>',
    "I will use code.\n```python\nx = 482 * 93\nprint(x)\n```\n",
    "The product is 44826, so the answer is \\boxed{44826}.",
    "Thinking... " * 40 + '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>' * 2,
]


def per_call_us(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": round(statistics.median(ordered) * 1e6, 1),
        "p90_us": round(ordered[int(0.9 * len(ordered))] * 1e6, 1),
    }


def step_overhead(steps: int) -> dict[str, Any]:
    task = Task("t", "What is 2 * 3?", ("6",))
    env = CodeMathEnv(
        tasks=[task], config=ToolEnvConfig(max_turns=10**9, max_tool_calls=10**9, max_context_chars=10**12)
    )
    env.reset()
    sync, asynchronous, final = [], [], []
    for _ in range(steps):
        started = time.perf_counter()
        env.step(UNKNOWN_TOOL)
        sync.append(time.perf_counter() - started)

    async def async_steps() -> None:
        for _ in range(steps):
            started = time.perf_counter()
            await env.astep(UNKNOWN_TOOL)
            asynchronous.append(time.perf_counter() - started)

    asyncio.run(async_steps())
    for _ in range(steps // 10):
        env.reset()
        started = time.perf_counter()
        env.step("\\boxed{6}")
        final.append(time.perf_counter() - started)
    env.close()
    return {
        "step_unknown_tool_sync": per_call_us(sync),
        "astep_unknown_tool": per_call_us(asynchronous),
        "step_final_answer_with_math_verify": per_call_us(final),
    }


def parser_throughput(seconds: float = 2.0) -> dict[str, float]:
    count, chars = 0, 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for message in MESSAGES:
            parse_actions(message)
            count += 1
            chars += len(message)
    return {"messages_per_s": round(count / seconds), "mb_per_s": round(chars / seconds / 1e6, 2)}


def codemath_episodes(episodes: int, concurrency: int) -> dict[str, float]:
    tasks = load_tasks("codemath-val")[:episodes]

    async def play(task: Task, gate: asyncio.Semaphore) -> float:
        async with gate:
            env = CodeMathEnv(tasks=[task])
            env.reset()
            expression = task.question.removeprefix("What is ").removesuffix("?")
            call = json.dumps({"name": "python", "arguments": {"code": f"print({expression})"}})
            observation, *_ = await env.astep(f"<tool_call>{call}</tool_call>")
            _, reward, *_ = await env.astep(f"\\boxed{{{observation[0]['content']}}}")
            env.close()
            return reward

    async def main() -> list[float]:
        gate = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(play(task, gate) for task in tasks))

    asyncio.run(main())  # warm the sandbox pool and the imports
    started = time.perf_counter()
    rewards = asyncio.run(main())
    elapsed = time.perf_counter() - started
    if sum(rewards) != len(rewards):
        raise RuntimeError("the scripted policy should solve every task")
    return {
        "episodes": len(tasks),
        "concurrency": concurrency,
        "episodes_per_s": round(len(tasks) / elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/envs.json")
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    report: dict[str, Any] = {"step_overhead": step_overhead(args.steps), "parser": parser_throughput()}
    report["codemath_sequential"] = codemath_episodes(40, 1)
    report["codemath_concurrent"] = codemath_episodes(80, 8)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
