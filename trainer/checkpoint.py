"""Checkpoints that a SIGKILL cannot corrupt: each one is written into a temporary directory, flushed,
then renamed into place, and `latest` names the newest complete one (also replaced by a rename).

A checkpoint holds what the learner writes into it (`Learner.save`: model, optimizer and reference
shards written with torch.distributed.checkpoint, which any number of ranks reads back, plus version
and skip counts) and everything else as JSON in `state.json`: the loop's step, the data cursor, the
pool, the in-flight partial rollouts with their version tags, and the RNG states. What the loop stores
in `state` is its business; this module only writes, finds and reads checkpoints.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

LATEST = "latest"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read back from disk."""

    path: Path
    """Its directory (`Learner.load` reads the learner's part from it)."""
    state: dict[str, Any]
    """The loop's JSON state."""


def save_checkpoint(
    directory: Path, step: int, save_learner: Callable[[Path], None], state: dict[str, Any], *, keep: int = 2
) -> Path:
    """Write checkpoint `step` under `directory` atomically and keep the newest `keep` of them;
    `save_learner` writes the learner's part into the checkpoint's (not yet visible) directory."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:07d}"
    scratch = directory / f".step-{step:07d}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    save_learner(scratch)
    full_state = {**state, "step": step, "rng": rng_state()}
    (scratch / "state.json").write_text(json.dumps(full_state, allow_nan=False), encoding="utf-8")
    _fsync_tree(scratch)
    if final.exists():
        shutil.rmtree(final)
    scratch.rename(final)
    _write_atomic(directory / LATEST, final.name)
    for old in sorted(directory.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint under `directory`, or None."""
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    path = directory / pointer.read_text(encoding="utf-8").strip()
    return path if path.is_dir() else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint; a missing or corrupt one raises ValueError naming the file."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"checkpoint {path} is unreadable ({error}); resume from another one") from error
    has_learner = (path / "learner.json").is_file() or (path / "learner.pt").is_file()
    if not isinstance(state, dict) or "step" not in state or not has_learner:
        raise ValueError(f"checkpoint {path} is incomplete; resume from another one")
    return Checkpoint(path, state)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as JSON."""
    kind, keys, position, has_gauss, gauss = cast(tuple[str, Any, int, int, float], np.random.get_state())
    return {
        "python": _jsonable(random.getstate()),
        "numpy": [kind, keys.tolist(), position, has_gauss, gauss],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """The inverse of `rng_state`."""
    random.setstate(_tupled(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _write_atomic(path: Path, text: str) -> None:
    scratch = path.with_name(path.name + ".partial")
    with scratch.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    scratch.replace(path)


def _fsync_tree(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_dir():
            _fsync_tree(entry)
            continue
        with entry.open("rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
