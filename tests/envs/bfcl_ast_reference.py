"""Test helpers for BFCL-AST-v0: bfcl-eval's own `ast_checker`, calls built from BFCL's possible answers,
and those calls altered the ways a model goes wrong."""

from __future__ import annotations

import copy
import importlib
import json
import random
import sys
import types
from typing import Any

from pacerl.envs.tasks import Task

Calls = list[dict[str, Any]]
"""Structured calls: `{"name", "arguments"}`."""


def bfcl_ast_checker() -> Any:
    """bfcl-eval's `ast_checker` function. Its module imports bfcl-eval's model registry, which imports
    the API clients of every model bfcl-eval supports (not installed: bfcl-eval is installed without
    dependencies); the checker reads the registry only to rename dotted function names for models that
    need it, so the registry is replaced by one that renames nothing while the module is imported."""
    name = "bfcl_eval.eval_checker.ast_eval.ast_checker"
    if name in sys.modules:
        return sys.modules[name].ast_checker
    registry_name = "bfcl_eval.constants.model_config"
    saved = sys.modules.get(registry_name)
    registry = types.ModuleType(registry_name)
    registry.MODEL_CONFIG_MAPPING = {"pacerl": types.SimpleNamespace(underscore_to_dot=False)}  # type: ignore[attr-defined]
    sys.modules[registry_name] = registry
    try:
        return importlib.import_module(name).ast_checker
    finally:
        if saved is None:
            del sys.modules[registry_name]
        else:
            sys.modules[registry_name] = saved


def bfcl_verdict(task: Task, calls: Calls) -> bool:
    """bfcl-eval's verdict on `calls` (decoded as its handlers decode them: `[{name: arguments}]`);
    irrelevance as its relevance runner judges it (correct when nothing is called)."""
    meta = task.metadata
    if meta["category"] == "irrelevance":
        return not calls
    language = importlib.import_module("bfcl_eval.constants.enums").Language.PYTHON
    decoded = [{call["name"]: call["arguments"]} for call in calls]
    functions = copy.deepcopy(meta["functions"])
    result = bfcl_ast_checker()(
        functions, decoded, meta["ground_truth"], language, meta["category"], "pacerl"
    )
    return bool(result["valid"])


def _first(possible: dict[str, list[Any]], doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each key at its first possible value, left out when that is `""` (the optional marker); with
    the function's `doc`, two quirks of BFCL's answers are read as BFCL's checker reads them: a
    required parameter whose first value is `""` takes its first other one (simple_python_200), and an
    optional parameter the doc does not define is left out (parallel_multiple_26's `type`). A dict
    value's possible answers are again such dicts (a list of dicts: a list of them)."""
    properties = doc["parameters"]["properties"] if doc else possible
    required = doc["parameters"].get("required", []) if doc else []
    chosen = {}
    for key, values in possible.items():
        present = [value for value in values if value != ""]
        if key in required:
            chosen[key] = _concrete(present[0])
        elif values[0] != "" and key in properties:
            chosen[key] = _concrete(values[0])
    return chosen


def _concrete(value: Any) -> Any:
    if isinstance(value, dict):
        return _first(value)
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return [_first(item) for item in value]
    return value


def answer_calls(task: Task) -> Calls:
    """The calls BFCL's possible answers describe, each parameter at its first possible value."""
    docs = {doc["name"]: doc for doc in task.metadata["functions"]}
    return [
        {"name": name, "arguments": _first(params, docs[name])}
        for answer in task.metadata["ground_truth"]
        for name, params in answer.items()
    ]


def action(calls: Calls) -> str:
    return "\n".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls)


def _other_value(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 7
    if isinstance(value, str):
        return value + " elsewhere"
    if isinstance(value, list):
        return [*value, value[0]] if value else ["extra"]
    return {"unrelated": 1}


def mutations(task: Task, calls: Calls, rng: random.Random) -> dict[str, Calls]:
    """The calls altered one way each: another function's name, a changed value, a required parameter
    dropped, an unknown parameter added, a call dropped (several calls) or added (irrelevance)."""
    if not calls:
        doc = task.metadata["functions"][0]
        return {"stray": [{"name": doc["name"], "arguments": {}}]}
    altered: dict[str, Calls] = {}
    index = rng.randrange(len(calls))

    def changed(change: Any) -> Calls:
        copies = copy.deepcopy(calls)
        change(copies[index])
        return copies

    altered["wrong_function"] = changed(lambda call: call.update(name=call["name"] + "_v2"))
    if calls[index]["arguments"]:
        param = rng.choice(sorted(calls[index]["arguments"]))
        altered["wrong_value"] = changed(
            lambda call: call["arguments"].update({param: _other_value(call["arguments"][param])})
        )
    doc = next(d for d in task.metadata["functions"] if d["name"] == calls[index]["name"])
    required = [p for p in doc["parameters"].get("required", []) if p in calls[index]["arguments"]]
    if required:
        altered["missing_required"] = changed(lambda call: call["arguments"].pop(rng.choice(required)))
    altered["unknown_param"] = changed(lambda call: call["arguments"].update(unknown_flag=True))
    arguments = calls[index]["arguments"]
    texts = [p for p, value in arguments.items() if isinstance(value, str)]
    if texts:  # BFCL ignores case, spaces and some punctuation in strings
        param = rng.choice(texts)
        altered["restyled"] = changed(
            lambda call: call["arguments"].update({param: arguments[param].upper() + " "})
        )
    numbers = [p for p, value in arguments.items() if type(value) in (int, float)]
    if numbers:  # a number sent as a string, or an integer as a float
        param = rng.choice(numbers)
        altered["stringified"] = changed(
            lambda call: call["arguments"].update({param: str(arguments[param])})
        )
        altered["as_float"] = changed(lambda call: call["arguments"].update({param: float(arguments[param])}))
    if len(calls) > 1:
        altered["missing_call"] = calls[:index] + calls[index + 1 :]
        altered["shuffled"] = rng.sample(calls, len(calls))
    return altered
