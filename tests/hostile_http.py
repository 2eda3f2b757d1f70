"""Hostile HTTP clients on raw sockets, for the servers' tests (tests/sandbox/test_sandbox_server.py,
tests/envs/test_retriever.py, tests/pacerl/test_serve_openai.py), and a guarded server on a thread.
Loopback only; every loop is bounded in count and time. The assertions wait for events (the server
answers, the server closes the connection), never for the machine's speed: each read has a generous
timeout, and hitting it means the server never did what it must."""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Any

from pacerl.sandbox.http_guard import ErrorBody, HttpGuardConfig, detail_body, uvicorn_config
from tests.helpers import ThreadServer, free_port

PATIENCE_S = 20.0
"""How long a client waits for the server to answer or close, far past every timeout under test."""


Answer = tuple[int, dict[str, str], bytes]
"""(status, headers with lower-case names, body)."""


def exchange(port: int, data: bytes) -> Answer:
    """Send `data` on a new connection to 127.0.0.1:`port` and read the answer, then the close the
    answer announced (`Connection: close`): socket.timeout if either takes over PATIENCE_S."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S) as connection:
        connection.sendall(data)
        answer = read_answer(connection)
        if answer[1].get("connection") == "close":
            assert read_to_close(connection) == b"", "more after an answer that closes the connection"
    return answer


def read_answer(connection: socket.socket) -> Answer:
    """One HTTP answer read off `connection`."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(65536)
        assert chunk, f"the server closed the connection without a (whole) answer: {received[:200]!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    if "content-length" not in headers:  # h11's own 400 has none: its body ends with the connection
        return int(status_line.split(" ")[1]), headers, body + read_to_close(connection)
    while len(body) < int(headers["content-length"]):
        chunk = connection.recv(65536)
        assert chunk, "the server closed the connection in the middle of its answer"
        body += chunk
    return int(status_line.split(" ")[1]), headers, body


def read_to_close(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received


def refused_then_closed_while_trickling(port: int, head: bytes) -> Answer:
    """Send `head` (a request whose body is refused), read the answer, then keep sending body bytes
    slowly: the server must drop them and, within its header timeout, close the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S) as connection:
        connection.sendall(head)
        answer = read_answer(connection)
        assert trickle_until_closed(connection), f"a refused body kept its connection for {PATIENCE_S:g} s"
    return answer


def trickle_until_closed(connection: socket.socket) -> bool:
    """Send a byte every 50 ms until the server closes the connection (True) or PATIENCE_S passes."""
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:  # bounded: at most PATIENCE_S / 50 ms bytes
        try:
            connection.sendall(b"x")
        except (BrokenPipeError, ConnectionResetError):
            return True
        readable, _, _ = select.select([connection], [], [], 0.05)
        if readable:
            try:
                if connection.recv(1024) == b"":
                    return True
            except ConnectionResetError:
                return True
    return False


def closed_by_server(client: socket.socket) -> bool:
    """Waits (up to the socket's timeout) for the server to close: True on EOF or reset, False if it
    sent something instead."""
    try:
        return client.recv(1024) == b""
    except ConnectionResetError:
        return True


def detail(body: bytes) -> Any:
    return json.loads(body)["detail"]


def post_head(path: str, content_length: bytes | int, content_type: str = "application/json") -> bytes:
    """The request line and headers of a POST whose body is yet to come."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n".encode()
        + b"Content-Length: "
        + str(content_length).encode()
        + b"\r\n\r\n"
    )


def assert_slow_headers_are_closed(port: int, path: str, connections: int = 100) -> None:
    """`connections` clients that never finish their headers, one that sends nothing at all, and one
    that trickles a header byte by byte: the server must close every one of them (recv gives b"")."""
    partial = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ".encode()
    stalled = []
    try:
        for _ in range(connections):
            client = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S)
            stalled.append(client)
            client.sendall(partial)
        silent = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S)
        stalled.append(silent)
        for client in stalled:
            assert closed_by_server(client), "a connection with unfinished headers got an answer"
    finally:
        for client in stalled:
            client.close()

    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S) as trickler:
        trickler.sendall(partial)
        assert trickle_until_closed(trickler), f"a client trickling its headers kept it for {PATIENCE_S:g} s"


def assert_idle_after_answer_then_partial_is_closed(port: int, request: bytes, path: str) -> None:
    """A keep-alive connection that got its answer and then starts a request it never finishes is
    closed too (the keep-alive timer alone stops at that request's first byte)."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S) as client:
        client.sendall(request)
        status, headers, _ = read_answer(client)
        assert status == 200 and headers.get("connection") != "close", (status, headers)
        client.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
        assert trickle_until_closed(client), "the unfinished second request kept its connection"


def assert_slow_body_is_408(port: int, path: str, partial_body: bytes) -> None:
    """Part of 100 declared bytes, then nothing: the body timeout (1 s in the guarded fixtures)
    answers 408, then the server closes the connection."""
    status, headers, body = exchange(port, post_head(path, 100) + partial_body)
    assert status == 408 and headers["connection"] == "close"
    assert detail(body) == "the request body did not arrive within 1 s"


def padded_request(path: str, head_bytes: int, *, ended: bool = True) -> bytes:
    """A GET of `path` whose request line and headers are `head_bytes` long (an X-Padding header makes
    up the length); without `ended` the blank line that ends the headers never comes."""
    start = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: ".encode()
    end = b"\r\n\r\n" if ended else b"\r\n"
    return start + b"a" * (head_bytes - len(start) - len(end)) + end


def assert_oversized_headers_are_431(port: int, path: str, cap: int = 16 * 1024) -> list[bytes]:
    """Headers of 20 KB and 70 KB sent at once, and 20 KB of headers that never end, are answered 431
    and the connection is closed; headers just under `cap` are served (`path` answers a GET with 200).
    Returns the bodies of the three 431 answers. (h11 alone counted only headers still incomplete:
    those that arrived whole, at any size, were served.)"""
    bodies = []
    for request in (padded_request(path, 20_000), padded_request(path, 70_000)):
        status, headers, body = exchange(port, request)
        assert status == 431 and headers["connection"] == "close", (len(request), status, body[:200])
        bodies.append(body)
    status, headers, body = exchange(port, padded_request(path, 20_000, ended=False))
    assert status == 431 and headers["connection"] == "close", ("unended", status, body[:200])
    bodies.append(body)
    status, _, body = exchange(port, padded_request(path, cap - 100))
    assert status == 200, (status, body[:200])
    return bodies


def open_silent_connections(port: int, count: int) -> list[socket.socket]:
    """`count` connections to 127.0.0.1:`port` that send nothing (the caller closes them)."""
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            opened.append(socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S))
    except BaseException:
        for connection in opened:
            connection.close()
        raise
    return opened


class GuardedServer(ThreadServer):
    """`app` served as `pacerl.sandbox.http_guard.run_server` serves it (the guard's protocol, connection cap
    and header cap, `error_body` for the answers the protocol writes itself), on a daemon thread of
    this process, at 127.0.0.1:`port`."""

    def __init__(self, app: Any, guard: HttpGuardConfig, error_body: ErrorBody = detail_body) -> None:
        config = uvicorn_config(
            app, "127.0.0.1", free_port(), guard, error_body=error_body, log_level="warning"
        )
        super().__init__(app, config=config)
