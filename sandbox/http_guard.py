"""What keeps pacerl's HTTP servers (`pacerl serve sandbox`, `pacerl serve retriever`, `pacerl serve
openai`) standing under hostile load: authentication before the body, bounded bodies, bounded body
memory, bounded headers, read timeouts, a bounded connection count and a bounded run queue.

The servers are FastAPI apps under uvicorn. Two layers guard them:

- `BodyGuard`, an ASGI middleware in front of the app. With an `authorize` check (the OpenAI server's
  API key), a request that fails it is HTTP 401 before a byte of its body is read. A declared
  `Content-Length` over the cap is HTTP 413 before a byte of the body is read, a malformed one HTTP
  400. Before reading a body the request reserves its size (the cap, when chunked) from a
  `BodyBudget` shared by all requests and keeps it until the answer is sent, so the bodies held in
  memory (raw and parsed) never add up to more than the budget, whatever the mix of requests. Past
  the budget requests wait (in arrival order, but small ones that fit go ahead of large ones that do
  not); past `max_waiting` waiting, or after `queue_timeout_s` of waiting, they get HTTP 503 with
  `Retry-After`. While reading, bytes are counted (a chunked body past the cap is 413) and the whole
  body must arrive within `body_timeout_s`, else HTTP 408 and the connection is closed. After a 401,
  413 or 503 the server reads and drops the rest of the body, so that the client reads the answer
  rather than a reset connection, for at most `header_timeout_s`: then the connection is closed.
- The connection, in uvicorn (`guarded_protocol`, a subclass of uvicorn's h11 protocol): a connection
  whose request line and headers have not all arrived within `header_timeout_s` of its opening or of
  the first byte of the request is closed (uvicorn itself has no such timeout: its keep-alive timer
  stops at the first byte, so a client sending one header byte at a time kept a connection forever).
  A request line plus headers over `max_header_bytes` is HTTP 431 and the connection is closed, whether
  they arrive in pieces or at once (h11 alone counts only headers still incomplete: 70 KB arriving
  whole passed). At most `max_connections` connections are kept: one more closes the connection
  that has waited longest for a request (unfinished headers, or idle between requests), so clients
  holding connections open cannot lock others out; when every connection is busy with a request, a
  request on one more is HTTP 503. `run_server` raises the open-file limit to fit them (else lowers
  the cap), so that accept() never fails for want of a file descriptor; were it to fail anyway,
  asyncio's report of it (a traceback for every attempt, thousands a second) is logged once a minute.

Every refusal is written by an `ErrorBody`: FastAPI's `{"detail": message}` by default
(`detail_body`), the OpenAI server's `{"error": {...}}` there.

`Gate` bounds the work itself (sandbox runs, BM25 searches, generations): `limit` at once, `max_queue`
waiting. Once the last large body of a burst is released, `release_freed_memory` hands glibc's free
pages back to the system, so the server's resident memory falls back after the load.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import dataclasses
import http
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # fastapi and uvicorn are imported where used: the `pacerl` CLI reads the config
    import fastapi
    import uvicorn
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True)
class HttpGuardConfig:
    """Limits on what one HTTP server accepts. Each server sets its own `max_body_bytes` and
    `body_budget_bytes` (sandbox.server.GUARD, envs.retriever.RetrieverLimits.guard); the rest are
    shared defaults."""

    max_body_bytes: int = 16 * MIB
    """Largest request body; a longer one is HTTP 413."""
    body_budget_bytes: int = 64 * MIB
    """Body bytes all requests together may hold at once, from before the body is read until the answer
    is sent (a chunked body counts as `max_body_bytes`); at least `max_body_bytes`."""
    max_waiting: int = 64
    """Requests that may wait for room in the body budget; one more is HTTP 503 at once."""
    queue_timeout_s: float = 30.0
    """Longest wait for room in the body budget before HTTP 503."""
    body_timeout_s: float = 30.0
    """The whole body must arrive within this many seconds of the server starting to read it (after
    any wait for the budget), else HTTP 408 and the connection is closed."""
    header_timeout_s: float = 10.0
    """The request line and headers must arrive within this many seconds of the connection opening
    (or of the first byte of a later request on it), else the connection is closed. It also bounds how
    long the rest of a refused body (413, 503) is read and dropped."""
    keep_alive_s: int = 5
    """An idle keep-alive connection is closed after this many seconds (uvicorn's timeout_keep_alive)."""
    max_connections: int = 2048
    """Connections kept at once. One more closes the connection that has waited longest for a request
    (unfinished headers, or idle); when all are busy with requests, a request on one more is HTTP 503.
    Each costs a few KiB, its unfinished headers at most `max_header_bytes`."""
    max_header_bytes: int = 16 * 1024
    """Request line plus headers; longer is HTTP 431 and the connection is closed."""

    def __post_init__(self) -> None:
        positive = {
            "max_body_bytes": self.max_body_bytes,
            "queue_timeout_s": self.queue_timeout_s,
            "body_timeout_s": self.body_timeout_s,
            "header_timeout_s": self.header_timeout_s,
            "keep_alive_s": self.keep_alive_s,
            "max_connections": self.max_connections,
            "max_header_bytes": self.max_header_bytes,
        }
        for name, value in positive.items():
            if not value > 0:  # also refuses NaN
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(
                f"body_budget_bytes ({self.body_budget_bytes}) must be at least max_body_bytes "
                f"({self.max_body_bytes}), or a body at the cap could never be read"
            )

    def summary(self) -> str:
        """One line for a server's startup log."""
        return (
            f"bodies up to {self.max_body_bytes} bytes, {self.body_budget_bytes} held at once, "
            f"{self.max_waiting} waiting for {self.queue_timeout_s:g} s at most; body within "
            f"{self.body_timeout_s:g} s, headers within {self.header_timeout_s:g} s (at most "
            f"{self.max_header_bytes} bytes); {self.max_connections} connections, idle ones closed "
            f"after {self.keep_alive_s} s"
        )


class BudgetExhaustedError(Exception):
    """No room in the body budget: the wait queue is full or the wait took too long."""


class BodyBudget:
    """A weighted semaphore over body bytes. Waiters are served in arrival order, but one that fits in
    what is free goes ahead of a larger one that does not: bodies at the cap (or chunked ones, which
    count as the cap) never hold up small requests, which are most of them. A large body waits until
    enough is free, at most `queue_timeout_s`. Counters are kept for /health and tests."""

    def __init__(self, total_bytes: int, max_waiting: int) -> None:
        self.total_bytes = total_bytes
        self.max_waiting = max_waiting
        self.reserved_bytes = 0
        self.holders = 0
        """Requests holding a reservation now (reading their body or being answered)."""
        self.peak_reserved_bytes = 0
        self.peak_holders = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int, timeout_s: float) -> AsyncIterator[None]:
        """Hold `nbytes` of the budget for the block; BudgetExhaustedError if none comes in time."""
        await self._acquire(nbytes, timeout_s)
        try:
            yield
        finally:
            self._release(nbytes)

    async def _acquire(self, nbytes: int, timeout_s: float) -> None:
        if self.reserved_bytes + nbytes <= self.total_bytes:
            self._grant(nbytes)
            return
        if len(self._waiters) >= self.max_waiting:
            raise BudgetExhaustedError(f"{self.waiting} requests already wait for room to read their body")
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, granted)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout_s):
                await granted
        except BaseException as error:
            if granted.done() and not granted.cancelled():
                self._release(nbytes)  # granted in the same instant as cancelled: give it back
            else:
                self._waiters.remove(entry)
                self._wake()  # the next in line may fit now that this one no longer blocks it
            if isinstance(error, TimeoutError):
                raise BudgetExhaustedError(f"no room to read the body within {timeout_s:g} s") from None
            raise

    def _grant(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.holders += 1
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.peak_holders = max(self.peak_holders, self.holders)

    def _release(self, nbytes: int) -> None:
        self.reserved_bytes -= nbytes
        self.holders -= 1
        self._wake()

    def _wake(self) -> None:
        for entry in list(self._waiters):  # in arrival order, each that fits
            nbytes, granted = entry
            if granted.done():
                continue  # cancelled (timed out); its task takes it off the queue when it next runs
            if self.reserved_bytes + nbytes <= self.total_bytes:
                self._waiters.remove(entry)
                self._grant(nbytes)
                granted.set_result(None)


class _MallocTrim:
    """glibc's `malloc_trim(0)`: hands the free pages of every malloc arena back to the system, which
    glibc does not do on its own for memory freed inside an arena (worker threads each get one).
    Measured with benchmarks/servers_load.py's maximal retriever requests: about 15 MiB less kept
    after a burst. A no-op where the C library has none (musl, macOS)."""

    def __init__(self) -> None:
        self._trim: Any = None
        self._looked_up = False

    def __call__(self) -> bool:
        if not self._looked_up:  # on first use: loading the C library is no cost to importers
            self._trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
            self._looked_up = True
        return bool(self._trim is not None and self._trim(0))


release_freed_memory = _MallocTrim()

TRIM_AFTER_BYTES = 1 * MIB
"""Bodies at least this large, once all released, are followed by `release_freed_memory()`."""


ErrorBody = Callable[[int, str], bytes]
"""(HTTP status, message) -> the body of a refusal, as JSON."""


def detail_body(status: int, message: str) -> bytes:
    """FastAPI's error shape, `{"detail": message}`: the refusals of the sandbox and retriever servers."""
    return json.dumps({"detail": message}).encode()


Authorize = Callable[["Scope"], "str | None"]
"""A request's scope (its path and headers) -> None when it may go on, else why not (HTTP 401)."""


def declared_length(headers: Iterable[tuple[bytes, bytes]], max_bytes: int) -> tuple[int | None, str]:
    """(Content-Length, "") from raw headers, None when absent; (None, problem) when malformed (400).
    A value with more digits than `max_bytes` is returned as `max_bytes + 1` without converting it
    (Python refuses to turn a string of over 4,300 digits into an int)."""
    values = {value.strip() for name, value in headers if name.lower() == b"content-length"}
    if not values:
        return None, ""
    if len(values) > 1:
        return None, "conflicting Content-Length headers"
    (value,) = values
    if not value.isdigit():  # bytes.isdigit is ASCII digits only: no sign, exponent or space
        shown = value[:40].decode("latin-1")
        return None, f"Content-Length must be a non-negative integer, got {shown!r}"
    digits = value.lstrip(b"0") or b"0"
    if len(digits) > len(str(max_bytes)):
        return max_bytes + 1, ""
    return int(digits), ""


class BodyGuard:
    """ASGI middleware: checks each request's authorization, then caps, budgets and times its body
    before the app sees it (the module docstring). The app receives the body as one message."""

    def __init__(
        self,
        app: ASGIApp,
        config: HttpGuardConfig,
        budget: BodyBudget,
        error_body: ErrorBody = detail_body,
        authorize: Authorize | None = None,
    ) -> None:
        self.app = app
        self.config = config
        self.budget = budget
        self.error_body = error_body
        self.authorize = authorize

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.authorize(scope) if self.authorize is not None else None
        if refused is not None:
            await self._refuse(send, 401, refused, close=False)
            return
        cap = self.config.max_body_bytes
        length, problem = declared_length(scope["headers"], cap)
        if problem:
            await self._refuse(send, 400, problem, close=True)  # the body's end is unknown: never in sync
            return
        chunked = any(name.lower() == b"transfer-encoding" for name, _ in scope["headers"])
        if not chunked and not length:  # no body at all (GET /health, an empty POST)
            await self.app(scope, receive, send)
            return
        if length is not None and length > cap:
            await self._refuse(send, 413, f"request body larger than {cap} bytes", close=False)
            return
        reserved = cap if length is None else length
        try:
            async with self.budget.reserve(reserved, self.config.queue_timeout_s):
                body = await self._read(receive, send)
                if body is not None:
                    await self.app(scope, _replay(body, receive), send)
                    del body  # the last reference: the memory can be handed back below
        except BudgetExhaustedError as error:
            busy = f"server busy: {error}; try again later"
            await self._refuse(send, 503, busy, close=False, retry_after_s=1)
            return
        if reserved >= TRIM_AFTER_BYTES and self.budget.reserved_bytes < TRIM_AFTER_BYTES:
            release_freed_memory()

    async def _read(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once the client left or was answered 408/413."""
        cap, timeout_s = self.config.max_body_bytes, self.config.body_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        chunks: list[bytes] = []
        received = 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                late = f"the request body did not arrive within {timeout_s:g} s"
                await self._refuse(send, 408, late, close=True)
                return None
            if message["type"] == "http.disconnect":
                return None  # the client left; nothing to answer
            chunk: bytes = message.get("body", b"")
            received += len(chunk)
            if received > cap:
                await self._refuse(send, 413, f"request body larger than {cap} bytes", close=False)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _refuse(
        self, send: Send, status: int, message: str, *, close: bool, retry_after_s: int | None = None
    ) -> None:
        await refuse(
            send, status, message, close=close, retry_after_s=retry_after_s, error_body=self.error_body
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body read already, then defers to the server's (which then
    only reports a disconnect). The body is dropped here once handed over."""
    pending: list[bytes] = [body]

    async def replayed() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replayed


async def refuse(
    send: Send,
    status: int,
    message: str,
    *,
    close: bool,
    retry_after_s: int | None = None,
    error_body: ErrorBody = detail_body,
) -> None:
    """Answer `error_body(status, message)` with `status`. With `close` the connection closes after
    the answer; without, the server reads and drops the rest of the body (the header timeout bounds
    how long), so that a client still sending it reads the answer instead of a reset connection."""
    body = error_body(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def guard_app(
    app: fastapi.FastAPI,
    config: HttpGuardConfig,
    *,
    error_body: ErrorBody = detail_body,
    authorize: Authorize | None = None,
) -> BodyBudget:
    """Put a `BodyGuard` in front of `app`; returns its budget (also at `app.state.body_budget`)."""
    budget = BodyBudget(config.body_budget_bytes, config.max_waiting)
    app.add_middleware(BodyGuard, config=config, budget=budget, error_body=error_body, authorize=authorize)
    app.state.body_budget = budget
    return budget


def budget_report(budget: BodyBudget) -> dict[str, int]:
    """The budget's state for a /health answer."""
    return {
        "budget_bytes": budget.total_bytes,
        "reserved_bytes": budget.reserved_bytes,
        "holders": budget.holders,
        "waiting": budget.waiting,
    }


class Gate:
    """A work limit: `limit` at once, at most `max_queue` more waiting (None: no cap), HTTP 503 with
    `Retry-After` past that (a `fastapi.HTTPException`, which each app's handler words). `what` names
    the work in the refusal ("runs", "searches")."""

    def __init__(self, limit: int, max_queue: int | None, what: str) -> None:
        if limit < 1 or (max_queue is not None and max_queue < 0):
            raise ValueError(f"{what} at once must be >= 1 (got {limit}), queued >= 0 (got {max_queue})")
        self.limit = limit
        self.max_queue = max_queue
        self.what = what
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(limit)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.max_queue is not None and self._slots.locked() and self.waiting >= self.max_queue:
            import fastapi

            raise fastapi.HTTPException(
                503, f"{self.running} {self.what} executing and {self.waiting} queued; try again later",
                headers={"Retry-After": "1"},
            )  # fmt: skip
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()


HEADERS_TOO_LARGE = "request line and headers larger than {cap} bytes"
"""The HTTP 431 message, formatted with `max_header_bytes`."""


def guarded_protocol(guard: HttpGuardConfig, error_body: ErrorBody = detail_body) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol under `guard`'s header timeout, header cap and connection cap (the module
    docstring); `error_body` writes its 431, 400 and 503 answers. A class, since uvicorn builds one
    protocol object per connection from it; the connections of one server share what it encloses."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    header_timeout_s, header_cap = guard.header_timeout_s, guard.max_header_bytes
    waiting: dict[Any, None] = {}
    """The connections waiting for a request (its headers unfinished, or idle between requests),
    longest waiting first: those closed to make room for a new one."""
    closing: set[Any] = set()
    """Connections closed to make room, not yet gone from uvicorn's count (they leave it a turn of the
    event loop later)."""

    class HeaderCappedConnection(h11.Connection):
        """h11's connection, which also refuses (RemoteProtocolError, hint 431) a request line plus
        headers over the cap that arrived whole: h11 itself checks only what is still incomplete."""

        head_too_large = False

        def next_event(self) -> Any:
            before_request = self.their_state is h11.IDLE
            before = len(self._receive_buffer)  # h11 counts what it consumed nowhere public
            try:
                event = super().next_event()
            except h11.RemoteProtocolError as error:
                self.head_too_large = before_request and error.error_status_hint == 431
                raise
            if isinstance(event, h11.Request) and before - len(self._receive_buffer) > header_cap:
                self.head_too_large = True
                raise h11.RemoteProtocolError("request headers too large", error_status_hint=431)
            return event

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._capped_conn = HeaderCappedConnection(h11.SERVER, max_incomplete_event_size=header_cap)
            self.conn = self._capped_conn
            self._header_deadline: asyncio.TimerHandle | None = None
            self._guarded_app = self.app
            self.app = self._app_within_connection_cap

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()
            self._wait_for_request()
            if self._over_the_cap():
                self._make_room()

        def data_received(self, data: bytes) -> None:
            between_requests = self.cycle is None or self.cycle.response_complete
            if between_requests and self._header_deadline is None:
                self._arm_header_deadline()  # the next request (or a refused body's rest) is coming
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived: its body is the app's to time
                self._cancel_header_deadline()
                waiting.pop(self, None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._wait_for_request()  # idle until the next request: first to go when room is short

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_deadline()
            waiting.pop(self, None)
            closing.discard(self)
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to what h11 refuses (it logs "Invalid HTTP request received."): 431 for
            headers over the cap, else 400; in `error_body`'s shape; the connection closes."""
            status, message = 400, msg
            if self._capped_conn.head_too_large:
                status, message = 431, HEADERS_TOO_LARGE.format(cap=header_cap)
            body = error_body(status, message)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            reason = http.HTTPStatus(status).phrase.encode()
            self.transport.write(
                self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
            )
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()

        async def _app_within_connection_cap(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and self._over_the_cap() and not self._make_room():
                busy = (
                    f"server busy: {guard.max_connections} connections, each with a request; try again later"
                )
                await refuse(send, 503, busy, close=True, retry_after_s=1, error_body=error_body)
                return
            await self._guarded_app(scope, receive, send)

        def _over_the_cap(self) -> bool:
            return len(self.connections) - len(closing) > guard.max_connections

        def _make_room(self) -> bool:
            """Close the connection that has waited longest for a request, unless that is this one;
            False when there is none."""
            oldest = next((other for other in waiting if other is not self), None)
            if oldest is None:
                return False
            logger.debug("closing %s to make room for %s", oldest.client, self.client)
            oldest._close()
            closing.add(oldest)
            return True

        def _wait_for_request(self) -> None:
            waiting.pop(self, None)
            waiting[self] = None

        def _arm_header_deadline(self) -> None:
            self._header_deadline = self.loop.call_later(header_timeout_s, self._header_deadline_passed)

        def _cancel_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _header_deadline_passed(self) -> None:
            self._header_deadline = None
            logger.debug("closing %s: no complete request within %g s", self.client, header_timeout_s)
            self._close()

        def _close(self) -> None:
            self._cancel_header_deadline()
            waiting.pop(self, None)
            if self.transport.is_closing():
                return
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    return GuardedH11Protocol


ACCEPT_BACKLOG = 2048
"""Connections the kernel queues before they are accepted (uvicorn's default), at most
`max_connections`; also how many asyncio accepts in one turn of its event loop."""


def accept_backlog(connections: int) -> int:
    return min(ACCEPT_BACKLOG, connections)


def uvicorn_config(
    app: ASGIApp,
    host: str,
    port: int,
    guard: HttpGuardConfig,
    *,
    error_body: ErrorBody = detail_body,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's settings for a guarded server: `guarded_protocol` (which keeps the connection cap:
    uvicorn's own limit_concurrency stays off) and `guard`'s keep-alive; `options` are passed on
    (log_level, access_log, ...)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(guard, error_body),
        timeout_keep_alive=guard.keep_alive_s,
        backlog=accept_backlog(guard.max_connections),
        h11_max_incomplete_event_size=guard.max_header_bytes,
        **options,
    )


SPARE_FILES = 256
"""File descriptors a server needs besides its connections (listening socket, logs, sandboxes' pipes)."""


def open_files_needed(connections: int) -> int:
    """File descriptors a server keeping `connections` may hold at once: those, a backlog's worth
    accepted in one turn of the event loop before room is made for them, as many closed to make room
    and not yet released, and SPARE_FILES."""
    return connections + 2 * accept_backlog(connections) + SPARE_FILES


def allow_open_files(connections: int) -> int:
    """Raise this process's soft limit on open files to `open_files_needed(connections)`, as far as the
    hard limit allows (a soft limit of 1,024 is common; past it accept() fails, and asyncio retries it
    for each connection waiting, logging a traceback each time). Returns the connections that fit."""
    import resource

    needed = open_files_needed(connections)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return connections
    room = soft - SPARE_FILES
    if room - 2 * ACCEPT_BACKLOG > ACCEPT_BACKLOG:  # a full backlog fits
        return min(connections, room - 2 * ACCEPT_BACKLOG)
    return min(connections, max(0, room // 3))


ACCEPT_FAILED = "socket.accept() out of system resource"
"""asyncio's report when accept() fails for want of file descriptors or memory."""


class QuietAcceptFailures:
    """An event loop exception handler that logs asyncio's accept() failures once a minute at most,
    with a count: asyncio (3.11) retries accept() for every connection waiting after a failure, and
    reports each with a traceback, thousands a second. Everything else goes to the default handler."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self.last_logged = float("-inf")
        self.unlogged = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last_logged < self.every_s:
            self.unlogged += 1
            return
        logging.getLogger("uvicorn.error").error(
            "accept() failed: %s (%d failures not logged since the last report); is the open-file "
            "limit (ulimit -n) too low for --max-connections?",
            context.get("exception"),
            self.unlogged,
        )
        self.last_logged, self.unlogged = now, 0


def run_server(
    app: ASGIApp,
    host: str,
    port: int,
    guard: HttpGuardConfig,
    *,
    error_body: ErrorBody = detail_body,
    **options: Any,
) -> None:
    """Serve `app` under `guard` with uvicorn until SIGINT/SIGTERM (`error_body` writes the refusals the
    protocol makes itself); `options` go to uvicorn.Config. The connection cap is lowered to what the
    open-file limit holds (RuntimeError when that is none)."""
    import uvicorn

    allowed = guard.max_connections
    fitting = allow_open_files(allowed)
    if fitting < 1:
        raise RuntimeError(
            f"the open-file limit leaves no room for connections (a server needs "
            f"{open_files_needed(1)} open files at least): raise it (ulimit -n)"
        )
    guard = dataclasses.replace(guard, max_connections=fitting)
    config = uvicorn_config(app, host, port, guard, error_body=error_body, **options)  # configures logging
    log = logging.getLogger("uvicorn.error")
    if fitting < allowed:
        log.warning("the open-file limit leaves room for %d of the %d connections allowed", fitting, allowed)
    log.info("HTTP limits: %s", guard.summary())

    class GuardedServer(uvicorn.Server):
        async def serve(self, sockets: Any = None) -> None:
            asyncio.get_running_loop().set_exception_handler(QuietAcceptFailures())
            await super().serve(sockets)

    GuardedServer(config).run()


GUARD_FLAGS = {
    "max_body_bytes": ("--max-body-bytes", int, "largest request body; longer is HTTP 413"),
    "body_budget_bytes": ("--body-budget-bytes", int, "body bytes held at once; past it requests wait"),
    "max_waiting": ("--max-waiting-bodies", int, "requests waiting for body budget; more get HTTP 503"),
    "queue_timeout_s": ("--queue-timeout", float, "seconds a request may wait for body budget, then 503"),
    "body_timeout_s": ("--body-timeout", float, "seconds for the whole body to arrive, then 408"),
    "header_timeout_s": ("--header-timeout", float, "seconds for a request's headers, then it is closed"),
    "keep_alive_s": ("--keep-alive", int, "seconds an idle keep-alive connection stays open"),
    "max_connections": ("--max-connections", int,
                        "connections kept at once; one more closes the longest idle, or is HTTP 503"),
    "max_header_bytes": ("--max-header-bytes", int, "request line plus headers; longer is HTTP 431"),
}  # fmt: skip
"""HttpGuardConfig field -> (flag, type, help), for every guarded server's command."""


def add_guard_flags(parser: argparse.ArgumentParser, body_defaults: tuple[str, str]) -> None:
    """The HTTP limits of a server, as flags. `body_defaults` are the server's own defaults of
    --max-body-bytes and --body-budget-bytes, as help text: the modules that compute them import
    fastapi, too slow for a parser built on every `pacerl` call (a test checks the two agree)."""
    shared = HttpGuardConfig()
    shown = {"max_body_bytes": body_defaults[0], "body_budget_bytes": body_defaults[1]}
    group = parser.add_argument_group("HTTP limits against hostile clients")
    for field, (flag, kind, text) in GUARD_FLAGS.items():
        default = shown.get(field, getattr(shared, field))
        metavar = "S" if field.endswith("_s") else "N"
        help_text = f"{text} (default: {default})"
        group.add_argument(
            flag, dest=f"http_{field}", type=kind, default=None, metavar=metavar, help=help_text
        )


def guard_from_flags(args: argparse.Namespace, defaults: HttpGuardConfig) -> HttpGuardConfig:
    """`defaults` with the HTTP limit flags given on the command line."""
    given = {field: getattr(args, f"http_{field}") for field in GUARD_FLAGS}
    return dataclasses.replace(
        defaults, **{field: value for field, value in given.items() if value is not None}
    )
