"""The BM25 retriever, its Search-R1-compatible server and the `search` tool, over real HTTP on 127.0.0.1.

One server is the CLI (`pacerl serve retriever`, a subprocess); the others run uvicorn on a thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import bm25s
import fastapi
import httpx
import pytest
from fastapi.responses import JSONResponse

from pacerl.cli import _RETRIEVER_FLAGS as RETRIEVER_FLAGS
from pacerl.cli import main
from pacerl.envs.retriever import BM25Index, RetrieverLimits, create_app
from pacerl.envs.tasks import DATA_DIR, load_tasks
from pacerl.envs.tools import ToolContext, ToolError, get_tool
from pacerl.envs.tools.search import retrieve
from tests.helpers import ThreadServer, free_port, record_http_requests
from tests.hostile_http import (
    assert_idle_after_answer_then_partial_is_closed,
    assert_oversized_headers_are_431,
    assert_slow_body_is_408,
    assert_slow_headers_are_closed,
    detail,
    exchange,
    post_head,
    refused_then_closed_while_trickling,
)

CORPUS = DATA_DIR / "search-corpus.jsonl"


@pytest.fixture(scope="module")
def index() -> BM25Index:
    return BM25Index.from_jsonl(CORPUS)


@pytest.fixture(scope="module")
def url(index: BM25Index) -> Iterator[str]:
    with ThreadServer(create_app(index, default_topk=3), free_port()) as server:
        yield server.url


def title(document: dict[str, str]) -> str:
    return document["contents"].partition("\n")[0].strip('"')


# -- BM25 ------------------------------------------------------------------------------------------------


def test_bm25_ranks_the_subject_high_for_every_shipped_question(index: BM25Index) -> None:
    """Asked the whole question, BM25 ranks the passage of the entity it is about (a two-hop
    question's first hop) first or nearly."""
    tasks = load_tasks("search-val") + load_tasks("search-train")[:1600]
    results = index.search([task.question for task in tasks], topk=3)
    first = top3 = 0
    for task, hits in zip(tasks, results, strict=True):
        subject = task.metadata["queries"][0]
        single = task.metadata["hops"] == 1
        found = [title(doc) == subject and (not single or task.answer in doc["contents"]) for doc, _ in hits]
        first += found[0]
        top3 += any(found)
    # Measured with Lucene BM25, k1=0.9, b=0.4: first for 1,910 of 2,000 (400 val + 1,600 train; the
    # question's other words, "founded", "born", pull in the passages that mention the subject), in
    # the top 3 for all 2,000. The demonstrations search the bare name (test_search_world.py).
    assert first / len(tasks) >= 0.93 and top3 / len(tasks) >= 0.99, (first, top3, len(tasks))
    scores = [score for hits in results for score in (s for _, s in hits)]
    assert all(score > 0 for score in scores)
    assert all([s for _, s in hits] == sorted((s for _, s in hits), reverse=True) for hits in results)


def test_ranking_equals_bm25s_own_retrieval(index: BM25Index) -> None:
    """The top-k selection is our own (see BM25Index._best); its scores must be bm25s's."""
    contents = [json.loads(line)["contents"] for line in CORPUS.read_text().splitlines()]
    reference = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
    reference.index(bm25s.tokenize(contents, stopwords="en", show_progress=False), show_progress=False)
    queries = [task.question for task in load_tasks("search-val")] + [
        "Ardbridan river",
        "city on the river Karath",
    ]
    tokens = bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
    _, best_scores = reference.retrieve(tokens, k=5, show_progress=False)
    for hits, query_tokens, wanted in zip(index.search(queries, topk=5), tokens, best_scores, strict=True):
        assert [score for _, score in hits] == pytest.approx(wanted.tolist())
        # Each hit scores what bm25s gives that document (equal scores may come in another order).
        every = reference.get_scores(query_tokens)
        assert [score for _, score in hits] == pytest.approx([float(every[int(d["id"])]) for d, _ in hits])


def test_search_edge_cases(index: BM25Index) -> None:
    assert len(index) == 20_000
    assert index.search([], topk=3) == []
    nothing = index.search(["", "the of and", "zzzqqq", "\ud800", "?" * 10_000], topk=3)
    assert nothing == [[], [], [], [], []]  # no shared term, no hit (as from Lucene)
    # topk beyond the corpus is capped at the documents that match at all.
    (every,) = index.search(["city taught"], topk=100_000)  # every place and every person
    assert len(every) == 20_000 and {doc["id"] for doc, _ in every} == {str(i) for i in range(20_000)}
    (only,) = index.search(["Ardbridan Ardbridan founded"], topk=1)
    assert len(only) == 1 and title(only[0][0]) == "Ardbridan" and set(only[0][0]) == {"id", "contents"}
    with pytest.raises(ValueError, match="topk"):
        index.search(["x"], topk=0)


def test_corpus_rows_in_either_form(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [
        {"id": "a", "contents": '"Alpha"\nThe alpha document.'},
        {"title": "Beta", "text": "The beta document."},
        {"id": 7, "text": "Untitled gamma."},
    ]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    index = BM25Index.from_jsonl(corpus)
    (beta,), (gamma,) = index.search(["beta"], topk=1), index.search(["gamma"], topk=1)
    assert beta[0][0] == {"id": "1", "contents": '"Beta"\nThe beta document.'}
    assert gamma[0][0] == {"id": "7", "contents": '""\nUntitled gamma.'}
    assert len(BM25Index(rows)) == 3


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no documents"),
        (b'{"id": "1", "contents": "x"}\n{"id": "1", "contents": "y"}\n', "'1' is repeated"),
        (b'{"id": "1", "contents": "x"}\nnot json\n', r":2: not JSON \(Expecting value\)"),
        (b'["a list"]\n', ":1: a document must be a JSON object"),
        (b'{"id": "1", "contents": 3}\n', ":1: a document needs a string 'contents'"),
        (b'{"id": "1", "text": "x", "title": 3}\n', ":1: 'title' must be a string"),
        (b'{"id": [1], "contents": "x"}\n', ":1: 'id' must be a string or an integer"),
        (b'{"contents": "\\ud800"}\n', ":1: 'contents' is not valid Unicode"),
        (b'{"contents": "\xff"}\n', ":1: not UTF-8 text"),
    ],
)
def test_malformed_corpus_is_a_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        BM25Index.from_jsonl(corpus)
    with pytest.raises(FileNotFoundError):
        BM25Index.from_jsonl(tmp_path / "missing.jsonl")


