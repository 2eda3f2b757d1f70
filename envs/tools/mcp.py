"""MCP servers as tools: every tool of a Model Context Protocol server becomes a pacerl tool, in one line.

    tools = mcp_tools(["python3", "-m", "my_server"], sandbox=SandboxPolicy(limits=Limits(timeout_s=10)),
                      prefix="fs_")

Where the server runs. Inside the sandbox, for the life of an episode: each episode that calls one of
the tools gets a sandbox session of its own for this server (started at the first call, released with
the episode's other sessions), whose interpreter starts the server as a child process with its stdio on
pipes. The server is therefore under every limit of the session (memory and processes of the whole
sandbox, its CPU budget per call, the wall clock of each call), sees the sandbox's file system and no
network, and its state (memory, files) ends with the episode: the next one starts a fresh server in a
clean sandbox.

How messages cross. The host speaks MCP with the official SDK (`mcp`): for each call a `ClientSession`
runs over memory streams whose far end is a bridge; the bridge hands each JSON-RPC message the client
writes to a cell of the session, where a small relay writes it to the server's stdin and reads the
server's stdout until the answer to a pending request (or a request of the server's own) arrives, and
hands those lines back to the client. One handshake (`initialize`) per server; later calls adopt it.
Request ids are renumbered per server, so no id is ever reused within the server's session.

A server over HTTP. `mcp_tools(url="http://host:port/mcp")` reaches a server that runs as a service of
its own (streamable HTTP, the protocol's current network transport) instead of starting one: it runs
wherever it runs, outside the sandbox. Each episode that calls its tools gets an MCP session of its
own (`initialize` at the first call, the server's `Mcp-Session-Id` on every later one), so a server
that keeps state per session keeps it for one episode; the session is ended (an HTTP DELETE) when the
episode's tool context is released. Each call opens a connection of its own, bounded by the call's
wall-clock limit. The legacy HTTP+SSE transport is not offered: it ties a session to one open event
stream, which no call here outlives.

What the model sees. A tool's schema is the server's own (name, description, `inputSchema`); arguments
that do not match it are refused before anything is sent. The text content of a result is the
observation. A result flagged `isError`, an error answer, a server that hangs past the call's limits,
dies, or answers more than the sandbox's output cap: each is a `ToolError` the model reads, never an
exception that ends the episode; a server that hung or died is stopped and the next call starts it
afresh (its state is gone, as the message says). Over HTTP the same holds for a call past its limit,
a server that cannot be reached, and one that forgot the episode's session (it restarted): the next
call starts a new session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import threading
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic

from pacerl.envs.tools.core import TOOLS, SandboxPolicy, Tool, ToolContext, ToolError
from pacerl.sandbox import ExecStatus, Limits, SandboxUsageError, Session

if TYPE_CHECKING:
    import httpx2
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
    from mcp.client.session import ClientSession
    from mcp.shared.message import SessionMessage
    from mcp_types import CallToolResult, InitializeResult, RequestId
    from mcp_types import Tool as ServerTool

log = logging.getLogger(__name__)
T = TypeVar("T")

MCP_POLICY = SandboxPolicy(limits=Limits(timeout_s=30, memory_mb=1024, output_cap_bytes=262_144))
"""The default policy of MCP tools: a call may take 30 s, the sandbox 1 GiB, a reply 256 KiB."""

_SANDBOX_FAILURE = -32010
"""The JSON-RPC error code (implementation-defined range) of a call the sandbox ended, not the server."""
_REPLY_HEADROOM = 1024
"""Bytes of a relay reply kept for what is not the server's messages (its status line)."""

