"""skyrl-gym envs through the adapter (`pacerl.envs.skyrl`), on the real skyrl-gym: its gsm8k rewards, its
multi-turn env's turns, Gymnasium's make and checker, the registry's id form and its errors, and SkyRL's
dataset rows as tasks."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import gymnasium
import pytest
import skyrl_gym
from gymnasium.utils.env_checker import check_env
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from pacerl.assembly import env_factory, held_out_of_training, training_tasks
from pacerl.config import ConfigError, config_from_dict
from pacerl.config_keys import check_keys
from pacerl.envs import Task, load_tasks
from pacerl.envs.registry import env_class, tool_env_ids
from pacerl.envs.skyrl import SkyRLGymEnv, skyrl_env_class

FIXTURE = str(Path(__file__).resolve().parents[1] / "fixtures" / "skyrl" / "gsm8k.parquet")
FIRST = "openai/gsm8k-train-0"
"""The fixture's first task: 6 trays of 12 rolls, 50 sold; the answer is 22."""


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return load_tasks(FIXTURE)


def test_skyrl_rows_keep_what_the_skyrl_env_reads(tasks: list[Task]) -> None:
    task = tasks[0]
    assert len(tasks) == 10 and task.id == FIRST and task.answers == ("22",)
    assert task.question.startswith("A baker fills 6 trays")  # extra_info.question
    assert task.metadata["reward_spec"] == {"method": "rule", "ground_truth": "22"}
    assert task.metadata["env_class"] == "gsm8k" and task.metadata["extra_info"]["index"] == 0
    assert task.metadata["prompt"][0]["content"].endswith('after "####".')
    env = env_class("skyrl-gym/gsm8k")(tasks=tasks)
    extras = env.extras(task)
    assert set(extras) == {"data_source", "reward_spec", "extra_info"}  # as SkyRL's dataset hands them over
    plain = env.extras(Task("p1", "What is 2 + 3?", ("5",)))  # a task of pacerl's own schema
    assert plain == {"reward_spec": {"method": "rule", "ground_truth": "5"}, "extra_info": {}}
    env.close()


def test_gsm8k_rewards_a_right_answer_and_ends_after_one_turn(tasks: list[Task]) -> None:
    env = env_class("skyrl-gym/gsm8k")(tasks=tasks)
    try:
        observation, info = env.reset(options={"task_id": FIRST})
        assert observation == tuple(tasks[0].metadata["prompt"]) and info["task_id"] == FIRST
        assert env.tool_schemas() == [] and info["tools"] == []
        observation, reward, terminated, truncated, info = env.step("72 - 50 is 22.\n#### 22")
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert info["skyrl_reward"] == 1.0 and info["truncation_reason"] is None and not info["error"]
        for wrong in ("#### 23", "The answer is 22."):  # wrong, or right but not in the `#### N` form
            env.reset(options={"task": tasks[0]})
            assert env.step(wrong)[1:3] == (0.0, True)
        with pytest.raises(RuntimeError, match="call reset"):
            env.step("#### 22")
        assert env.score(tasks[0], "#### 22").total == 1.0 and env.score(tasks[0], "#### 2").total == 0.0
    finally:
        env.close()
        env.close()  # idempotent


def test_the_multi_turn_env_plays_its_turns_and_the_return_comes_at_the_end(tasks: list[Task]) -> None:
    env = env_class("skyrl-gym/gsm8k_multi_turn")(tasks=tasks, max_turns=8)
    try:
        env.reset(options={"task_id": FIRST})
        rewards, infos, observations = [], [], []
        for action in ("Let me think.", "#### 21", "#### 22"):
            observation, reward, terminated, truncated, info = env.step(action)
            rewards.append(reward)
            infos.append(info)
            observations.append(observation)
        # skyrl's turn rewards: 0 unformatted, 0.2/5 formatted but wrong, 1 right (and done).
        assert [info["skyrl_reward"] for info in infos] == [0.0, 0.04, 1.0]
        assert rewards == [0.0, 0.0, pytest.approx(1.04)] and terminated and not truncated
        assert infos[0]["truncation_reason"] is None and observations[2] == ()
        assert (
            observations[0][0]["role"] == "user"
            and "tentative numeric answer" in observations[0][0]["content"]
        )
        assert infos[-1]["skyrl_metrics"] == {"steps": 3}
    finally:
        env.close()


def test_the_runs_turn_limit_truncates_a_skyrl_episode_with_its_return(tasks: list[Task]) -> None:
    env = env_class("skyrl-gym/gsm8k_multi_turn")(tasks=tasks, max_turns=2)
    try:
        env.reset(options={"task_id": FIRST})
        first = env.step("#### 21")
        assert first[0][0]["role"] == "user" and "#### ANSWER" in first[0][0]["content"]
        _, reward, terminated, truncated, info = env.step("#### 20")
        assert (terminated, truncated, info["truncation_reason"]) == (False, True, "max_turns")
        assert reward == pytest.approx(0.08)  # both turns' format rewards
    finally:
        env.close()


