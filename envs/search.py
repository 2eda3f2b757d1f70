"""pacerl/Search-v0: search-augmented question answering against a Search-R1-compatible retriever;
pacerl/SearchR1-v0: the same task exactly as Search-R1 poses, runs and scores it."""

from __future__ import annotations

import contextlib
import functools
import json
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from pacerl.envs.base import ToolEnv, ToolEnvConfig
from pacerl.envs.parsing import Parsed, ToolCall, extract_tag
from pacerl.envs.retriever import BM25Index, local_retriever
from pacerl.envs.rewards import Reward, answer_tag_reward, exact_match, f1_score
from pacerl.envs.spaces import Message
from pacerl.envs.tasks import DATA_DIR, Task, load_tasks
from pacerl.envs.tools.core import ToolError
from pacerl.envs.tools.search import format_documents, retrieve

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
    `tasks`: a shipped set name, a .jsonl/.parquet path, or a list of `Task`s (default `search-train`,
    single-hop and two-hop questions about the generated world of `pacerl.envs.search_world`; its corpus is
    envs/data/search-corpus.jsonl, `pacerl serve retriever --corpus ...`);
    `config`: a `ToolEnvConfig` (default: Hermes calls only), whose `settings["retriever_url"]` is the
    retriever's address, whose fields are also keyword arguments (`max_turns=2`); `render_mode`: None or
    "ansi"; `retriever_url`: sets that setting.

    ## Version History
    - v0: first version.
    """

    tool_names = ("search",)
    validation_tasks = "search-val"
    # Copying names into queries and answers out of passages is learnt late: on the first, 500-passage
    # world 75 clean steps left sampled accuracy at 0.4%, 150 at 5%, 300 at 44%; on the generated world
    # 150 steps give 8% greedy (12% single-hop, 4% two-hop; docs/experiments.md).
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
        **config_fields: Any,
    ) -> None:
        config = self.resolve_config(config, **config_fields)
        if retriever_url is not None:
            config = replace(config, settings={**config.settings, "retriever_url": retriever_url})
        super().__init__(load_tasks(tasks) if isinstance(tasks, str) else tasks, config, render_mode)

    def initial_messages(self, task: Task) -> list[Message]:
        return self.pose(SYSTEM_PROMPT, task.question)

    def score(self, task: Task, final_message: str) -> Reward:
        return answer_tag_reward(final_message, task.answers, self.config.format_weight)

    def final_answer(self, final_message: str) -> str | None:
        """The answer `score` judges: the last `<answer>` element's content (for maj@k's vote)."""
        return extract_tag(final_message, "answer")

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
        """`clean`: one search per hop (the subject, then for a two-hop question the entity the first
        passage names), each with the passages the shipped BM25 corpus returns for it (as the search
        tool formats them), then `<answer> A </answer>` (`search_turns`)."""
        if style != "clean":
            raise ValueError(f"{type(self).__name__} writes clean demonstrations, not {style!r}")
        return search_turns(task)


DEMONSTRATION_TOPK = 1
"""Passages each demonstrated search asks for: BM25 ranks the searched entity's own passage first for
every shipped question (tests/envs/test_search_world.py), and one passage a search keeps a two-hop
episode within the default 256-token context."""


def search_turns(task: Task) -> list[Message]:
    """The assistant and tool turns of a Search demonstration (`SearchEnv.demonstration`): one search
    per hop for the entity `task.metadata["queries"]` names (the shipped world's tasks carry them:
    `pacerl.envs.search_world`; a task without them searches its whole question once), each with
    `topk` `DEMONSTRATION_TOPK` and followed by the passage the shipped BM25 corpus returns for it,
    then `<answer> A </answer>`."""
    queries = task.metadata.get("queries") or [task.question]
    turns: list[Message] = []
    for query in queries:
        call = {"name": "search", "arguments": {"query": str(query), "topk": DEMONSTRATION_TOPK}}
        (hits,) = _shipped_index().search([str(query)], DEMONSTRATION_TOPK)
        turns += [
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {"role": "tool", "name": "search", "content": format_documents([doc for doc, _ in hits])},
        ]
    return [*turns, {"role": "assistant", "content": f"<answer> {task.answer} </answer>"}]


@functools.cache
def _shipped_index() -> BM25Index:
    """The shipped corpus, as `pacerl serve retriever` serves it by default."""
    return BM25Index.from_jsonl(DATA_DIR / "search-corpus.jsonl")


# -- Search-R1 mode ---------------------------------------------------------------------------------------

SEARCH_R1_INSTRUCTION = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: "
)
"""Search-R1's instruction, character for character (its typo "as your want" included): `make_prefix`
with `template_type="base"` in PeterGriffinJin/Search-R1 `scripts/data_process/nq_search.py` (and
`qa_search_test_merge.py`), the text its checkpoints were trained on. The question and a newline follow."""

SEARCH_R1_INVALID_ACTION = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
"""What Search-R1 appends after a turn with neither a search nor an answer
(`search_r1/llm_agent/generation.py`, `execute_predictions`)."""

SEARCH_R1_STOP = ("</search>", "</answer>")
"""Where Search-R1 cuts each generated turn (`_postprocess_responses`): the engine's stop strings."""

