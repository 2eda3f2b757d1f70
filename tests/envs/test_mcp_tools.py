"""MCP servers as tools (`pacerl.envs.tools.mcp_tools`), with the FastMCP server of
tests/envs/mcp_server_fixture.py
run inside the real local sandbox (bubblewrap, else unshare) over stdio."""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from pacerl.envs import Message, Task, ToolEnv
from pacerl.envs.rewards import Reward, exact_match
from pacerl.envs.tools import TOOLS, McpTool, SandboxPolicy, ToolContext, ToolError, get_tool, mcp_tools, tool
from pacerl.sandbox import Limits
from pacerl.sandbox.local import LocalOptions
from tests.envs import mcp_server_fixture

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "mcp_server_fixture.py"
SANDBOX_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"


def _distributions(root: str) -> list[metadata.Distribution]:
    """`root` and every distribution it requires, recursively (those installed here)."""
    seen: dict[str, metadata.Distribution] = {}
    pending = [root]
    while pending:
        name = pending.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            seen[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for requirement in seen[name].requires or []:
            if "extra ==" not in requirement:
                pending.append(re.split(r"[^A-Za-z0-9._-]", requirement.strip(), maxsplit=1)[0])
    return list(seen.values())


def _staged_server() -> Path:
    """The server and the `mcp` package with its dependencies, copied (hard links where the file system
    allows) into a folder every user may enter: the sandbox runs as an unprivileged uid, which cannot
    reach this checkout's venv when a folder above it is private (a checkout made by mktemp is 0700)."""
    stage = Path(tempfile.mkdtemp(prefix="pacerl-mcp-test-"))
    stage.chmod(0o755)
    atexit.register(shutil.rmtree, stage, True)
    site = stage / "site"
    for distribution in _distributions("mcp"):
        for file in distribution.files or []:
            source = Path(str(distribution.locate_file(file))).resolve()
            target = (site / file).resolve()
            if not source.is_file() or not target.is_relative_to(site):
                continue  # scripts and data outside site-packages
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
    for folder in [stage, *site.rglob("*")]:
        folder.chmod(0o755 if folder.is_dir() else 0o644)
    shutil.copy2(FIXTURE, stage / "server.py")
    (stage / "server.py").chmod(0o644)
    return stage


STAGE = _staged_server()
OPTIONS = {"ro_binds": ((str(STAGE / "site"), "/opt/site"), (str(STAGE / "server.py"), "/opt/mcp/server.py"))}
COMMAND = [SANDBOX_PYTHON, "/opt/mcp/server.py"]
ENV = {"PYTHONPATH": "/opt/site"}
LIMITS = Limits(timeout_s=10, memory_mb=512)

# Needed, never skipped: without it every test here would pass vacuously or not run.
assert Path(SANDBOX_PYTHON).exists(), f"the sandbox sees no {SANDBOX_PYTHON} to run the test's MCP server"


def fixture_tools(limits: Limits = LIMITS, register: bool = False, prefix: str = "fx_") -> dict[str, McpTool]:
    policy = SandboxPolicy(backend="local", limits=limits, options=OPTIONS)
    tools = mcp_tools(COMMAND, sandbox=policy, prefix=prefix, env=ENV, register=register)
    return {tool.name: tool for tool in tools}


@pytest.fixture(scope="module")
def tools() -> Iterator[dict[str, McpTool]]:
    """The fixture server's tools, registered as fx_* (listed once, in a sandbox, at definition)."""
    made = fixture_tools(register=True)
    yield made
    for name in made:
        TOOLS.pop(name, None)


async def call(tool: McpTool, context: ToolContext, **arguments: object) -> str:
    return await tool(arguments, context)


def test_the_tools_and_their_schemas_are_the_servers_own(tools: dict[str, McpTool]) -> None:
    served = asyncio.run(mcp_server_fixture.server.list_tools())  # the server's own listing, in-process
    assert sorted(tools) == sorted(f"fx_{tool.name}" for tool in served)
    for remote in served:
        schema = tools[f"fx_{remote.name}"].schema()
        assert schema["function"]["parameters"] == remote.input_schema
        assert schema["function"]["description"] == (remote.description or "").strip()
        assert schema["function"]["name"] == f"fx_{remote.name}"
    echo = tools["fx_echo"].schema()["function"]["parameters"]
    assert echo["required"] == ["text"] and echo["properties"]["times"]["default"] == 1
    assert get_tool("fx_add") is tools["fx_add"]  # registered: an env offers it by name


@pytest.mark.slow
def test_listing_the_same_server_again_replaces_and_a_taken_name_is_refused(
    tools: dict[str, McpTool],
) -> None:
    again = fixture_tools(register=True)
    try:
        assert get_tool("fx_add") is again["fx_add"]
    finally:
        TOOLS.update(tools)

    @tool(name="clash_add")
    def taken(a: int) -> str:
        """A tool that holds the name first."""
        return str(a)

    try:
        with pytest.raises(ValueError, match="a tool named 'clash_add' is already registered"):
            fixture_tools(register=True, prefix="clash_")
        assert "clash_echo" not in TOOLS  # nothing of the refused listing was registered
    finally:
        TOOLS.pop("clash_add", None)


async def test_calls_return_the_servers_text(tools: dict[str, McpTool]) -> None:
    context = ToolContext()
    try:
        assert await call(tools["fx_add"], context, a=2, b=40) == "42"
        # The server logs, pings the client and reports progress mid-call: the client answers, then reads on.
        assert await call(tools["fx_chatty"], context) == "the client answered the ping"
        # Calls of one episode share its server; concurrent ones take turns.
        echoed = await asyncio.gather(
            *(call(tools["fx_echo"], context, text=str(i), times=2) for i in range(3))
        )
        assert echoed == ["0 0", "1 1", "2 2"]
        assert context.sessions_open == 1
    finally:
        await context.aclose()
    assert context.sessions_open == 0


async def test_errors_are_tool_errors_the_model_reads(tools: dict[str, McpTool]) -> None:
    context = ToolContext()
    try:
        with pytest.raises(ToolError, match="boom"):  # a result flagged isError
            await call(tools["fx_fail"], context, reason="boom")
        with pytest.raises(ToolError, match="the MCP server answered: refused by the fixture"):
            await call(tools["fx_refuse"], context)  # a JSON-RPC error answer
        assert await call(tools["fx_add"], context, a=1, b=2) == "3"  # neither harmed the server
    finally:
        await context.aclose()


async def test_bad_arguments_are_refused_before_anything_is_sent(tools: dict[str, McpTool]) -> None:
    context = ToolContext()
    with pytest.raises(ToolError, match=r"invalid arguments for fx_add: .*'b' is a required property"):
        await call(tools["fx_add"], context, a=1)
    with pytest.raises(ToolError, match=r"a: 'one' is not of type 'integer'"):
        await call(tools["fx_add"], context, a="one", b=2)
    with pytest.raises(ToolError, match=r"times: 'twice' is not of type 'integer'"):
        await call(tools["fx_echo"], context, text="hi", times="twice")
    assert context.sessions_open == 0  # no server was started for them


def test_the_server_runs_inside_the_sandbox(tools: dict[str, McpTool]) -> None:
    host_file = HERE / "test_mcp_tools.py"
    assert host_file.is_file()  # the host sees it; the server cannot

    async def probe() -> str:
        context = ToolContext()
        try:
            return await call(tools["fx_probe"], context, path=str(host_file))
        finally:
            await context.aclose()

    seen = asyncio.run(probe())
    assert seen == f"hostname=sandbox {host_file}: cannot read: FileNotFoundError cwd=/work"


async def test_the_sandbox_memory_limit_applies_to_the_server(tools: dict[str, McpTool]) -> None:
    context = ToolContext()
    try:
        await call(tools["fx_remember"], context, note="before")
        assert await call(tools["fx_hog"], context, megabytes=64) == "allocated 64 MiB"
        with pytest.raises(ToolError, match="Error executing tool hog"):  # MemoryError: past 512 MiB
            await call(tools["fx_hog"], context, megabytes=2048)
        assert await call(tools["fx_recall"], context) == "memory=before disk=before"  # it lived on
    finally:
        await context.aclose()


async def test_a_dead_server_is_a_tool_error_and_the_next_call_starts_it_afresh(
    tools: dict[str, McpTool],
) -> None:
    context = ToolContext()
    try:
        await call(tools["fx_remember"], context, note="lost")
        with pytest.raises(ToolError, match="the MCP server exited with code 3"):
            await call(tools["fx_crash"], context)
        assert await call(tools["fx_recall"], context) == "memory= disk="  # a fresh server, clean sandbox
    finally:
        await context.aclose()


async def test_each_episode_has_a_server_of_its_own(tools: dict[str, McpTool]) -> None:
    first, second = ToolContext(), ToolContext()
    try:
        await asyncio.gather(
            call(tools["fx_remember"], first, note="first"), call(tools["fx_remember"], second, note="second")
        )
        assert await call(tools["fx_recall"], first) == "memory=first disk=first"
        assert await call(tools["fx_recall"], second) == "memory=second disk=second"
    finally:
        await first.aclose()
        await second.aclose()
    later = ToolContext()  # its sandbox may be a recycled one: nothing of the earlier episodes remains
    try:
        assert await call(tools["fx_recall"], later) == "memory= disk="
    finally:
        await later.aclose()


@pytest.mark.slow
async def test_a_hung_server_ends_at_the_call_limit_and_restarts() -> None:
    short = fixture_tools(limits=Limits(timeout_s=2, memory_mb=512), prefix="short_")
    context = ToolContext()
    try:
        with pytest.raises(ToolError, match=r"did not answer within the sandbox's limits \(.*limit"):
            await call(short["short_spin"], context)
        assert await call(short["short_add"], context, a=2, b=2) == "4"
    finally:
        await context.aclose()


def test_a_server_that_cannot_start_is_a_clear_error() -> None:
    policy = SandboxPolicy(backend="local", limits=LIMITS, options=OPTIONS)
    with pytest.raises(RuntimeError, match="could not start '/opt/nowhere/server'"):
        mcp_tools(["/opt/nowhere/server"], sandbox=policy, register=False)
    exits = [SANDBOX_PYTHON, "-c", "import sys; sys.exit('no configuration found')"]
    with pytest.raises(
        RuntimeError, match="exited with code 1; its stderr ends with: no configuration found"
    ):
        mcp_tools(exits, sandbox=policy, register=False)


class AddEnv(ToolEnv):
    """Add two numbers with the MCP server's `add` tool."""

    tool_names = ("fx_add",)

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.question}]

    def score(self, task: Task, final_message: str) -> Reward:
        correct = exact_match(final_message, task.answers)
        return Reward(total=correct, correctness=correct, format=1.0)