# -- the HTTP schema -------------------------------------------------------------------------------------


def post(url: str, **request: Any) -> httpx.Response:
    return httpx.post(f"{url}/retrieve", timeout=30, **request)


def test_scored_batch_has_search_r1s_exact_shape(url: str, index: BM25Index) -> None:
    queries = ["Who founded Ardbridan?", "In which year was Ardfenpol founded?", "zzz"]
    response = post(url, json={"queries": queries, "topk": 2, "return_scores": True})
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"result"} and len(body["result"]) == 3
    expected = index.search(queries, topk=2)
    for hits, wanted in zip(body["result"], expected, strict=True):
        assert [set(hit) for hit in hits] == [{"document", "score"}] * len(wanted)
        assert [hit["document"] for hit in hits] == [doc for doc, _ in wanted]
        assert all(set(hit["document"]) == {"id", "contents"} for hit in hits)
        assert [hit["score"] for hit in hits] == pytest.approx([score for _, score in wanted])
        assert all(isinstance(hit["score"], float) for hit in hits)
    assert title(body["result"][0][0]["document"]) == "Ardbridan" and len(body["result"][0]) == 2
    assert body["result"][2] == []


def test_unscored_default_topk_and_single_query(url: str) -> None:
    # return_scores defaults to false: bare documents; topk null (or absent) means the default 3.
    for request in ({"queries": ["Ardbridan river"]}, {"queries": ["Ardbridan river"], "topk": None}):
        body = post(url, json=request).json()
        assert set(body) == {"result"} and len(body["result"]) == 1 and len(body["result"][0]) == 3
        assert all(set(hit) == {"id", "contents"} for hit in body["result"][0])
        assert title(body["result"][0][0]) == "Ardbridan"
    batched = post(url, json={"queries": ["Ardbridan", "Ardfenpol"], "topk": 1}).json()["result"]
    assert [title(hits[0]) for hits in batched] == ["Ardbridan", "Ardfenpol"]
    single = post(url, json={"query": "Ardfenpol", "topk": 1, "return_scores": True}).json()
    assert set(single) == {"result"} and len(single["result"]) == 1
    assert title(single["result"][0][0]["document"]) == "Ardfenpol" and single["result"][0][0]["score"] > 0
    assert post(url, json={"queries": []}).json() == {"result": []}
    # Fields Search-R1's model does not know are ignored, as there.
    assert post(url, json={"query": "Ardbridan", "topk": 1, "extra": 1}).status_code == 200