# The relay, run by the session's interpreter inside the sandbox (standard library only). It holds the
# server's process and, per call, writes the host's lines to its stdin and reads its stdout until the
# answer to a pending request, or a request of the server's own, has come. The call's limits still
# apply: its wall-clock alarm interrupts a read that waits too long (the server is killed then), and
# the server's own CPU budget is renewed for each call as the interpreter's is.
_RELAY = r"""
import json as _json, os as _os, resource as _resource, signal as _signal, subprocess as _subprocess


class _PacerlMcpRelay:
    def __init__(self, command, env, cap):
        self.cap, self.process, self.reason = cap, None, ""
        self.log = open("/tmp/.mcp-server-stderr", "w+b")
        try:
            self.process = _subprocess.Popen(
                command, stdin=_subprocess.PIPE, stdout=_subprocess.PIPE, stderr=self.log,
                env=dict(_os.environ, **env),
            )
        except OSError as error:
            self.reason = f"could not start {command[0]!r}: {error.strerror or error}"

    def say(self, state, lines=(), reason="", asked=False):
        print(_json.dumps({"state": state, "reason": reason, "asked": asked}))
        for line in lines:
            print(line)

    def started(self):
        if self.process is None:
            return self.say("exited", reason=self.reason)
        return self.say("ok")

    def budget(self, cpu_s):
        try:
            with open(f"/proc/{self.process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            used = (int(fields[11]) + int(fields[12])) / _os.sysconf("SC_CLK_TCK")
            soft = int(used) + cpu_s + 1
            _resource.prlimit(self.process.pid, _resource.RLIMIT_CPU, (soft, _resource.RLIM_INFINITY))
        except (ProcessLookupError, FileNotFoundError):
            pass  # already gone: the exchange below finds out

    def exited(self, lines):
        try:
            code = self.process.wait(timeout=1)
        except _subprocess.TimeoutExpired:  # it closed its stdout but lives on
            self.process.kill()
            code = self.process.wait()
        if code < 0:
            name = _signal.Signals(-code).name
            why = " (its CPU time ran out)" if name == "SIGXCPU" else ""
            reason = f"the MCP server was killed by {name}{why}"
        else:
            reason = f"the MCP server exited with code {code}"
        self.log.seek(0, 2)
        self.log.seek(max(0, self.log.tell() - 600))
        tail = " ".join(self.log.read().decode("utf-8", "replace").split())
        self.process = None
        self.reason = reason + (f"; its stderr ends with: {tail}" if tail else "")
        self.say("exited", lines, self.reason)

    def exchange(self):
        chunks = []
        while True:
            chunk = _os.read(0, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        job = _json.loads(b"".join(chunks))
        if self.process is None:
            return self.say("exited", reason=self.reason or "the MCP server is not running")
        self.budget(job["cpu_s"])
        try:
            for line in job["lines"]:
                self.process.stdin.write(line.encode() + b"\n")
            self.process.stdin.flush()
        except OSError:
            return self.exited([])
        lines, size, wait, asked = [], 0, set(job["wait"]), False
        try:
            while wait:
                raw = self.process.stdout.readline(self.cap + 1)
                size += len(raw)
                if size > self.cap:
                    self.process.kill()
                    self.process = None
                    self.reason = "its answer was over the output cap"
                    return self.say("too_long", reason=self.reason)
                if not raw.endswith(b"\n"):
                    return self.exited(lines)
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if not line.strip():
                    continue
                lines.append(line)
                try:
                    message = _json.loads(line)
                except ValueError:
                    continue
                if not isinstance(message, dict):
                    continue
                if "method" in message:
                    if "id" in message:
                        asked = True  # the server asks the client something: the host answers next
                        break
                elif type(message.get("id")) is int and message["id"] in wait:
                    break
        except BaseException:
            self.process.kill()  # the call was interrupted (its limit): the server must not run on
            self.process = None
            raise
        self.say("ok", lines, asked=asked)
"""

_EXCHANGE_CELL = """
try:
    _pacerl_mcp_relay
except NameError:
    print('{"state": "exited", "reason": "the sandbox was restarted and the MCP server with it"}')
else:
    _pacerl_mcp_relay.exchange()
"""


@dataclass(frozen=True)
class _ServerPolicy(SandboxPolicy):
    """A tool's sandbox policy whose sessions are this server's own: an episode's MCP server never
    shares its sandbox (nor its limits) with another tool's code."""

    server: str = ""

    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        backend, options = super().key()
        return f"{backend} mcp:{self.server}", options


@dataclass(frozen=True)
class _Reply:
    lines: list[str]
    failure: str | None = None
    """Why the exchange failed, in words for the model."""
    fatal: bool = False
    """The server is gone or in an unknown state: the next call restarts it."""
    asked: bool = False
    """The last line is a request of the server's: the client's answer goes next."""


