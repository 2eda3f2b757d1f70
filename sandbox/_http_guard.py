"""What keeps pacerl's HTTP servers (`pacerl serve sandbox`, `pacerl serve retriever`) standing under
hostile load: bounded bodies, bounded body memory, read timeouts and a bounded run queue.

Both servers are FastAPI apps under uvicorn. Two layers guard them:

- `BodyGuard`, an ASGI middleware in front of the app. A declared `Content-Length` over the cap is
  HTTP 413 before a byte of the body is read, a malformed one HTTP 400. Before reading a body the
  request reserves its size (the cap, when chunked) from a `BodyBudget` shared by all requests and
  keeps it until the answer is sent, so the bodies held in memory (raw and parsed) never add up to
  more than the budget, whatever the mix of requests. Past the budget requests wait (in arrival
  order, but small ones that fit go ahead of large ones that do not); past `max_waiting` waiting, or
  after `queue_timeout_s` of waiting, they get HTTP 503 with `Retry-After`. While reading, bytes are
  counted (a chunked body past the cap is 413) and the whole body must arrive within
  `body_timeout_s`, else HTTP 408 and the connection is closed. After a 413 or 503 the server reads
  and drops the rest of the body, so that the client reads the answer rather than a reset
  connection, for at most `header_timeout_s`: then the connection is closed.
- The connection, in uvicorn: `protocol_with_header_timeout` closes a connection whose request line
  and headers have not all arrived within `header_timeout_s` of its opening or of the first byte of
  the request (uvicorn itself has no such timeout: its keep-alive timer stops at the first byte, so a
  client sending one header byte at a time kept a connection forever); headers are capped at
  `max_header_bytes` (h11 answers 400 past it) and at most `max_connections` connections are served
  at once (more get uvicorn's 503).

`Gate` bounds the work itself (sandbox runs, BM25 searches): `limit` at once, `max_queue` waiting.
Once the last large body of a burst is released, `release_freed_memory` hands glibc's free pages
back to the system, so the server's resident memory falls back after the load.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import json
import logging
from collections.abc import AsyncIterator, Iterable
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
    """Connections served at once; a request on one more is uvicorn's HTTP 503 (its limit_concurrency).
    High enough that a thousand slow-loris connections, until their header timeout, leave room for
    everyone else (each costs a few KiB, its unfinished headers at most `max_header_bytes`)."""
    max_header_bytes: int = 16 * 1024
    """Request line plus headers; longer is HTTP 400 (h11's max_incomplete_event_size)."""

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
    """ASGI middleware: caps, budgets and times each request body before the app sees it (the module
    docstring). The app receives the body as one message."""

    def __init__(self, app: ASGIApp, config: HttpGuardConfig, budget: BodyBudget) -> None:
        self.app = app
        self.config = config
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.config.max_body_bytes
        length, problem = declared_length(scope["headers"], cap)
        if problem:
            await refuse(send, 400, problem, close=True)  # the body's end is unknown: never in sync again
            return
        chunked = any(name.lower() == b"transfer-encoding" for name, _ in scope["headers"])
        if not chunked and not length:  # no body at all (GET /health, an empty POST)
            await self.app(scope, receive, send)
            return
        if length is not None and length > cap:
            await refuse(send, 413, f"request body larger than {cap} bytes", close=False)
            return
        reserved = cap if length is None else length
        try:
            async with self.budget.reserve(reserved, self.config.queue_timeout_s):
                body = await self._read(receive, send)
                if body is not None:
                    await self.app(scope, _replay(body, receive), send)
                    del body  # the last reference: the memory can be handed back below
        except BudgetExhaustedError as error:
            await refuse(send, 503, f"server busy: {error}; try again later", close=False, retry_after_s=1)
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
                await refuse(send, 408, f"the request body did not arrive within {timeout_s:g} s", close=True)
                return None
            if message["type"] == "http.disconnect":
                return None  # the client left; nothing to answer
            chunk: bytes = message.get("body", b"")
            received += len(chunk)
            if received > cap:
                await refuse(send, 413, f"request body larger than {cap} bytes", close=False)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
    send: Send, status: int, detail: str, *, close: bool, retry_after_s: int | None = None
) -> None:
    """Answer `{"detail": ...}` with `status`. With `close` the connection closes after the answer;
    without, the server reads and drops the rest of the body (the header timeout bounds how long),
    so that a client still sending it reads the answer instead of a reset connection."""
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def guard_app(app: fastapi.FastAPI, config: HttpGuardConfig) -> BodyBudget:
    """Put a `BodyGuard` in front of `app`; returns its budget (also at `app.state.body_budget`)."""
    budget = BodyBudget(config.body_budget_bytes, config.max_waiting)
    app.add_middleware(BodyGuard, config=config, budget=budget)
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
    `Retry-After` past that. `what` names the work in the refusal ("runs", "searches")."""

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


def protocol_with_header_timeout(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol plus a header read timeout: once a connection opens, or once the first
    byte of its next request arrives, that request's line and headers must all arrive within
    `header_timeout_s`, or the connection is closed. (uvicorn closes idle keep-alive connections, but
    its timer stops at the first byte received, so a client sending a header a byte at a time held a
    connection forever.) A class, since uvicorn builds one protocol object per connection from it."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

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

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._header_deadline = self.loop.call_later(header_timeout_s, self._header_deadline_passed)

        def _cancel_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _header_deadline_passed(self) -> None:
            self._header_deadline = None
            if self.transport.is_closing():
                return
            logger.debug("closing %s: no complete request within %g s", self.client, header_timeout_s)
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    return HeaderTimeoutH11Protocol


def uvicorn_config(
    app: ASGIApp, host: str, port: int, guard: HttpGuardConfig, **options: Any
) -> uvicorn.Config:
    """uvicorn's settings for a guarded server: the header timeout protocol and the connection limits
    of `guard`; `options` are passed on (log_level, access_log, ...)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_with_header_timeout(guard.header_timeout_s),
        timeout_keep_alive=guard.keep_alive_s,
        limit_concurrency=guard.max_connections,
        h11_max_incomplete_event_size=guard.max_header_bytes,
        **options,
    )


SPARE_FILES = 256
"""File descriptors a server needs besides its connections (listening socket, logs, sandboxes' pipes)."""


def allow_open_files(connections: int) -> int:
    """Raise this process's soft limit on open files to fit `connections` plus SPARE_FILES, as far as
    the hard limit allows (a soft limit of 1,024 is common; past it, accept() fails and uvicorn stops
    accepting anyone for a second at a time). Returns the connections that fit."""
    import resource

    needed = connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY:
        return connections
    return min(connections, soft - SPARE_FILES)


def run_server(app: ASGIApp, host: str, port: int, guard: HttpGuardConfig, **options: Any) -> None:
    """Serve `app` under `guard` with uvicorn until SIGINT/SIGTERM; `options` go to uvicorn.Config."""
    import uvicorn

    config = uvicorn_config(app, host, port, guard, **options)  # configures uvicorn's logging
    log = logging.getLogger("uvicorn.error")
    fitting = allow_open_files(guard.max_connections)
    if fitting < guard.max_connections:
        log.warning(
            "the open-file limit leaves room for %d of the %d connections allowed",
            fitting,
            guard.max_connections,
        )
    log.info("HTTP limits: %s", guard.summary())
    uvicorn.Server(config).run()
