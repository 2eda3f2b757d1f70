"""MCP servers over streamable HTTP (`mcp_tools(url=...)`): the FastMCP server of
tests/envs/mcp_server_fixture.py served on loopback by uvicorn, spoken to with the real protocol."""

from __future__ import annotations

import asyncio
import gc
import queue
from collections.abc import Iterator
from typing import Any

import pytest

from pacerl.envs import Message, Task, ToolEnv
from pacerl.envs.rewards import Reward, exact_match
from pacerl.envs.tools import TOOLS, McpTool, ToolContext, ToolError, get_tool, mcp_tools
from tests.envs import mcp_server_fixture
from tests.helpers import ThreadServer, free_port

HANG_GUARD_S = 60
"""How long a test waits for the server to see an episode's end (it comes at once; this only stops a hang)."""


class Watched:
    """The fixture's streamable HTTP app, with every session the server was asked to end (DELETE)."""

    def __init__(self) -> None:
        self.app = mcp_server_fixture.server.streamable_http_app()  # a session manager of its own
        self.ended: queue.Queue[str] = queue.Queue()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "DELETE":
            self.ended.put(dict(scope["headers"]).get(b"mcp-session-id", b"").decode())
        await self.app(scope, receive, send)


def wait_ended(app: Watched, ids: set[str]) -> None:
    """Return once the server was asked to end each session of `ids` (others may end meanwhile)."""
    seen: set[str] = set()
    while not ids <= seen:
        seen.add(app.ended.get(timeout=HANG_GUARD_S))


def serve(port: int | None = None) -> tuple[ThreadServer, Watched]:
    app = Watched()
    return ThreadServer(app, port=port, lifespan="on"), app  # type: ignore[arg-type]


def http_tools(url: str, prefix: str = "hx_", **options: Any) -> dict[str, McpTool]:
    return {t.name: t for t in mcp_tools(url=url, prefix=prefix, register=False, **options)}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Watched]]:
    thread, app = serve()
    with thread:
        yield f"{thread.url}/mcp", app


@pytest.fixture(scope="module")
def tools(server: tuple[str, Watched]) -> Iterator[dict[str, McpTool]]:
    made = {t.name: t for t in mcp_tools(url=server[0], prefix="hx_")}
    yield made
    for name in made:
        TOOLS.pop(name, None)


async def call(tool: McpTool, context: ToolContext, **arguments: object) -> str:
    return await tool(arguments, context)


def session_of(tool: McpTool, context: ToolContext) -> str:
    session_id = tool.server.session(context).id  # type: ignore[union-attr]
    assert isinstance(session_id, str) and session_id
    return session_id


def test_the_tools_and_their_schemas_are_the_servers_own(tools: dict[str, McpTool]) -> None:
    served = asyncio.run(mcp_server_fixture.server.list_tools())
    assert sorted(tools) == sorted(f"hx_{tool.name}" for tool in served)
    for remote in served:
        function = tools[f"hx_{remote.name}"].schema()["function"]
        assert function["parameters"] == remote.input_schema
        assert function["description"] == (remote.description or "").strip()
    assert get_tool("hx_add") is tools["hx_add"]  # registered: an env offers it by name
    assert tools["hx_add"].sandbox is None  # the server runs as a service of its own
    assert tools["hx_add"].server.info.startswith("pacerl-fixture ")  # as it introduced itself


async def test_calls_errors_and_bad_arguments(tools: dict[str, McpTool]) -> None:
    context = ToolContext()
    assert await call(tools["hx_add"], context, a=2, b=40) == "42"
    # The server logs, pings the client and reports progress mid-call (over the call's event stream).
    assert await call(tools["hx_chatty_in_call"], context) == "the client answered the ping"
    echoed = await asyncio.gather(*(call(tools["hx_echo"], context, text=str(i), times=2) for i in range(3)))
    assert echoed == ["0 0", "1 1", "2 2"]
    with pytest.raises(ToolError, match="boom"):  # a result flagged isError
        await call(tools["hx_fail"], context, reason="boom")
    with pytest.raises(ToolError, match="the MCP server answered: refused by the fixture"):
        await call(tools["hx_refuse"], context)
    with pytest.raises(ToolError, match=r"invalid arguments for hx_add: .*'b' is a required property"):
        await call(tools["hx_add"], context, a=1)
    assert await call(tools["hx_add"], context, a=1, b=2) == "3"  # none of it harmed the session


