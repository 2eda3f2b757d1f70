"""The environment worker of `runtime = "ray"`: a Ray actor hosting the envs of many episodes and their
sandboxes. It imports `envs` and nothing heavier (no torch, no transformers): environment workers are
many, start often and belong on CPU machines, where each saves the half gigabyte those would take."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from envs import EpisodeLost, Message, ToolEnv

Step = tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]
"""What `env.astep` returns."""


class EnvWorker:
    """Hosts the environments of many episodes (and their sandboxes), each under the key of the proxy
    that plays it (`pacerl.ray_runtime.runtime.RemoteEnv`). An episode is started by its first step, which
    brings the reset options and, after the loss of the worker that held it, the actions to replay."""

    def __init__(self, make_env: Callable[[], ToolEnv]) -> None:
        self.make_env = make_env
        self.envs: dict[str, ToolEnv] = {}

    async def step(
        self, key: str, action: str, reset: dict[str, Any] | None = None, replay: Sequence[str] = ()
    ) -> Step:
        """`env.astep(action)` of episode `key`; with `reset`, first a fresh env reset with those options
        and the completed `replay` actions stepped again (their tools rerun, their outputs dropped)."""
        if reset is not None:
            self._drop(key)
            fresh = self.envs[key] = self.make_env()
            fresh.reset(options=reset)
            for done in replay:
                *_, terminated, truncated, _ = await fresh.astep(done)
                if terminated or truncated:
                    self._drop(key)
                    raise EpisodeLost("the replayed episode ended before its record did")
        env = self.envs.get(key)
        if env is None:
            raise KeyError(f"no episode {key!r} on this worker")
        return await env.astep(action)

    def close(self, key: str) -> None:
        """End episode `key` (its sandboxes are released). Idempotent."""
        self._drop(key)

    def ping(self) -> int:
        """The process id (answers as soon as the actor is up)."""
        return os.getpid()

    def load(self) -> int:
        """Episodes open on this worker."""
        return len(self.envs)

    def _drop(self, key: str) -> None:
        env = self.envs.pop(key, None)
        if env is not None:
            env.close()
