"""pacerl/BFCL-AST-v0: BFCL v4's single-turn AST categories (simple_python, multiple, parallel,
parallel_multiple, irrelevance) from the installed `bfcl-eval` package, scored by BFCL's AST match.

BFCL's own checker (`bfcl_eval.eval_checker.ast_eval.ast_checker`) cannot be imported without the API
clients of every model bfcl-eval supports (its model registry imports them), so the match is written
here from its rules and the tests hold it to the real checker: per parameter, the value must have
the doc's type (an integer passes as a float; a value of the possible answers' own type when that
differs from the doc's, BFCL's "variable", is compared as is) and be among the possible answers,
strings compared without case, spaces or `,./-_*^`; a required parameter must be given; a parameter
neither documented nor among the answers fails; an answer's parameter without `""` among its values
must be given; parallel calls match the answers in any order (each answer takes the first unmatched
call that fits, as BFCL's greedy pass does). Nothing the model writes is evaluated: the calls arrive
as JSON (name and arguments) and are compared as data.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pacerl.envs.base import ToolEnv, ToolEnvConfig
from pacerl.envs.bfcl_backends import BFCL_INSTRUCTION, CALL_FORMAT, data_dir, json_lines, openai_schema
from pacerl.envs.parsing import Parsed
from pacerl.envs.rewards import Reward
from pacerl.envs.spaces import Message
from pacerl.envs.tasks import Task, load_tasks

AST_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
"""BFCL v4's single-turn (non-live) Python categories scored by AST, in its leaderboard's order."""
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
"""What BFCL appends to every function description of a Python category."""
SYSTEM_PROMPT = (
    f"{BFCL_INSTRUCTION}\n\n{CALL_FORMAT}; put every call you need in one message. If no call is "
    "needed, answer in plain text."
)
"""BFCL's function-calling instructions, with pacerl's call format."""

_PYTHON_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "float": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "any": str,
}
"""The Python type BFCL's checker expects of each doc type (`any` is taken as a string, as BFCL does)."""


@functools.lru_cache(maxsize=8)
def _category_tasks(category: str) -> tuple[Task, ...]:
    if category not in AST_CATEGORIES:
        raise ValueError(f"no BFCL AST category {category!r}; categories: {', '.join(AST_CATEGORIES)}")
    data = data_dir()
    answers: dict[str, list[Any]] = {}
    if category != "irrelevance":  # irrelevance has no answers: the right reply calls nothing
        answer_file = data / "possible_answer" / f"BFCL_v4_{category}.json"
        answers = {row["id"]: row["ground_truth"] for row in json_lines(answer_file)}
    tasks = []
    for entry in json_lines(data / f"BFCL_v4_{category}.json"):
        truth = answers.get(entry["id"], [])
        question = "\n".join(m["content"] for m in entry["question"][0] if m["role"] == "user")
        metadata = {"category": category, "functions": entry["function"], "ground_truth": truth}
        tasks.append(Task(entry["id"], question, (json.dumps(truth),), 0, metadata))
    return tuple(tasks)


def ast_tasks(categories: Sequence[str] = AST_CATEGORIES) -> list[Task]:
    """The entries of `categories` as `Task`s (ids = BFCL's). Metadata: `category`, `functions` (BFCL's
    function docs), `ground_truth` (one `{function: {parameter: [possible values]}}` per expected call;
    empty for irrelevance)."""
    return [task for category in categories for task in _category_tasks(category)]


# -- BFCL's AST match ------------------------------------------------------------------------------------


def _standard(text: str) -> str:
    """A string as BFCL compares it: no spaces or `,./-_*^`, lower case, `'` as `"`."""
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def _standard_items(values: Any) -> list[Any]:
    """The items of a list (or, as BFCL iterates it, the characters of a string) with strings standardised."""
    return [_standard(v) if type(v) is str else v for v in values]


def _answer_type(possible: Sequence[Any]) -> type | None:
    """The type of the first possible answer that is not `""` (the optional marker)."""
    return next((type(answer) for answer in possible if answer != ""), None)


def _items_fit(items: Sequence[Any], item_type: type, possible: Any) -> bool:
    """BFCL's one-level nested check: every item has the doc's item type, or the answer's item type."""
    if type(possible) is not list:
        return True
    alternative = _answer_type(possible)
    return all(type(item) is item_type or type(item) is alternative for item in items)