_SEARCH_R1_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", flags=re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", flags=re.DOTALL)


def search_r1_prompt(question: str) -> str:
    """The user message Search-R1 poses for `question` (stripped, `?` appended when missing)."""
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    return f"{SEARCH_R1_INSTRUCTION}{question}\n"


def search_r1_question(prompt: str) -> str | None:
    """The question inside a user message `search_r1_prompt` wrote; None for any other text."""
    if prompt.startswith(SEARCH_R1_INSTRUCTION) and prompt.endswith("\n"):
        return prompt[len(SEARCH_R1_INSTRUCTION) : -1]
    return None


def search_r1_action(text: str) -> tuple[str | None, str]:
    """Search-R1's reading of one turn (`postprocess_predictions`): the first `<search>` or `<answer>`
    element decides; `("search", query)`, `("answer", answer)`, or `(None, "")` (an invalid turn)."""
    match = _SEARCH_R1_ACTION.search(text)
    return (match.group(1), match.group(2).strip()) if match else (None, "")


def search_r1_passages(documents: Sequence[Mapping[str, Any]]) -> str:
    """Search-R1's `_passages2string`: `Doc i(Title: <first line>) <other lines>` per document, each
    ending in a newline. The title keeps its quotes, as the corpus writes it (`"Title"`)."""
    lines = []
    for index, document in enumerate(documents, start=1):
        title, _, text = str(document["contents"]).partition("\n")
        lines.append(f"Doc {index}(Title: {title}) {text}\n")
    return "".join(lines)


def search_r1_reward(text: str, answers: Sequence[str], format_score: float = 0.0) -> Reward:
    """Search-R1's `qa_em.compute_score_em` on `text`, the whole episode (prompt, turns and
    observations, as Search-R1 decodes prompt and response together): the last `<answer>` counts, and
    only when there are at least two, since the instruction itself holds one; exact match after SQuAD
    normalization gives 1, a wrong answer `format_score`, no answer 0. F1 is reported, not rewarded."""
    matches = _ANSWER.findall(text)
    if len(matches) <= 1:
        return Reward(0.0, 0.0, 0.0, extra={"f1": 0.0})
    answer = matches[-1].strip()
    correct = exact_match(answer, answers)
    total = 1.0 if correct else format_score
    return Reward(total, correct, 1.0, extra={"f1": f1_score(answer, answers)})


