"""Both HTTP servers under a hostile mix of requests, on 127.0.0.1 only (issue 13, item 7).

    .venv/bin/python benchmarks/servers_load.py [--out benchmarks/results/servers_load.json]

Starts `pacerl serve sandbox` (local backend) and `pacerl serve retriever` (the shipped corpus) as
subprocesses with their default limits, then throws at each, all at once, a bounded storm:

- sandbox: eight concurrent valid 47 MB requests (files and stdin near their caps: the issue's
  2.4 GB case), eight declaring a 20-digit Content-Length (about 1e20), two chunked bodies streamed past
  the cap, `--slowloris` connections that never finish their headers, slow bodies that trickle, and a
  small legitimate run in the middle of it all;
- retriever: eight concurrent maximal requests (every default cap at once), the issue's old maximal
  request (10,000 queries of 8,192 characters: over the body cap now), one request over each
  per-request cap, a 1e20 Content-Length, slow-loris connections and slow bodies, and a small query.

For each server it records the resident memory of the server process (sampled every 10 ms: before,
peak, and `--settle` seconds after the last answer), and each kind of request's answers by status
(or by how the connection ended) with their times. Every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pacerl.envs.retriever import RetrieverLimits
from pacerl.envs.tasks import DATA_DIR
from pacerl.sandbox.server import GUARD as SANDBOX_GUARD

CORPUS = DATA_DIR / "search-corpus.jsonl"
MIB = 1024 * 1024
STORM_LIMIT_S = 240.0
"""No request of the storm is waited for longer than this (the longest server timeout is 30 s)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start(argv: list[str], port: int, probe: str, log: Path) -> subprocess.Popen[bytes]:
    """`pacerl <argv> --port port` on 127.0.0.1, once `probe` answers."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "pacerl.cli", *argv, "--host", "127.0.0.1", "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()}")
        try:
            httpx.get(f"http://127.0.0.1:{port}{probe}", timeout=1).raise_for_status()
            return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"{argv[:2]} did not start within 120 s")


class MemoryProbe:
    """The resident memory of one process, sampled every 10 ms on a thread."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def rss(self) -> int:
        rss: int = self.process.memory_info().rss
        return rss

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> MemoryProbe:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


Outcome = tuple[str, float]
"""(an HTTP status, or how the connection ended: "closed_by_server", "reset", "no_answer"), seconds."""


async def timed(attempt: Callable[[], Awaitable[str]]) -> Outcome:
    started = time.perf_counter()
    try:
        outcome = await asyncio.wait_for(attempt(), STORM_LIMIT_S)
    except TimeoutError:
        outcome = "no_answer"
    except (ConnectionResetError, BrokenPipeError, httpx.ReadError, httpx.WriteError):
        outcome = "reset"
    return outcome, time.perf_counter() - started


async def http_post(client: httpx.AsyncClient, url: str, **request: Any) -> str:
    return str((await client.post(url, **request)).status_code)


