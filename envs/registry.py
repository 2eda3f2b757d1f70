"""Env ids to `ToolEnv` classes: the shipped ids and any a user's module registers.

    env_class("pacerl/CodeMath-v0")           # a shipped env
    env_class("my_envs:ShellQuiz-v0")          # imports my_envs first (Gymnasium's module:id form)
    env_class("skyrl-gym/gsm8k")               # a skyrl-gym env through its adapter (`pacerl.envs.skyrl`)

A user's module registers its env with `gymnasium.register(id=..., entry_point=...)` at import; the
`module:Name-v0` form imports it, exactly as `gymnasium.make` does, so `pacerl train env.id=...` and
`pacerl eval --env ...` take it with no edit to the package. An id `skyrl-gym/<name>` is the adapter of
the env skyrl-gym registers as `<name>` (a user's module registering one with `skyrl_gym.register` is
named `module:skyrl-gym/<name>`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import gymnasium

from pacerl.envs.base import ToolEnv


def env_class(env_id: str) -> type[ToolEnv]:
    """The `ToolEnv` subclass registered as `env_id` (`[module:]namespace/Name-vN`, or
    `[module:]skyrl-gym/<name>`). A ValueError that says what is wrong: the module does not import, the
    id is not registered (the registered tool envs are listed; for a skyrl-gym id, skyrl-gym's envs),
    or its entry point is not a ToolEnv, or skyrl-gym, which a skyrl-gym id needs, is not installed."""
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"an env id is a non-empty string, got {env_id!r}")
    module, sep, name = env_id.rpartition(":")
    if sep:
        if not module:
            raise ValueError(f"env {env_id!r}: nothing before ':' (the form is module:Name-v0)")
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(f"env {env_id!r}: cannot import module {module!r}: {error}") from None
    if name.startswith("skyrl-gym/"):
        from pacerl.envs.skyrl import PREFIX, skyrl_env_class

        try:
            return skyrl_env_class(name.removeprefix(PREFIX))
        except ImportError as error:  # a ValueError here, as every id this function cannot resolve
            raise ValueError(f"env {env_id!r}: {error}") from None
    spec = gymnasium.registry.get(name)
    if spec is None:
        hint = "" if sep else "; a user's env is named module:Name-v0, so that its module is imported first"
        known = ", ".join(tool_env_ids()) or "none"
        raise ValueError(f"env {name!r} is not registered (registered tool envs: {known}){hint}")
    entry = spec.entry_point
    if isinstance(entry, str):
        entry_module, _, attribute = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(entry_module), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"env {name!r}: its entry point {spec.entry_point!r} does not load: {error}"
            ) from None
    if not (isinstance(entry, type) and issubclass(entry, ToolEnv)):
        raise ValueError(f"env {name!r} is not a pacerl ToolEnv (its entry point is {entry!r})")
    return entry


def tool_env_ids() -> list[str]:
    """The registered ids whose entry point is a `ToolEnv` subclass, among modules already imported."""
    ids = []
    for env_id, spec in gymnasium.registry.items():
        entry = spec.entry_point
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            entry = getattr(sys.modules.get(module), attribute, None)
        if isinstance(entry, type) and issubclass(entry, ToolEnv):
            ids.append(env_id)
    return sorted(ids)


def registered_kwargs(env_id: str) -> dict[str, Any]:
    """The keyword arguments `env_id` was registered with (`gymnasium.register(..., kwargs=...)`), which
    `gymnasium.make` passes to the constructor; a run's env maker passes them too."""
    env_class(env_id)  # imports the module of a module:Name-v0 id, and checks the id
    return dict(gymnasium.registry[env_id.rpartition(":")[2]].kwargs)
