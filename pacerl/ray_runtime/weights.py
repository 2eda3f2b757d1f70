"""How models and weights travel between the actors of `runtime = "ray"`: the recipe an actor builds
its own copy of the model from, the trainer's published weights (left in the trainer's process until
read), and the torch.distributed group a broadcast of them goes through."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import nn

WeightSpec = tuple[str, tuple[int, ...], torch.dtype]
"""One tensor of a broadcast: its name, shape and dtype, in the order the trainer sends them."""


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


class PublishedWeights(Mapping[str, torch.Tensor]):
    """The trainer's weights of one version, left in the trainer's process until someone reads them:
    the router hands the object-store reference to the replicas (the driver never holds a copy); a
    local reader (the background evaluator's engine) fetches them on first access."""

    def __init__(self, trainer: Any, version: int) -> None:
        self.trainer, self.version = trainer, version
        self._ref: Any = None
        self._state: dict[str, torch.Tensor] | None = None

    def ref(self) -> Any:
        """The object-store reference of the state dict (made once, on first use)."""
        if self._ref is None:
            self._ref = self.trainer.weights.remote(self.version)
        return self._ref

    def _fetched(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            self._state = ray.get(self.ref())
        return self._state

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._fetched()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetched())

    def __len__(self) -> int:
        return len(self._fetched())


def join_broadcast_group(address: str, world_size: int, rank: int, backend: str) -> None:
    """Join the group the trainer (rank 0) broadcasts its weights to the replicas in; blocks until every
    member has joined."""
    # A dead member must end a broadcast in minutes, not the half hour torch waits by default.
    dist.init_process_group(
        backend, init_method=address, world_size=world_size, rank=rank, timeout=timedelta(minutes=5)
    )
