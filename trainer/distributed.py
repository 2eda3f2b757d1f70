"""The learner across processes: PyTorch FSDP2 (`fully_shard`) over torch.distributed, gloo on CPU and
NCCL on GPU, the same code.

Every rank holds one shard of the parameters, gradients and AdamW state, receives the whole batch (the
trajectories are small next to the model) and forwards and backwards its own share of the micro-batches:
micro-batch i goes to rank i mod N. FSDP collectives run inside every forward and backward, so every rank
must run the same number of them: a rank with one micro-batch fewer runs a copy of one of its own with
weight 0 (`share`). Losses are normalised by the whole update's denominator on every rank and multiplied
by the number of ranks, which FSDP's average over ranks divides out again, so the update is the
single-process update with any world size;
SAT's quantile, the skip decisions and the step's figures are taken over every rank (`Ranks`).

`serve_learner` is the loop of ranks 1..N-1: rank 0 runs the whole training loop and calls its learner
through `LearnerGroup`, which first sends each call to the other ranks, so they enter the same collectives.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

Item = TypeVar("Item")
MixedPrecision = Literal["auto", "bf16", "fp32"]
TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for a rank that does not arrive (a dead rank ends the run, not hangs it)."""


@dataclass
class Ranks:
    """This process's place among the learner's ranks; the default (rank 0 of 1) needs no process group
    and turns every collective into the identity."""

    rank: int = 0
    """This process's rank."""
    size: int = 1
    """How many ranks train together."""
    objects: Any = field(default=None, repr=False)
    """The gloo group Python objects travel through (NCCL's default group moves tensors on the GPU only);
    None: the default group."""

    @classmethod
    def of_default_group(cls) -> Ranks:
        """The ranks of torch.distributed's default group (initialised by `join`)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "learner.parallel=fsdp needs torch.distributed initialised: launch through `pacerl train` "
                "(it starts the ranks itself) or torchrun"
            )
        objects = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        return cls(dist.get_rank(), dist.get_world_size(), objects)

    def gather(self, value: Item) -> list[Item]:
        """Every rank's `value`, in rank order."""
        if self.size == 1:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.objects)
        return values

    def agree(self, reason: str) -> str:
        """The first non-empty `reason` of any rank ("" when none has one): ranks abandon a step together."""
        return next((r for r in self.gather(reason) if r), "")

    def share(self, items: Sequence[Item]) -> list[tuple[Item, bool]]:
        """This rank's items (i mod size == rank), each with True; padded to every rank's count with
        (one of its own items or the first, False): work to run for the collectives and weigh by 0."""
        mine = [(item, True) for item in items[self.rank :: self.size]]
        count = -(-len(items) // self.size)
        filler = mine[0][0] if mine else items[0]
        return mine + [(filler, False)] * (count - len(mine))

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over the ranks."""
        total: dict[str, float] = {}
        for part in self.gather(values):
            for key, value in part.items():
                total[key] = total.get(key, 0.0) + value
        return total


def join(backend: str | None = None) -> Ranks:
    """Join the default process group from torchrun's environment variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); the backend defaults to NCCL with a GPU, gloo without."""
    if not dist.is_initialized():
        missing = [
            name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ
        ]
        if missing:
            raise RuntimeError(f"torch.distributed needs {', '.join(missing)} in the environment")
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(chosen, timeout=TIMEOUT)
    return Ranks.of_default_group()


def shard(model: nn.Module, mixed_precision: MixedPrecision = "auto") -> nn.Module:
    """`fully_shard` each decoder layer, then the root (the units FSDP gathers one at a time). FSDP
    averages the ranks' gradients; every rank's loss carries the whole update's normalisation, so the
    learner multiplies it by the number of ranks (gloo has no pre-multiplied sum to set a divide factor
    of 1 with). Mixed precision (bf16 compute, fp32 gradient reduction and master weights)
    is the default on GPU; CPU stays fp32, where the ranks' update equals one process's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    use_bf16 = mixed_precision == "bf16" or (mixed_precision == "auto" and dist.get_backend() == "nccl")
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16 else None
    )
    options: dict[str, Any] = {"mp_policy": policy} if policy is not None else {}
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers causal LM (`model.model.layers`), FSDP's units."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(
            f"learner.parallel=fsdp shards a transformers causal LM by its decoder layers "
            f"(model.model.layers); {type(model).__name__} has none"
        )
    return list(layers)


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard` has been applied to `model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


Call = tuple[str, tuple[Any, ...], dict[str, Any]]
"""A learner method's name, its positional and its keyword arguments."""
STOP = "__stop__"


class RanksLostError(RuntimeError):
    """A rank of the learner died: the shards it held are gone, the run must resume a checkpoint."""


class LearnerGroup:
    """Rank 0's learner when the learner spans ranks: each call is sent to ranks 1..N-1 first (they run
    `serve_learner`), then run here, so every rank enters the same collectives in the same order (calls
    from several threads take turns)."""

    COLLECTIVE = ("train_step", "prefix_drift", "weights", "save", "load", "logprobs", "mismatch")
    """The learner methods every rank must run together (each one below)."""

    def __init__(self, learner: Any, ranks: Ranks, processes: Sequence[subprocess.Popen[bytes]] = ()) -> None:
        self._learner, self._ranks = learner, ranks
        self._processes = list(processes)
        self._turn = threading.Lock()
        self._closed = False
        self.broken = False
        """Set when a collective failed: the group can neither train nor gather any more."""

    def train_step(self, groups: Sequence[Sequence[Any]]) -> Any:
        return self._together("train_step", groups)

    def prefix_drift(self, trajectories: Sequence[Any]) -> list[float]:
        drifts: list[float] = self._together("prefix_drift", trajectories)
        return drifts

    def weights(self) -> dict[str, torch.Tensor]:
        """The full weights (gathered from every rank's shard)."""
        full: dict[str, torch.Tensor] = self._together("weights")
        return full

    def save(self, directory: Path) -> None:
        self._together("save", directory)

    def load(self, directory: Path) -> None:
        self._together("load", directory)

    def logprobs(self, trajectories: Sequence[Any], **options: Any) -> Any:
        return self._together("logprobs", trajectories, **options)

    def mismatch(self, trajectories: Sequence[Any]) -> dict[str, float]:
        figures: dict[str, float] = self._together("mismatch", trajectories)
        return figures

    def _together(self, name: str, *args: Any, **options: Any) -> Any:
        with self._turn:
            if self._closed or self.broken:
                raise RuntimeError(f"{name}: the learner's ranks have been released or lost")
            try:
                send(self._ranks, (name, args, options))
                return getattr(self._learner, name)(*args, **options)
            except RuntimeError as error:  # gloo and NCCL report a vanished peer as RuntimeError
                lost = self._lost_ranks()
                if not lost and not _from_a_collective(error):
                    raise
                self.broken = True
                who = f"lost {', '.join(lost)}" if lost else "had a collective fail"
                raise RanksLostError(
                    f"the learner {who} during {name}; the shards of a lost rank are gone, so the run "
                    f"stops: continue it from its latest checkpoint with `pacerl train --resume RUN_DIR` "
                    f"({str(error).splitlines()[0][:200]})"
                ) from None

    def _lost_ranks(self) -> list[str]:
        """The ranks this process started that have exited (a killed one may take a moment to be
        reaped after its sockets closed, so each is given a few seconds)."""
        lost = []
        for rank, process in enumerate(self._processes, start=1):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5.0)
            if process.returncode is not None:
                lost.append(f"rank {rank} (exit code {process.returncode})")
        return lost

    @property
    def version(self) -> int:
        return int(self._learner.version)

    @property
    def counts(self) -> Counter[str]:
        counts: Counter[str] = self._learner.counts
        return counts

    @property
    def learner(self) -> Any:
        """Rank 0's own `Learner` (its shard)."""
        return self._learner

    def close(self, timeout: float = 60.0) -> None:
        """Release ranks 1..N-1 (they leave `serve_learner`), leave the process group, and wait for the
        ranks this process started (killed after `timeout` seconds)."""
        with self._turn:
            if self._closed:
                return
            self._closed = True
            try:
                if not self.broken:  # a lost rank takes no call, and the others left with an error
                    send(self._ranks, (STOP, (), {}))
                    dist.destroy_process_group()
            finally:
                for process in self._processes:
                    try:
                        process.wait(timeout)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()


def _from_a_collective(error: RuntimeError) -> bool:
    """Whether `error` came out of torch.distributed (a peer gone, a timeout), not the learner's code."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(mark in text for mark in ("gloo", "NCCL", "Connection"))


def send(ranks: Ranks, call: Call) -> None:
    """Rank 0: tell the other ranks what to run next."""
    message: list[Any] = [call]
    dist.broadcast_object_list(message, src=0, group=ranks.objects)


def receive(ranks: Ranks) -> Call:
    """Ranks 1..N-1: the next call of rank 0."""
    message: list[Any] = [None]
    dist.broadcast_object_list(message, src=0, group=ranks.objects)
    call: Call = message[0]
    return call


def serve_learner(build: Callable[[], Any], ranks: Ranks) -> None:
    """The loop of a rank > 0: build the learner (collectively, with rank 0), then run rank 0's calls
    until it stops."""
    learner = build()
    while True:
        name, args, options = receive(ranks)
        if name == STOP:
            break
        if name not in LearnerGroup.COLLECTIVE:
            raise RuntimeError(f"rank 0 sent {name!r}, which is not a learner call ranks share")
        getattr(learner, name)(*args, **options)
    dist.destroy_process_group()