class McpServer:
    """One MCP server as the tools see it: its command, sandbox policy and listing, and its live
    processes, one per episode (in that episode's sandbox session)."""

    _ids = itertools.count()

    def __init__(
        self,
        command: Sequence[str],
        policy: SandboxPolicy,
        env: Mapping[str, str],
        start_timeout_s: float,
    ) -> None:
        if not command or not all(isinstance(part, str) and part for part in command):
            raise ValueError(f"command must be a non-empty list of strings, got {command!r}")
        self.command = tuple(command)
        self.env = dict(env)
        self.policy = _ServerPolicy(
            backend=policy.backend,
            limits=policy.limits,
            options=policy.options,
            server=f"{self.command[0]}#{next(self._ids)}",
        )
        limits = policy.limits
        self.start_limits = limits.replace(
            timeout_s=max(limits.timeout_s, start_timeout_s),
            cpu_s=None if limits.cpu_s is None else max(limits.cpu_s, start_timeout_s),
        )
        """The limits of the server's start (its answer to `initialize`): importing a server's
        packages can take longer than one of its calls."""
        self.info: str = ""
        """The server's name and version, as it introduced itself."""
        self._connections: weakref.WeakKeyDictionary[Session, _Connection] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"McpServer({list(self.command)!r}, server={self.info or '?'})"

    def connection(self, context: ToolContext) -> _Connection:
        """The episode's server (its sandbox session is the episode's, released with it)."""
        session = context.bound(self.policy).session()
        connection = self._connections.get(session)
        if connection is None:
            connection = self._connections[session] = _Connection(self, session)
        return connection

    async def list_tools(self) -> list[ServerTool]:
        """Start the server in a sandbox of its own, list its tools (every page), and stop it."""
        context = ToolContext()
        connection = self.connection(context)
        try:
            tools = await connection.use(_listing)
            if connection.initialized is not None:
                info = connection.initialized.server_info
                self.info = f"{info.name} {info.version}"
            return tools
        finally:
            await context.aclose()

    async def call(self, context: ToolContext, name: str, arguments: Mapping[str, Any]) -> CallToolResult:
        """Call the server's tool `name` in the episode's server; ToolError for anything expected."""
        return await self.connection(context).use(_calling(name, arguments))


async def _listing(client: ClientSession) -> list[ServerTool]:
    """Every tool of the server (every page of its listing)."""
    import mcp_types

    tools: list[ServerTool] = []
    cursor: str | None = None
    while True:
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await client.list_tools(params=params)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def _calling(name: str, arguments: Mapping[str, Any]) -> Callable[[ClientSession], Awaitable[CallToolResult]]:
    """The work of one call of the server's tool `name`."""
    import mcp_types

    request = mcp_types.CallToolRequest(
        params=mcp_types.CallToolRequestParams(name=name, arguments=dict(arguments))
    )

    async def call(client: ClientSession) -> CallToolResult:
        # send_request, not call_tool: the observation is the result's text, and call_tool would
        # list the tools again on every call to check structured output against its schema.
        return await client.send_request(request, mcp_types.CallToolResult)

    return call


_CLIENT_INFO = ("pacerl", "0.1.0")
"""The client's name and version, as it introduces itself to a server."""
_SESSION_HEADER = "mcp-session-id"
_VERSION_HEADER = "mcp-protocol-version"


class McpHttpServer:
    """One MCP server reached over streamable HTTP at `url`, and its sessions, one per episode."""

    def __init__(
        self, url: str, headers: Mapping[str, str], call_timeout_s: float, start_timeout_s: float
    ) -> None:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must be an http:// or https:// address, got {url!r}")
        if not call_timeout_s > 0 or not start_timeout_s > 0:
            raise ValueError("call_timeout_s and start_timeout_s must be > 0")
        self.url = url
        self.headers = dict(headers)
        """Sent with every request (e.g. an `authorization` header)."""
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.info: str = ""
        """The server's name and version, as it introduced itself."""
        self._episodes: weakref.WeakKeyDictionary[ToolContext, _HttpSession] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"McpHttpServer({self.url!r}, server={self.info or '?'})"

    def session(self, context: ToolContext) -> _HttpSession:
        """The episode's MCP session (ended when the episode's tool context is released)."""
        session = self._episodes.get(context)
        if session is None:
            session = self._episodes[context] = _HttpSession(self)
            weakref.finalize(context, session.end)
        return session

    async def list_tools(self) -> list[ServerTool]:
        """List the server's tools (every page) in a session of their own, then end it."""
        session = _HttpSession(self)
        try:
            tools = await session.use(_listing, self.start_timeout_s)
            if session.initialized is not None:
                info = session.initialized.server_info
                self.info = f"{info.name} {info.version}"
            return tools
        finally:
            session.end()

    async def call(self, context: ToolContext, name: str, arguments: Mapping[str, Any]) -> CallToolResult:
        """Call the server's tool `name` in the episode's session; ToolError for anything expected."""
        return await self.session(context).use(_calling(name, arguments), self.call_timeout_s)


