"""Tools: schema from the signature, argument validation, sandbox policy, and the tutorial page."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal

import pydantic
import pytest

from pacerl.envs.tools import TOOLS, SandboxPolicy, ToolContext, ToolError, get_tool, make_tool
from pacerl.envs.tools.python import format_result
from pacerl.sandbox import ExecResult, ExecStatus, Limits

DOCS = Path(__file__).resolve().parents[2] / "docs"


async def lookup(
    word: str,
    mode: Literal["exact", "prefix"] = "exact",
    limit: Annotated[int, pydantic.Field(ge=1, le=5)] = 2,
    tags: list[str] | None = None,
) -> str:
    """Look a word up in the dictionary.

    Args:
        word: The word to find.
        mode: How to match: exact or prefix.
        limit: At most this many entries,
            counted after matching.
        tags: Only entries with these tags.

    Returns:
        The entries.
    """
    return f"{word}:{mode}:{limit}:{tags}"


def test_schema_comes_from_signature_and_docstring() -> None:
    schema = make_tool(lookup).schema()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "lookup"
    assert function["description"] == "Look a word up in the dictionary."
    parameters = function["parameters"]
    assert parameters["required"] == ["word"]
    assert parameters["additionalProperties"] is False
    props = parameters["properties"]
    assert props["word"] == {"type": "string", "description": "The word to find."}
    assert props["mode"]["enum"] == ["exact", "prefix"] and props["mode"]["default"] == "exact"
    assert props["limit"]["maximum"] == 5 and props["limit"]["minimum"] == 1
    assert props["limit"]["description"] == "At most this many entries, counted after matching."
    assert "Returns" not in str(props)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "word: Field required"),
        ({"word": 3}, "word: Input should be a valid string"),
        ({"word": "a", "mode": "fuzzy"}, "mode: Input should be 'exact' or 'prefix'"),
        ({"word": "a", "limit": 9}, "limit: Input should be less than or equal to 5"),
        ({"word": "a", "extra": 1}, "extra: Extra inputs are not permitted"),
        ({"word": "a", "tags": "x"}, "tags: Input should be a valid list"),
    ],
)
async def test_bad_arguments_become_tool_errors(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ToolError, match=re.escape(message)):
        await make_tool(lookup)(arguments, ToolContext())


async def test_valid_arguments_with_defaults_and_coercion() -> None:
    assert await make_tool(lookup)({"word": "cat", "limit": "3"}, ToolContext()) == "cat:exact:3:None"


def test_definition_errors_are_raised_at_decoration() -> None:
    def undocumented(x: int) -> str:
        return str(x)

    def untyped(x) -> str:  # type: ignore[no-untyped-def]
        """Doc."""
        return str(x)

    with pytest.raises(ValueError, match="needs a docstring"):
        make_tool(undocumented)
    with pytest.raises(ValueError, match="needs a type annotation"):
        make_tool(untyped)
    with pytest.raises(KeyError, match=r"no tool named 'nope'; registered: .*python"):
        get_tool("nope")


async def test_sync_tools_and_non_string_results() -> None:
    def shout(text: str) -> str:
        """Upper-case the text.

        Args:
            text: Anything.
        """
        return text.upper()

    def broken(text: str) -> int:
        """Returns the wrong type.

        Args:
            text: Anything.
        """
        return 1

    assert await make_tool(shout)({"text": "hi"}, ToolContext()) == "HI"
    with pytest.raises(TypeError, match="returned int"):
        await make_tool(broken)({"text": "hi"}, ToolContext())


async def test_max_concurrency_is_enforced() -> None:
    running = peak = 0

    async def slow(n: int) -> str:
        """Sleep a little.

        Args:
            n: Which call.
        """
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        return str(n)

    limited = make_tool(slow, max_concurrency=2)
    results = await asyncio.gather(*(limited({"n": i}, ToolContext()) for i in range(6)))
    assert results == [str(i) for i in range(6)] and peak == 2


async def test_python_tool_keeps_state_per_episode_and_releases_it() -> None:
    python = get_tool("python")
    first, second = ToolContext(), ToolContext()
    try:
        assert await python({"code": "x = 5"}, first) == "(no output)"
        assert await python({"code": "x * 2"}, first) == "10"
        assert "NameError" in await python({"code": "x"}, second)  # episodes are isolated
        assert first.sessions_open == 1
    finally:
        await first.aclose()
        await second.aclose()
    assert first.sessions_open == 0


async def test_python_tool_limit_hits_are_tool_errors() -> None:
    python = get_tool("python")
    context = ToolContext()
    quick = SandboxPolicy(limits=Limits(timeout_s=1))
    try:
        slow = make_tool(python.function, name="python_quick", sandbox=quick)
        # The tool's own 1 s policy ended the cell (the reason says so), not the cell's 20 s sleep.
        with pytest.raises(ToolError, match=r"\[timeout: wall-clock limit of 1 s exceeded\]") as raised:
            await slow({"code": "import time\ntime.sleep(20)\nprint('woke')"}, context)
        assert "woke" not in str(raised.value)
    finally:
        await context.aclose()


def test_tools_without_a_policy_cannot_reach_a_sandbox() -> None:
    with pytest.raises(RuntimeError, match="no sandbox policy"):
        ToolContext().bound(None).session()


def test_format_result() -> None:
    ok = ExecResult(ExecStatus.OK, 0, "4\n", "", 0.1)
    assert format_result(ok) == "4"
    failed = ExecResult(ExecStatus.ERROR, 1, "", "Traceback ...\nValueError: x\n", 0.1, "exit code 1")
    assert format_result(failed) == "Traceback ...\nValueError: x"
    killed = ExecResult(ExecStatus.MEMORY, 1, "partial\n", "MemoryError\n", 0.1, "memory limit exceeded")
    assert format_result(killed) == "partial\nMemoryError\n[memory: memory limit exceeded]"


@pytest.mark.slow
def test_the_tutorial_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/tools.md end to end: its `# my_tools.py` blocks become a module outside the package, its
    other Python blocks run against it, then its shell blocks train and evaluate that module's env with
    the `pacerl` command, and the run's outputs are where the page says."""
    page = (DOCS / "tools.md").read_text()
    python = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    module = [block for block in python if block.startswith("# my_tools.py")]
    assert len(python) == 4 and len(module) == 2
    (tmp_path / "my_tools.py").write_text("\n\n".join(module))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import my_tools  # type: ignore[import-not-found]

        namespace: dict[str, object] = dict(vars(my_tools))
        for block in python:
            if block not in module:
                exec(compile(block, "docs/tools.md", "exec"), namespace)
        assert "shell" in TOOLS
    finally:
        TOOLS.pop("shell", None)
        sys.modules.pop("my_tools", None)
    (shell,) = re.findall(r"```bash\n(.*?)```", page, flags=re.DOTALL)
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shell],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    run_dir = tmp_path / "runs" / "quiz"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 3 and [e["step"] for e in summary["evaluations"]] == [0, 3]
    assert json.loads((run_dir / "eval.json").read_text())["episodes"] == 2
    plots = sorted(line for line in ran.stdout.splitlines() if line.endswith(".png"))
    assert plots and plots == sorted(path.name for path in (run_dir / "plots").iterdir())
