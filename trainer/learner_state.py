"""The learner's state: the weights it publishes to the engines, and its model, optimizer, KL reference,
version and skip counts saved into a checkpoint and loaded back.

A checkpoint's learner part is written with torch.distributed.checkpoint into `LEARNER_SHARDS`, each
rank its own shards, so that a checkpoint saved with any number of ranks loads with any other; the
version and counts go into `LEARNER_META`. Checkpoints of runs before sharded saves hold one
`learner.pt` (the in-memory state of `memory_state`), which loads into an unsharded learner.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pacerl.trainer.distributed import is_sharded

LEARNER_SHARDS = "learner"
"""The directory of a checkpoint that holds the learner's torch.distributed.checkpoint shards."""
LEARNER_META = "learner.json"
"""The file of a checkpoint that holds the learner's version and skip counts."""
LEGACY_STATE = "learner.pt"
"""The file of a checkpoint from before sharded saves: the whole learner state in one `torch.save`."""


@dataclass(frozen=True)
class TrainedModules:
    """What a learner trains and keeps, whose tensors a checkpoint holds."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    reference: nn.Module | None
    """The frozen KL reference (None when the loss has no KL term)."""


def publishable_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The current weights to publish (detached views; the engine copies them). Sharded: every rank
    calls it, rank 0 gets the full tensors (on the CPU) and the others an empty dict."""
    if is_sharded(model):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(model, options=options)
        return {name: value for name, value in full.items() if isinstance(value, torch.Tensor)}
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def save_state(
    directory: Path, modules: TrainedModules, *, version: int, counts: Counter[str], rank: int
) -> None:
    """Write `modules`' state into `directory`/learner (this rank's shards) and, on rank 0, version and
    counts into learner.json. Every rank calls it."""
    with _one_process_quietly():
        dcp_save(_dcp_state(modules), checkpoint_id=directory / LEARNER_SHARDS)
    if rank == 0:
        meta = {"version": version, "counts": dict(counts)}
        (directory / LEARNER_META).write_text(json.dumps(meta), encoding="utf-8")


def load_state(directory: Path, modules: TrainedModules) -> tuple[int, Counter[str]]:
    """The inverse of `save_state`, resharded to these `modules`' ranks, in place; returns the version and
    counts. A legacy `learner.pt` loads into unsharded modules."""
    legacy = directory / LEGACY_STATE
    if not (directory / LEARNER_SHARDS).is_dir() and legacy.is_file() and not is_sharded(modules.model):
        return load_memory_state(torch.load(legacy, weights_only=False), modules)
    state = _dcp_state(modules)
    with _one_process_quietly():
        dcp_load(state, checkpoint_id=directory / LEARNER_SHARDS)
    set_state_dict(
        modules.model,
        modules.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    if modules.reference is not None:
        if "reference" not in state:
            raise ValueError(f"{directory} holds no KL reference model, but learner.loss.kl_coef > 0")
        set_model_state_dict(modules.reference, state["reference"])
    meta = json.loads((directory / LEARNER_META).read_text(encoding="utf-8"))
    return int(meta["version"]), Counter(meta["counts"])


def memory_state(modules: TrainedModules, *, version: int, counts: Counter[str]) -> dict[str, Any]:
    """Model, optimizer, version and counts of unsharded `modules`, in memory (`save_state` writes a
    checkpoint, sharded or not)."""
    if is_sharded(modules.model):
        raise RuntimeError("a sharded learner's state is saved with `save`, each rank its own shards")
    return {
        "model": modules.model.state_dict(),
        "optimizer": modules.optimizer.state_dict(),
        "version": version,
        "counts": dict(counts),
        "reference": None if modules.reference is None else modules.reference.state_dict(),
    }


def load_memory_state(state: dict[str, Any], modules: TrainedModules) -> tuple[int, Counter[str]]:
    """The inverse of `memory_state`, in place; returns the version and counts."""
    modules.model.load_state_dict(state["model"])
    modules.optimizer.load_state_dict(state["optimizer"])
    version, counts = int(state["version"]), Counter(state["counts"])
    if modules.reference is not None and state.get("reference") is not None:
        modules.reference.load_state_dict(state["reference"])
    return version, counts


def _dcp_state(modules: TrainedModules) -> dict[str, Any]:
    """The state torch.distributed.checkpoint saves and loads in place (this rank's shards)."""
    model, optimizer = get_state_dict(modules.model, modules.optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if modules.reference is not None:
        state["reference"] = get_model_state_dict(modules.reference)
    return state


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """torch.distributed.checkpoint warns each time it runs without a process group; one process is
    the unsharded learner's normal case, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