async def test_each_episode_has_a_session_of_its_own_ended_with_it(
    server: tuple[str, Watched], tools: dict[str, McpTool]
) -> None:
    first, second = ToolContext(), ToolContext()
    await asyncio.gather(
        call(tools["hx_session_note"], first, note="a"), call(tools["hx_session_note"], second, note="b")
    )
    assert await call(tools["hx_session_note"], first, note="c") == "2 note(s) in this session"
    assert await call(tools["hx_session_notes"], first) == "notes=a,c"
    assert await call(tools["hx_session_notes"], second) == "notes=b"
    ids = {session_of(tools["hx_add"], first), session_of(tools["hx_add"], second)}
    assert len(ids) == 2
    del first, second
    gc.collect()
    wait_ended(server[1], ids)
    later = ToolContext()
    assert await call(tools["hx_session_notes"], later) == "notes="


class NoteEnv(ToolEnv):
    """Keep a note with the MCP server, then answer."""

    tool_names = ("hx_session_note",)

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.question}]

    def score(self, task: Task, final_message: str) -> Reward:
        correct = exact_match(final_message, task.answers)
        return Reward(total=correct, correctness=correct, format=1.0)


def test_an_env_offering_the_tools_completes_an_episode_and_ends_its_session(
    server: tuple[str, Watched], tools: dict[str, McpTool]
) -> None:
    env = NoteEnv([Task("q1", "Note x, then say done.", ("done",))])
    try:
        env.reset(seed=0)
        note = '<tool_call>{"name": "hx_session_note", "arguments": {"note": "x"}}</tool_call>'
        observation, _, _, _, info = env.step(note)
        assert observation[0]["content"] == "1 note(s) in this session" and not info["error"]
        session_id = session_of(tools["hx_session_note"], env._context)  # type: ignore[arg-type]
        assert env.step("done")[1:4] == (1.0, True, False)
        wait_ended(server[1], {session_id})  # released with the episode
    finally:
        env.close()


async def test_a_dead_server_is_a_tool_error_and_a_restarted_one_gets_a_new_session() -> None:
    thread, _ = serve()
    with thread:
        url = f"{thread.url}/mcp"
        short = http_tools(url)
        context = ToolContext()
        await call(short["hx_session_note"], context, note="kept")
    with pytest.raises(ToolError, match=rf"could not reach the MCP server at {url}: .*"):
        await call(short["hx_session_note"], context, note="lost")
    again, _ = serve(thread.port)
    with again:
        # The failed call dropped the session: the next one starts a new one, its state empty.
        assert await call(short["hx_session_notes"], context) == "notes="
        second = ToolContext()
        await call(short["hx_session_note"], second, note="kept")
    restarted, _ = serve(thread.port)
    with restarted:  # a server that forgot the session without the client seeing it go
        with pytest.raises(
            ToolError, match=r"no longer knows this episode's session .* state for the episode is gone"
        ):
            await call(short["hx_session_notes"], second)
        assert await call(short["hx_session_notes"], second) == "notes="  # a new session


async def test_a_call_past_its_limit_is_a_tool_error(server: tuple[str, Watched]) -> None:
    stalling = http_tools(server[0], call_timeout_s=1)
    context = ToolContext()
    with pytest.raises(ToolError, match=rf"the MCP server at {server[0]} did not answer within 1 s"):
        await call(stalling["hx_stall"], context)


def test_a_server_that_cannot_be_reached_or_a_bad_spec_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(
        RuntimeError, match=rf"could not list the tools of the MCP server {url}: could not reach"
    ):
        mcp_tools(url=url, register=False)
    with pytest.raises(ValueError, match=r"command .* or its url .*, not both"):
        mcp_tools(["python3", "server.py"], url=url)
    with pytest.raises(ValueError, match=r"command .* or its url"):
        mcp_tools()
    with pytest.raises(ValueError, match="url must be an http:// or https:// address, got 'ftp://x/mcp'"):
        mcp_tools(url="ftp://x/mcp")
    with pytest.raises(ValueError, match="sandbox and env are for a server started by command"):
        mcp_tools(url=url, env={"A": "1"})