def _type_problem(
    name: str, value: Any, spec: Mapping[str, Any], possible: Sequence[Any]
) -> tuple[str | None, bool]:
    """(why `value` has the wrong type, or None; whether it is compared as a BFCL "variable")."""
    doc_type = spec["type"]
    expected = _PYTHON_TYPES[doc_type]
    answer_type = _answer_type(possible)
    variable = answer_type is not None and answer_type is not expected
    value_type = type(value)
    if value_type is expected:
        if doc_type not in ("array", "tuple"):
            return None, variable
        item_type = _PYTHON_TYPES[spec["items"]["type"]]
        if any(_items_fit(value, item_type, answer) for answer in possible):
            return None, variable
    if answer_type is not None and value_type is answer_type:
        return None, True
    return f"{name}: expected {doc_type}, got {value_type.__name__} {value!r}", False


def _dict_fits(value: Any, answer: Any) -> bool:
    """BFCL's dict check: every key among the answer's, its value among the answer's values (strings
    standardised), every answer key without `""` among its values given."""
    if not isinstance(value, Mapping) or not isinstance(answer, Mapping):
        return False
    for key, item in value.items():
        if key not in answer:
            return False
        if (_standard(item) if type(item) is str else item) not in _standard_items(answer[key]):
            return False
    return all(key in value or "" in possible for key, possible in answer.items())


def _value_fits(value: Any, expected: type, item_type: type | None, possible: Sequence[Any]) -> bool:
    if expected is dict:
        return any(answer != "" and _dict_fits(value, answer) for answer in possible)
    if expected is list and item_type is dict:  # a list of dicts: one answer's dicts, in order
        return any(
            len(value) == len(answer) and all(_dict_fits(v, a) for v, a in zip(value, answer, strict=True))
            for answer in possible
        )
    if expected is str:
        return _standard(value) in [_standard(a) for a in possible if type(a) is str]
    if expected is list:
        return _standard_items(value) in [_standard_items(a) for a in possible if isinstance(a, list | str)]
    return value in possible


