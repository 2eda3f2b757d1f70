"""Trajectory records on disk, one JSON object per line (the record itself, `pacerl.agents.trajectory`,
imports no env module: this file holds what reads and writes them through the project's JSON-lines reader)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from pacerl.agents.trajectory import Trajectory
from pacerl.envs.jsonl import read_jsonl


def save_jsonl(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Write one trajectory per line; ids must be unique. Returns how many were written."""
    records = list(trajectories)
    ids = [t.id for t in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate trajectory ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    with Path(path).open("w", encoding="utf-8") as file:
        for trajectory in records:
            file.write(json.dumps(trajectory.to_json(), allow_nan=False, separators=(",", ":")) + "\n")
    return len(records)


def load_jsonl(path: str | Path) -> list[Trajectory]:
    """Read what `save_jsonl` wrote; a bad line raises with its line number."""
    trajectories: list[Trajectory] = []
    for number, row in read_jsonl(path):
        try:
            trajectories.append(Trajectory.from_json(row))
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from error
    ids = [t.id for t in trajectories]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate trajectory ids")
    return trajectories
