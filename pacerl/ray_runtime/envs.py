"""The environments of `runtime = "ray"`: `EnvWorker`, a Ray actor hosting the envs of many episodes and
their sandboxes, and `RemoteEnv`, the driver's proxy of one episode played on a worker.

This module imports `envs` and nothing heavier (no torch, no transformers): environment workers are
many, start often and belong on CPU machines, where each saves the half gigabyte those would take."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError

from pacerl.envs import EpisodeLost, Message, ToolEnv
from pacerl.ray_runtime.supervisor import Slot, Supervisor

if TYPE_CHECKING:  # agents.rollout imports torch
    from pacerl.agents.rollout import EpisodeEnv

Step = tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]
"""What `env.astep` returns."""


class EnvWorker:
    """Hosts the environments of many episodes (and their sandboxes), each under the key of the proxy
    that plays it (`RemoteEnv`). An episode is started by its first step, which brings the reset options
    and, after the loss of the worker that held it, the actions to replay."""

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


class RemoteEnv:
    """An episode played on an environment worker, with the env interface the driver uses.

    `reset` runs on a local env of the same maker (a reset only poses the task, and the loop must not
    wait on a worker for it); the worker's env is reset by the first step. The actions stepped so far
    are kept, so that a worker lost mid-episode is replaced by another one replaying them."""

    def __init__(self, workers: Supervisor, make_env: Callable[[], EpisodeEnv]) -> None:
        self._workers, self._make_env = workers, make_env
        self._key = uuid.uuid4().hex
        self._options: dict[str, Any] | None = None
        self._schemas: list[dict[str, Any]] = []
        self._actions: list[str] = []
        self._slot: Slot | None = None
        # Whether the env's observations continue the model's text (Search-R1's): the local env's answer.
        self.inline_observations = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        self.close()
        local = self._make_env()
        try:
            observation, info = local.reset(seed=seed, options=options)
            self._schemas = local.tool_schemas()
            self.inline_observations = bool(getattr(local, "inline_observations", False))
        finally:
            local.close()
        self._options, self._actions = dict(options or {}), []
        return observation, info

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self._schemas

    async def astep(self, action: str) -> Step:
        if self._options is None:
            raise RuntimeError("step before reset")
        while True:
            fresh = self._slot is None
            if self._slot is None:
                self._slot = await self._workers.pick()
                self._slot.outstanding += 1
            slot = self._slot
            try:
                step: Step = await slot.handle.step.remote(
                    self._key, action, self._options if fresh else None, list(self._actions) if fresh else []
                )
            except RayActorError as error:
                self._workers.lost(slot, error)
                self._release_slot()
                replayed = len(self._actions)
                self._workers.faults.event("env_episode_resumed", actor=slot.name, replayed=replayed)
                continue
            self._actions.append(action)
            return step

    def close(self) -> None:
        if self._slot is not None:
            self._slot.handle.close.remote(self._key)  # nothing to wait for
            self._release_slot()

    def _release_slot(self) -> None:
        if self._slot is not None:
            self._slot.outstanding -= 1
            self._slot = None
