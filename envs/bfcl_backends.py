"""BFCL v4 multi-turn, the data and the machinery: tasks from the installed `bfcl-eval` package, its
function docs as OpenAI tool schemas, the executable backends run as structured calls, and BFCL's
multi-turn verdict (`multi_turn_checker`'s state and response checks) turn by turn.

`bfcl-eval` is optional (`pip install --no-deps bfcl-eval==2026.3.23`); it is imported here only inside
the functions that need it. Its modules used: `bfcl_eval/data` (the entries `BFCL_v4_multi_turn_*.json`,
`possible_answer/`, `multi_turn_func_doc/`), `constants.executable_backend_config` (class → module map,
stateless classes) and the backend classes in `eval_checker.multi_turn_eval.func_source_code`.

Why the backends run in this process, not in a sandbox: they are pure in-memory Python state machines
(a file system of dicts, a trading account, a vehicle, ...) that touch no file, process or network; the
model never supplies code, only a function name and JSON arguments, which are validated against the
function's doc and passed as keyword arguments to a method of the episode's own instance. Nothing the
model writes is evaluated (bfcl-eval's own executor builds call strings and `eval`s them; it is not used
here), and ground-truth calls are read with `ast` into literal arguments.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import importlib
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pacerl.envs.tasks import Task

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
"""BFCL v4's multi-turn categories, in its leaderboard's column order."""
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23"
"""How to install the package the BFCL env reads its data and backends from."""
ERROR_PREFIX = "Error during execution: "
"""How BFCL's executor reports a call that raised (kept, so error results compare as BFCL's do)."""
STEP_LIMIT = 20
"""Messages with calls allowed in one user turn before BFCL forces the model to quit
(`MAXIMUM_STEP_LIMIT`: the call past it still runs, then the entry fails unless it was the last turn)."""
BFCL_INSTRUCTION = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. "
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
    "If none of the functions can be used, point it out. If the given question lacks the parameters "
    "required by the function, also point it out."
)
"""The opening of BFCL's system prompt (its `classic` prompt style), shared by the BFCL envs."""
CALL_FORMAT = (
    'Call a function as <tool_call>{"name": "func_name", "arguments": {"param": "value"}}</tool_call>'
)
"""How the BFCL envs ask for calls (pacerl's Hermes format, not BFCL's Python-syntax list)."""
ADDED_FUNCTIONS_NOTE = "I have updated some more functions you can choose from. What about now?"
"""BFCL's user message of a miss_func turn (`DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC`)."""


def bfcl_module(name: str = "bfcl_eval") -> ModuleType:
    """A module of bfcl-eval, or an ImportError saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"the BFCL env needs bfcl-eval ({INSTALL}): {error}") from None


def data_dir() -> Path:
    """bfcl-eval's data folder (the entries, `possible_answer/`, `multi_turn_func_doc/`)."""
    return Path(str(bfcl_module().__file__)).parent / "data"


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The rows of one of BFCL's JSON-lines files."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@functools.lru_cache(maxsize=16)
def function_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """The BFCL function docs (`multi_turn_func_doc`) of one backend class."""
    config = bfcl_module("bfcl_eval.constants.executable_backend_config")
    return tuple(
        json_lines(data_dir() / "multi_turn_func_doc" / config.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name])
    )


@functools.lru_cache(maxsize=8)
def _category_tasks(category: str) -> tuple[Task, ...]:
    if category not in CATEGORIES:
        raise ValueError(f"no BFCL multi-turn category {category!r}; categories: {', '.join(CATEGORIES)}")
    data = data_dir()
    entries = json_lines(data / f"BFCL_v4_{category}.json")
    answers = {
        row["id"]: row["ground_truth"]
        for row in json_lines(data / "possible_answer" / f"BFCL_v4_{category}.json")
    }
    tasks = []
    for entry in entries:
        turns = entry["question"]
        truth = answers[entry["id"]]
        if len(truth) != len(turns):
            raise ValueError(
                f"BFCL entry {entry['id']}: {len(turns)} user turns but {len(truth)} ground-truth turns"
            )
        metadata = {
            "category": category,
            "turns": turns,
            "initial_config": entry.get("initial_config", {}),
            "involved_classes": entry["involved_classes"],
            "ground_truth": truth,
            "missed_function": entry.get("missed_function", {}),
        }
        first = "\n".join(m["content"] for m in turns[0] if m["role"] == "user")
        tasks.append(Task(entry["id"], first, (json.dumps(truth),), 0, metadata))
    return tuple(tasks)


def bfcl_tasks(categories: Sequence[str] = CATEGORIES) -> list[Task]:
    """The multi-turn entries of `categories` as `Task`s (ids = BFCL's entry ids). Metadata: `category`,
    `turns` (each user turn's messages; a miss_func turn is empty), `initial_config`, `involved_classes`,
    `ground_truth` (BFCL's call strings per turn), `missed_function` (turn index → function names)."""
    return [task for category in categories for task in _category_tasks(category)]