def test_an_env_offering_the_tools_completes_an_episode(tools: dict[str, McpTool]) -> None:
    env = AddEnv([Task("q1", "What is 20 + 22?", ("42",))])
    try:
        _, info = env.reset(seed=0)
        assert info["tools"] == ["fx_add"]
        assert env.tool_schemas() == [tools["fx_add"].schema()]
        call_add = '<tool_call>{"name": "fx_add", "arguments": {"a": 20, "b": 22}}</tool_call>'
        observation, reward, terminated, truncated, info = env.step(call_add)
        assert observation[0]["content"] == "42" and not info["error"]
        observation, reward, terminated, truncated, info = env.step(
            '<tool_call>{"name": "fx_add", "arguments": {"a": "twenty"}}</tool_call>'
        )
        assert info["error"] and "invalid arguments for fx_add" in observation[0]["content"]
        observation, reward, terminated, truncated, info = env.step("42")
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert env.sandbox_sessions_open == 0  # the episode's server went with it
    finally:
        env.close()


def test_read_only_binds_map_host_paths_and_refuse_hidden_targets() -> None:
    assert LocalOptions(ro_binds=("/usr/share", ("/usr/lib", "/opt/venv"))).ro_binds[1] == (
        "/usr/lib",
        "/opt/venv",
    )
    with pytest.raises(ValueError, match="/srv/nowhere does not exist on the host"):
        LocalOptions(ro_binds=(("/srv/nowhere", "/opt/venv"),))
    private = Path(tempfile.mkdtemp())  # 0700, as mktemp makes it
    (private / "site").mkdir(mode=0o755)
    try:
        with pytest.raises(ValueError, match=rf"{private} has mode 0700 \(other users may not enter it\)"):
            LocalOptions(ro_binds=((str(private / "site"), "/opt/site"),))
    finally:
        shutil.rmtree(private)
    for hidden in (
        "/work/venv",
        ("/srv/venv", "/tmp/venv"),
        ("/srv/venv", "/proc/x"),
        ("/srv/venv", "/work"),
    ):
        with pytest.raises(ValueError, match="would be hidden by the sandbox's own"):
            LocalOptions(ro_binds=(hidden,))
    with pytest.raises(ValueError, match="absolute paths"):
        LocalOptions(ro_binds=(("venv", "/opt/venv"),))
