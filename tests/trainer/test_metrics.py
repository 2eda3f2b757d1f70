"""MetricsWriter: JSON lines read back as written, and TensorBoard events parsed from the raw file."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from pacerl.trainer.metrics import MetricsWriter, read_metrics


def read_events(directory: Path) -> list[event_pb2.Event]:
    """Every event of the one TFRecord file under `directory`: 8-byte length, its 4-byte CRC, the data,
    the data's 4-byte CRC (the CRCs are not checked here)."""
    (path,) = directory.glob("events.out.tfevents.*")
    data = path.read_bytes()
    events, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        start = offset + 12
        event = event_pb2.Event()
        event.ParseFromString(data[start : start + length])
        events.append(event)
        offset = start + length + 4
    assert offset == len(data)
    return events


def test_three_steps_read_back_from_jsonl_and_tensorboard(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as metrics:
        for step in range(3):
            metrics.write(
                step,
                {"loss": 1.5 - 0.5 * step, "episodes": 8 * (step + 1)},
                histograms={"advantages": np.array([-1.0, 0.0, 1.0]) * (step + 1)},
            )
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["loss"], r["episodes"]) for r in rows] == [(0, 1.5, 8), (1, 1.0, 16), (2, 0.5, 24)]
    assert isinstance(rows[0]["episodes"], int) and "nonfinite" not in rows[0]
    assert rows[0]["time"] <= rows[1]["time"] <= rows[2]["time"]
    assert read_metrics(tmp_path / "metrics.jsonl") == rows

    events = read_events(tmp_path / "tb")
    scalars = {
        (value.tag, event.step): value.simple_value
        for event in events
        for value in event.summary.value
        if value.HasField("simple_value")
    }
    assert scalars == {
        ("loss", 0): 1.5,
        ("loss", 1): 1.0,
        ("loss", 2): 0.5,
        ("episodes", 0): 8.0,
        ("episodes", 1): 16.0,
        ("episodes", 2): 24.0,
    }
    histograms = {
        event.step: value.histo
        for event in events
        for value in event.summary.value
        if value.tag == "advantages" and value.HasField("histo")
    }
    assert sorted(histograms) == [0, 1, 2]
    assert (histograms[2].min, histograms[2].max, histograms[2].num, histograms[2].sum) == (-3.0, 3.0, 3, 0.0)


def test_nonfinite_values_are_null_in_strict_json(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, tensorboard=False) as metrics:
        metrics.write(0, {"loss": math.nan, "grad_norm": math.inf, "reward": np.float64(0.25)})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    row = json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert row["loss"] is None and row["grad_norm"] is None and row["reward"] == 0.25
    assert row["nonfinite"] == ["loss", "grad_norm"]
    assert not (tmp_path / "tb").exists()


def test_close_is_idempotent_appends_on_reopen_and_checks_names(tmp_path: Path) -> None:
    metrics = MetricsWriter(tmp_path)
    metrics.write(0, {"loss": 1.0}, histograms={"ratio": [math.nan, 1.0]})
    with pytest.raises(ValueError, match="reserved"):
        metrics.write(1, {"step": 1.0})
    with pytest.raises(TypeError, match="must be a number"):
        metrics.write(1, {"loss": "low"})  # type: ignore[dict-item]
    metrics.close()
    metrics.close()
    with pytest.raises(RuntimeError, match="closed"):
        metrics.write(1, {"loss": 0.5})
    with MetricsWriter(tmp_path, tensorboard=False) as resumed:
        resumed.write(1, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
