"""BM25 retriever throughput on a generated corpus, in-process and over HTTP (`pacerl serve retriever`).

    .venv/bin/python benchmarks/retriever.py [--documents 100000] [--out benchmarks/results/retriever.json]

The corpus is made here (seeded): invented places in the style of the earlier Search corpus, each document
a ~60-word passage whose filler words follow a Zipf law over a 20k-word vocabulary, so posting lists are
as skewed as in real text. Queries ask for a place's founding year or founder. Measured: index build time,
queries/s batched and one by one in-process, and over HTTP batched (Search-R1's rollout sends a whole
batch per request), one by one on a keep-alive connection, with 16 concurrent callers, and through the
`search` tool (a new connection per call, as an episode makes it), plus top-1 accuracy as a sanity check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pacerl.envs.retriever import BM25Index
from pacerl.envs.tools import ToolContext, get_tool

SYLLABLES = [consonant + vowel for consonant in "bdfklmnrstvz" for vowel in "aeiou"]
KINDS = ["city", "river", "mountain", "island", "kingdom", "valley", "forest", "harbour"]
BATCH = 256


def synthesize(documents: int, seed: int) -> tuple[list[dict[str, str]], list[tuple[str, str, str]]]:
    """Documents in Search-R1 form and (question, entity, answer) triples about them."""
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < documents:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(3, 4))).capitalize())
    ordered = sorted(names)
    vocabulary = np.array(["".join(rng.choice(SYLLABLES) for _ in range(2)) + str(i) for i in range(20_000)])
    zipf = np.random.default_rng(seed).zipf(1.3, size=(documents, 30)) % len(vocabulary)
    rows, questions = [], []
    for index, name in enumerate(ordered):
        year, founder = rng.randint(1100, 1990), "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize()
        filler = " ".join(vocabulary[zipf[index]])
        text = (
            f"{name} is a {rng.choice(KINDS)} near {rng.choice(ordered)}. It was first recorded in {year}, "
            f"when the explorer {founder} described it. {filler}."
        )
        rows.append({"id": str(index), "contents": f'"{name}"\n{text}'})
        if rng.random() < 0.5:
            questions.append((f"In which year was {name} first recorded?", name, str(year)))
        else:
            questions.append((f"Which explorer first described {name}?", name, founder))
    rng.shuffle(questions)
    return rows, questions


def rate(count: int, started: float) -> float:
    return round(count / (time.perf_counter() - started), 1)


def timed_rate(call: Callable[[], int]) -> float:
    started = time.perf_counter()
    return rate(call(), started)


def in_process(index: BM25Index, queries: list[str], single: int) -> dict[str, float]:
    def batched() -> int:
        for start in range(0, len(queries), BATCH):
            index.search(queries[start : start + BATCH], topk=3)
        return len(queries)

    def one_by_one() -> int:
        for query in queries[:single]:
            index.search([query], topk=3)
        return single

    return {"batched_256_qps": timed_rate(batched), "one_by_one_qps": timed_rate(one_by_one)}


def over_http(url: str, queries: list[str], single: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with httpx.Client(timeout=120) as client:

        def batched() -> int:
            for start in range(0, len(queries), BATCH):
                batch = queries[start : start + BATCH]
                answer = client.post(
                    f"{url}/retrieve", json={"queries": batch, "topk": 3, "return_scores": True}
                )
                answer.raise_for_status()
                if len(answer.json()["result"]) != len(batch):
                    raise RuntimeError("the server answered the wrong number of result lists")
            return len(queries)

        def one_by_one() -> int:
            for query in queries[:single]:
                client.post(f"{url}/retrieve", json={"queries": [query], "topk": 3}).raise_for_status()
            return single

        out["batched_256_qps"] = timed_rate(batched)
        out["one_by_one_keepalive_qps"] = timed_rate(one_by_one)

    async def concurrent(callers: int) -> int:
        pending = list(queries[:single])
        async with httpx.AsyncClient(timeout=120) as client:

            async def caller() -> None:
                while pending:
                    query = pending.pop()
                    (
                        await client.post(f"{url}/retrieve", json={"query": query, "topk": 3})
                    ).raise_for_status()

            await asyncio.gather(*(caller() for _ in range(callers)))
        return single

    async def through_tool(callers: int) -> int:
        search, context = get_tool("search"), ToolContext({"retriever_url": url})
        pending = list(queries[:single])

        async def caller() -> None:
            while pending:
                text = await search({"query": pending.pop()}, context)
                if not text.startswith("Doc 1("):
                    raise RuntimeError(f"the search tool failed: {text}")

        await asyncio.gather(*(caller() for _ in range(callers)))
        return single

    out["concurrent_16_callers_qps"] = timed_rate(lambda: asyncio.run(concurrent(16)))
    out["search_tool_16_callers_qps"] = timed_rate(lambda: asyncio.run(through_tool(16)))
    return out


def start_server(corpus: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "pacerl.cli",
        "serve",
        "retriever",
        "--corpus",
        str(corpus),
        "--port",
        str(port),
    ]
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
            return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise TimeoutError("the retriever did not start within 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=4096, help="queries of the batched runs")
    parser.add_argument("--single", type=int, default=1000, help="queries of the one-by-one runs")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--out", default="benchmarks/results/retriever.json")
    args = parser.parse_args()

    rows, questions = synthesize(args.documents, seed=11)
    queries = [question for question, _, _ in questions[: args.queries]]
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "load_average_at_start": [round(load, 2) for load in os.getloadavg()],  # shared: noisy
        },
        "corpus": {
            "documents": len(rows),
            "mean_words": round(np.mean([len(r["contents"].split()) for r in rows]), 1),
        },
        "queries": {"batched": len(queries), "one_by_one": args.single, "batch_size": BATCH, "topk": 3},
    }
    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
        started = time.perf_counter()
        index = BM25Index.from_jsonl(corpus)
        report["index_build_s"] = round(time.perf_counter() - started, 2)

        hits = index.search(queries, topk=1)
        correct = sum(
            bool(found)
            and found[0][0]["contents"].startswith(f'"{entity}"\n')
            and answer in found[0][0]["contents"]
            for found, (_, entity, answer) in zip(hits, questions[: len(queries)], strict=True)
        )
        report["top1_accuracy"] = round(correct / len(queries), 4)
        report["in_process"] = in_process(index, queries, args.single)
        del index

        process = start_server(corpus, args.port, Path(scratch) / "server.log")
        try:
            report["http"] = over_http(f"http://127.0.0.1:{args.port}", queries, args.single)
        finally:
            process.terminate()
            process.wait(timeout=60)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