def test_health(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=5).json() == {
        "status": "ok",
        "documents": 20_000,
        "default_topk": 3,
        "max_topk": 100,
    }


JSON = {"content-type": "application/json"}
CAPS = RetrieverLimits()
MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("not JSON", {"content": b"queries", "headers": JSON}, "Invalid JSON"),
    ("empty body", {"content": b"", "headers": JSON}, "Invalid JSON"),
    ("form body", {"content": b"query=x"}, "Content-Type: application/json"),
    ("deeply nested", {"content": b"[" * 100_000, "headers": JSON}, "recursion limit"),
    ("lone surrogate", {"content": b'{"query": "\\ud800"}', "headers": JSON}, "Invalid JSON"),
    ("a JSON array", {"json": ["q"]}, "Input should be an object"),
    ("neither form", {"json": {"topk": 3}}, 'give either "queries"'),
    ("both forms", {"json": {"queries": ["a"], "query": "b"}}, 'give either "queries"'),
    ("queries a string", {"json": {"queries": "abc"}}, "valid array"),
    ("query a number", {"json": {"query": 3}}, "valid string"),
    ("a non-string query", {"json": {"queries": ["a", 3]}}, "valid string"),
    ("topk 0", {"json": {"query": "a", "topk": 0}}, "greater than or equal to 1"),
    ("topk 101", {"json": {"query": "a", "topk": 101}}, "over this server's cap of 100"),
    ("topk a string", {"json": {"query": "a", "topk": "3"}}, "valid integer"),
    ("topk a bool", {"json": {"query": "a", "topk": True}}, "valid integer"),
    ("return_scores a list", {"json": {"query": "a", "return_scores": [1]}}, "valid boolean"),
    ("query too long", {"json": {"query": "q" * (CAPS.max_query_chars + 1)}}, "at most 512"),
    ("a query too long", {"json": {"queries": ["a", "q" * 513]}}, "the query has 513 characters"),
    ("too many queries", {"json": {"queries": ["a"] * 4097}}, "4097 queries; at most 4096 per request"),
    ("too many hits", {"json": {"queries": ["a"] * 2000, "topk": 10}}, "exceeds 16384 hits"),
]


@pytest.mark.parametrize(
    ("request_options", "message"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_requests_are_422_with_a_clear_message(
    url: str, request_options: dict[str, Any], message: str
) -> None:
    response = post(url, **request_options)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, list) and message in " ".join(item["msg"] for item in detail), detail
    assert len(response.content) < 2000, "the rejected input is not echoed back"


def test_oversized_body_is_413(url: str) -> None:
    response = post(url, content=b" " * (CAPS.max_body_bytes + 1), headers=JSON)
    assert response.status_code == 413 and "larger than" in response.json()["detail"]
    assert post(url, json={"query": "Ardbridan"}).status_code == 200  # the server carries on


def test_create_app_validates_the_default_topk(index: BM25Index) -> None:
    for bad in (0, 101):
        with pytest.raises(ValueError, match="topk"):
            create_app(index, default_topk=bad)


# -- the search tool and its client ----------------------------------------------------------------------


async def test_search_tool_reads_passages_from_the_server(url: str, index: BM25Index) -> None:
    search = get_tool("search")
    context = ToolContext({"retriever_url": url})
    text = await search({"query": "Who founded Ardbridan?"}, context)
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].startswith("Doc 1(Title: Ardbridan) Ardbridan is a city")
    assert "founded in 1394 by Galphadra" in lines[0] and lines[2].startswith("Doc 3(Title: ")
    assert await search({"query": "Ardbridan", "topk": 1}, context) == (
        "Doc 1(Title: Ardbridan) Ardbridan is a city on the river Karath, founded in 1394 by Galphadra."
    )
    assert await search({"query": "zzzqqq"}, context) == "No results."
    # The address may be given with or without /retrieve.
    with_path = ToolContext({"retriever_url": f"{url}/retrieve/"})
    assert await search({"query": "Ardbridan"}, with_path) == await search({"query": "Ardbridan"}, context)
    # Batched, through the client: the server's hits and scores, in order.
    found = await retrieve(url, ["Ardbridan", "Ardfenpol", "zzz"], topk=2)
    expected = index.search(["Ardbridan", "Ardfenpol", "zzz"], topk=2)
    assert [[(d["id"], d["contents"]) for d in hits] for hits in found] == [
        [(doc["id"], doc["contents"]) for doc, _ in hits] for hits in expected
    ]
    assert [d["score"] for d in found[0]] == pytest.approx([s for _, s in expected[0]])


