"""A BM25 retriever over a JSONL corpus, served with Search-R1's `/retrieve` schema
(`pacerl serve retriever`).

Any client of a Search-R1 retriever (Search-R1's own rollout, verl's search tool, pacerl's `search`
tool) works against it unchanged. The shapes follow `search_r1/search/retrieval_server.py` of
github.com/PeterGriffinJin/Search-R1 (`QueryRequest`, `retrieve_endpoint`):

    POST /retrieve  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    ->  {"result": [[{"document": {"id": "7", "contents": "\\"Title\\"\\ntext"}, "score": 4.1}, ...], ...]}

and with `return_scores` false (the default) each hit is the bare document, `{"id", "contents"}`.
`topk` null means the server's default. Where this server differs, it is stricter or more lenient,
never differently shaped:

- A single `{"query": "q"}` is accepted too (some clients send that) and answered as a batch of one,
  `{"result": [[...]]}`. Exactly one of `queries` and `query` must be given.
- `topk` must be 1..100 (Search-R1 reads 0 as "the default"; here 0 is refused). Fields Search-R1
  does not know are ignored, as its pydantic model ignores them.
- Hits are documents sharing at least one term with the query, best first, so a query may get fewer
  than `topk` (or none), as from Search-R1's BM25 (pyserini's Lucene). Scoring is Lucene's BM25 with
  pyserini's k1=0.9, b=0.4 and English stopwords, but without pyserini's Porter stemming.
- Anything malformed (not JSON, wrong types, neither or both of `queries`/`query`, `topk` below 1)
  or over a per-request cap of `RetrieverLimits` (queries per request, characters per query, `topk`,
  hits per request) is HTTP 422 with FastAPI's `{"detail": [{"loc", "msg", "type"}]}`, the offending
  input never echoed. The caps bound one request's work: at the defaults, one maximal request
  (4,096 queries of 512 characters) takes well under a second of CPU on the shipped corpus.
- The HTTP limits of `pacerl.sandbox.http_guard` apply: a body over `RetrieverLimits.max_body_bytes` is 413
  (at once when declared), a body not in within the body timeout 408, a full body budget or a full
  search queue 503 with `Retry-After`, headers over the cap 431, a connection that does not finish
  its headers in time is closed, and past the connection cap so is the one waiting longest for a
  request. Searches run on at most `search_workers` threads, off the event loop. `GET /health`
  reports the document count.

Corpus rows are Search-R1's `{"id": str, "contents": "\\"Title\\"\\ntext"}`; rows with `text` (and an
optional `title`) instead are turned into that form. The id defaults to the row's index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import bm25s
import fastapi
import numpy as np
import pydantic
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from pacerl.envs.jsonl import read_jsonl
from pacerl.sandbox.http_guard import Gate, HttpGuardConfig, guard_app, run_server

_uvicorn_log = logging.getLogger("uvicorn.error")
"""Lifecycle lines go where uvicorn writes its own."""

MAX_TOPK = 100
"""The largest `topk` by default."""
STOPWORDS = "en"
K1, B = 0.9, 0.4


Document = dict[str, str]
"""`{"id": str, "contents": '"Title"\\ntext'}`."""


class BM25Index:
    """Lucene-style BM25 (bm25s) over documents in Search-R1 form. Read-only once built: `search`
    may run on several threads at once."""

    def __init__(self, documents: Sequence[Mapping[str, Any]], *, k1: float = K1, b: float = B) -> None:
        """Index `documents` (Search-R1 rows, or rows with `text`/`title`); ValueError names a bad row."""
        ids: list[str] = []
        contents: list[str] = []
        for index, row in enumerate(documents):
            identifier, text = _normalize(row, index, f"document {index}")
            ids.append(identifier)
            contents.append(text)
        if not contents:
            raise ValueError("the corpus has no documents")
        if len(set(ids)) != len(ids):
            repeated = next(identifier for identifier, count in Counter(ids).items() if count > 1)
            raise ValueError(f"document ids must be unique; {repeated!r} is repeated")
        self._ids = ids
        self._contents = contents
        self._bm25 = bm25s.BM25(k1=k1, b=b, method="lucene")
        self._bm25.index(
            bm25s.tokenize(contents, stopwords=STOPWORDS, show_progress=False), show_progress=False
        )

    @classmethod
    def from_jsonl(cls, path: str | Path, *, k1: float = K1, b: float = B) -> BM25Index:
        """Index the corpus in `path` (one document per line). OSError if it cannot be read, ValueError
        (with the line number) if a line is not a document."""
        path = Path(path)
        rows: list[Document] = []
        for number, row in read_jsonl(path):
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: a document must be a JSON object")
            identifier, contents = _normalize(row, len(rows), f"{path}:{number}")
            rows.append({"id": identifier, "contents": contents})
        if not rows:
            raise ValueError(f"{path}: the corpus has no documents")
        return cls(rows, k1=k1, b=b)

    def __len__(self) -> int:
        return len(self._ids)

    def search(self, queries: Sequence[str], topk: int) -> list[list[tuple[Document, float]]]:
        """For each query, up to `topk` `(document, score)` pairs, best first; documents sharing no
        term with the query are left out, so a list may be shorter or empty."""
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not queries:
            return []
        tokens = bm25s.tokenize(list(queries), stopwords=STOPWORDS, return_ids=False, show_progress=False)
        return [self._best(query_tokens, topk) for query_tokens in tokens]

    def _best(self, tokens: list[str], topk: int) -> list[tuple[Document, float]]:
        if not tokens:  # nothing but stopwords and punctuation
            return []
        scores = self._bm25.get_scores(tokens)
        k = min(topk, len(scores))
        # Not bm25s's own top-k: numpy's argpartition with kth near the end of an array full of ties
        # (every document sharing no term scores 0) is ~20x slower than with kth near the start.
        candidates = np.argpartition(-scores, k - 1)[:k]
        ranked = candidates[np.lexsort((candidates, -scores[candidates]))]  # ties by corpus order
        return [
            ({"id": self._ids[i], "contents": self._contents[i]}, float(scores[i]))
            for i in ranked.tolist()
            if scores[i] > 0
        ]


def _normalize(row: Mapping[str, Any], index: int, where: str) -> tuple[str, str]:
    """A row's id and its contents in Search-R1 form."""
    contents = row.get("contents")
    if contents is None and isinstance(row.get("text"), str):
        title = row.get("title", "")
        if not isinstance(title, str):
            raise ValueError(f"{where}: 'title' must be a string")
        contents = f'"{title}"\n{row["text"]}'
    if not isinstance(contents, str):
        raise ValueError(
            f"{where}: a document needs a string 'contents' (or 'text', with an optional 'title')"
        )
    identifier = row.get("id", index)
    if not isinstance(identifier, str | int) or isinstance(identifier, bool):
        raise ValueError(f"{where}: 'id' must be a string or an integer")
    try:
        # JSON may carry lone surrogates ("\\ud800"), which no answer could encode.
        contents.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{where}: 'contents' is not valid Unicode text ({error.reason})") from None
    return str(identifier), contents