class _HttpSession:
    """One episode's MCP session with a server over HTTP: its id and handshake, set at the first call."""

    def __init__(self, server: McpHttpServer) -> None:
        self.server = server
        self.id: str | None = None
        """The server's `Mcp-Session-Id` (None: the next call starts a session)."""
        self.initialized: InitializeResult | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    async def use(self, work: Callable[[ClientSession], Awaitable[T]], timeout_s: float) -> T:
        """Run `work` with a client in this session (started first if need be), within `timeout_s`."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:
            try:
                async with asyncio.timeout(timeout_s):
                    return await self._with_client(work, timeout_s)
            except TimeoutError:
                raise ToolError(
                    f"the MCP server at {self.server.url} did not answer within {timeout_s:g} s"
                ) from None

    async def _with_client(self, work: Callable[[ClientSession], Awaitable[T]], timeout_s: float) -> T:
        import httpx2
        import mcp_types
        from mcp.client.session import ClientSession
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared.exceptions import MCPError

        url = self.server.url
        headers = dict(self.server.headers)
        if self.id is not None and self.initialized is not None:
            headers |= {_SESSION_HEADER: self.id, _VERSION_HEADER: self.initialized.protocol_version}
        sent_id = self.id
        given: list[str] = []
        lost = False

        async def watch(response: httpx2.Response) -> None:
            nonlocal lost
            if sent_id is not None and response.status_code == 404:
                lost = True  # the server no longer knows the session: it restarted, or ended it
            elif sent_id is None and _SESSION_HEADER in response.headers:
                given.append(response.headers[_SESSION_HEADER])

        outcome: list[T] = []
        error: ToolError | None = None
        client_info = mcp_types.Implementation(name=_CLIENT_INFO[0], version=_CLIENT_INFO[1])
        http = httpx2.AsyncClient(
            headers=headers, timeout=httpx2.Timeout(timeout_s), event_hooks={"response": [watch]}
        )
        try:
            async with (
                http,
                streamable_http_client(url, http_client=http, terminate_on_close=False) as (read, write),
                ClientSession(read, write, client_info=client_info) as client,
            ):
                # Failures are caught inside: the transport's task group would wrap them in a group.
                try:
                    if self.initialized is None:
                        initialized = await client.initialize()
                        self.id, self.initialized = (given[-1] if given else None), initialized
                    else:
                        client.adopt(self.initialized)
                    outcome.append(await work(client))
                except MCPError as failure:
                    error = ToolError(f"the MCP server answered: {failure.message}")
                except (pydantic.ValidationError, RuntimeError) as failure:
                    message = str(failure).splitlines()[0]
                    error = ToolError(f"the MCP server's answer is malformed: {message}")
        except Exception as failure:
            reason = _network_failure(failure)
            if reason is None:
                raise
            self.id = self.initialized = None
            raise ToolError(f"could not reach the MCP server at {url}: {reason}") from None
        if lost:
            self.id = self.initialized = None
            error = ToolError(
                f"the MCP server at {url} no longer knows this episode's session (it restarted or ended "
                "it): its state for the episode is gone, and the next call starts a new session"
            )
        if error is not None:
            raise error
        return outcome[0]

    def end(self) -> None:
        """End the session on the server (an HTTP DELETE, sent on a thread of its own so that no
        caller waits on the server); idempotent."""
        session_id, self.id, self.initialized = self.id, None, None
        if session_id is None:
            return
        headers = {**self.server.headers, _SESSION_HEADER: session_id}
        url, timeout_s = self.server.url, self.server.call_timeout_s
        threading.Thread(target=_delete_session, args=(url, headers, timeout_s), daemon=True).start()


def _delete_session(url: str, headers: Mapping[str, str], timeout_s: float) -> None:
    import httpx2

    try:
        httpx2.delete(url, headers=dict(headers), timeout=timeout_s)
    except httpx2.HTTPError as error:  # the server is gone: so is the session
        log.debug("ending the MCP session at %s failed: %s", url, error)


def _network_failure(failure: BaseException) -> str | None:
    """What went wrong, if `failure` (or every exception of a group) is the network's, else None."""
    import httpx2

    if isinstance(failure, BaseExceptionGroup):
        reasons = [_network_failure(inner) for inner in failure.exceptions]
        return None if None in reasons else "; ".join(dict.fromkeys(r for r in reasons if r))
    if isinstance(failure, httpx2.HTTPError | OSError):
        return str(failure) or type(failure).__name__
    return None