@pytest.mark.parametrize(
    ("arguments", "settings", "message"),
    [
        ({"query": "x", "topk": 11}, {"retriever_url": "http://127.0.0.1:9"}, "less than or equal to 10"),
        ({"query": "   "}, {"retriever_url": "http://127.0.0.1:9"}, "the query is empty"),
        ({"question": "x"}, {"retriever_url": "http://127.0.0.1:9"}, "invalid arguments for search"),
        ({"query": "x"}, {}, "no search service is configured"),
    ],
)
async def test_search_tool_refuses_bad_calls(
    arguments: dict[str, Any], settings: dict[str, str], message: str
) -> None:
    with pytest.raises(ToolError, match=message):
        await get_tool("search")(arguments, ToolContext(settings))


async def test_search_tool_against_a_dead_port_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connection is the model's observation at once: one attempt, no retry, and the
    error is the refusal (ConnectError), not a timeout (ConnectTimeout, ReadTimeout) waited for."""
    dead = f"http://127.0.0.1:{free_port()}"
    sent = record_http_requests(monkeypatch)
    with pytest.raises(ToolError, match=r"unreachable \(ConnectError\)"):
        await get_tool("search")({"query": "x"}, ToolContext({"retriever_url": dead}))
    assert [str(request.url) for request in sent] == [f"{dead}/retrieve"]


def _other_servers() -> fastapi.FastAPI:
    """Retrievers that answer in other (or broken) shapes."""
    app = fastapi.FastAPI()
    answers: dict[str, tuple[int, Any]] = {
        "flat": (200, {"result": [{"document": {"id": "1", "contents": '"T"\nflat'}, "score": 1.0}]}),
        "flat-empty": (200, {"result": []}),
        "title-text": (200, {"result": [[{"id": "2", "title": "Wiki", "text": "from title and text"}]]}),
        "strings": (200, {"result": [["just a passage"]]}),
        "numbers": (200, {"result": [[1, 2]]}),
        "not-a-list": (200, {"result": "abc"}),
        "no-result": (200, {"documents": []}),
        "two-lists": (200, {"result": [[], []]}),
        "down": (503, {"detail": "overloaded"}),
    }

    @app.post("/{name}/retrieve")
    async def answer(name: str) -> JSONResponse:
        status, body = answers[name]
        return JSONResponse(body, status_code=status)

    return app


async def test_search_tool_reads_other_shapes_and_refuses_broken_ones() -> None:
    search = get_tool("search")
    with ThreadServer(_other_servers(), free_port()) as server:

        async def ask(name: str) -> str:
            return await search({"query": "q"}, ToolContext({"retriever_url": f"{server.url}/{name}"}))

        assert await ask("flat") == "Doc 1(Title: T) flat"
        assert await ask("flat-empty") == "No results."
        assert await ask("title-text") == "Doc 1(Title: Wiki) from title and text"
        assert await ask("strings") == "Doc 1(Title: just a passage) "
        for name in ("numbers", "not-a-list", "no-result"):
            with pytest.raises(ToolError, match="unknown format"):
                await ask(name)
        with pytest.raises(ToolError, match="2 result lists for 1 queries"):
            await ask("two-lists")
        with pytest.raises(ToolError, match="HTTP 503"):
            await ask("down")


# -- the CLI ---------------------------------------------------------------------------------------------


def test_cli_serves_the_corpus_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "pacerl.cli", "serve", "retriever", "--corpus", str(CORPUS)]
    with log.open("wb") as sink:
        process = subprocess.Popen([*argv, "--port", str(port), "--topk", "2"], stdout=sink, stderr=sink)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()
            try:
                health = httpx.get(f"{url}/health", timeout=1).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the CLI server did not answer within 30 s"
                time.sleep(0.05)
        assert health == {"status": "ok", "documents": 20_000, "default_topk": 2, "max_topk": 100}
        body = post(url, json={"queries": ["Who founded Ardbridan?"]}).json()
        assert len(body["result"][0]) == 2 and title(body["result"][0][0]) == "Ardbridan"
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=30)
    output = log.read_text()
    assert returncode == -signal.SIGTERM, output
    assert f"Serving 20000 documents from {CORPUS} (indexed in " in output and "; default topk 2" in output, (
        output
    )
    assert "POST /retrieve" not in output, "no access log"
    assert "Traceback" not in output and "Finished server process" in output, output


def test_cli_refuses_a_bad_corpus_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "fine"}\n{"id": "1", contents}\n')
    argv = [sys.executable, "-m", "pacerl.cli", "serve", "retriever", "--corpus", str(bad)]
    done = subprocess.run([*argv, "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert (
        done.stderr
        == f"pacerl: error: {bad}:2: not JSON (Expecting property name enclosed in double quotes)\n"
    )

    # The same path in-process (a second interpreter start would only cost time).
    missing = tmp_path / "missing.jsonl"
    assert main(["serve", "retriever", "--corpus", str(missing), "--port", str(free_port())]) == 2
    assert capsys.readouterr().err == f"pacerl: error: [Errno 2] No such file or directory: '{missing}'\n"
    assert main(["serve", "retriever", "--corpus", str(bad), "--topk", "0"]) == 2
    assert capsys.readouterr().err == "pacerl: error: --topk must be 1..100, got 0\n"


# -- hostile clients and per-request work caps -----------------------------------------------------------

GUARDED_FLAGS = [
    "--header-timeout",
    "0.5",
    "--body-timeout",
    "1",
    "--max-queries",
    "8",
    "--max-query-chars",
    "64",
]
"""The hostile-client tests' CLI server: short read timeouts and small caps, set by flags."""