@dataclasses.dataclass(frozen=True)
class RetrieverLimits:
    """What one `/retrieve` request may ask for, and how many searches run at once. Past a cap the
    request is HTTP 422 naming it; past the queue, HTTP 503."""

    max_queries: int = 4096
    """Queries in one request (Search-R1's rollout sends a whole batch of prompts times samples)."""
    max_query_chars: int = 512
    """Characters in one query: a search query, not a document (longer ones are runaway generations)."""
    max_topk: int = MAX_TOPK
    """Largest `topk`."""
    max_hits: int = 16_384
    """`queries x topk` in one request: bounds the size of an answer (4,096 queries at Search-R1's 3
    fit, with room)."""
    search_workers: int = 2
    """Searches running at once, each on its own thread."""
    max_waiting: int = 64
    """Requests waiting for a search thread; one more is HTTP 503 at once."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            least = 0 if field.name == "max_waiting" else 1
            value = getattr(self, field.name)
            if value < least:
                raise ValueError(f"{field.name} must be >= {least}, got {value}")

    def summary(self) -> str:
        """One line for the startup log."""
        return (
            f"{self.max_queries} queries of {self.max_query_chars} characters, topk {self.max_topk}, "
            f"{self.max_hits} hits per request; {self.search_workers} search threads, "
            f"{self.max_waiting} waiting"
        )

    @property
    def max_body_bytes(self) -> int:
        """The largest body worth reading: every query at its cap, JSON-escaped (6 bytes a character
        as \\uXXXX; a batch at the cap made only of characters outside the BMP, 12 bytes each, is
        413), plus room for the rest of the request."""
        return self.max_queries * (6 * self.max_query_chars + 4) + 64 * 1024

    def guard(self) -> HttpGuardConfig:
        """The HTTP limits that go with these caps: bodies up to `max_body_bytes`, and four of them
        in memory at once."""
        return HttpGuardConfig(max_body_bytes=self.max_body_bytes, body_budget_bytes=4 * self.max_body_bytes)


class RetrieveRequest(pydantic.BaseModel):
    """Search-R1's `QueryRequest`, plus the single-`query` form. The caps of `RetrieverLimits` are
    checked after parsing (`_over_caps`), since they are the server's settings."""

    model_config = pydantic.ConfigDict(extra="ignore")

    queries: list[str] | None = None
    """The queries of a batch."""
    query: str | None = None
    """One query (instead of `queries`)."""
    topk: Annotated[int, pydantic.Field(ge=1, strict=True)] | None = None
    """Documents per query; null means the server's default."""
    return_scores: bool = False
    """Wrap each document as `{"document": ..., "score": ...}`."""

    @pydantic.model_validator(mode="after")
    def _one_form(self) -> RetrieveRequest:
        if (self.queries is None) == (self.query is None):
            raise ValueError('give either "queries" (a list of strings) or "query" (one string)')
        return self

    def batch(self) -> list[str]:
        return self.queries if self.queries is not None else [self.query or ""]