class SearchR1Env(SearchEnv):
    """## Description
    Search-R1 (Jin et al. 2025, arXiv:2503.09516) exactly as its code runs it, so its checkpoints and
    data work unchanged: its prompt, its `<search> query </search>` calls, its `<information>` blocks
    continuing the model's own text, its answer format and its exact-match reward.

    ## Action
    The text of one generated turn (cut at `</search>` or `</answer>`: `SEARCH_R1_STOP`). The first
    `<search>` or `<answer>` element decides (`search_r1_action`).

    ## Observation
    The user message of the task's own Search-R1 `prompt` (a row of Search-R1's parquet, unchanged),
    or `search_r1_prompt(question)`, on reset; after a search, one `tool` message whose content is
    `"\\n\\n<information>" + passages.strip() + "</information>\\n\\n"` (`search_r1_passages`, top 3 by
    default, `settings["topk"]`); after a turn with neither element, `SEARCH_R1_INVALID_ACTION`. The
    rollout driver appends these to the assistant's text (`inline_observations`), not as chat turns.

    ## Rewards
    `search_r1_reward` over the whole episode's text, given at its end whether terminated or
    truncated (Search-R1 scores every sequence); `format_weight` is its `format_score`.

    ## Episode End
    Terminated on an answer. Truncated on the `max_turns`-th turn, whose search is not run (Search-R1's
    final rollout: its `max_turns=N` is `max_turns=N+1` here), after `max_tool_calls` searches, past
    `max_context_chars`, or on a failed search if `on_tool_error="truncate"`.

    ## Arguments
    As `SearchEnv`. The default config allows 5 turns (Search-R1's `max_turns=4`) and 4 searches.

    ## Version History
    - v0: first version.
    """

    inline_observations: ClassVar[bool] = True
    """Observations continue the assistant's text (the rollout driver appends their content as it is)."""
    stop_strings: ClassVar[tuple[str, ...]] = SEARCH_R1_STOP
    """Where each turn ends: what a served model's requests carry (`pacerl.agents.evaluation.served`)."""
    warm_start_steps = {}  # noqa: RUF012 (a ClassVar of the base; its demonstrations would be chat turns)

    @classmethod
    def default_config(cls) -> ToolEnvConfig:
        return ToolEnvConfig(max_turns=5, max_tool_calls=4, tool_formats=("hermes",))

    def tool_schemas(self) -> list[dict[str, Any]]:
        """None: the instruction describes the search call, as in Search-R1's prompt."""
        return []

    def initial_messages(self, task: Task) -> list[Message]:
        prompt = task.metadata.get("prompt")
        if isinstance(prompt, list | tuple) and prompt:  # a Search-R1 (verl) row: posed unchanged
            return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
        return self.pose("", search_r1_prompt(task.question))

    def parse(self, action: str) -> Parsed:
        """A search as a call of the search tool; an answer or an invalid turn makes none."""
        kind, content = search_r1_action(action)
        return Parsed((ToolCall("search", {"query": content}),) if kind == "search" else ())

    def score(self, task: Task, final_message: str) -> Reward:
        """`search_r1_reward` of the posed prompt followed by `final_message`."""
        prompt = "".join(m["content"] for m in self.initial_messages(task))
        return search_r1_reward(prompt + final_message, task.answers, self.config.format_weight)

    async def astep(self, action: str) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        _, info = self._take_message(action)
        kind, content = search_r1_action(action)
        errors: list[str] = []
        truncation = "max_turns" if self._turns >= self.config.max_turns else None
        if kind == "search" and truncation is None and self._tool_calls >= self.config.max_tool_calls:
            truncation = "max_tool_calls"
        if kind == "answer" or truncation is not None:
            return await self._end(info, truncation)
        if kind == "search":
            self._tool_calls += 1
            try:
                passages = search_r1_passages(await self._search(content))
            except ToolError as error:
                errors.append(str(error))
                passages = f"Error: {error}"
            observation: Message = {
                "role": "tool",
                "name": "search",
                "content": f"\n\n<information>{passages.strip()}</information>\n\n",
            }
        else:
            observation = {"role": "tool", "name": "invalid", "content": SEARCH_R1_INVALID_ACTION}
        self._tool_errors += len(errors)
        self._chars += len(observation["content"])
        self._transcript.append(observation)
        if errors and self.config.on_tool_error == "truncate":
            return await self._end(info, "tool_error", errors)
        if self._chars > self.config.max_context_chars:
            return await self._end(info, "context_budget", errors)
        return (observation,), 0.0, False, False, self._info(info, Reward(0.0, 0.0, 0.0), errors, None)

    async def _search(self, query: str) -> list[dict[str, Any]]:
        url = self.config.settings.get("retriever_url")
        if not url:
            raise ToolError("no search service is configured for this environment (settings.retriever_url)")
        (documents,) = await retrieve(str(url), [query], int(self.config.settings.get("topk", 3)))
        return documents

    async def _end(
        self, info: dict[str, Any], truncation: str | None, errors: Sequence[str] = ()
    ) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        """End the episode, scored on its whole text as Search-R1 scores every sequence."""
        assert self._task is not None
        text = "".join(m["content"] for m in self._transcript)
        reward = search_r1_reward(text, self._task.answers, self.config.format_weight)
        self._done = True
        await self._arelease_context()
        info = self._info(info, reward, list(errors), truncation)
        return (), reward.total, truncation is None, truncation is not None, info
