"""Sandbox latency and throughput, every backend side by side in one run (this machine is noisy).

    .venv/bin/python benchmarks/sandbox.py [--runs N] [--out benchmarks/results/sandbox.json]

Measures one-shot `print(1+1)` latency next to a plain `python3 -I -c` start (with requests 0.1 s
apart, which find a sandbox waiting, and back to back, which race its reset), persistent-session call
latency, throughput with 1, 2 and 8 concurrent callers and the CPU each run costs there (this
process, the sandboxes' cgroups, and dockerd and containerd-shim for Docker), and a session cycle
(open, one call, close, back to back) with recycled sandboxes and with a fresh one each. The local
backend is measured twice: runs forked from its zygote, and runs in a fresh interpreter each
(`fresh_interpreter=True`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pacerl.sandbox import Sandbox

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


def throughput(sandbox: Sandbox, callers: int, seconds: float) -> tuple[float, dict[str, float]]:
    """Runs per second with `callers` concurrent callers, and the CPU milliseconds each run cost."""

    async def caller(deadline: float, counts: list[int]) -> None:
        while time.perf_counter() < deadline:
            check(await sandbox.arun(CODE))
            counts[0] += 1

    async def main() -> int:
        counts = [0]
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(caller(deadline, counts) for _ in range(callers)))
        return counts[0]

    cpu_before = cpu_seconds(sandbox)
    started = time.perf_counter()
    done = asyncio.run(main())
    elapsed = time.perf_counter() - started
    cpu = {
        key: round((value - cpu_before[key]) * 1000 / done, 2) for key, value in cpu_seconds(sandbox).items()
    }
    return round(done / elapsed, 1), cpu


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(sandbox: Sandbox) -> dict[str, float]:
    """CPU seconds so far of this process, of the sandboxes (their cgroups), and of Docker's daemons."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {"host": usage.ru_utime + usage.ru_stime}
    backend = sandbox._backend
    if sandbox.backend_name == "local" and backend._cgroups is not None:
        out["sandboxes"] = int((backend._cgroups.folders["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
    elif sandbox.backend_name == "docker":
        # Every container's cgroup on this host (the parent counts removed ones too).
        parent = Path("/sys/fs/cgroup/cpuacct/docker/cpuacct.usage")
        if parent.exists():
            out["sandboxes"] = int(parent.read_text()) / 1e9
        for name in ("dockerd", "containerd-shim"):
            out[name] = 0.0
            for stat in Path("/proc").glob("[0-9]*/stat"):
                with contextlib.suppress(OSError):
                    text = stat.read_text()
                    if text[text.index("(") + 1 : text.rindex(")")] == name:
                        fields = text.rsplit(")", 1)[1].split()
                        out[name] += (int(fields[11]) + int(fields[12])) / _TICKS
    return out


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
        out["throughput_runs_per_s"] = {}
        for callers in (1, 2, 8):
            out["throughput_runs_per_s"][str(callers)], cpu = throughput(sandbox, callers, 4.0)
        out["cpu_ms_per_run_8_callers"] = cpu
        out["recycled"] = getattr(sandbox._backend, "recycled", None)
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
    # Each run in an interpreter of its own (its own hash secret and layout): an interpreter start per run.
    report["local_bwrap_fresh_interpreter"] = bench_backend("local", args.runs, fresh_interpreter=True)
    with Sandbox("local", warm_pool=0) as cold:
        report["local_bwrap_cold"] = {"oneshot": timed(lambda: check(cold.run(CODE)), args.runs // 2)}
    report["local_unshare"] = bench_backend("local", args.runs, isolation="unshare")
    report["session_cycle"] = {
        "local_bwrap": session_cycle(args.session_cycles),
        "local_unshare": session_cycle(args.session_cycles, isolation="unshare"),
    }
    try:
        from pacerl.sandbox.image import ensure_image

        report["docker"] = bench_backend("docker", args.runs, image=ensure_image())
    except Exception as error:  # no daemon here: say so in the report instead of failing the rest
        report["docker"] = {"unavailable": f"{type(error).__name__}: {error}"}
    plain = report["plain_python3_-I_-c"]["p50_ms"]
    report["ratios_vs_plain_p50"] = {
        key: round(report[key]["oneshot_idle_arrivals"]["p50_ms"] / plain, 2)
        for key in ("local_bwrap", "local_bwrap_fresh_interpreter", "local_unshare", "docker")
        if "oneshot_idle_arrivals" in report[key]
    } | {
        f"{key}_back_to_back": round(report[key]["oneshot_back_to_back"]["p50_ms"] / plain, 2)
        for key in ("local_bwrap", "local_bwrap_fresh_interpreter", "local_unshare", "docker")
        if "oneshot_back_to_back" in report[key]
    }
    local = report["local_bwrap"]["throughput_runs_per_s"]["8"]
    report["throughput_vs_local_8_callers"] = {
        key: round(report[key]["throughput_runs_per_s"]["8"] / local, 2)
        for key in ("local_bwrap_fresh_interpreter", "local_unshare", "docker")
        if "throughput_runs_per_s" in report[key]
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