def _over_caps(request: RetrieveRequest, topk: int, limits: RetrieverLimits) -> list[dict[str, Any]]:
    """FastAPI-shaped errors for each cap `request` exceeds (empty when within them all)."""
    errors: list[dict[str, Any]] = []

    def error(loc: list[str | int], kind: str, message: str) -> None:
        errors.append({"loc": ["body", *loc], "msg": message, "type": kind})

    queries = request.batch()
    if len(queries) > limits.max_queries:
        message = f"{len(queries)} queries; at most {limits.max_queries} per request, split the batch"
        error(["queries"], "too_many_queries", message)
    for position, query in enumerate(queries):
        if len(query) > limits.max_query_chars:
            where: list[str | int] = ["queries", position] if request.queries is not None else ["query"]
            message = f"the query has {len(query)} characters; at most {limits.max_query_chars}"
            error(where, "query_too_long", message)
            break  # one says why; thousands would make an answer as large as the request
    if topk > limits.max_topk:
        error(["topk"], "topk_too_large", f"topk {topk} is over this server's cap of {limits.max_topk}")
    if not errors and len(queries) * topk > limits.max_hits:
        message = f"{len(queries)} queries x topk {topk} exceeds {limits.max_hits} hits per request; split it"
        error([], "too_many_hits", message)
    return errors


def _invalid(error: pydantic.ValidationError, content_type: str) -> JSONResponse:
    # Each error without its input: a rejected 8 MiB query should not come back as an 8 MiB error.
    detail: list[dict[str, Any]] = [
        {"loc": ["body", *error_item["loc"]], "msg": error_item["msg"], "type": error_item["type"]}
        for error_item in error.errors(include_url=False)
    ]
    if "json" not in content_type:
        hint = f"the body must be JSON sent with Content-Type: application/json (got {content_type!r})"
        detail.insert(0, {"loc": ["header", "content-type"], "msg": hint, "type": "content_type"})
    return JSONResponse({"detail": detail}, status_code=422)


