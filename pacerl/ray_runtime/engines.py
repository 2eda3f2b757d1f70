"""The Ray actors of `runtime = "ray"`: each hosts one part of the local runtime, unchanged.

- `EngineActor`: one engine replica, an `EmbeddedEngine` on its own copy of the model (CPU or a GPU)
  or the client of one SGLang server.
- `EnvWorker` (in `pacerl.ray_runtime.envs`, which imports no torch): the environments of many episodes.
- `TrainerActor`: the `Learner`, its model and optimizer.

The classes are plain Python; `pacerl.ray_runtime.runtime` turns them into actors (`ray.remote(...)`) and
supervises them. Nothing here decides where anything runs.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch import nn

from agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from agents.engine.protocol import Generation, SamplingParams
from agents.engine.sglang import SGLangEngine, SGLangOptions
from agents.trajectory import Trajectory
from trainer.learner import Learner, LearnerConfig, StepResult

WeightSpec = tuple[str, tuple[int, ...], torch.dtype]
"""One tensor of a broadcast: its name, shape and dtype, in the order the trainer sends them."""


class ReplicaNotReady(RuntimeError):  # noqa: N818 (a state, like the SGLang client's SGLangUnavailable)
    """The replica has not been told which weights to serve yet (it was just created)."""


@dataclass(frozen=True)
class ModelRecipe:
    """How an actor builds its own copy of the model: the class and config of the trained model (the
    weights travel separately, through the object store)."""

    model_class: type[nn.Module]
    """The transformers class of the trained model."""
    model_config: Any
    """Its `PretrainedConfig`."""

    def build(self, state: Mapping[str, torch.Tensor] | None, device: str = "cpu") -> nn.Module:
        """The model with `state` loaded (None: as initialised, for weights that arrive later)."""
        model = self.model_class(self.model_config)
        if state is not None:
            model.load_state_dict(dict(state))
        return model.to(device).eval()


@dataclass(frozen=True)
class EngineSpec:
    """One engine replica."""

    recipe: ModelRecipe | None
    """The model of an embedded engine (None for an SGLang client)."""
    tokenizer: Any
    """The tokenizer (stop strings are matched on decoded text)."""
    embedded: EmbeddedEngineConfig
    """Options of an embedded engine."""
    sglang: SGLangOptions | None
    """The server of an SGLang client (None: embedded)."""
    threads: int
    """torch threads of the replica's process."""
    device: str
    """Where an embedded engine runs: `cpu`, or `cuda` on a replica that was given a GPU."""


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class EngineActor:
    """One engine replica. It refuses work (`ReplicaNotReady`) until the router has told it which
    weights to serve (`sync`): a replacement starts without the current weights and must not generate
    before it holds them."""

    def __init__(self, spec: EngineSpec, state: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """`state` of `version` for an embedded engine (an SGLang server holds its own), or None with
        version -1: no weights yet, the first `sync` brings them (a replacement)."""
        torch.set_num_threads(spec.threads)
        self.engine: EmbeddedEngine | SGLangEngine
        if spec.sglang is not None:
            self.engine = SGLangEngine(spec.sglang, version=version)
        else:
            if spec.recipe is None or (state is None and version >= 0):
                raise ValueError("an embedded replica needs the model recipe, and the weights of its version")
            model = spec.recipe.build(state, spec.device)
            self.engine = EmbeddedEngine(model, spec.tokenizer, spec.embedded, version=version)
        self.serving = False
        self.outstanding = 0
        """Generations running now (what the router's least-outstanding balancing estimates)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str | None,
        return_routed_experts: bool,
        routed_experts_start_len: int = 0,
    ) -> Generation:
        if not self.serving:
            raise ReplicaNotReady("this engine replica has not been synced since it started")
        self.outstanding += 1
        try:
            return await self.engine.generate(
                input_ids,
                sampling,
                request_id=request_id,
                return_routed_experts=return_routed_experts,
                routed_experts_start_len=routed_experts_start_len,
            )
        finally:
            self.outstanding -= 1

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def sync(self, state: Mapping[str, torch.Tensor] | None, version: int) -> int:
        """Serve `version`: load `state` unless this replica already holds that version or a newer one
        (in-flight generations go on under the new weights, each token tagged). Its version after."""
        if version > self.engine.version:
            if state is None:
                raise ValueError(
                    f"version {version} (this replica: {self.engine.version}) came without weights"
                )
            await self.engine.update_weights(state, version)
        self.serving = True
        return self.engine.version

    async def version(self) -> int:
        """The version of the weights this replica serves."""
        return self.engine.version

    async def ping(self) -> int:
        """The process id (answers as soon as the actor is up)."""
        return os.getpid()

    async def load(self) -> int:
        """Generations running now."""
        return self.outstanding

    async def join_group(self, address: str, world_size: int, rank: int, backend: str) -> None:
        """Join the trainer's broadcast group (blocks until every member has joined)."""
        await asyncio.to_thread(_join, address, world_size, rank, backend)

    async def receive_weights(self, specs: Sequence[WeightSpec], version: int) -> int:
        """Receive one broadcast of the trainer's weights and serve them as `version`."""
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"

        def receive() -> dict[str, torch.Tensor]:
            received = {}
            for name, shape, dtype in specs:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(buffer, src=0)
                received[name] = buffer
            return received

        state = await asyncio.to_thread(receive)
        return await self.sync(state, version)

    async def aclose(self) -> None:
        await self.engine.aclose()


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
        _join(address, world_size, 0, backend)
        self._broadcast_device = "cuda" if backend == "nccl" else "cpu"
        return [(name, tuple(t.shape), t.dtype) for name, t in self.learner.weights().items()]

    def broadcast_weights(self, version: int) -> None:
        """Send the weights of `version` to every replica of the group."""
        for tensor in self.weights(version).values():
            dist.broadcast(tensor.to(self._broadcast_device).contiguous(), src=0)


def _join(address: str, world_size: int, rank: int, backend: str) -> None:
    # A dead member must end a broadcast in minutes, not the half hour torch waits by default.
    dist.init_process_group(
        backend, init_method=address, world_size=world_size, rank=rank, timeout=timedelta(minutes=5)
    )
