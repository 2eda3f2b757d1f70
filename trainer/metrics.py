"""Training metrics: one JSON line per step (`metrics.jsonl`), TensorBoard events (`tb/`) and the scalars
handed to any experiment trackers (`pacerl.trainer.trackers`: W&B, MLflow).

    with MetricsWriter(Path("runs/exp1")) as metrics:
        metrics.write(step, {"loss": 0.31, "reward": 0.42}, histograms={"advantages": adv})
    rows = read_metrics("runs/exp1")

The JSON lines are the record a script or a test reads (strict JSON: a NaN or an infinity is written as
null and its key listed under `"nonfinite"`); the events are for watching a run in TensorBoard.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TextIO

import numpy as np
from tensorboardX import SummaryWriter

from pacerl.envs.jsonl import read_jsonl

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
_RESERVED = frozenset({"step", "time", "nonfinite"})


class Tracker(Protocol):
    """An experiment tracker (`pacerl.trainer.trackers`): each step's scalars (a non-finite one as a float
    NaN or infinity), then one close."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Appends each step's scalars to `run_dir/metrics.jsonl` (flushed per line, so a crashed run keeps
    every step it logged) and, with `tensorboard`, writes them and any histograms as TensorBoard events
    under `run_dir/tb/`; each of `trackers` gets the same scalars. A context manager; `close()` is
    idempotent and closes the trackers too."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, trackers: Sequence[Tracker] = ()) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        # Append: a resumed run continues the same record.
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._tb: SummaryWriter | None = None
        if tensorboard:
            # flush_secs is a ceiling only: write() flushes the events itself, once per step.
            self._tb = SummaryWriter(logdir=str(self.run_dir / TENSORBOARD_DIR), flush_secs=10)
        self._trackers = list(trackers)

    def write(
        self,
        step: int,
        scalars: Mapping[str, float | int],
        histograms: Mapping[str, Sequence[float] | np.ndarray] | None = None,
    ) -> None:
        """Record `scalars` (and, in TensorBoard only, `histograms`) for `step`."""
        if self._file is None:
            raise RuntimeError("the metrics writer is closed")
        clash = _RESERVED.intersection(scalars)
        if clash:
            raise ValueError(f"scalar names {sorted(clash)} are reserved for the record itself")
        now = time.time()
        row: dict[str, Any] = {"step": int(step), "time": now}
        nonfinite: list[str] = []
        for name, value in scalars.items():
            number = _number(name, value)
            if isinstance(number, float) and not math.isfinite(number):
                nonfinite.append(name)
                row[name] = None
            else:
                row[name] = number
        if nonfinite:
            row["nonfinite"] = nonfinite
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        floats = {name: float(value) for name, value in scalars.items()}
        for tracker in self._trackers:
            tracker.log(int(step), floats)
        if self._tb is None:
            return
        for name, value in scalars.items():
            self._tb.add_scalar(name, float(value), global_step=int(step), walltime=now)
        for name, values in (histograms or {}).items():
            array = np.asarray(values, dtype=np.float64).ravel()
            # A histogram cannot bin NaN or infinity; the finite rest still shows the distribution.
            array = array[np.isfinite(array)]
            if array.size:
                self._tb.add_histogram(name, array, global_step=int(step), walltime=now)
        self._tb.flush()

    def close(self) -> None:
        """Flush and close every output. Idempotent."""
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _number(name: str, value: object) -> float | int:
    """`value` as a JSON number: ints (and numpy ints) stay ints, everything else becomes a float."""
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows a `MetricsWriter` wrote, in order: `path` is the run directory or its metrics.jsonl."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [row for _, row in read_jsonl(path)]
