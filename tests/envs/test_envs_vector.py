"""The tool envs under Gymnasium's vector envs: SyncVectorEnv as it is, AsyncVectorEnv with
`shared_memory=False`, and a clear refusal when AsyncVectorEnv is left at its shared-memory default."""

from __future__ import annotations

import json
from collections.abc import Callable

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv, VectorEnv

from pacerl import envs
from pacerl.envs import Task

TASKS = (Task("v1", "What is 123 * 45?", ("5535",), 1), Task("v2", "What is 7 * 6?", ("42",), 1))


def python_call(code: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


def codemath_fns() -> list[Callable[[], gymnasium.Env[tuple[envs.Message, ...], str]]]:
    # Each env is handed its own task, so the batch is two different real episodes.
    def make(task: Task) -> Callable[[], gymnasium.Env[tuple[envs.Message, ...], str]]:
        return lambda: gymnasium.make("pacerl/CodeMath-v0", tasks=[task])

    return [make(task) for task in TASKS]


def play_a_batch(vector: VectorEnv) -> None:
    """Two CodeMath episodes side by side: a python tool call each, then the right answer each."""
    observations, infos = vector.reset(seed=0)
    assert [obs[1]["content"] for obs in observations] == [task.question for task in TASKS]
    assert list(infos["task_id"]) == ["v1", "v2"]

    calls = [python_call("print(123 * 45)"), python_call("print(7 * 6)")]
    observations, rewards, terminated, truncated, infos = vector.step(calls)
    assert observations == (
        ({"role": "tool", "name": "python", "content": "5535"},),
        ({"role": "tool", "name": "python", "content": "42"},),
    )
    assert rewards.tolist() == [0.0, 0.0] and not terminated.any() and not truncated.any()
    assert list(infos["tool_calls"]) == [1, 1]

    observations, rewards, terminated, truncated, infos = vector.step(["\\boxed{5535}", "\\boxed{42}"])
    assert observations == ((), ())
    assert rewards.tolist() == [1.0, 1.0] and terminated.all() and not truncated.any()
    np.testing.assert_array_equal(infos["reward_breakdown"]["correctness"], [1.0, 1.0])


def test_sync_vector_env_steps_real_episodes() -> None:
    vector = SyncVectorEnv(codemath_fns())
    try:
        play_a_batch(vector)
    finally:
        vector.close()


@pytest.mark.timeout(120)  # a worker that inherits a dead sandbox thread hangs: fail, do not wait
def test_async_vector_env_without_shared_memory_steps_real_episodes() -> None:
    # This process has run a tool before the workers fork (their default start method): they must
    # start sandboxes of their own, not wait on the parent's.
    parent = gymnasium.make("pacerl/CodeMath-v0", tasks=[TASKS[0]])
    parent.reset(seed=0)
    assert parent.step(python_call("print(1 + 1)"))[0] == (
        {"role": "tool", "name": "python", "content": "2"},
    )
    vector = AsyncVectorEnv(codemath_fns(), shared_memory=False)
    try:
        play_a_batch(vector)
    finally:
        vector.close()
        parent.close()


@pytest.mark.parametrize("env_id", envs.ENV_IDS)
def test_async_vector_env_with_default_arguments_says_what_to_pass(env_id: str) -> None:
    with pytest.raises(ValueError, match=r"Pass shared_memory=False") as refused:
        AsyncVectorEnv([lambda: gymnasium.make(env_id)] * 2)
    assert "ChatMessages" in str(refused.value) and "text of any length" in str(refused.value)