def bfcl_split(
    tasks: Sequence[Task], eval_share: float = 0.25, seed: int = 0
) -> tuple[list[Task], list[Task]]:
    """(training tasks, evaluation tasks): an entry is held out for evaluation when the SHA-256 of
    `"{seed}:{id}"` falls in the first `eval_share` of its range. Decided per id, so an entry lands on
    the same side whichever categories are loaded together; each list keeps the tasks' order."""
    if not 0.0 < eval_share < 1.0:
        raise ValueError(f"eval_share must be in (0, 1), got {eval_share}")
    held = [
        t
        for t in tasks
        if int(hashlib.sha256(f"{seed}:{t.id}".encode()).hexdigest()[:8], 16) < eval_share * 2**32
    ]
    ids = {t.id for t in held}
    return [t for t in tasks if t.id not in ids], held


def named_bfcl_tasks(name: str) -> list[Task]:
    """Tasks by name: `bfcl:multi_turn` (the four categories), `bfcl:multi_turn_base` or a comma list
    of categories, or the single-turn ones (`bfcl:ast`, `bfcl:simple_python`, ...: `ast_tasks`), each
    optionally ending in `/train` or `/eval` (`bfcl_split`'s default halves)."""
    body = name.removeprefix("bfcl:")
    body, _, part = body.partition("/")
    categories = CATEGORIES if body in ("", "multi_turn") else tuple(c.strip() for c in body.split(","))
    # imported here: the AST env's module imports this one
    from pacerl.envs.bfcl_ast import AST_CATEGORIES, ast_tasks

    if body == "ast":
        categories = AST_CATEGORIES
    single_turn = set(categories) <= set(AST_CATEGORIES)
    tasks = ast_tasks(categories) if single_turn else bfcl_tasks(categories)
    if part == "":
        return tasks
    if part not in ("train", "eval"):
        raise ValueError(f"{name!r}: a BFCL task set ends in /train or /eval, not /{part}")
    train, held = bfcl_split(tasks)
    return train if part == "train" else held


# -- schemas and validation ----------------------------------------------------------------------------

_JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def openai_schema(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as an OpenAI function tool (`dict` → object, `float` → number, `tuple` →
    array, `any` → no type; BFCL's `response` field dropped)."""
    return {
        "type": "function",
        "function": {
            "name": doc["name"],
            "description": doc["description"],
            "parameters": _normalise(doc["parameters"]),
        },
    }


def _normalise(schema: Any) -> Any:
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str) and value in _JSON_TYPES:
            if _JSON_TYPES[value] is not None:
                out[key] = _JSON_TYPES[value]
        elif key == "properties" and isinstance(value, Mapping):
            out[key] = {name: _normalise(prop) for name, prop in value.items()}
        elif key == "items":
            out[key] = _normalise(value)
        else:
            out[key] = value
    return out


def _type_ok(bfcl_type: str, value: Any) -> bool:
    """Whether a JSON value has a BFCL doc type (an integer is a float, as Python takes it)."""
    checks: dict[str, Any] = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "tuple": lambda v: isinstance(v, list),
        "dict": lambda v: isinstance(v, dict),
    }
    check = checks.get(bfcl_type)
    return True if check is None else bool(check(value))


