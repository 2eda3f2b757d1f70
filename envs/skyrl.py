"""skyrl-gym/<name>: any skyrl-gym env, trained and evaluated through one adapter, unchanged.

    env = gymnasium.make("skyrl-gym/gsm8k", tasks="gsm8k.parquet")  # rows in SkyRL's dataset schema
    pacerl train env.id=skyrl-gym/gsm8k env.tasks=gsm8k.parquet

`skyrl_env_class(name)` makes the adapter class of the skyrl-gym env registered as `name` (once per name)
and registers it with Gymnasium as `skyrl-gym/<name>`; `pacerl.envs.registry.env_class` calls it for
every id of that form. skyrl-gym is imported here only (`pip install 'pacerl[skyrl]'`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, cast

import gymnasium

from pacerl.envs.base import ToolEnv, ToolEnvConfig
from pacerl.envs.rewards import Reward
from pacerl.envs.spaces import ROLES, Message
from pacerl.envs.tasks import Task, load_tasks

log = logging.getLogger(__name__)

PREFIX = "skyrl-gym/"
"""The id form of an adapted skyrl-gym env: `skyrl-gym/<name>`, `<name>` as skyrl-gym registers it."""
ENV_CONFIG = "skyrl_env_config"
"""The key of `ToolEnvConfig.settings` whose mapping is the skyrl env's `env_config` (as SkyRL's
`environment.skyrl_gym.<name>` section: e.g. `search_url` for `search`, `db_path` for `text2sql`)."""

_ADAPTERS: dict[str, type[SkyRLGymEnv]] = {}


def skyrl_gym() -> Any:
    """The `skyrl_gym` module, or an ImportError saying which extra installs it."""
    try:
        import skyrl_gym
    except ImportError as error:
        raise ImportError(
            f"the skyrl-gym/<name> envs need skyrl-gym: pip install 'pacerl[skyrl]' ({error})"
        ) from None
    return skyrl_gym


def skyrl_env_class(name: str) -> type[SkyRLGymEnv]:
    """The adapter class of the skyrl-gym env registered as `name`, made once and registered with
    Gymnasium as `skyrl-gym/<name>`. A ValueError for a name skyrl-gym does not know (it lists those it
    knows); an ImportError without skyrl-gym."""
    if name in _ADAPTERS:
        return _ADAPTERS[name]
    registry = skyrl_gym().registry
    if name not in registry:
        known = ", ".join(sorted(registry)) or "none"
        raise ValueError(f"env {PREFIX}{name}: skyrl-gym registers no env {name!r} (it registers: {known})")
    label = f"SkyRLGymEnv[{name}]"  # found again by `__getattr__` below: pickled by reference too
    namespace = {"skyrl_name": name, "__module__": __name__, "__qualname__": label}
    cls = cast(type[SkyRLGymEnv], type(label, (SkyRLGymEnv,), namespace))
    _ADAPTERS[name] = cls
    if PREFIX + name not in gymnasium.registry:
        entry_point = f"{__name__}:{label}"  # `__getattr__` below resolves it
        gymnasium.register(id=PREFIX + name, entry_point=entry_point, disable_env_checker=False)
    return cls


def __getattr__(attribute: str) -> type[SkyRLGymEnv]:
    if attribute.startswith("SkyRLGymEnv[") and attribute.endswith("]"):
        return skyrl_env_class(attribute[len("SkyRLGymEnv[") : -1])
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")


class SkyRLGymEnv(ToolEnv):
    """## Description
    A skyrl-gym env (`skyrl_gym.make(name, env_config=..., extras=...)`), played as a pacerl env: one
    skyrl env per episode, built from the task's row, which parses the model's text and runs its own
    tools. Use `skyrl_env_class(name)` (or the id `skyrl-gym/<name>`), not this base.

    ## Action
    The assistant's message text, handed to the skyrl env's `step` as it is.

    ## Observation
    On reset, what the skyrl env's `init(prompt)` returns for the task's `prompt` (the row's chat
    messages, or the question as a user message); after a step, the messages its `step` returns.

    ## Rewards
    Deferred to the episode's end: each step's skyrl reward is in `info["skyrl_reward"]`, and the step
    that ends the episode (terminated or truncated) carries their sum, the episode's return; the other
    steps carry 0. The sum of the steps' rewards is therefore skyrl's return, and the rollout driver,
    which reads the last one, records it.

    ## Episode End
    Terminated when the skyrl env says `done` (an answer, or its own turn limit: skyrl has no
    truncation flag, and its limits are part of its task). Truncated at `config.max_turns` (the run's
    limit), past `max_context_chars`, or when the skyrl env raises (`truncation_reason`
    "skyrl_error: ...", logged with its traceback).

    ## Arguments
    `tasks`: a .jsonl/.parquet path, a shipped set's name or a list of `Task`s (no default: skyrl-gym
    ships no data); `config`: a `ToolEnvConfig` (`max_turns`, `max_context_chars`, `system_prompt`,
    `settings["skyrl_env_config"]`: the skyrl env's `env_config`; the tool-call fields do not apply),
    whose fields are also keyword arguments; `render_mode`: None or "ansi".

    ## Version History
    - v0: first version.
    """

    skyrl_name: ClassVar[str] = ""
    """The skyrl-gym env this class adapts (`skyrl_gym.registry`'s id)."""

    def __init__(
        self,
        tasks: str | Sequence[Task],
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        **config_fields: Any,
    ) -> None:
        if not self.skyrl_name:
            raise TypeError("SkyRLGymEnv adapts one skyrl-gym env: use skyrl_env_class(name)")
        super().__init__(
            load_tasks(tasks) if isinstance(tasks, str) else tasks, config, render_mode, **config_fields
        )
        self._skyrl: Any = None
        self._return = 0.0

    def tool_schemas(self) -> list[dict[str, Any]]:
        """None: a skyrl env parses its own calls, and its prompt describes them."""
        return []

    def initial_messages(self, task: Task) -> list[Message]:
        """The row's `prompt` unchanged (SkyRL poses it so), else the question as a user message; a
        non-empty `config.system_prompt` replaces the row's system message."""
        prompt = task.metadata.get("prompt")
        if isinstance(prompt, list | tuple) and prompt:
            posed = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
        else:
            posed = [{"role": "user", "content": task.question}]
        if self.config.system_prompt:
            posed = [m for m in posed if m["role"] != "system"]
            posed.insert(0, {"role": "system", "content": self.config.system_prompt})
        return posed

    def extras(self, task: Task) -> dict[str, Any]:
        """The skyrl env's `extras`: every column of the task's row but `prompt` and `env_class` (as
        SkyRL's dataset hands them over: `reward_spec`, `extra_info`, `data_source`, ...); a task of
        pacerl's own schema gets `reward_spec: {"method": "rule", "ground_truth": its answer}` and an
        empty `extra_info`."""
        extras = {key: value for key, value in task.metadata.items() if key not in ("prompt", "env_class")}
        if "reward_spec" not in extras and "reward_model" not in extras:
            extras["reward_spec"] = {"method": "rule", "ground_truth": task.answer}
            extras.setdefault("extra_info", {})
        return extras

    def _make(self, task: Task) -> Any:
        """A fresh skyrl env for `task`; a ValueError naming the task when it refuses the row."""
        env_config = skyrl_gym_config(self.config.settings.get(ENV_CONFIG, {}))
        try:
            return skyrl_gym().make(self.skyrl_name, env_config=env_config, extras=self.extras(task))
        except (AssertionError, KeyError, TypeError, ValueError) as error:  # its checks of the row
            raise ValueError(
                f"skyrl-gym env {self.skyrl_name!r} refuses task {task.id!r}: {type(error).__name__}: {error}"
            ) from None

    def score(self, task: Task, final_message: str) -> Reward:
        """The reward a fresh episode of the skyrl env gives `final_message` as its first turn."""
        env = self._make(task)
        try:
            env.init(self.initial_messages(task))
            reward = float(env.step(final_message)["reward"])
        finally:
            env.close()
        return Reward(reward, reward, 0.0)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        """Start an episode on `options["task"]`, `options["task_id"]` or a seeded draw (as every
        `ToolEnv`): a fresh skyrl env built from the task and its `init(prompt)`."""
        gymnasium.Env.reset(self, seed=seed)
        self._close_skyrl()
        self._task = self._choose_task(options or {})
        self._reset_counters()
        self._return = 0.0
        self._skyrl = self._make(self._task)
        prompt, metadata = self._skyrl.init(self.initial_messages(self._task))
        observation = chat_messages(prompt, self.skyrl_name)
        self._done = False
        self._chars = sum(len(m["content"]) for m in observation)
        self._transcript = list(observation)
        tools = sorted(getattr(self._skyrl, "tool_to_toolgroup", {}))
        return observation, {"task_id": self._task.id, "tools": tools, "skyrl_metadata": plain(metadata)}

    async def astep(self, action: str) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        """One skyrl `step` (on a worker thread: a skyrl env may block on its tools)."""
        _, info = self._take_message(action)
        try:
            output = await asyncio.to_thread(self._skyrl.step, action)
        except Exception as error:  # a bug in the skyrl env must not cost the run; logged loudly
            log.exception("skyrl-gym env %s failed on a step", self.skyrl_name)
            return self._end((), info, False, f"skyrl_error: {type(error).__name__}: {error}")
        observation = chat_messages(output.get("observations") or [], self.skyrl_name)
        reward = float(output.get("reward") or 0.0)
        self._return += reward
        self._chars += sum(len(m["content"]) for m in observation)
        self._transcript.extend(observation)
        info.update(skyrl_reward=reward, skyrl_metadata=plain(output.get("metadata") or {}))
        if output.get("done"):
            return self._end(observation, info, True, None)
        if self._turns >= self.config.max_turns:
            return self._end(observation, info, False, "max_turns")
        if self._chars > self.config.max_context_chars:
            return self._end(observation, info, False, "context_budget")
        return observation, 0.0, False, False, {**info, "truncation_reason": None}

    def _end(
        self, observation: tuple[Message, ...], info: dict[str, Any], terminated: bool, truncation: str | None
    ) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        """The step that ends the episode: it carries the return, the skyrl env's metrics, and closes it."""
        self._done = True
        metrics = plain(self._skyrl.get_metrics()) if hasattr(self._skyrl, "get_metrics") else {}
        self._close_skyrl()
        info.update(
            reward_breakdown={"total": self._return},
            skyrl_metrics=metrics,
            truncation_reason=truncation,
            error=bool(truncation and truncation.startswith("skyrl_error")),
        )
        return observation, self._return, terminated, not terminated, info

    def _close_skyrl(self) -> None:
        if self._skyrl is not None:
            env, self._skyrl = self._skyrl, None
            env.close()

    def close(self) -> None:
        """Close the episode's skyrl env and the private loop. Idempotent."""
        self._close_skyrl()
        super().close()


def skyrl_gym_config(values: Mapping[str, Any]) -> Any:
    """A skyrl env's `env_config`: an OmegaConf `DictConfig` of `values` (attribute access, as SkyRL
    hands it over; omegaconf comes with skyrl-gym)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(values))


def chat_messages(messages: Any, name: str) -> tuple[Message, ...]:
    """skyrl's OpenAI-format messages as pacerl's (string fields only); a ValueError for anything else,
    which is a bug of the skyrl env."""
    out: list[Message] = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in ROLES or "content" not in message:
            raise ValueError(f"skyrl-gym env {name!r} returned {message!r}, not a chat message of {ROLES}")
        out.append({str(key): str(value) for key, value in message.items() if value is not None})
    return tuple(out)


def plain(value: Any) -> Any:
    """`value` as plain JSON types (a trajectory stores the env's info as JSON): what JSON cannot hold
    becomes its `str`."""
    return json.loads(json.dumps(value, default=str))
