"""An env's settings as keyword arguments (`gymnasium.make(id, max_turns=1)`), for every shipped id and a
user's env class, and `pacerl eval --help` naming every shipped id."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import gymnasium
import pytest

from pacerl.cli import build_parser
from pacerl.envs import ENV_IDS, Message, Task, ToolEnv, ToolEnvConfig
from pacerl.envs.rewards import Reward, exact_match

FORCED_SINGLE_TURN = {"pacerl/Math-v0"}
"""Envs whose turn limit is 1 whatever they are given."""


def made(env_id: str, **kwargs: Any) -> ToolEnv:
    env = gymnasium.make(env_id, **kwargs).unwrapped
    assert isinstance(env, ToolEnv)
    return env


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_gymnasium_make_takes_the_envs_settings_as_keywords(env_id: str) -> None:
    default = made(env_id).config
    env = made(env_id, max_turns=2, max_context_chars=777, format_weight=0.25, system_prompt="")
    try:
        config = env.config
        assert (config.max_context_chars, config.format_weight, config.system_prompt) == (777, 0.25, "")
        assert config.max_turns == (1 if env_id in FORCED_SINGLE_TURN else 2)
        # What no keyword named keeps the env's own default (Search's hermes-only formats included).
        assert (config.tool_formats, config.on_tool_error) == (default.tool_formats, default.on_tool_error)
        observation, _ = env.reset(seed=0)
        assert [message["role"] for message in observation] == ["user"]  # system_prompt="": none sent
    finally:
        env.close()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_an_unknown_setting_is_a_type_error_that_lists_the_settings(env_id: str) -> None:
    with pytest.raises(TypeError, match=r"'max_turnz'.*fields of ToolEnvConfig: max_turns, max_tool_calls"):
        gymnasium.make(env_id, max_turnz=1)


def test_keywords_win_over_config_and_the_rest_of_config_is_kept() -> None:
    config = ToolEnvConfig(max_turns=6, max_tool_calls=5, on_tool_error="truncate", settings={"a": 1})
    env = made("pacerl/CodeMath-v0", config=config, max_turns=1, tool_formats=["hermes"], settings={"b": 2})
    try:
        assert env.config == ToolEnvConfig(
            max_turns=1,
            max_tool_calls=5,
            on_tool_error="truncate",
            tool_formats=("hermes",),
            settings={"b": 2},
        )
    finally:
        env.close()
    with pytest.raises(ValueError, match="max_turns and max_context_chars must be >= 1"):
        gymnasium.make("pacerl/CodeMath-v0", max_turns=0)  # validated as a config is


def test_max_turns_from_make_truncates_the_episode() -> None:
    env = gymnasium.make("pacerl/Search-v0", max_turns=1, retriever_url="http://127.0.0.1:9")
    try:
        env.reset(seed=0)
        call = '<tool_call>{"name": "nowhere", "arguments": {}}</tool_call>'
        _, _, terminated, truncated, info = env.step(call)
        assert (terminated, truncated) == (False, True) and info["truncation_reason"] == "max_turns"
    finally:
        env.close()


class Quiz(ToolEnv):
    """A user's env with no `__init__` of its own and a default config of its own."""

    @classmethod
    def default_config(cls) -> ToolEnvConfig:
        return ToolEnvConfig(max_turns=3, tool_formats=("hermes",))

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.question}]

    def score(self, task: Task, final_message: str) -> Reward:
        correct = exact_match(final_message, task.answers)
        return Reward(total=correct, correctness=correct, format=1.0)


class NamedQuiz(Quiz):
    """A user's env whose `__init__` takes arguments of its own and hands the settings on."""

    def __init__(
        self,
        tasks: Sequence[Task],
        greeting: str = "hello",
        config: ToolEnvConfig | None = None,
        **config_fields: Any,
    ) -> None:
        self.greeting = greeting
        super().__init__(tasks, config, **config_fields)


TASKS = [Task("q1", "What is 2 + 2?", ("4",))]


@contextlib.contextmanager
def registered(env_id: str, entry_point: type[ToolEnv]) -> Iterator[None]:
    gymnasium.register(id=env_id, entry_point=f"{__name__}:{entry_point.__name__}", kwargs={"tasks": TASKS})
    try:
        yield
    finally:
        gymnasium.registry.pop(env_id)


def test_a_users_env_takes_its_settings_as_keywords() -> None:
    with registered("test/Quiz-v0", Quiz), registered("test/NamedQuiz-v0", NamedQuiz):
        plain = made("test/Quiz-v0")
        assert plain.config == ToolEnvConfig(max_turns=3, tool_formats=("hermes",))  # its default_config
        quiz = made("test/Quiz-v0", max_tool_calls=1)
        assert quiz.config == ToolEnvConfig(max_turns=3, max_tool_calls=1, tool_formats=("hermes",))
        named = made("test/NamedQuiz-v0", greeting="hi", max_turns=1)
        assert isinstance(named, NamedQuiz) and named.greeting == "hi" and named.config.max_turns == 1
        with pytest.raises(TypeError, match="NamedQuiz got unexpected keyword argument"):
            gymnasium.make("test/NamedQuiz-v0", greetin="hi")
        named.reset(seed=0)
        assert named.step("4")[1:4] == (1.0, True, False)
        for env in (plain, quiz, named):
            env.close()


def test_eval_help_names_every_shipped_env(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for env_id in ENV_IDS:
        assert env_id in text, env_id
