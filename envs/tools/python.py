"""The `python` tool: a persistent interpreter per episode, in the sandbox."""

from __future__ import annotations

from pacerl.envs.tools.core import SandboxPolicy, ToolContext, ToolError, tool
from pacerl.sandbox import ExecResult, ExecStatus, Limits

PYTHON_POLICY = SandboxPolicy(limits=Limits(timeout_s=10, memory_mb=512, output_cap_bytes=4096))


def format_result(result: ExecResult) -> str:
    """What the model sees: stdout, then stderr, then why the run did not end well."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append(result.stderr.rstrip("\n"))
    if result.status is not ExecStatus.OK and result.status is not ExecStatus.ERROR:
        parts.append(f"[{result.status.value}: {result.reason}]")
    return "\n".join(parts) if parts else "(no output)"


@tool(sandbox=PYTHON_POLICY, max_concurrency=32)
async def python(code: str, ctx: ToolContext) -> str:
    """Run Python code in a persistent interpreter: variables and imports survive between calls.
    Print what you want to see; the value of a last bare expression is shown too.

    Args:
        code: Python source code to execute.
    """
    result = await ctx.session().arun(code)
    if result.status in (ExecStatus.OK, ExecStatus.ERROR):
        return format_result(result)  # the code's own exception is an ordinary observation
    raise ToolError(format_result(result))  # limits hit or sandbox down: a failed call
