"""pacerl/Math-v0: single-turn math, no tools (the PACE paper's first setting)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pacerl.envs.base import ToolEnv, ToolEnvConfig
from pacerl.envs.parsing import extract_boxed
from pacerl.envs.rewards import Reward, boxed_math_reward
from pacerl.envs.spaces import Message
from pacerl.envs.tasks import Task, load_tasks

SYSTEM_PROMPT = "Solve the problem. Give the final answer as \\boxed{...}."
PAPER_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""The directive math papers evaluate with (DeepSeek-R1's usage recommendation, Qwen2.5-Math's chain of
thought prompt): after the problem, in the user turn, with no system prompt (`settings["prompt"]` =
"paper", the math suites' default)."""


class MathEnv(ToolEnv):
    """## Description
    Single-turn math: one question, one answer, no tools.

    ## Action
    The assistant's message text.

    ## Observation
    The system prompt and the question on reset; an empty tuple after the (only) step. With
    `settings["prompt"] = "paper"` (the math suites'), no system prompt unless one is configured, and
    the question followed by `PAPER_INSTRUCTION` on a new line.

    ## Rewards
    1 if the last `\\boxed{}` is mathematically equal to the answer (math-verify), else 0.

    ## Episode End
    Terminated after the first message.

    ## Arguments
    `tasks`: a shipped set name, a .jsonl/.parquet path, or a list of `Task`s (default `math-train`);
    `config`: a `ToolEnvConfig`, whose fields are also keyword arguments (its turn limit is forced to
    1); `render_mode`: None or "ansi".

    ## Version History
    - v0: first version.
    """

    tool_names = ()
    validation_tasks = "math-val"
    warm_start_steps = {"clean": 75}  # noqa: RUF012 (a ClassVar of the base)

    def __init__(
        self,
        tasks: str | Sequence[Task] = "math-train",
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        **config_fields: Any,
    ) -> None:
        config = replace(self.resolve_config(config, **config_fields), max_turns=1, max_tool_calls=0)
        super().__init__(load_tasks(tasks) if isinstance(tasks, str) else tasks, config, render_mode)

    def initial_messages(self, task: Task) -> list[Message]:
        if self.config.settings.get("prompt") == "paper":  # a system prompt only when one is configured
            return self.pose("", f"{task.question}\n{PAPER_INSTRUCTION}")
        return self.pose(SYSTEM_PROMPT, task.question)

    def score(self, task: Task, final_message: str) -> Reward:
        return boxed_math_reward(final_message, task.answers, self.config.format_weight)

    def final_answer(self, final_message: str) -> str | None:
        """The answer `score` judges: the last `\\boxed{}`'s content (for maj@k's vote)."""
        return extract_boxed(final_message)

    def demonstration(self, task: Task, style: str, rng: random.Random) -> list[Message]:
        """`clean`: `\\boxed{N}` directly."""
        if style != "clean":
            raise ValueError(f"{type(self).__name__} writes clean demonstrations, not {style!r}")
        return [{"role": "assistant", "content": f"\\boxed{{{task.answer}}}"}]
