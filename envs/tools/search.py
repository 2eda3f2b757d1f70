"""The `search` tool: a client of any Search-R1-compatible retriever (`POST /retrieve`).

Request `{"queries": [...], "topk": k, "return_scores": true}`, answer
`{"result": [[{"document": {"id", "contents"}, "score"}, ...]]}` (Search-R1's
`search_r1/search/retrieval_server.py`). Servers that take a single `query` instead are accepted too.
The retriever's address comes from the env's settings (`retriever_url`).
"""

from __future__ import annotations

import functools
import ssl
from typing import Annotated, Any

import httpx
import pydantic

from pacerl.envs.tools.core import ToolContext, ToolError, tool

SEARCH_TIMEOUT_S = 10.0


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default TLS context, made once: each client would otherwise load the CA bundle again,
    about 70 ms of CPU on the event loop per search call."""
    return httpx.create_ssl_context()


async def retrieve(
    url: str, queries: list[str], topk: int, timeout_s: float = SEARCH_TIMEOUT_S
) -> list[list[dict[str, Any]]]:
    """Documents for each query, best first: `[[{"id", "contents", "score"}, ...], ...]`.

    ToolError when the service is unreachable or answers something that is not Search-R1's shape.
    """
    endpoint = url.rstrip("/") + ("" if url.rstrip("/").endswith("/retrieve") else "/retrieve")
    try:
        async with httpx.AsyncClient(timeout=timeout_s, verify=_tls()) as client:
            answer = await client.post(
                endpoint, json={"queries": queries, "topk": topk, "return_scores": True}
            )
            if answer.status_code in (400, 422) and len(queries) == 1:  # a single-query server
                answer = await client.post(
                    endpoint, json={"query": queries[0], "topk": topk, "return_scores": True}
                )
    except httpx.HTTPError as error:
        raise ToolError(f"the search service at {endpoint} is unreachable ({type(error).__name__})") from None
    if answer.status_code != 200:
        raise ToolError(f"the search service answered HTTP {answer.status_code}{_why(answer)}")
    try:
        result = answer.json()["result"]
        if not isinstance(result, list):
            raise TypeError("result is not a list")
        if not result or isinstance(result[0], dict | str):  # a single-query server answers one flat list
            result = [result]
        if len(result) != len(queries):
            raise ToolError(
                f"the search service answered {len(result)} result lists for {len(queries)} queries"
            )
        return [[_document(item) for item in hits] for hits in result]
    except (ValueError, KeyError, TypeError, IndexError):
        raise ToolError("the search service answered in an unknown format") from None


def _why(answer: httpx.Response) -> str:
    """The reason a refusing service gave (FastAPI's `detail`, a string or a list of errors), briefly,
    so the model can fix its call (a query over the length cap, say)."""
    try:
        detail = answer.json().get("detail")
    except (ValueError, AttributeError):
        return ""
    if isinstance(detail, list):
        detail = "; ".join(
            str(item.get("msg", item)) if isinstance(item, dict) else str(item) for item in detail
        )
    return f": {str(detail)[:300]}" if detail else ""


def _document(item: Any) -> dict[str, Any]:
    """One hit as `{"id", "contents", "score"}`: Search-R1's `{"document", "score"}`, a bare document
    (`contents`, or `title` and `text`), or a plain string. TypeError/KeyError for anything else."""
    score = item.get("score") if isinstance(item, dict) else None
    document = item.get("document", item) if isinstance(item, dict) else item
    if isinstance(document, str):
        return {"id": "", "contents": document, "score": score}
    if not isinstance(document, dict):
        raise TypeError(f"a hit is a {type(document).__name__}, not a document")
    contents = document.get("contents")
    if contents is None:
        contents = f'"{document.get("title", "")}"\n{document["text"]}'
    return {"id": str(document.get("id", "")), "contents": str(contents), "score": score}


def format_documents(documents: list[dict[str, Any]]) -> str:
    """Search-R1's passage format: `Doc i(Title: T) text`."""
    if not documents:
        return "No results."
    lines = []
    for index, document in enumerate(documents, start=1):
        title, _, text = document["contents"].partition("\n")
        lines.append(f"Doc {index}(Title: {title.strip(chr(34))}) {text.strip()}")
    return "\n".join(lines)


@tool(max_concurrency=32)
async def search(query: str, ctx: ToolContext, topk: Annotated[int, pydantic.Field(ge=1, le=10)] = 3) -> str:
    """Search the knowledge base and return the most relevant passages.

    Args:
        query: What to look for, in a few words.
        topk: How many passages to return (1 to 10).
    """
    url = ctx.settings.get("retriever_url")
    if not url:
        raise ToolError("no search service is configured for this environment (settings.retriever_url)")
    if not query.strip():
        raise ToolError("the query is empty")
    (documents,) = await retrieve(str(url), [query], topk)
    return format_documents(documents)
