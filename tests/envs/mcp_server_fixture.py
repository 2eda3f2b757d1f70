"""A small MCP server for tests/envs/test_mcp_tools.py, written with the SDK's FastMCP (named `MCPServer`
since mcp 2). The test runs it inside the sandbox over stdio: `python3 mcp_server_fixture.py`;
tests/envs/test_mcp_http.py serves it over streamable HTTP (`server.streamable_http_app()`)."""

from __future__ import annotations

import os
import socket

import anyio
import mcp_types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp.shared.message import ServerMessageMetadata

server = MCPServer("pacerl-fixture")
_notes: list[str] = []
_session_notes: dict[str, list[str]] = {}
"""Notes per MCP session (over HTTP one server holds many sessions; over stdio it has one)."""


def _session_key(ctx: Context) -> str:
    return (ctx.headers or {}).get("mcp-session-id", "stdio")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str, times: int = 1) -> str:
    """Repeat the text back.

    Args:
        text: What to repeat.
        times: How many times.
    """
    return " ".join([text] * times)


@server.tool()
def fail(reason: str) -> str:
    """Fail with this reason (a result flagged isError)."""
    raise ToolError(reason)


@server.tool()
def refuse() -> str:
    """Answer with a JSON-RPC error (a protocol error, not a tool result)."""
    raise MCPError(code=-32602, message="refused by the fixture")


@server.tool()
async def chatty(ctx: Context) -> str:
    """Log a message and ping the client before answering (messages of the server's own mid-call)."""
    await ctx.info("about to ping the client")
    await ctx.session.send_ping()
    await ctx.report_progress(1, 1)
    return "the client answered the ping"


@server.tool()
async def chatty_in_call(ctx: Context) -> str:
    """Log, ping the client and report progress, each tied to this call (over HTTP: on the call's own
    stream, where a ping of the server's own travels on the session's standalone stream)."""
    await ctx.info("about to ping the client")
    in_call = ServerMessageMetadata(related_request_id=ctx.request_id)
    await ctx.session.send_request(mcp_types.PingRequest(), mcp_types.EmptyResult, metadata=in_call)
    await ctx.report_progress(1, 1)
    return "the client answered the ping"


@server.tool()
def spin() -> str:
    """Loop forever (a server that hangs)."""
    while True:
        pass


@server.tool()
def hog(megabytes: int) -> str:
    """Allocate this much memory and say how much it got."""
    data = bytearray(megabytes * 1024 * 1024)
    return f"allocated {len(data) // (1024 * 1024)} MiB"


@server.tool()
def crash() -> str:
    """Exit the server process at once (a server that dies)."""
    os._exit(3)


@server.tool()
def probe(path: str) -> str:
    """Where the server runs: its host name, whether it can read `path`, and its working directory."""
    try:
        with open(path, "rb") as handle:
            readable = f"read {len(handle.read())} bytes"
    except OSError as error:
        readable = f"cannot read: {type(error).__name__}"
    return f"hostname={socket.gethostname()} {path}: {readable} cwd={os.getcwd()}"


@server.tool()
def remember(note: str) -> str:
    """Keep a note in the server's memory and in a file of its working directory."""
    _notes.append(note)
    with open("notes.txt", "a") as handle:
        handle.write(note + "\n")
    return f"{len(_notes)} note(s)"


@server.tool()
def recall() -> str:
    """The notes kept so far (in memory | on disk)."""
    on_disk = []
    if os.path.exists("notes.txt"):
        with open("notes.txt") as handle:
            on_disk = handle.read().split()
    return f"memory={','.join(_notes)} disk={','.join(on_disk)}"


@server.tool()
def session_note(note: str, ctx: Context) -> str:
    """Keep a note for this MCP session only."""
    notes = _session_notes.setdefault(_session_key(ctx), [])
    notes.append(note)
    return f"{len(notes)} note(s) in this session"


@server.tool()
def session_notes(ctx: Context) -> str:
    """The notes this MCP session kept."""
    return "notes=" + ",".join(_session_notes.get(_session_key(ctx), []))


@server.tool()
async def stall() -> str:
    """Wait (almost) forever without using the CPU (a server that never answers)."""
    await anyio.sleep(3600)
    return "woke up"


if __name__ == "__main__":
    server.run()