class _Connection:
    """One episode's server: the sandbox session it runs in and the state of its MCP session."""

    def __init__(self, server: McpServer, session: Session) -> None:
        self.server = server
        # Weak: the server keeps its connections by session, weakly, so each goes with its episode.
        self._session = weakref.ref(session)
        self.initialized: InitializeResult | None = None
        self._lock = asyncio.Lock()
        self._started = False
        """A server was started in this session (a restart resets the session first)."""
        self._broken: str | None = "not started"
        """Why no server runs now (None: one runs and is initialized, or is being initialized)."""
        self._next_id = 1
        self._pending: dict[int, RequestId] = {}
        """Requests sent and not answered: the id the server saw -> the client's own."""

    @property
    def session(self) -> Session:
        session = self._session()
        if session is None:
            raise RuntimeError("the episode's sandbox session is gone")
        return session

    async def use(self, work: Callable[[ClientSession], Awaitable[T]]) -> T:
        """Run `work` with a client of this episode's server (started, or restarted, first)."""
        async with self._lock:
            if self._broken is not None:
                await self._start()
            try:
                return await self._with_client(work)
            finally:
                if self._pending:  # interrupted mid-call: the server's state is unknown
                    self._broken = "a call to it was interrupted"
                    self._pending.clear()

    async def _start(self) -> None:
        if self._started:
            await self.session.areset()  # a clean sandbox: nothing of the server that failed remains
        self._started = True
        self.initialized = None
        self._pending.clear()
        server = self.server
        cap = max(server.policy.limits.output_cap_bytes - _REPLY_HEADROOM, 256)
        arguments = (
            f"_json.loads({json.dumps(list(server.command))!r}), _json.loads({json.dumps(server.env)!r})"
        )
        start = f"_pacerl_mcp_relay = _PacerlMcpRelay({arguments}, {cap})\n_pacerl_mcp_relay.started()\n"
        code = f"{_RELAY}\n{start}"
        reply = await self._cell(code, "", server.start_limits)
        if reply.failure is not None:
            self._broken = reply.failure
            raise ToolError(f"the MCP server did not start: {reply.failure}")
        self._broken = None

    async def _with_client(self, work: Callable[[ClientSession], Awaitable[T]]) -> T:
        import anyio
        import mcp_types
        from mcp.client.session import ClientSession
        from mcp.shared.exceptions import MCPError
        from mcp.shared.message import SessionMessage

        to_client, from_bridge = anyio.create_memory_object_stream[SessionMessage | Exception](16)
        to_bridge, from_client = anyio.create_memory_object_stream[SessionMessage](16)
        outcome: list[T] = []
        error: ToolError | None = None
        async with to_client, from_bridge, to_bridge, from_client, anyio.create_task_group() as group:
            group.start_soon(self._bridge, from_client, to_client)
            client_info = mcp_types.Implementation(name="pacerl", version="0.1.0")
            try:
                async with ClientSession(from_bridge, to_bridge, client_info=client_info) as client:
                    # Failures are caught inside: the session's task group would wrap them in a group.
                    try:
                        if self.initialized is None:
                            self.initialized = await client.initialize()
                        else:
                            client.adopt(self.initialized)
                        outcome.append(await work(client))
                    except MCPError as failure:
                        sandbox = failure.code == _SANDBOX_FAILURE
                        text = failure.message if sandbox else f"the MCP server answered: {failure.message}"
                        error = ToolError(text)
                    except (pydantic.ValidationError, RuntimeError) as failure:
                        # A result that is not what the protocol says (or a protocol version we lack).
                        message = str(failure).splitlines()[0]
                        error = ToolError(f"the MCP server's answer is malformed: {message}")
            finally:
                group.cancel_scope.cancel()
        if self.initialized is None and self._broken is None:
            self._broken = "its handshake failed"  # a server that cannot say hello is restarted
        if error is not None:
            raise error
        return outcome[0]

    async def _bridge(
        self,
        outgoing: MemoryObjectReceiveStream[SessionMessage],
        incoming: MemoryObjectSendStream[SessionMessage | Exception],
    ) -> None:
        """Carry the client's messages to the server and the server's back, one exchange at a time."""
        import mcp_types

        async for item in outgoing:
            message = item.message
            if isinstance(message, mcp_types.JSONRPCRequest):
                server_id, self._next_id = self._next_id, self._next_id + 1
                self._pending[server_id] = message.id
                message = message.model_copy(update={"id": server_id})
            reply = await self._exchange([message.model_dump_json(by_alias=True, exclude_unset=True)])
            await self._deliver(reply, incoming)
            # Keep reading while a request waits for its answer (the relay stops at any pending id's,
            # and an exchange may end early), unless the server now waits for the client's answer.
            while self._pending and reply.failure is None and not reply.asked:
                reply = await self._exchange([])
                await self._deliver(reply, incoming)

    async def _deliver(
        self, reply: _Reply, incoming: MemoryObjectSendStream[SessionMessage | Exception]
    ) -> None:
        """Hand the server's messages to the client (answers under the client's own ids), and fail
        every pending request if the exchange failed."""
        import mcp_types
        from mcp.shared.message import SessionMessage

        for text in reply.lines:
            answer = _parse(text)
            if isinstance(answer, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError):
                if not isinstance(answer.id, int) or answer.id not in self._pending:
                    continue  # an answer to a request that was given up (or a stray id)
                answer = answer.model_copy(update={"id": self._pending.pop(answer.id)})
            if answer is not None:
                await incoming.send(SessionMessage(answer))
        if reply.failure is not None:
            if reply.fatal:
                self._broken = reply.failure
            error = mcp_types.ErrorData(code=_SANDBOX_FAILURE, message=reply.failure)
            for client_id in self._pending.values():
                failed = mcp_types.JSONRPCError(jsonrpc="2.0", id=client_id, error=error)
                await incoming.send(SessionMessage(failed))
            self._pending.clear()

    async def _exchange(self, lines: list[str]) -> _Reply:
        """Send `lines` to the server and read until a pending request's answer (or its own request)."""
        if self._broken is not None:
            return _Reply([], f"the MCP server is not running ({self._broken})", fatal=True)
        limits = self.server.policy.limits if self.initialized is not None else self.server.start_limits
        job = json.dumps({"lines": lines, "wait": sorted(self._pending), "cpu_s": limits.effective_cpu_s})
        return await self._cell(_EXCHANGE_CELL, job, limits)

    async def _cell(self, code: str, stdin: str, limits: Limits) -> _Reply:
        """Run one relay cell and read its reply (untrusted: the sandbox wrote it)."""
        try:
            result = await self.session.arun(code, stdin=stdin, limits=limits)
        except SandboxUsageError as error:  # refused before it ran: the server never saw the message
            return _Reply([], f"the sandbox refused the message: {error}")
        except BaseException:
            self._broken = "a call to it was interrupted"  # its reply may still be on the way
            raise
        if result.status is not ExecStatus.OK:
            details = result.reason or result.status.value
            if result.status is ExecStatus.TIMEOUT:
                failure = f"the MCP server did not answer within the sandbox's limits ({details})"
            elif result.status is ExecStatus.MEMORY:
                failure = f"the MCP server's sandbox ran out of memory ({details})"
            else:
                failure = f"the MCP server's sandbox failed ({details}): {result.stderr.strip()[-500:]}"
            return _Reply([], failure + "; it was stopped and the next call starts it afresh", fatal=True)
        head, _, body = result.stdout.partition("\n")
        try:
            status = json.loads(head)
            state, reason = status["state"], str(status["reason"])
        except (ValueError, KeyError, TypeError):
            state, reason = "garbled", f"the MCP relay answered {head[:80]!r}"
        if state == "too_long" or result.stdout_truncated:
            cap = limits.output_cap_bytes
            failure = f"the MCP server's answer is over the sandbox's output cap of {cap} bytes"
            return _Reply([], failure + " (Limits.output_cap_bytes); it was stopped", fatal=True)
        lines = [line for line in body.split("\n") if line.strip()]
        if state == "ok":
            return _Reply(lines, asked=status.get("asked") is True)
        return _Reply(lines, reason + "; the next call starts it afresh", fatal=True)