def call_problem(doc: Mapping[str, Any], call: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
    """Why the structured call `{"name", "arguments"}` does not match the possible answer
    `{function: {parameter: [values]}}` of the function `doc`, or None (BFCL's simple-function check)."""
    name = doc["name"]
    possible_values: Mapping[str, Sequence[Any]] = next(iter(answer.values()))
    if call["name"] != name:
        return f"expected a call of {name}, got {call['name']}"
    arguments: Mapping[str, Any] = call["arguments"]
    properties: Mapping[str, Any] = doc["parameters"]["properties"]
    missing = [p for p in doc["parameters"].get("required", []) if p not in arguments]
    if missing:
        return f"{name}: missing required parameter {missing[0]}"
    for param, value in arguments.items():
        if param not in properties or param not in possible_values:
            return f"{name}: unexpected parameter {param}"
        spec, possible = properties[param], possible_values[param]
        if spec["type"] == "float" and type(value) is int:
            value = float(value)
        problem, variable = _type_problem(param, value, spec, possible)
        if problem is not None:
            return f"{name}: {problem}"
        expected = _PYTHON_TYPES[spec["type"]]
        item_type = _PYTHON_TYPES[spec["items"]["type"]] if expected is list and "items" in spec else None
        fits = value in possible if variable else _value_fits(value, expected, item_type, possible)
        if not fits:
            return f"{name}: {param}={value!r} is not among {possible!r}"
    unsent = [p for p, possible in possible_values.items() if p not in arguments and "" not in possible]
    return f"{name}: parameter {unsent[0]} must be given" if unsent else None


def ast_problem(
    category: str,
    functions: Sequence[Mapping[str, Any]],
    calls: Sequence[Mapping[str, Any]],
    truth: Sequence[Any],
) -> str | None:
    """BFCL's AST verdict on a message's structured calls: why they fail `truth`, or None."""
    docs = {doc["name"]: doc for doc in functions}
    if len(calls) != len(truth):
        return f"expected {len(truth)} call(s), got {len(calls)}"
    if "parallel" not in category:  # simple and multiple: the one call against the one answer
        doc = functions[0] if "multiple" not in category else docs[next(iter(truth[0]))]
        return call_problem(doc, calls[0], truth[0])
    matched: set[int] = set()
    for index, answer in enumerate(truth):
        doc = docs[next(iter(answer))]
        fit = next(
            (
                i
                for i, call in enumerate(calls)
                if i not in matched and call_problem(doc, call, answer) is None
            ),
            None,
        )
        if fit is None:
            return f"no call matches expected call {index} ({doc['name']})"
        matched.add(fit)
    return None


def ast_verdict(task: Task, parsed: Parsed) -> str | None:
    """Why the parsed message fails the task, or None: irrelevance passes when no well-formed call was
    made (a malformed one decodes to nothing, as in BFCL); the other categories need well-formed calls
    that pass `ast_problem`."""
    meta = task.metadata
    if meta["category"] == "irrelevance":
        return f"called {parsed.calls[0].name} where no function fits" if parsed.calls else None
    if parsed.errors:
        return f"a malformed call: {parsed.errors[0].message}"
    calls = [{"name": call.name, "arguments": call.arguments} for call in parsed.calls]
    if any(not isinstance(call["arguments"], dict) for call in calls):
        return "a call's arguments are not a JSON object"
    return ast_problem(meta["category"], meta["functions"], calls, meta["ground_truth"])


class BFCLASTEnv(ToolEnv):
    """## Description
    BFCL v4's single-turn AST categories (Patil et al., the Berkeley Function Calling Leaderboard):
    a user asks for something; the model answers with the function call(s) that do it, or none when no
    offered function fits (irrelevance). Nothing runs: the calls are compared with BFCL's possible
    answers (`pacerl.envs.bfcl_ast`).

    ## Action
    The assistant's message: Hermes `<tool_call>` JSON (or whole-message JSON calls), or plain text.

    ## Observation
    On reset: the system prompt and the user's question; the entry's functions are `tool_schemas()`
    (BFCL's docs with its Python hint). Empty after the one message.

    ## Rewards
    BFCL's AST verdict, 1 or 0: simple_python and multiple need exactly one matching call, parallel
    and parallel_multiple one call per possible answer in any order, irrelevance no call.
    `info["bfcl"]["problem"]` says what failed.

    ## Episode End
    Terminated after the first assistant message.

    ## Arguments
    `tasks`: a task set name (`bfcl:ast`, a category such as `bfcl:simple_python` or a comma list, each
    optionally `/train` or `/eval`: `bfcl_split`), another `load_tasks` source, or `Task`s from
    `ast_tasks` (default `bfcl:ast/train`; validation `bfcl:ast/eval`); `config`: a `ToolEnvConfig`
    (its fields are keyword arguments too); `render_mode`: None or "ansi".

    ## Version History
    - v0: first version.
    """

    validation_tasks = "bfcl:ast/eval"

    def __init__(
        self,
        tasks: str | Sequence[Task] = "bfcl:ast/train",
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        **config_fields: Any,
    ) -> None:
        tasks = load_tasks(tasks) if isinstance(tasks, str) else tasks
        super().__init__(tasks, config, render_mode, **config_fields)
        self._problem: str | None = None

    @classmethod
    def default_config(cls) -> ToolEnvConfig:
        """One message; `hermes` and `json` calls (no ```python blocks: there is no python tool)."""
        return ToolEnvConfig(max_turns=1, tool_formats=("hermes", "json"))

    def initial_messages(self, task: Task) -> list[Message]:
        return self.pose(SYSTEM_PROMPT, task.question)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The entry's functions as OpenAI schemas, each description ending in BFCL's Python hint."""
        if self._task is None:
            return []
        schemas = [openai_schema(doc) for doc in self._task.metadata["functions"]]
        for schema in schemas:
            schema["function"]["description"] += PYTHON_HINT
        return schemas

    def score(self, task: Task, final_message: str) -> Reward:
        self._problem = ast_verdict(task, self.parse(final_message))
        passed = float(self._problem is None)
        return Reward(passed, passed, 0.0)

    def final_answer(self, final_message: str) -> str | None:
        """None: BFCL judges the calls, not an answer."""
        return None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        observation, info = super().reset(seed=seed, options=options)
        assert self._task is not None
        self._problem = None
        return observation, {**info, "tools": [doc["name"] for doc in self._task.metadata["functions"]]}

    async def astep(self, action: str) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        """Judge the message (the base class ends the episode on it: this env offers no tool to run)."""
        observation, reward, terminated, truncated, info = await super().astep(action)
        assert self._task is not None
        info["bfcl"] = {"category": self._task.metadata["category"], "problem": self._problem}
        return observation, reward, terminated, truncated, info
