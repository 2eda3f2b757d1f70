"""Sandbox latency and throughput, every backend side by side in one run (this machine is noisy).

    .venv/bin/python benchmarks/sandbox.py [--runs N] [--out benchmarks/results/sandbox.json]

Measures one-shot `print(1+1)` latency next to a plain `python3 -I -c` start, persistent-session
call latency, throughput with 1, 2 and 8 concurrent callers, Docker warm exec latency, and a session
cycle (open, one call, close, back to back) with recycled sandboxes and with a fresh one each.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import Sandbox

CODE = "print(1+1)"


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": round(pick(0.5) * 1000, 2), "p90_ms": round(pick(0.9) * 1000, 2), "n": len(samples)}


def timed(call: Callable[[], object], runs: int, gap_s: float = 0.0) -> dict[str, float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
        if gap_s:
            time.sleep(gap_s)
    return percentiles(samples)


def plain_python() -> None:
    subprocess.run(["/usr/bin/python3", "-I", "-c", CODE], capture_output=True, check=True)


def check(result: Any) -> None:
    if result.stdout != "2\n":
        raise RuntimeError(f"benchmark run failed: {result}")


def throughput(sandbox: Sandbox, callers: int, seconds: float) -> float:
    async def caller(deadline: float, counts: list[int]) -> None:
        while time.perf_counter() < deadline:
            check(await sandbox.arun(CODE))
            counts[0] += 1

    async def main() -> int:
        counts = [0]
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(caller(deadline, counts) for _ in range(callers)))
        return counts[0]

    started = time.perf_counter()
    done = asyncio.run(main())
    return round(done / (time.perf_counter() - started), 1)


def session_cycle(runs: int, **options: Any) -> dict[str, Any]:
    """Open a session, make one call, close it; back to back, as RL episodes do."""

    def cycle(sandbox: Sandbox) -> None:
        with sandbox.session() as session:
            check(session.run(CODE))

    out: dict[str, Any] = {}
    for label, recycle in (("recycled", True), ("fresh_sandbox_each", False)):
        with Sandbox("local", recycle_sessions=recycle, **options) as sandbox:
            cycle(sandbox)
            time.sleep(0.5)
            started = time.perf_counter()
            out[label] = timed(functools.partial(cycle, sandbox), runs)
            out[label]["sessions_per_s"] = round(runs / (time.perf_counter() - started), 1)
            out[label]["recycled"] = getattr(sandbox._backend, "recycled", None)
    return out


def bench_backend(name: str, runs: int, idle_gap_s: float = 0.1, **options: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"idle_gap_s": idle_gap_s}
    with Sandbox(name, **options) as sandbox:
        check(sandbox.run(CODE))
        time.sleep(max(0.5, 2 * idle_gap_s))
        # Requests arriving with idle gaps find a warm sandbox ready (the gap lets the pool refill:
        # a container takes longer to start than a bubblewrap sandbox); back-to-back ones race it.
        out["oneshot_idle_arrivals"] = timed(lambda: check(sandbox.run(CODE)), runs, gap_s=idle_gap_s)
        out["oneshot_back_to_back"] = timed(lambda: check(sandbox.run(CODE)), runs)
        with sandbox.session() as session:
            session.run("x = 1")
            out["session_call"] = timed(lambda: session.run("x + 1"), runs * 2)
        out["throughput_runs_per_s"] = {str(c): throughput(sandbox, c, 4.0) for c in (1, 2, 8)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/sandbox.json")
    parser.add_argument("--session-cycles", type=int, default=200)
    parser.add_argument("--only-session-cycle", action="store_true", help="skip every other case")
    args = parser.parse_args()

    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "code": CODE,
    }
    if args.only_session_cycle:
        report["session_cycle"] = {
            "local_bwrap": session_cycle(args.session_cycles),
            "local_unshare": session_cycle(args.session_cycles, isolation="unshare"),
        }
        print(json.dumps(report, indent=2))
        return
    report["plain_python3_-I_-c"] = timed(plain_python, args.runs)
    report["local_bwrap"] = bench_backend("local", args.runs)
    with Sandbox("local", warm_pool=0) as cold:
        report["local_bwrap_cold"] = {"oneshot": timed(lambda: check(cold.run(CODE)), args.runs // 2)}
    report["local_unshare"] = bench_backend("local", args.runs, isolation="unshare")
    report["session_cycle"] = {
        "local_bwrap": session_cycle(args.session_cycles),
        "local_unshare": session_cycle(args.session_cycles, isolation="unshare"),
    }
    try:
        from sandbox.image import ensure_image

        report["docker"] = bench_backend("docker", args.runs // 2, idle_gap_s=0.8, image=ensure_image())
    except Exception as error:  # no daemon here: say so in the report instead of failing the rest
        report["docker"] = {"unavailable": f"{type(error).__name__}: {error}"}
    plain = report["plain_python3_-I_-c"]["p50_ms"]
    report["ratios_vs_plain_p50"] = {
        key: round(report[key]["oneshot_idle_arrivals"]["p50_ms"] / plain, 2)
        for key in ("local_bwrap", "local_unshare", "docker")
        if "oneshot_idle_arrivals" in report[key]
    } | {
        "local_bwrap_back_to_back": round(report["local_bwrap"]["oneshot_back_to_back"]["p50_ms"] / plain, 2)
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
