"""pacerl/Search-v0: search-augmented question answering against a Search-R1-compatible retriever."""

from __future__ import annotations

import contextlib
import functools
import json
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from envs.base import ToolEnv, ToolEnvConfig
from envs.parsing import Parsed, ToolCall
from envs.retriever import BM25Index, local_retriever
from envs.rewards import Reward, answer_tag_reward
from envs.spaces import Message
from envs.tasks import DATA_DIR, Task, load_tasks
from envs.tools.core import get_tool
from envs.tools.search import format_documents

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
    validation_tasks = "search-val"
    # Copying the answer out of a passage is learnt late: 75 clean steps leave sampled accuracy at 0.4%,
    # 150 at 5%, 300 at 44%.
    warm_start_steps = {"clean": 300}  # noqa: RUF012 (a ClassVar of the base)

    @classmethod
    def default_config(cls) -> ToolEnvConfig:
        # Fenced code would parse as calls of a `python` tool this env does not offer.
        return ToolEnvConfig(tool_formats=("hermes",))

    @classmethod
    @contextlib.contextmanager
    def services(cls, settings: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
        """A BM25 retriever over the shipped corpus, in process on a free loopback port, unless
        `settings["retriever_url"]` names one."""
        if settings.get("retriever_url"):
            yield {}
            return
        with local_retriever() as url:
            yield {"retriever_url": url}

    def __init__(
        self,
        tasks: str | Sequence[Task] = "search-train",
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        retriever_url: str | None = None,
    ) -> None:
        config = config or self.default_config()
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

    def demonstration(self, task: Task, style: str, rng: random.Random) -> list[Message]:
        """`clean`: a search for the question's subject (the whole question if it names none), the
        passages the shipped BM25 corpus returns for it (as the search tool formats them), then
        `<answer> A </answer>`."""
        if style != "clean":
            raise ValueError(f"{type(self).__name__} writes clean demonstrations, not {style!r}")
        return search_turns(task)


_SUBJECT_RE = re.compile(r"was (\w+) first recorded|described (\w+)\?")


def search_turns(task: Task) -> list[Message]:
    """The assistant and tool turns of a Search demonstration (`SearchEnv.demonstration`)."""
    match = _SUBJECT_RE.search(task.question)
    query = next(group for group in match.groups() if group) if match else task.question
    call = {"name": "search", "arguments": {"query": query}}
    (hits,) = _shipped_index().search([query], _search_topk())
    return [
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "name": "search", "content": format_documents([doc for doc, _ in hits])},
        {"role": "assistant", "content": f"<answer> {task.answer} </answer>"},
    ]


@functools.cache
def _shipped_index() -> BM25Index:
    """The shipped corpus, as `pacerl serve retriever` serves it by default."""
    return BM25Index.from_jsonl(DATA_DIR / "search-corpus.jsonl")


def _search_topk() -> int:
    """The search tool's default `topk` (the demonstrations' calls leave it out)."""
    properties = get_tool("search").schema()["function"]["parameters"]["properties"]
    return int(properties["topk"]["default"])