class _BrokenEnv(BaseTextEnv):
    """A skyrl env with a bug: its step raises."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()

    def step(self, action: str) -> BaseTextEnvStepOutput:
        raise ZeroDivisionError("a bug in the env")


def test_a_skyrl_env_that_raises_truncates_the_episode_and_a_refused_row_is_named(
    tasks: list[Task], caplog: pytest.LogCaptureFixture
) -> None:
    skyrl_gym.register(id="pacerl_test_broken", entry_point=_BrokenEnv)
    try:
        env = env_class("skyrl-gym/pacerl_test_broken")(tasks=tasks)
        env.reset(seed=1)
        _, reward, terminated, truncated, info = env.step("#### 22")
        assert (reward, terminated, truncated, info["error"]) == (0.0, False, True, True)
        assert info["truncation_reason"] == "skyrl_error: ZeroDivisionError: a bug in the env"
        assert "failed on a step" in caplog.text
        env.close()
    finally:
        skyrl_gym.envs.registration.deregister("pacerl_test_broken")
    aime = env_class("skyrl-gym/aime")(tasks=tasks)  # AIME reads `reward_model`; SkyRL's gsm8k rows have none
    with pytest.raises(ValueError, match=r"skyrl-gym env 'aime' refuses task 'openai/gsm8k-train-0': Assert"):
        aime.reset(options={"task_id": FIRST})
    aime.close()


def test_ids_resolve_once_register_with_gymnasium_and_pass_its_checker() -> None:
    cls = env_class("skyrl-gym/gsm8k")
    assert cls is skyrl_env_class("gsm8k") and issubclass(cls, SkyRLGymEnv) and cls.skyrl_name == "gsm8k"
    assert "skyrl-gym/gsm8k" in tool_env_ids()
    assert pickle.loads(pickle.dumps(cls)) is cls  # by reference: a Ray env worker finds the same class
    env = gymnasium.make("skyrl-gym/gsm8k", tasks=FIXTURE)
    try:
        check_env(env.unwrapped, skip_render_check=False)
        assert env.unwrapped.tasks == load_tasks(FIXTURE)
    finally:
        env.close()
    with pytest.raises(TypeError, match="skyrl_env_class"):
        SkyRLGymEnv(tasks=[Task("t", "q", ("a",))])


def test_an_unknown_skyrl_name_lists_skyrl_gyms_envs() -> None:
    with pytest.raises(ValueError, match=r"registers no env 'nope' \(it registers: aime, gsm8k, gsm8k_multi"):
        env_class("skyrl-gym/nope")
    with pytest.raises(ConfigError, match=r"env.id: env skyrl-gym/nope: skyrl-gym registers no env"):
        env_factory(config_from_dict({"env": {"id": "skyrl-gym/nope", "tasks": FIXTURE}}))


def test_a_run_config_takes_the_id_and_holds_a_tenth_of_the_rows_out(tasks: list[Task]) -> None:
    check_keys({}, ["env.id=skyrl-gym/gsm8k", f"env.tasks={FIXTURE}"])  # the static key check
    with pytest.raises(ConfigError, match="skyrl-gym/gsm8k has no default tasks"):
        env_factory(config_from_dict({"env": {"id": "skyrl-gym/gsm8k"}}))
    config = config_from_dict({"env": {"id": "skyrl-gym/gsm8k", "tasks": FIXTURE, "max_turns": 2}})
    make_env = env_factory(config)
    assert training_tasks(make_env) == tasks
    kept, held = held_out_of_training(config, tasks)
    assert held is not None and len(held) == 1 and len(kept) == 9
    env = make_env()
    assert env.config.max_turns == 2
    env.close()


async def test_episodes_step_concurrently_on_the_loop(tasks: list[Task]) -> None:
    cls = env_class("skyrl-gym/gsm8k")
    envs = [cls(tasks=tasks) for _ in range(8)]
    for env, task in zip(envs, tasks, strict=False):
        env.reset(options={"task": task})
    results = await asyncio.gather(
        *(env.astep(f"#### {task.answer}") for env, task in zip(envs, tasks, strict=False))
    )
    assert [result[1:3] for result in results] == [(1.0, True)] * 8
    for env in envs:
        env.close()


USER_SKYRL_MODULE = """
from skyrl_gym import register
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class EchoEnv(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.truth = extras["reward_spec"]["ground_truth"]

    def step(self, action):
        reward = float(action == self.truth)
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})


register(id="pacerl_test_echo", entry_point=EchoEnv)
"""


def test_a_users_module_registering_a_skyrl_env_is_named_module_colon_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_skyrl_echo.py").write_text(USER_SKYRL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        env = env_class("user_skyrl_echo:skyrl-gym/pacerl_test_echo")(tasks=[Task("e1", "Say 7", ("7",))])
        observation, _ = env.reset(seed=0)
        assert observation == ({"role": "user", "content": "Say 7"},)  # pacerl's schema: the question
        assert env.step("7")[1:3] == (1.0, True)
        env.close()
    finally:
        skyrl_gym.envs.registration.deregister("pacerl_test_echo")
