"""The learner of `runtime = "ray"`: `TrainerActor` holds the `Learner` (the trained model, its
optimizer, the updates), and `RemoteLearner` is the learner the driver's loop calls, forwarding every
call to it."""

from __future__ import annotations

import os
import random
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError

from agents.trajectory import Trajectory
from pacerl.ray_runtime.supervisor import brief
from pacerl.ray_runtime.weights import ModelRecipe, PublishedWeights, WeightSpec, join_broadcast_group
from trainer.checkpoint import latest_checkpoint
from trainer.learner import Learner, LearnerConfig, StepResult


class TrainerLostError(RuntimeError):
    """The trainer actor died: its weights and optimizer are gone, the run must resume a checkpoint."""


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TrainerActor:
    """The learner: the trained model, its optimizer, the updates. Calls run one at a time."""

    def __init__(
        self,
        recipe: ModelRecipe,
        state: Mapping[str, torch.Tensor],
        config: LearnerConfig,
        pad_id: int,
        threads: int,
        seed: int,
    ) -> None:
        torch.set_num_threads(threads)
        _seed(seed)
        self.learner = Learner(recipe.build(state), config, pad_id=pad_id)
        self._broadcast_device = "cpu"

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> tuple[StepResult, int, dict[str, int]]:
        result = self.learner.train_step(groups)
        return result, self.learner.version, dict(self.learner.counts)

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return self.learner.prefix_drift(trajectories)

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of `version` (an error if the learner has moved on: never publish a mislabel)."""
        if version != self.learner.version:
            raise ValueError(
                f"weights of version {version} asked for; the learner holds {self.learner.version}"
            )
        return self.learner.weights()  # detached views: serialising them is the copy

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, dict[str, int]]:
        self.learner.load_state_dict(state)
        return self.learner.version, dict(self.learner.counts)

    def status(self) -> tuple[int, dict[str, int]]:
        return self.learner.version, dict(self.learner.counts)

    def snapshot(self) -> tuple[int, Any]:
        """The current version and an object-store reference to its weights, taken together."""
        return self.learner.version, ray.put(self.learner.weights())

    def ping(self) -> int:
        return os.getpid()

    def group_address(self) -> str:
        """A `tcp://host:port` for the broadcast group, on this actor's node (rank 0 listens there)."""
        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # what other nodes reach
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join_group(self, address: str, world_size: int, backend: str) -> list[WeightSpec]:
        """Join the broadcast group as rank 0; the tensors every broadcast sends, in order."""
        join_broadcast_group(address, world_size, 0, backend)
        self._broadcast_device = "cuda" if backend == "nccl" else "cpu"
        return [(name, tuple(t.shape), t.dtype) for name, t in self.learner.weights().items()]

    def broadcast_weights(self, version: int) -> None:
        """Send the weights of `version` to every replica of the group."""
        for tensor in self.weights(version).values():
            dist.broadcast(tensor.to(self._broadcast_device).contiguous(), src=0)


class RemoteLearner:
    """The learner as the loop sees it (`trainer.learner.LearnerLike`), living in the trainer actor."""

    def __init__(self, handle: Any, run_dir: Path) -> None:
        self.handle, self.run_dir = handle, run_dir
        self.alive = True
        version, counts = self._call("status")
        self.version: int = version
        self.counts: Counter[str] = Counter(counts)

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> StepResult:
        result, self.version, counts = self._call("train_step", [list(group) for group in groups])
        self.counts = Counter(counts)
        return result  # type: ignore[no-any-return]

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return self._call("prefix_drift", list(trajectories))  # type: ignore[no-any-return]

    def weights(self) -> PublishedWeights:
        return PublishedWeights(self.handle, self.version)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, counts = self._call("load_state_dict", state)
        self.counts = Counter(counts)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.handle, method).remote(*args))
        except RayActorError as error:
            self.alive = False
            raise TrainerLostError(self._lost_message(error)) from None

    def _lost_message(self, error: BaseException) -> str:
        latest = latest_checkpoint(self.run_dir / "checkpoints")
        where = (
            f"continue it from {latest.name} with `pacerl train --resume {self.run_dir}`"
            if latest is not None
            else "it had no checkpoint yet (set loop.checkpoint_every): start it again"
        )
        return f"the trainer actor died ({brief(error)}); the run stops: {where}"