async def raw(port: int, data: bytes, trickle: bytes = b"", every_s: float = 0.5) -> str:
    """Send `data`, then `trickle` a byte at a time every `every_s` (bounded by its length), reading
    whatever comes back: the status of the answer, or "closed_by_server" if it closes unanswered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        answer = asyncio.ensure_future(reader.read(65536))
        for byte in trickle:
            done, _ = await asyncio.wait({answer}, timeout=every_s)
            if done:
                break
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except (ConnectionResetError, BrokenPipeError):
                break  # the server closed: what it sent before, if anything, is in `answer`
        try:
            first = await answer
        except ConnectionResetError:
            first = b""
        return first.split(b" ", 2)[1].decode() if first else "closed_by_server"
    finally:
        writer.close()


def post_head(path: str, content_length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    ).encode()


def slowloris(port: int, path: str, count: int) -> list[Awaitable[Outcome]]:
    """`count` connections that send part of their headers, then a byte every 0.5 s (at most 120)."""
    partial = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
    return [timed(lambda: raw(port, partial, trickle=b"x" * 120)) for _ in range(count)]


def slow_bodies(port: int, path: str, count: int) -> list[Awaitable[Outcome]]:
    """`count` requests declaring 100 body bytes and sending one every 0.5 s (at most 100)."""
    return [timed(lambda: raw(port, post_head(path, 100), trickle=b"{" + b" " * 99)) for _ in range(count)]


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    by_status: dict[str, list[float]] = collections.defaultdict(list)
    for status, seconds in outcomes:
        by_status[status].append(seconds)
    return {
        status: {
            "count": len(times),
            "median_s": round(statistics.median(times), 3),
            "max_s": round(max(times), 3),
        }
        for status, times in sorted(by_status.items())
    }


async def storm(kinds: dict[str, list[Awaitable[Outcome]]]) -> dict[str, Any]:
    """Run every kind of request at once; their answers by status, per kind."""
    names = [name for name, attempts in kinds.items() for _ in attempts]
    outcomes = await asyncio.gather(*(attempt for attempts in kinds.values() for attempt in attempts))
    grouped: dict[str, list[Outcome]] = collections.defaultdict(list)
    for name, outcome in zip(names, outcomes, strict=True):
        grouped[name].append(outcome)
    return {name: summary(grouped[name]) for name in kinds}


def sandbox_storm(port: int, slowloris_count: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/run_code"
    rng = random.Random(7)
    # 47 MB in all: 24 MiB of file bytes (32 MiB as base64) and 15 MiB of stdin, as in the issue.
    blob = base64.b64encode(rng.randbytes(24 * MIB)).decode()
    big = json.dumps({
        "code": "import os, sys\nprint(os.path.getsize('blob.bin'), len(sys.stdin.read()))",
        "language": "python",
        "files": {"blob.bin": blob},
        "stdin": "x" * (15 * MIB),
    }).encode()  # fmt: skip
    over_cap = SANDBOX_GUARD.max_body_bytes + MIB

    async def streamed() -> AsyncIterator[bytes]:
        yield b'{"code": "'
        for _ in range(over_cap // MIB):
            yield b"#" * MIB
        yield b'", "language": "python"}'

    async def run() -> dict[str, Any]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=STORM_LIMIT_S, limits=limits) as client:
            json_headers = {"content-type": "application/json"}
            small = {"code": "print(6 * 7)", "language": "python"}

            async def legit_in_the_middle() -> str:
                await asyncio.sleep(1.0)  # once the storm is under way
                return await http_post(client, url, json=small)

            return await storm({
                "valid_47MB_x8": [timed(lambda: http_post(client, url, content=big, headers=json_headers))
                                  for _ in range(8)],
                "content_length_1e20_x8": [timed(lambda: raw(port, post_head("/run_code", 10**20 - 1)))
                                           for _ in range(8)],
                "chunked_past_the_cap_x2": [timed(lambda: http_post(client, url, content=streamed(),
                                                                    headers=json_headers)) for _ in range(2)],
                f"slowloris_x{slowloris_count}": slowloris(port, "/run_code", slowloris_count),
                "slow_body_x20": slow_bodies(port, "/run_code", 20),
                "small_run_during_the_storm": [timed(legit_in_the_middle)],
            })  # fmt: skip

    return asyncio.run(run())


def maximal_body(limits: RetrieverLimits, seed: int) -> bytes:
    """A request at every cap of `limits` at once: the most queries, each of the most characters, made
    of corpus words (so every term scores), and the most hits."""
    rng = random.Random(seed)
    vocabulary = sorted({
        word
        for line in CORPUS.read_text().splitlines()
        for word in json.loads(line)["contents"].replace('"', " ").replace(".", " ").split()
    })  # fmt: skip

    def query() -> str:
        words: list[str] = []
        while sum(len(word) + 1 for word in words) < limits.max_query_chars:
            words.append(rng.choice(vocabulary))
        return " ".join(words)[: limits.max_query_chars]

    queries = [query() for _ in range(limits.max_queries)]
    topk = limits.max_hits // limits.max_queries
    return json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode()


def retriever_storm(port: int, slowloris_count: int, limits: RetrieverLimits) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/retrieve"
    topk = limits.max_hits // limits.max_queries
    maximal = maximal_body(limits, seed=11)
    old_maximal = json.dumps({"queries": ["Kaloter markets " * 512] * 10_000, "topk": 10}).encode()
    over_caps = {
        "queries": {"queries": ["Kaloter"] * (limits.max_queries + 1)},
        "query_chars": {"query": "k" * (limits.max_query_chars + 1)},
        "topk": {"query": "Kaloter", "topk": limits.max_topk + 1},
        "hits": {"queries": ["Kaloter"] * limits.max_queries, "topk": topk + 1},
    }

    async def run() -> dict[str, Any]:
        pool = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=STORM_LIMIT_S, limits=pool) as client:
            json_headers = {"content-type": "application/json"}

            async def small_in_the_middle() -> str:
                await asyncio.sleep(1.0)
                return await http_post(client, url, json={"query": "Which explorer first described Kaloter?"})

            return await storm({
                "maximal_x8": [timed(lambda: http_post(client, url, content=maximal, headers=json_headers))
                               for _ in range(8)],
                "old_maximal_10000x8192_chars": [timed(lambda: http_post(client, url, content=old_maximal,
                                                                         headers=json_headers))],
                **{f"over_cap_{name}": [timed(lambda body=body: http_post(client, url, json=body))]
                   for name, body in over_caps.items()},
                "content_length_1e20_x8": [timed(lambda: raw(port, post_head("/retrieve", 10**20 - 1)))
                                           for _ in range(8)],
                f"slowloris_x{slowloris_count}": slowloris(port, "/retrieve", slowloris_count),
                "slow_body_x20": slow_bodies(port, "/retrieve", 20),
                "small_query_during_the_storm": [timed(small_in_the_middle)],
            })  # fmt: skip

    return asyncio.run(run())


def one_maximal_request_cpu_s(port: int, pid: int, limits: RetrieverLimits) -> float:
    """CPU seconds the retriever spends on one request at every default cap."""
    body = maximal_body(limits, seed=12)
    server = psutil.Process(pid)
    before = server.cpu_times()
    headers = {"content-type": "application/json"}
    answer = httpx.post(f"http://127.0.0.1:{port}/retrieve", content=body, headers=headers, timeout=120)
    answer.raise_for_status()
    after = server.cpu_times()
    return round(after.user + after.system - before.user - before.system, 2)


def measure(
    name: str, process: subprocess.Popen[bytes], run_storm: Callable[[], dict[str, Any]], settle_s: float
) -> dict[str, Any]:
    with MemoryProbe(process.pid) as memory:
        before = memory.rss()
        started = time.perf_counter()
        answers = run_storm()
        took = time.perf_counter() - started
        time.sleep(settle_s)
        after = memory.rss()
    print(f"{name}: {took:.1f} s, peak {memory.peak / MIB:.0f} MiB, after {after / MIB:.0f} MiB", flush=True)
    return {
        "rss_mib": {
            "before": round(before / MIB, 1),
            "peak": round(memory.peak / MIB, 1),
            f"after_{settle_s:g}s": round(after / MIB, 1),
        },
        "storm_s": round(took, 1),
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slowloris", type=int, default=1000, help="slow-header connections per server")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the storm before 'after'")
    parser.add_argument("--out", default="benchmarks/results/servers_load.json")
    args = parser.parse_args()

    limits = RetrieverLimits()
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "load_average_at_start": [round(load, 2) for load in os.getloadavg()],  # shared: noisy
        },
        "limits": {
            "sandbox": SANDBOX_GUARD.summary(),
            "retriever": f"{limits.summary()}; {limits.guard().summary()}",
        },
    }
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    sandbox_port, retriever_port = free_port(), free_port()
    argv = ["serve", "sandbox", "--backend", "local"]
    sandbox = start(argv, sandbox_port, "/v1/ping", logs / "sandbox.log")
    try:
        report["sandbox"] = measure(
            "sandbox", sandbox, lambda: sandbox_storm(sandbox_port, args.slowloris), args.settle
        )
        children = psutil.Process(sandbox.pid).children(recursive=True)
        warm = sum(child.memory_info().rss for child in children)
        report["sandbox"]["warm_sandboxes_rss_mib"] = round(warm / MIB, 1)
    finally:
        sandbox.terminate()
        sandbox.wait(timeout=60)

    argv = ["serve", "retriever", "--corpus", str(CORPUS)]
    retriever = start(argv, retriever_port, "/health", logs / "retriever.log")
    try:
        hostile = lambda: retriever_storm(retriever_port, args.slowloris, limits)  # noqa: E731
        report["retriever"] = measure("retriever", retriever, hostile, args.settle)
        cpu_s = one_maximal_request_cpu_s(retriever_port, retriever.pid, limits)
        report["retriever"]["one_maximal_request_cpu_s"] = cpu_s
    finally:
        retriever.terminate()
        retriever.wait(timeout=60)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