def create_app(
    index: BM25Index,
    default_topk: int = 3,
    *,
    source: str = "",
    limits: RetrieverLimits = RetrieverLimits(),  # frozen: one shared default is safe
    guard: HttpGuardConfig | None = None,
) -> fastapi.FastAPI:
    """The ASGI app serving `index` (the schema in the module docstring); `source` says where the
    documents came from in the startup log line. `guard` defaults to `limits.guard()`."""
    if not 1 <= default_topk <= limits.max_topk:
        raise ValueError(f"the default topk must be 1..{limits.max_topk}, got {default_topk}")
    gate = Gate(limits.search_workers, limits.max_waiting, "searches")

    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        _uvicorn_log.info("Serving %d documents%s; default topk %d", len(index), source, default_topk)
        _uvicorn_log.info("Request caps: %s", limits.summary())
        yield

    app = fastapi.FastAPI(
        title="pacerl retriever",
        summary="A Search-R1-compatible /retrieve service (BM25)",
        description=__doc__,
        lifespan=lifespan,
    )
    guard_app(app, guard or limits.guard())
    app.state.search_gate = gate
    request_schema = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RetrieveRequest.model_json_schema()}},
        }
    }

    def check(body: bytes, content_type: str) -> tuple[list[str], int, bool] | JSONResponse:
        """(queries, topk, return_scores), or the 422 answer: quick, so not behind the searches."""
        try:
            parsed = RetrieveRequest.model_validate_json(body)
        except pydantic.ValidationError as error:
            return _invalid(error, content_type)
        topk = parsed.topk or default_topk
        over = _over_caps(parsed, topk, limits)
        if over:
            return JSONResponse({"detail": over}, status_code=422)
        return parsed.batch(), topk, parsed.return_scores

    def answer(queries: list[str], topk: int, return_scores: bool) -> JSONResponse:
        hits = index.search(queries, topk)
        if return_scores:
            result: list[list[Any]] = [
                [{"document": doc, "score": score} for doc, score in row] for row in hits
            ]
        else:
            result = [[doc for doc, _ in row] for row in hits]
        return JSONResponse({"result": result})  # rendered here, off the event loop too

    @app.post("/retrieve", tags=["search"], openapi_extra=request_schema)
    async def retrieve(request: fastapi.Request) -> JSONResponse:
        """The `topk` best documents of each query (see the module docstring)."""
        # The body is parsed here rather than declared as a parameter, so that every malformed body
        # (deep nesting included) is a 422 from one parser. Parsing, searching and rendering all run
        # on worker threads: the event loop stays free for other connections. The guard in front has
        # capped and read the body already.
        body = await request.body()
        checked = await run_in_threadpool(check, body, request.headers.get("content-type", ""))
        if isinstance(checked, JSONResponse):
            return checked
        async with gate.slot():
            return await run_in_threadpool(answer, *checked)

    @app.get("/health", tags=["health"])
    async def health() -> dict[str, Any]:
        """Liveness and what this server holds."""
        return {
            "status": "ok",
            "documents": len(index),
            "default_topk": default_topk,
            "max_topk": limits.max_topk,
        }

    return app


def serve(
    corpus: str,
    host: str,
    port: int,
    default_topk: int,
    limits: RetrieverLimits = RetrieverLimits(),  # frozen: one shared default is safe
    guard: HttpGuardConfig | None = None,
) -> None:
    """Index `corpus` (JSONL) and serve it until SIGINT/SIGTERM. A corpus that cannot be read or is
    malformed raises (OSError/ValueError) before the server starts. `guard` defaults to
    `limits.guard()`."""
    if not 1 <= default_topk <= limits.max_topk:
        raise ValueError(f"--topk must be 1..{limits.max_topk}, got {default_topk}")
    guard = guard or limits.guard()
    started = time.perf_counter()
    index = BM25Index.from_jsonl(corpus)
    took = time.perf_counter() - started
    app = create_app(
        index, default_topk, source=f" from {corpus} (indexed in {took:.1f} s)", limits=limits, guard=guard
    )
    # No access log: a training run sends thousands of queries a second, a line each would be the
    # server's main cost and bury the lines that matter.
    run_server(app, host, port, guard, log_level="info", access_log=False)


LOCAL_START_S = 30.0
"""How long `local_retriever` waits for its server to listen before it gives up."""


@contextlib.contextmanager
def local_retriever(corpus: str | Path | None = None) -> Iterator[str]:
    """A Search-R1 `/retrieve` server (BM25 over `corpus`, default the shipped search corpus) on a free
    loopback port, on a daemon thread of this process; yields its URL and stops it on exit. On its own
    thread uvicorn leaves the process's signal handlers alone, so Ctrl-C still reaches the caller."""
    import uvicorn

    from pacerl.envs.tasks import DATA_DIR

    path = Path(corpus) if corpus is not None else DATA_DIR / "search-corpus.jsonl"
    app = create_app(BM25Index.from_jsonl(path), source=f" from {path}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # the kernel picks a free port: no race with a probe-then-bind
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name="local-retriever", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + LOCAL_START_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the in-process retriever over {path} did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()
