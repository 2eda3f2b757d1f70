"""Experiment trackers, offline, with the real packages: the W&B run file (parsed with W&B's own record
type) and the MLflow file store (read through `MlflowClient`) hold the steps and values of metrics.jsonl,
from the writer and from a short `pacerl train`; unknown or uninstalled trackers fail at load."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pacerl.config import ConfigError, config_from_dict, load_config
from pacerl.trainer.metrics import read_metrics
from pacerl.trainer.trackers import LoggingConfig, MlflowOptions, open_metrics


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing reaches a network or the user's home: W&B offline, MLflow in the run directory's store."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # Set, then deleted: monkeypatch then restores its absence, undoing what the tracker sets.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run file: LevelDB's log format (32 KiB blocks of chunks with a 7-byte
    header: checksum, length, type) after W&B's 7-byte file header, each record a `Record` protobuf."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is whole
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record
        elif kind == 0:
            pending = b""


def wandb_history(wandb_dir: Path) -> list[dict[str, float]]:
    """Every row the one offline W&B run under `wandb_dir` logged, by name ('/'-joined keys)."""
    [run_file] = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    rows = []
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {
                (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def mlflow_history(run_dir: Path, store: Path | None = None) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every metric of the one MLflow run in `store` (default `run_dir/mlruns`), in
    logged order."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=(store or run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("pacerl")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    return {
        name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        for name in run.data.metrics
    }


def assert_same_in_mlflow(run_dir: Path, rows: list[dict[str, Any]], store: Path | None = None) -> None:
    """Every scalar of `rows` (metrics.jsonl) is in the MLflow run at the same steps, in the same order,
    with the same values, and nothing else is."""
    history = mlflow_history(run_dir, store)
    expected: dict[str, list[tuple[int, float | None]]] = {}
    for row in rows:
        for name, value in row.items():
            if name not in ("step", "time", "nonfinite"):
                expected.setdefault(name, []).append((row["step"], value))
    assert set(history) == set(expected)
    for name, points in expected.items():
        assert [s for s, _ in history[name]] == [s for s, _ in points], name
        assert all(_same(w, v) for (_, w), (_, v) in zip(points, history[name], strict=True)), name


def _same(a: float | None, b: float) -> bool:
    return (a is None and math.isnan(b)) or (a is not None and math.isclose(a, b, rel_tol=1e-6))


def test_unknown_and_uninstalled_trackers_are_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError, match="unknown tracker 'neptune'; choose from tensorboard, wandb, mlflow"
    ):
        load_config(None, ['logging.trackers=["tensorboard","neptune"]'])
    with pytest.raises(ConfigError, match="names a tracker twice"):
        load_config(None, ['logging.trackers=["wandb","wandb"]'])
    assert load_config(None, ['logging.trackers=["wandb","mlflow"]']).logging.trackers == ("wandb", "mlflow")
    assert load_config().logging == LoggingConfig()  # TensorBoard alone, as before
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # what `import` sees when the package is absent
        with pytest.raises(
            ConfigError, match=rf"{name} needs the {name} package: pip install 'pacerl\[{name}\]'"
        ):
            config_from_dict({"logging": {"trackers": [name]}})


def test_the_writer_hands_every_step_to_wandb_and_mlflow(tmp_path: Path) -> None:
    """Steps out of order (a background evaluation lands after a later step), a NaN, an int: each tracker
    keeps the step and value metrics.jsonl has; the config reaches both."""
    config = LoggingConfig(trackers=("wandb", "mlflow"))
    writes = [
        (1, {"loss": 0.5, "reward": 0.25}),
        (2, {"loss": float("nan"), "reward": 0.75, "trajectories": 8}),
        (1, {"eval/accuracy": 0.125}),
    ]
    with open_metrics(config, tmp_path, {"loop": {"steps": 2}, "env": {"id": "pacerl/Math-v0"}}) as metrics:
        for step, scalars in writes:
            metrics.write(step, scalars)
    assert not (tmp_path / "tb").exists()  # tensorboard was not chosen
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 1]

    logged = wandb_history(tmp_path)
    assert [row["step"] for row in logged] == [1, 2, 1]
    for row, written in zip(logged, rows, strict=True):
        names = set(written) - {"step", "time", "nonfinite"}
        assert set(row) - {"step"} == names
        assert all(_same(written[name], row[name]) for name in names)
    [run_file] = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    [run_record] = [r.run for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    saved = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert saved["loop"] == {"steps": 2} and saved["env"] == {"id": "pacerl/Math-v0"}

    assert_same_in_mlflow(tmp_path, rows)


def test_mlflow_follows_its_uri_setting_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`logging.mlflow.tracking_uri`, else MLFLOW_TRACKING_URI, else the run directory's own store."""
    chosen, from_env = tmp_path / "chosen", tmp_path / "from-env"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", from_env.as_uri())
    cases = [(LoggingConfig(trackers=("mlflow",)), from_env)]
    cases.append(
        (LoggingConfig(trackers=("mlflow",), mlflow=MlflowOptions(tracking_uri=chosen.as_uri())), chosen)
    )
    for index, (config, store) in enumerate(cases):
        run_dir = tmp_path / f"run{index}"
        with open_metrics(config, run_dir, {}) as metrics:
            metrics.write(3, {"reward": 0.5})
        assert not (run_dir / "mlruns").exists()
        assert_same_in_mlflow(run_dir, read_metrics(run_dir), store)


@pytest.mark.slow
def test_a_short_training_run_logs_to_tensorboard_wandb_and_mlflow(tmp_path: Path) -> None:
    """`pacerl train` of the tiny model for two steps with an evaluation each step: W&B and MLflow hold
    exactly the scalars metrics.jsonl holds, at the same steps."""
    from pacerl.train import train

    run_dir = tmp_path / "run"
    config = load_config(
        None,
        [
            f"run_dir={run_dir}",
            "sft.steps=2",
            "loop.steps=2",
            "loop.batch_groups=2",
            "rollout.group_size=2",
            "filter.pace.target_groups=2",
            "filter.max_concurrent_groups=2",
            "evaluation.every=1",
            "evaluation.at_start=false",
            "evaluation.settings.max_tasks=4",
            "evaluation.extra_tasks={}",
            "loop.require_update=false",
            'logging.trackers=["tensorboard","wandb","mlflow"]',
        ],
    )
    asyncio.run(train(config))
    rows = read_metrics(run_dir)
    assert sorted({row["step"] for row in rows}) == [1, 2] and any("eval/accuracy" in row for row in rows)
    assert (run_dir / "tb").is_dir()

    logged = wandb_history(run_dir)
    assert [row["step"] for row in logged] == [row["step"] for row in rows]
    for row, written in zip(logged, rows, strict=True):
        names = set(written) - {"step", "time", "nonfinite"}
        assert set(row) - {"step"} == names
        assert all(_same(written[name], row[name]) for name in names)

    assert_same_in_mlflow(run_dir, rows)
