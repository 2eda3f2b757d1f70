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
- Anything malformed (not JSON, wrong types, neither or both of `queries`/`query`, `topk` out of
  range, too many queries or hits, a query over `MAX_QUERY_CHARS`) is HTTP 422 with FastAPI's
  `{"detail": [{"loc", "msg", "type"}]}`, the offending input never echoed; a body over
  `MAX_BODY_BYTES` is 413. `GET /health` reports the document count.

Corpus rows are Search-R1's `{"id": str, "contents": "\\"Title\\"\\ntext"}`; rows with `text` (and an
optional `title`) instead are turned into that form. The id defaults to the row's index.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import bm25s
import fastapi
import numpy as np
import pydantic
import uvicorn
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

_uvicorn_log = logging.getLogger("uvicorn.error")
"""Lifecycle lines go where uvicorn writes its own."""

MAX_TOPK = 100
MAX_QUERIES = 10_000
"""Queries in one request (Search-R1's rollout sends a whole batch of prompts times samples at once)."""
MAX_QUERY_CHARS = 8_192
MAX_HITS = 100_000
"""`len(queries) * topk` in one request: bounds the size of an answer."""
MAX_BODY_BYTES = 32 * 1024 * 1024
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
        with path.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
                except UnicodeDecodeError as error:
                    raise ValueError(f"{path}:{number}: not UTF-8 text ({error.reason})") from None
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


Query = Annotated[str, pydantic.Field(max_length=MAX_QUERY_CHARS)]


class RetrieveRequest(pydantic.BaseModel):
    """Search-R1's `QueryRequest`, plus the single-`query` form."""

    model_config = pydantic.ConfigDict(extra="ignore")

    queries: Annotated[list[Query], pydantic.Field(max_length=MAX_QUERIES)] | None = None
    """The queries of a batch."""
    query: Query | None = None
    """One query (instead of `queries`)."""
    topk: Annotated[int, pydantic.Field(ge=1, le=MAX_TOPK, strict=True)] | None = None
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


def create_app(index: BM25Index, default_topk: int = 3, *, source: str = "") -> fastapi.FastAPI:
    """The ASGI app serving `index` (the schema in the module docstring); `source` says where the
    documents came from in the startup log line."""
    if not 1 <= default_topk <= MAX_TOPK:
        raise ValueError(f"the default topk must be 1..{MAX_TOPK}, got {default_topk}")

    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        _uvicorn_log.info("Serving %d documents%s; default topk %d", len(index), source, default_topk)
        yield

    app = fastapi.FastAPI(
        title="pacerl retriever",
        summary="A Search-R1-compatible /retrieve service (BM25)",
        description=__doc__,
        lifespan=lifespan,
    )
    request_schema = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RetrieveRequest.model_json_schema()}},
        }
    }

    @app.post("/retrieve", tags=["search"], openapi_extra=request_schema)
    async def retrieve(request: fastapi.Request) -> JSONResponse:
        """The `topk` best documents of each query (see the module docstring)."""
        # The body is read and parsed here rather than declared as a parameter, so that every malformed
        # body (deep nesting included) is a 422 from one parser and an oversized one stops at the cap.
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return JSONResponse({"detail": f"request body larger than {MAX_BODY_BYTES} bytes"}, 413)
        try:
            parsed = RetrieveRequest.model_validate_json(bytes(body))
        except pydantic.ValidationError as error:
            return _invalid(error, request.headers.get("content-type", ""))
        queries = parsed.batch()
        topk = parsed.topk or default_topk
        if len(queries) * topk > MAX_HITS:
            message = f"{len(queries)} queries x topk {topk} exceeds {MAX_HITS} hits per request; split it"
            return JSONResponse({"detail": [{"loc": ["body"], "msg": message, "type": "too_many_hits"}]}, 422)
        hits = await run_in_threadpool(index.search, queries, topk)
        if parsed.return_scores:
            result: list[list[Any]] = [
                [{"document": doc, "score": score} for doc, score in row] for row in hits
            ]
        else:
            result = [[doc for doc, _ in row] for row in hits]
        return JSONResponse({"result": result})

    @app.get("/health", tags=["health"])
    async def health() -> dict[str, Any]:
        """Liveness and what this server holds."""
        return {"status": "ok", "documents": len(index), "default_topk": default_topk, "max_topk": MAX_TOPK}

    return app


def serve(corpus: str, host: str, port: int, default_topk: int) -> None:
    """Index `corpus` (JSONL) and serve it until SIGINT/SIGTERM. A corpus that cannot be read or is
    malformed raises (OSError/ValueError) before the server starts."""
    if not 1 <= default_topk <= MAX_TOPK:
        raise ValueError(f"--topk must be 1..{MAX_TOPK}, got {default_topk}")
    started = time.perf_counter()
    index = BM25Index.from_jsonl(corpus)
    took = time.perf_counter() - started
    app = create_app(index, default_topk, source=f" from {corpus} (indexed in {took:.1f} s)")
    # No access log: a training run sends thousands of queries a second, a line each would be the
    # server's main cost and bury the lines that matter.
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False)).run()
