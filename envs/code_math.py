"""pacerl/CodeMath-v0: tool-integrated math reasoning with a sandboxed python interpreter."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from typing import Any

from pacerl.envs.base import ToolEnv, ToolEnvConfig
from pacerl.envs.parsing import extract_boxed
from pacerl.envs.rewards import Reward, boxed_math_reward
from pacerl.envs.spaces import Message
from pacerl.envs.tasks import Task, load_tasks

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
    `tasks`: a shipped set name, a .jsonl/.parquet path, or a list of `Task`s (default
    `codemath-forms-train`: arithmetic in 30 surface forms, `pacerl.envs.tasks.codemath_tasks`;
    `codemath-train`: "What is EXPR?" only); validation on `codemath-val` ("What is EXPR?"), and on the
    six forms held out of training, `codemath-heldout`, reported on its own;
    `config`: a `ToolEnvConfig`, whose fields are also keyword arguments (`max_turns=1`);
    `render_mode`: None or "ansi".

    ## Version History
    - v0: first version.
    """

    tool_names = ("python",)
    validation_tasks = "codemath-val"
    # Questions in surface forms no training task is written in (envs.tasks.HELDOUT_FORMS).
    extra_validation_tasks = {"heldout": "codemath-heldout"}  # noqa: RUF012 (a ClassVar of the base)
    # The default: the skill first (clean tool use in every training form, 200 steps), then the
    # teacher's habit of answering easy problems directly (200): RL closes that behaviour gap on held-out
    # forms too, where the teacher alone leaves a miscopying skill gap (docs/training.md#the-default-run).
    # The teacher alone opens docs/learnability.md's behaviour gap in 300 steps; clean demonstrations
    # stop at 75 (the skill gap: greedy accuracy 30-50%).
    warm_start_steps = {"clean+teacher": 400, "teacher": 300, "clean": 75}  # noqa: RUF012 (a ClassVar of the base)
    warm_start_stages = {"clean+teacher": ("clean", "teacher")}  # noqa: RUF012 (a ClassVar of the base)

    def __init__(
        self,
        tasks: str | Sequence[Task] = "codemath-forms-train",
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        **config_fields: Any,
    ) -> None:
        tasks = load_tasks(tasks) if isinstance(tasks, str) else tasks
        super().__init__(tasks, config, render_mode, **config_fields)

    def initial_messages(self, task: Task) -> list[Message]:
        return self.pose(SYSTEM_PROMPT, task.question)

    def score(self, task: Task, final_message: str) -> Reward:
        return boxed_math_reward(final_message, task.answers, self.config.format_weight)

    def final_answer(self, final_message: str) -> str | None:
        """The answer `score` judges: the last `\\boxed{}`'s content (for maj@k's vote)."""
        return extract_boxed(final_message)

    def demonstration(self, task: Task, style: str, rng: random.Random) -> list[Message]:
        """`clean`: a python call running the task's program (`print(EXPR)`, or a short program for the
        two-step forms), its output, then `\\boxed{N}`. `teacher`: the same, but on
        easy problems (an operand of at most two digits) the answer comes directly, correctly, with
        probability `TEACHER_DIRECT_P`: a student copies the habit but cannot do the arithmetic, so RL
        has a tool-use behaviour to learn (docs/learnability.md's behaviour gap)."""
        if style not in self.warm_start_steps or style in self.warm_start_stages:
            styles = ", ".join(s for s in self.warm_start_steps if s not in self.warm_start_stages)
            raise ValueError(f"{type(self).__name__} writes {styles} demonstrations, not {style!r}")
        direct = style == "teacher" and is_easy(task) and rng.random() < TEACHER_DIRECT_P
        return code_math_turns(task, direct=direct)


_ARITHMETIC_RE = re.compile(r"^What is ([0-9][0-9 +*()-]*)\?$")
TEACHER_DIRECT_P = 0.8
"""Chance that the "teacher" answers an easy problem directly instead of calling the tool."""


def task_program(task: Task) -> str:
    """The python that prints `task`'s answer: the program its generator wrote (`metadata["code"]`, every
    form of `pacerl.envs.tasks.codemath_tasks`), else the expression of a plain "What is EXPR?" question."""
    code = task.metadata.get("code")
    if isinstance(code, str) and code.strip():
        return code
    match = _ARITHMETIC_RE.match(task.question)
    if match is None or "**" in match.group(1):
        raise ValueError(
            f"task {task.id!r} carries no program (metadata['code']) and is not a 'What is EXPR?' "
            f"arithmetic question: {task.question!r}"
        )
    return f"print({match.group(1)})"


def code_math_turns(task: Task, *, direct: bool = False) -> list[Message]:
    """The assistant and tool turns of a CodeMath demonstration: the task's program (`task_program`)
    through the python tool, whose output is the answer, then `\\boxed{N}`; `direct`: only the boxed
    answer."""
    code = task_program(task)
    answer: Message = {"role": "assistant", "content": f"\\boxed{{{task.answer}}}"}
    if direct:
        return [answer]
    call = {"name": "python", "arguments": {"code": code}}
    return [
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "name": "python", "content": task.answer},
        answer,
    ]


def is_easy(task: Task) -> bool:
    """docs/learnability.md's "easy" arithmetic problem: one of its operands has at most two digits."""
    return any(len(operand) <= 2 for operand in re.findall(r"\d+", task.question))
