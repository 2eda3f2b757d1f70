"""pacerl/CodeMath-v0: tool-integrated math reasoning with a sandboxed python interpreter."""

from __future__ import annotations

from collections.abc import Sequence

from envs.base import ToolEnv, ToolEnvConfig
from envs.rewards import Reward, boxed_math_reward
from envs.spaces import Message
from envs.tasks import Task, load_tasks

SYSTEM_PROMPT = (
    "You solve math problems. Use the python tool to compute exactly: call it with "
    '<tool_call>{"name": "python", "arguments": {"code": "print(...)"}}</tool_call> '
    "or write a ```python block; its output comes back to you. "
    "Give the final answer as \\boxed{...} in a message without tool calls."
)


class CodeMathEnv(ToolEnv):
    """## Description
    Tool-integrated reasoning in the style of ReTool/SimpleTIR: the model may run Python in a
    persistent sandboxed interpreter (variables survive between calls) before it answers.

    ## Action
    The assistant's message text. Tool calls as Hermes `<tool_call>` JSON or fenced ```python blocks.

    ## Observation
    A tuple of chat messages: the system prompt and the question on reset; one `tool` message per
    call after a step (stdout/stderr, or an error the model can read); empty when the episode ends.

    ## Rewards
    1 if the last `\\boxed{}` of the final message is mathematically equal to the answer (math-verify),
    else 0; `format_weight` optionally rewards a well-formed wrong answer. Given at termination.

    ## Episode End
    Terminated when a message makes no tool call (the final answer). Truncated after `max_turns`
    messages, `max_tool_calls` calls, `max_context_chars` characters, or a failed call if
    `on_tool_error="truncate"`.

    ## Arguments
    `tasks`: a shipped set name, a .jsonl/.parquet path, or a list of `Task`s (default `codemath-train`);
    `config`: a `ToolEnvConfig`; `render_mode`: None or "ansi".

    ## Version History
    - v0: first version.
    """

    tool_names = ("python",)

    def __init__(
        self,
        tasks: str | Sequence[Task] = "codemath-train",
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(load_tasks(tasks) if isinstance(tasks, str) else tasks, config, render_mode)

    def initial_messages(self, task: Task) -> list[Message]:
        return self.pose(SYSTEM_PROMPT, task.question)

    def score(self, task: Task, final_message: str) -> Reward:
        return boxed_math_reward(final_message, task.answers, self.config.format_weight)
