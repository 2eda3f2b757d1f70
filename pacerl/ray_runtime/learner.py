"""The learner of `runtime = "ray"`: `TrainerActor` holds the `Learner` (the trained model, its
optimizer, the updates), and `RemoteLearner` is the learner the driver's loop calls, forwarding every
call to it. With `learner.parallel = "fsdp"` the trainer is a group of `learner.world_size` actors in one
placement group, one per rank of an FSDP2 learner (`pacerl.trainer.distributed`): every call goes to all of
them, and rank 0 answers."""

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

from pacerl.agents.trajectory import Trajectory
from pacerl.ray_runtime.supervisor import brief
from pacerl.ray_runtime.weights import ModelRecipe, PublishedWeights, WeightSpec, join_broadcast_group
from pacerl.trainer.checkpoint import latest_checkpoint
from pacerl.trainer.distributed import join
from pacerl.trainer.learner import Learner, LearnerConfig, StepResult


class TrainerLostError(RuntimeError):
    """The trainer actor died: its weights and optimizer are gone, the run must resume a checkpoint."""


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TrainerActor:
    """The learner (or one rank of it): the trained model, its optimizer, the updates. Calls run one at
    a time. A rank of a group builds its learner in `join_learner_group`, with the other ranks."""

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
        self._recipe, self._state, self._config, self._pad_id = recipe, state, config, pad_id
        self._broadcast_device = "cpu"
        self._gathered: tuple[int, dict[str, torch.Tensor]] | None = None
        if config.parallel == "none":
            self.learner = Learner(recipe.build(state), config, pad_id=pad_id)

    def join_learner_group(self, address: str, rank: int) -> int:
        """Form the learner's process group with the other ranks (rank 0's `group_address`) and build this
        rank's shard; blocks until every rank has joined. Returns the version."""
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(self._config.world_size),
            MASTER_ADDR=host,
            MASTER_PORT=port,
            LOCAL_RANK="0",  # Ray shows each actor only the GPU it reserved
        )
        ranks = join()
        self.learner = Learner(
            self._recipe.build(self._state), self._config, pad_id=self._pad_id, ranks=ranks
        )
        self._state = {}  # the shard holds what it needs
        self._gather()
        return self.learner.version

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> tuple[StepResult, int, dict[str, int]]:
        result = self.learner.train_step(groups)
        self._gather()
        return result, self.learner.version, dict(self.learner.counts)

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return self.learner.prefix_drift(trajectories)

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of `version` (an error if the learner has moved on: never publish a mislabel). A
        group's rank 0 answers from the full weights all ranks gathered after the last change."""
        if version != self.learner.version:
            raise ValueError(
                f"weights of version {version} asked for; the learner holds {self.learner.version}"
            )
        if self._gathered is not None:
            return self._gathered[1]
        return self.learner.weights()  # detached views: serialising them is the copy

    def _gather(self) -> None:
        """In a group, gather the full weights of the current version now, with every rank (a replica
        asks rank 0 alone for them later)."""
        if self.learner.ranks.size > 1:
            self._gathered = (self.learner.version, self.learner.weights())

    def save(self, directory: Path) -> None:
        self.learner.save(directory)

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, dict[str, int]]:
        self.learner.load_state_dict(state)
        return self.learner.version, dict(self.learner.counts)

    def load(self, directory: Path) -> tuple[int, dict[str, int]]:
        self.learner.load(directory)
        self._gather()
        return self.learner.version, dict(self.learner.counts)

    def status(self) -> tuple[int, dict[str, int]]:
        return self.learner.version, dict(self.learner.counts)

    def snapshot(self) -> tuple[int, Any]:
        """The current version and an object-store reference to its weights, taken together."""
        return self.learner.version, ray.put(self.weights(self.learner.version))

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
    """The learner as the loop sees it (`pacerl.trainer.learner.LearnerLike`), living in the trainer actor, or
    in a group of them (every call to each rank, rank 0's answer)."""

    def __init__(self, handles: Sequence[Any], run_dir: Path) -> None:
        self.handles, self.run_dir = list(handles), run_dir
        self.handle = self.handles[0]
        """Rank 0's actor: it answers, and replicas read the published weights from it."""
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

    def save(self, directory: Path) -> None:
        """Each rank writes its shards into `directory` (a filesystem every rank's node sees)."""
        self._call("save", directory)

    def load(self, directory: Path) -> None:
        self.version, counts = self._call("load", directory)
        self.counts = Counter(counts)

    def state_dict(self) -> dict[str, Any]:
        """An unsharded learner's state, in memory (`save` writes a checkpoint of any learner)."""
        return self._call("state_dict")  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, counts = self._call("load_state_dict", state)
        self.counts = Counter(counts)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get([getattr(handle, method).remote(*args) for handle in self.handles])[0]
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