def argument_problem(doc: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """Why the function `doc` cannot run with `arguments` (an unknown or a missing parameter: the
    docs match the backends' signatures, so BFCL's executor fails these calls too), in words the model
    can act on; None when it can run."""
    name = doc["name"]
    properties: Mapping[str, Any] = doc["parameters"].get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        known = ", ".join(properties) or "none"
        return f"{name}() got unexpected parameter(s) {', '.join(unknown)}; its parameters: {known}"
    missing = [p for p in doc["parameters"].get("required", []) if p not in arguments]
    if missing:
        return f"{name}() is missing required parameter(s) {', '.join(missing)}"
    return None


def type_warning(doc: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """A note on the arguments whose JSON type differs from the doc's, or None. The call still runs,
    as BFCL's executor runs it (Python takes what it takes: BFCL's own ground truth passes the string
    'ticket_001' where `close_ticket`'s doc says integer)."""
    properties: Mapping[str, Any] = doc["parameters"].get("properties", {})
    wrong = [
        f"{key} is documented as {properties[key].get('type')}, got {type(value).__name__}"
        for key, value in arguments.items()
        if key in properties and not _type_ok(properties[key].get("type", "any"), value)
    ]
    return f"Note: {'; '.join(wrong)}." if wrong else None


# -- backends ------------------------------------------------------------------------------------------


def result_text(result: Any) -> str:
    """A call's result as BFCL's executor records it: a string as is, a dict as JSON, else `str`."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


class Backends:
    """Fresh instances of an entry's classes, each loaded with a deep copy of its `initial_config`
    (never bfcl-eval's module-global instance cache, so episodes share nothing); method names map to
    instances as BFCL's executor maps them (a later class wins a shared name)."""

    def __init__(
        self, involved_classes: Sequence[str], initial_config: Mapping[str, Any], long_context: bool
    ) -> None:
        config = bfcl_module("bfcl_eval.constants.executable_backend_config")
        self.instances: dict[str, Any] = {}
        self.owner: dict[str, Any] = {}
        for class_name in involved_classes:
            instance = getattr(bfcl_module(config.CLASS_FILE_PATH_MAPPING[class_name]), class_name)()
            if class_name not in config.STATELESS_CLASSES:
                instance._load_scenario(
                    copy.deepcopy(initial_config.get(class_name, {})), long_context=long_context
                )
            self.instances[class_name] = instance
            for method_name, _ in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not method_name.startswith("_"):
                    self.owner[method_name] = instance

    def call(self, name: str, arguments: Mapping[str, Any], positional: Sequence[Any] = ()) -> str:
        """Run method `name` with keyword `arguments` (and `positional` ones, for ground-truth calls);
        what it raises comes back as BFCL's error text."""
        try:
            return result_text(getattr(self.owner[name], name)(*positional, **arguments))
        except Exception as error:  # a backend's refusal is the model's observation, as in BFCL
            return f"{ERROR_PREFIX}{error}"

    def keywords(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A call's positional and keyword arguments as keywords (by the method's signature)."""
        bound = inspect.signature(getattr(self.owner[name], name)).bind(*args, **kwargs)
        return dict(bound.arguments)


def parse_ground_truth(call: str) -> tuple[str, list[Any], dict[str, Any]]:
    """A BFCL ground-truth call string (`mv(source='a', destination='b')`) as (name, positional
    arguments, keyword arguments), read with `ast` (literals only; nothing is evaluated)."""
    node = ast.parse(call.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {call!r}")
    args = [ast.literal_eval(arg) for arg in node.args]
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    if len(kwargs) != len(node.keywords):
        raise ValueError(f"**arguments in a ground-truth call: {call!r}")
    return node.func.id, args, kwargs


def ground_truth_calls(task: Task) -> list[list[dict[str, Any]]]:
    """The task's ground truth as structured calls per user turn, `{"name", "arguments"}` with every
    argument named (what a model that solves the entry sends)."""
    meta = task.metadata
    backends = Backends(
        meta["involved_classes"], meta["initial_config"], meta["category"] == "multi_turn_long_context"
    )
    turns = []
    for calls in meta["ground_truth"]:
        structured = []
        for call in calls:
            name, args, kwargs = parse_ground_truth(call)
            structured.append({"name": name, "arguments": backends.keywords(name, args, kwargs)})
        turns.append(structured)
    return turns


# -- BFCL's verdict --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnFailure:
    """The first check a turn failed, as multi_turn_checker names it."""

    turn: int
    """The user turn (0-based)."""
    check: str
    """`empty_turn_model_response`, `instance_state_mismatch` or `execution_response_mismatch`."""
    detail: str
    """What differed."""


def state_difference(model: Backends, truth: Backends) -> str | None:
    """multi_turn_checker's state check: every public attribute of each ground-truth instance equals the
    model's instance's; the differing attributes, or None."""
    for class_name, expected in truth.instances.items():
        actual = model.instances[class_name]
        differing = [
            key
            for key, value in vars(expected).items()
            if not key.startswith("_") and getattr(actual, key) != value
        ]
        if differing:
            return f"{class_name}: {', '.join(differing)} differ from the ground truth's"
    return None


def missing_results(model_results: Sequence[str], truth_results: Sequence[str]) -> list[str]:
    """multi_turn_checker's response check: the ground truth's results of a turn must all be among the
    model's results of every turn so far, each used once, in any order; those that are not."""
    remaining = list(model_results)
    missing = []
    for item in truth_results:
        if item in remaining:
            remaining.remove(item)
        else:
            missing.append(item)
    return missing


def judge_turn(
    turn: int,
    truth_calls: Sequence[str],
    model_steps: int,
    model_results: Sequence[str],
    model: Backends,
    truth: Backends,
) -> TurnFailure | None:
    """BFCL's verdict on user turn `turn` once it ended: runs the turn's ground-truth calls on `truth`
    (structurally), then, unless the ground truth is empty (an irrelevance turn, unchecked as in BFCL),
    the empty-turn, state and response checks. `model_steps`: the turn's messages holding calls;
    `model_results`: the results of every call the model made so far, all turns."""
    truth_results = []
    for call in truth_calls:
        name, args, kwargs = parse_ground_truth(call)
        truth_results.append(truth.call(name, kwargs, args))
    if not truth_calls:
        return None
    if model_steps == 0:
        return TurnFailure(turn, "empty_turn_model_response", "no function call in this turn")
    difference = state_difference(model, truth)
    if difference is not None:
        return TurnFailure(turn, "instance_state_mismatch", difference)
    missing = missing_results(model_results, truth_results)
    if missing:
        return TurnFailure(
            turn, "execution_response_mismatch", f"missing results: {json.dumps(missing)[:300]}"
        )
    return None
