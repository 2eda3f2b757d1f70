"""A process whose env ran a tool call that timed out on the sync path (`env.step`) ends cleanly: closing
the env and, at exit, the shared sandbox the tool ran in leaves no task destroyed pending and none
failing unseen (a pool fill cancelled by the close used to discard its sandbox after the backend had
let its watchdog go: "Task exception was never retrieved ... write to closed file")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = '''
from pacerl.envs import Task, ToolEnv
from pacerl.envs.rewards import Reward
from pacerl.envs.tools import SandboxPolicy, ToolContext, tool
from pacerl.sandbox import Limits


@tool(sandbox=SandboxPolicy(limits=Limits(timeout_s=1, memory_mb=128)))
async def spin(code: str, ctx: ToolContext) -> str:
    """Run Python code once in a fresh sandbox.

    Args:
        code: The program.
    """
    result = await ctx.run(code)
    return f"{result.status.value}: {result.reason}"


class SpinEnv(ToolEnv):
    """One question; the model may run code."""

    tool_names = ("spin",)

    def initial_messages(self, task):
        return [{"role": "user", "content": task.question}]

    def score(self, task, final_message):
        return Reward(total=0.0, correctness=0.0, format=1.0)


env = SpinEnv(tasks=[Task("q1", "spin", ("a",))])
env.reset(seed=0)
call = '<tool_call>{"name": "spin", "arguments": {"code": "while True: pass"}}</tool_call>'
observation, _, terminated, truncated, _ = env.step(call)
print(observation[0]["content"], terminated, truncated)
env.close()
env.close()
'''


def test_a_process_that_timed_out_a_call_on_the_sync_path_ends_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "spin_env.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("timeout: ") and done.stdout.split()[-2:] == ["False", "False"], done.stdout
    for complaint in ("Task was destroyed but it is pending", "Task exception was never retrieved",
                      "no running event loop", "Traceback"):  # fmt: skip
        assert complaint not in done.stderr, done.stderr[-3000:]
