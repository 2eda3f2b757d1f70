"""pacerl/Search-v0: search-augmented question answering against a Search-R1-compatible retriever."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from envs.base import ToolEnv, ToolEnvConfig
from envs.parsing import Parsed, ToolCall
from envs.rewards import Reward, answer_tag_reward
from envs.spaces import Message
from envs.tasks import Task, load_tasks

SYSTEM_PROMPT = (
    "Answer the question. If you lack knowledge, search for it: call the search tool with "
    '<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call> and the most relevant '
    "passages come back to you. You may search as often as you need. When you know the answer, reply "
    "without tool calls and put only the answer inside <answer> and </answer>, "
    "e.g. <answer> Beijing </answer>."
)


class SearchEnv(ToolEnv):
    """## Description
    Search-augmented reasoning in the style of Search-R1: the model may query a retriever (BM25 over a
    corpus, or any server speaking Search-R1's `/retrieve` schema) before it answers a factual question.

    ## Action
    The assistant's message text. Tool calls as Hermes `<tool_call>` JSON calling `search`
    (`{"query": str, "topk": 1..10}`) or as Search-R1's `<search>query</search>` tags; the final answer
    inside `<answer>...</answer>`.

    ## Observation
    A tuple of chat messages: the system prompt and the question on reset; one `tool` message per
    call after a step (the passages as `Doc i(Title: T) text`, or an error the model can read); empty
    when the episode ends.

    ## Rewards
    Exact match (SQuAD normalization) of the last `<answer>` against any accepted answer: 1 or 0, and 0
    without an `<answer>` tag; `format_weight` optionally rewards a well-formed wrong answer. Token F1
    is reported in `info["reward_breakdown"]["f1"]`, not rewarded. Given at termination.

    ## Episode End
    Terminated when a message makes no tool call (the final answer). Truncated after `max_turns`
    messages, `max_tool_calls` calls, `max_context_chars` characters, or a failed call (retriever down,
    bad arguments) if `on_tool_error="truncate"`.

    ## Arguments
    `tasks`: a shipped set name, a .jsonl/.parquet path, or a list of `Task`s (default `search-train`;
    its corpus is envs/data/search-corpus.jsonl, `pacerl serve retriever --corpus ...`);
    `config`: a `ToolEnvConfig` (default: Hermes calls only), whose `settings["retriever_url"]` is the
    retriever's address; `render_mode`: None or "ansi"; `retriever_url`: sets that setting.

    ## Version History
    - v0: first version.
    """

    tool_names = ("search",)

    def __init__(
        self,
        tasks: str | Sequence[Task] = "search-train",
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        retriever_url: str | None = None,
    ) -> None:
        # Fenced code would parse as calls of a `python` tool this env does not offer.
        config = config or ToolEnvConfig(tool_formats=("hermes",))
        if retriever_url is not None:
            config = replace(config, settings={**config.settings, "retriever_url": retriever_url})
        super().__init__(load_tasks(tasks) if isinstance(tasks, str) else tasks, config, render_mode)

    def initial_messages(self, task: Task) -> list[Message]:
        return self.pose(SYSTEM_PROMPT, task.question)

    def score(self, task: Task, final_message: str) -> Reward:
        return answer_tag_reward(final_message, task.answers, self.config.format_weight)

    def parse(self, action: str) -> Parsed:
        """Hermes tool calls, and Search-R1's own `<search>query</search>` tags."""
        parsed = super().parse(action)
        tagged = [
            ToolCall("search", {"query": match.group(1).strip()}, match.start())
            for match in re.finditer(r"<search>(.*?)</search>", action, flags=re.DOTALL)
        ]
        if not tagged:
            return parsed
        calls = sorted([*parsed.calls, *tagged], key=lambda call: call.start)
        return Parsed(tuple(calls), parsed.errors)