def _parse(line: str) -> Any:
    """A JSON-RPC message from the server's stdout line, or None (logged) for anything else."""
    import mcp_types

    try:
        return mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    except ValueError:
        log.debug("not a JSON-RPC message from the MCP server: %.200s", line)
        return None


@dataclass(frozen=True, kw_only=True)
class McpTool(Tool):
    """A tool of an MCP server: its schema is the server's, a call is a `tools/call` to the episode's
    server in its sandbox session. The server's JSON Schema (`input_schema`) is the contract: the
    inherited `arguments` model is an empty placeholder."""

    server: McpServer | McpHttpServer = field(compare=False)
    remote_name: str
    """The tool's name on the server (the pacerl name may carry a prefix)."""
    input_schema: Mapping[str, Any]
    """The server's JSON Schema of the arguments."""
    _validator: Any = field(compare=False, repr=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema, with the server's `inputSchema` as the parameters."""
        parameters = json.loads(json.dumps(self.input_schema))  # a copy the caller may change
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    async def __call__(self, arguments: Mapping[str, Any], context: ToolContext) -> str:
        """Check `arguments` against the server's schema, call the tool, and return its text."""
        errors = sorted(self._validator.iter_errors(dict(arguments)), key=lambda e: list(e.absolute_path))
        if errors:
            raise ToolError(f"invalid arguments for {self.name}: {_explain(errors)}")
        loop = asyncio.get_running_loop()
        gate = self._gates.setdefault(loop, asyncio.Semaphore(self.max_concurrency))
        async with gate:
            result = await self.server.call(context, self.remote_name, arguments)
        text = _render(result)
        if result.is_error:
            raise ToolError(text)
        return text


def _explain(errors: Sequence[Any]) -> str:
    parts = []
    for error in errors[:5]:
        where = ".".join(str(part) for part in error.absolute_path) or "arguments"
        parts.append(f"{where}: {error.message}")
    return "; ".join(parts)


def _render(result: CallToolResult) -> str:
    """What the model reads: the text of every content block (other kinds named), else the
    structured result as JSON."""
    import mcp_types

    parts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.EmbeddedResource) and isinstance(
            block.resource, mcp_types.TextResourceContents
        ):
            parts.append(block.resource.text)
        elif isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
            parts.append(f"[{block.type}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource: {block.uri}]")
        else:
            parts.append(f"[{block.type} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts) or "(no output)"


def mcp_tools(
    command: Sequence[str] | None = None,
    *,
    url: str | None = None,
    sandbox: SandboxPolicy | None = None,
    prefix: str = "",
    env: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
    call_timeout_s: float = 30.0,
    start_timeout_s: float = 60.0,
    max_concurrency: int = 64,
    register: bool = True,
) -> list[McpTool]:
    """The tools of an MCP server as pacerl tools: the server that `command` starts (stdio, in the
    sandbox), or the one that serves streamable HTTP at `url` (give one of the two).

    A `command`'s server is started once here, in a sandbox under `sandbox`, to list its tools; then
    once per episode that calls them, at the first call. A `url`'s server is asked for its tools here,
    in a session of their own; then each episode that calls them opens a session of its own. Each tool
    is registered under `prefix` + its name (unless `register=False`), so an env offers it by that name.

    Args:
        command: The server's command line inside the sandbox, e.g. `["python3", "-m", "my_server"]`.
            What it needs (its interpreter, its packages) must be visible there: the local backend's
            `ro_binds` option binds host paths in.
        url: The streamable HTTP endpoint of a running server, e.g. `"http://127.0.0.1:8000/mcp"`.
        sandbox: (command) Backend, limits and options of the server's sandbox (default `MCP_POLICY`).
            `limits.timeout_s` bounds each message exchange with the server; memory, processes and CPU
            time bound the whole sandbox.
        prefix: Prepended to each tool's name (keeps two servers' `search` tools apart).
        env: (command) Environment variables of the server, on top of the sandbox's own.
        headers: (url) HTTP headers sent with every request, e.g. `{"authorization": "Bearer ..."}`.
        call_timeout_s: (url) The wall-clock limit of one call (an episode's first call includes its
            session's handshake).
        start_timeout_s: The wall-clock limit of the server's start (its answer to `initialize`), when
            longer than `limits.timeout_s`; for a `url`, the limit of the listing here.
        max_concurrency: Calls of each tool running at once across episodes (one episode's calls to
            its server run one at a time).
        register: Register the tools by name (a name already taken by another tool is an error).
    """
    server: McpServer | McpHttpServer
    if url is not None and command is None:
        if sandbox is not None or env is not None:
            raise ValueError(
                "sandbox and env are for a server started by command; a url's server runs already"
            )
        server = McpHttpServer(url, headers or {}, call_timeout_s, start_timeout_s)
        where = url
    elif command is not None and url is None:
        if headers is not None:
            raise ValueError("headers are for a server at a url; a command's server speaks stdio")
        server = McpServer(command, sandbox or MCP_POLICY, env or {}, start_timeout_s)
        where = str(list(command))
    else:
        raise ValueError("give an MCP server's command (stdio) or its url (streamable HTTP), not both")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as worker:  # callable from async code too
            listed = worker.submit(asyncio.run, server.list_tools()).result()
    except ToolError as error:
        raise RuntimeError(f"could not list the tools of the MCP server {where}: {error}") from None
    tools = [_make_tool(server, remote, prefix, max_concurrency) for remote in listed]
    if register:
        for made in tools:
            taken = TOOLS.get(made.name)
            if taken is not None and not (isinstance(taken, McpTool) and _same_server(taken, made)):
                raise ValueError(f"a tool named {made.name!r} is already registered")
        for made in tools:
            TOOLS[made.name] = made
    return tools


def _make_tool(
    server: McpServer | McpHttpServer, remote: ServerTool, prefix: str, max_concurrency: int
) -> McpTool:
    import jsonschema

    schema = dict(remote.input_schema)
    validator_type = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator_type.check_schema(schema)
    except jsonschema.SchemaError as error:
        message = f"the MCP server's tool {remote.name!r} has an invalid inputSchema: {error.message}"
        raise ValueError(message) from None
    description = (
        remote.description or remote.title or f"The tool {remote.name} of the MCP server {server.info}."
    )
    return McpTool(
        name=prefix + remote.name,
        description=description.strip(),
        function=server.call,
        arguments=pydantic.create_model(f"{prefix}{remote.name}_arguments"),
        context_parameter=None,
        sandbox=server.policy if isinstance(server, McpServer) else None,
        max_concurrency=max_concurrency,
        server=server,
        remote_name=remote.name,
        input_schema=schema,
        _validator=validator_type(schema),
    )


def _same_server(a: McpTool, b: McpTool) -> bool:
    """Two listings of one server (the same command, env and policy, or the same url and headers):
    re-registering replaces."""
    if isinstance(a.server, McpHttpServer) or isinstance(b.server, McpHttpServer):
        return (
            isinstance(a.server, McpHttpServer)
            and isinstance(b.server, McpHttpServer)
            and (a.server.url, a.server.headers) == (b.server.url, b.server.headers)
            and a.remote_name == b.remote_name
        )
    return (
        a.server.command == b.server.command
        and a.server.env == b.server.env
        and dataclasses.replace(a.server.policy, server="") == dataclasses.replace(b.server.policy, server="")
        and a.remote_name == b.remote_name
    )