@pytest.fixture(scope="module")
def guarded_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A `pacerl serve retriever` subprocess with GUARDED_FLAGS; its port."""
    port = free_port()
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    argv = [sys.executable, "-m", "pacerl.cli", "serve", "retriever", "--corpus", str(CORPUS)]
    with log.open("wb") as sink:
        process = subprocess.Popen([*argv, "--port", str(port), *GUARDED_FLAGS], stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the CLI server did not answer within 30 s"
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_content_length_of_1e20_gets_an_answer_at_once(guarded_port: int) -> None:
    # The old server waited for those bytes forever. 20 digits is the most h11 lets through.
    for declared in (10**20 - 1, CAPS.max_body_bytes + 1):
        status, _, body = refused_then_closed_while_trickling(guarded_port, post_head("/retrieve", declared))
        assert status == 413 and "request body larger than" in detail(body), declared
    status, headers, _ = exchange(guarded_port, post_head("/retrieve", 10**20))
    assert status == 400 and headers["connection"] == "close"


def test_a_slow_body_is_408_and_the_connection_closed(guarded_port: int) -> None:
    assert_slow_body_is_408(guarded_port, "/retrieve", b'{"query": "Kal')


@pytest.mark.slow
def test_slow_headers_are_closed(guarded_port: int) -> None:
    assert_slow_headers_are_closed(guarded_port, "/retrieve", connections=100)
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    assert_idle_after_answer_then_partial_is_closed(guarded_port, health, "/retrieve")
    assert httpx.get(f"http://127.0.0.1:{guarded_port}/health", timeout=5).status_code == 200


def test_oversized_headers_are_431_and_the_connection_closed(guarded_port: int) -> None:
    bodies = assert_oversized_headers_are_431(guarded_port, "/health")
    assert [detail(body) for body in bodies] == ["request line and headers larger than 16384 bytes"] * 3


def test_cli_caps_are_flags(guarded_port: int) -> None:
    url = f"http://127.0.0.1:{guarded_port}"
    assert post(url, json={"queries": ["Ardbridan"] * 8, "topk": 2}).status_code == 200
    too_many = post(url, json={"queries": ["Ardbridan"] * 9})
    assert too_many.status_code == 422
    assert too_many.json()["detail"] == [
        {"loc": ["body", "queries"], "msg": "9 queries; at most 8 per request, split the batch",
         "type": "too_many_queries"}
    ]  # fmt: skip
    too_long = post(url, json={"queries": ["Ardbridan", "k" * 65]})
    assert too_long.status_code == 422
    assert too_long.json()["detail"] == [
        {
            "loc": ["body", "queries", 1],
            "msg": "the query has 65 characters; at most 64",
            "type": "query_too_long",
        }
    ]


def test_cli_help_shows_the_real_defaults() -> None:
    assert {field: default for field, (_, _, default) in RETRIEVER_FLAGS.items()} == dataclasses.asdict(CAPS)


def test_a_maximal_request_is_answered(url: str, index: BM25Index) -> None:
    """At every default cap at once: 4,096 queries of 512 characters, 16,384 hits (measured: about
    0.9 s of CPU on the first, 500-passage corpus, and 1.0 s for the searches alone on the present
    one; the old caps allowed ten times that)."""
    (hits,) = index.search(["city"], topk=100)  # the titles: words every one of which matches
    words = " ".join(title(doc) for doc, _ in hits)
    query = (words * (CAPS.max_query_chars // len(words) + 1))[: CAPS.max_query_chars]
    body = {"queries": [query] * CAPS.max_queries, "topk": CAPS.max_hits // CAPS.max_queries}
    answer = httpx.post(f"{url}/retrieve", json=body, timeout=120)
    assert answer.status_code == 200
    assert [len(hits) for hits in answer.json()["result"]] == [4] * CAPS.max_queries


class BlockingIndex(BM25Index):
    """An index whose searches wait for `release`, so a test holds the search threads on purpose."""

    entered: threading.Semaphore
    release: threading.Event

    def search(self, queries: Sequence[str], topk: int) -> list[list[tuple[dict[str, str], float]]]:
        self.entered.release()
        assert self.release.wait(timeout=60), "the test never released the search"
        return super().search(queries, topk)


def test_searches_run_off_the_event_loop_and_a_full_queue_is_503() -> None:
    index = BlockingIndex.from_jsonl(CORPUS)
    index.entered, index.release = threading.Semaphore(0), threading.Event()
    limits = RetrieverLimits(search_workers=1, max_waiting=1)
    app = create_app(index, limits=limits)
    gate = app.state.search_gate
    with ThreadServer(app, free_port()) as server:

        async def scenario() -> tuple[list[httpx.Response], httpx.Response, int]:
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.ensure_future(
                    client.post(f"{server.url}/retrieve", json={"query": "Ardbridan"})
                )
                assert await asyncio.to_thread(index.entered.acquire, timeout=30), "no search started"
                # The only search thread is busy, yet the event loop answers.
                health = (await client.get(f"{server.url}/health")).status_code
                second = asyncio.ensure_future(
                    client.post(f"{server.url}/retrieve", json={"query": "Ardfenpol"})
                )
                for _ in range(500):  # bounded: until the second request waits for the thread
                    if gate.waiting == 1:
                        break
                    await asyncio.sleep(0.02)
                third = await client.post(f"{server.url}/retrieve", json={"query": "Karath"})
                index.release.set()
                return list(await asyncio.gather(first, second)), third, health

        served, refused, health = asyncio.run(scenario())
    assert health == 200
    assert [answer.status_code for answer in served] == [200, 200]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["detail"] == "1 searches executing and 1 queued; try again later"


def test_retriever_limits_are_validated() -> None:
    for field in ("max_queries", "max_query_chars", "max_topk", "max_hits", "search_workers"):
        with pytest.raises(ValueError, match=f"{field} must be >= 1"):
            RetrieverLimits(**{field: 0})
    with pytest.raises(ValueError, match="max_waiting must be >= 0"):
        RetrieverLimits(max_waiting=-1)
    assert CAPS.guard().max_body_bytes == CAPS.max_body_bytes
