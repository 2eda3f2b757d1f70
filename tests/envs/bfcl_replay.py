"""Test helpers for the BFCL env: play structured call sequences through it, judge the same sequences
with bfcl-eval's own `multi_turn_checker`, and alter ground truths the ways a model goes wrong."""

from __future__ import annotations

import copy
import itertools
import json
import random
from typing import Any

from pacerl.envs.bfcl import BFCLMultiTurnEnv
from pacerl.envs.bfcl_backends import function_docs
from pacerl.envs.tasks import Task

Turns = list[list[dict[str, Any]]]
"""Structured calls per user turn: `{"name", "arguments"}`."""
PER_MESSAGE = 8
"""Calls per assistant message (the parser's cap)."""
_checks = itertools.count()


def messages_of(calls: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A turn's calls as the assistant messages that send them."""
    return [calls[start : start + PER_MESSAGE] for start in range(0, len(calls), PER_MESSAGE)]


def action(calls: list[dict[str, Any]]) -> str:
    return "\n".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls)


def play(env: BFCLMultiTurnEnv, task: Task, turns: Turns) -> tuple[float, dict[str, Any]]:
    """Each turn's calls, then a message without calls; the final reward and info."""
    env.reset(options={"task": task})
    for calls in turns:
        for message in messages_of(calls):
            _, _, terminated, truncated, info = env.step(action(message))
            assert not (terminated or truncated), info
        _, reward, terminated, truncated, info = env.step("Done.")
    assert terminated and not truncated, info
    return reward, info


def call_string(call: dict[str, Any]) -> str:
    return f"{call['name']}({', '.join(f'{k}={v!r}' for k, v in call['arguments'].items())})"


def bfcl_verdict(task: Task, turns: Turns) -> bool:
    """bfcl-eval's `multi_turn_checker` on the same calls (its executor evals these call strings,
    which this test wrote itself); each check under a fresh model name, since bfcl caches instances."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    meta = task.metadata
    decoded = [[[call_string(c) for c in message] for message in messages_of(calls)] for calls in turns]
    entry = {
        "id": task.id,
        "initial_config": meta["initial_config"],
        "involved_classes": meta["involved_classes"],
    }
    result = multi_turn_checker(
        decoded, meta["ground_truth"], entry, meta["category"], f"pacerl_check_{next(_checks)}"
    )
    return bool(result["valid"])


def mutations(task: Task, truth: Turns, rng: random.Random) -> dict[str, Turns]:
    """The ground truth altered five ways: a call dropped, an argument changed, a stray call added
    (one repeated), a turn's calls skipped, a call renamed to another offered function."""
    busy = [index for index, calls in enumerate(truth) if calls]
    out: dict[str, Turns] = {}
    turns = copy.deepcopy(truth)
    t = rng.choice(busy)
    del turns[t][rng.randrange(len(turns[t]))]
    out["drop"] = turns
    turns = copy.deepcopy(truth)
    calls = [c for calls in turns for c in calls if any(_changeable(v) for v in c["arguments"].values())]
    if calls:
        call = rng.choice(calls)
        key = rng.choice([k for k, v in call["arguments"].items() if _changeable(v)])
        call["arguments"][key] = _changed(call["arguments"][key])
        out["argument"] = turns
    turns = copy.deepcopy(truth)
    t = rng.choice(busy)
    turns[t].append(copy.deepcopy(rng.choice(turns[t])))
    out["stray"] = turns
    turns = copy.deepcopy(truth)
    turns[rng.choice(busy)] = []
    out["skip"] = turns
    turns = copy.deepcopy(truth)
    hidden = {name for names in task.metadata["missed_function"].values() for name in names}
    offered = sorted(
        doc["name"]
        for cls in task.metadata["involved_classes"]
        for doc in function_docs(cls)
        if doc["name"] not in hidden
    )
    t = rng.choice(busy)
    call = rng.choice(turns[t])
    call["name"] = rng.choice([name for name in offered if name != call["name"]])
    out["wrong_function"] = turns
    return out


def _changeable(value: Any) -> bool:
    return isinstance(value, str | int | float)


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return value + "_x"
    return value + 1
