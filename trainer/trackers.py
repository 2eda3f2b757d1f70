"""Experiment trackers beside the run's own record: the scalars of every `metrics.jsonl` line also go to
Weights & Biases (offline by default) or MLflow (a local file store by default), chosen by one setting.

    logging.trackers = ["tensorboard", "wandb", "mlflow"]

A tracker gets the run's resolved config once, each step's scalars, and a close. TensorBoard stays
`MetricsWriter`'s own (it also takes the histograms); `wandb` and `mlflow` are optional extras
(`pip install 'pacerl[wandb]'`, `'pacerl[mlflow]'`), checked when the config loads and imported only when
a run opens them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pacerl.trainer.metrics import MetricsWriter, Tracker

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The trackers `logging.trackers` may name."""
_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
"""The module each optional tracker imports; its extra has the tracker's name."""


@dataclass(frozen=True)
class WandbOptions:
    """Weights & Biases (`wandb`): one W&B run per training run, its config the run's resolved config."""

    project: str = "pacerl"
    """The W&B project."""
    name: str | None = None
    """The W&B run's display name; None: the run directory's name."""
    mode: Literal["offline", "online"] = "offline"
    """offline: written under `dir` only (upload later with `wandb sync`); online: streamed to the W&B
    server (needs `wandb login`)."""
    dir: str | None = None
    """Where W&B writes its `wandb/` folder; None: the run directory."""


@dataclass(frozen=True)
class MlflowOptions:
    """MLflow (`mlflow`): one MLflow run per training run, its params the run's resolved config."""

    tracking_uri: str | None = None
    """The tracking store (`file:` URI, `sqlite:` URI or a server's `http:` URL); None: the
    `MLFLOW_TRACKING_URI` environment variable's, else a file store in the run directory's `mlruns/`."""
    experiment: str = "pacerl"
    """The MLflow experiment, created when missing."""
    run_name: str | None = None
    """The MLflow run's name; None: the run directory's name."""


@dataclass(frozen=True)
class LoggingConfig:
    """Where each step's metrics go besides `metrics.jsonl` (always written): TensorBoard events,
    Weights & Biases, MLflow."""

    trackers: tuple[str, ...] = ("tensorboard",)
    """The trackers, any of tensorboard, wandb, mlflow; () for metrics.jsonl alone."""
    wandb: WandbOptions = field(default_factory=WandbOptions)
    """The `wandb` tracker's project, run name, mode and directory."""
    mlflow: MlflowOptions = field(default_factory=MlflowOptions)
    """The `mlflow` tracker's store, experiment and run name."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.trackers if name not in TRACKERS]
        if unknown:
            raise ValueError(
                f"logging.trackers: unknown tracker {unknown[0]!r}; choose from {', '.join(TRACKERS)}"
            )
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"logging.trackers names a tracker twice: {list(self.trackers)}")
        for name in self.trackers:
            package = _PACKAGES.get(name)
            if package is not None and importlib.util.find_spec(package) is None:
                raise ValueError(
                    f"logging.trackers: {name} needs the {package} package: pip install 'pacerl[{name}]'"
                )
        if self.wandb.mode not in ("offline", "online"):
            raise ValueError(f"logging.wandb.mode must be offline or online, got {self.wandb.mode!r}")


def open_metrics(config: LoggingConfig, run_dir: Path, run_config: Mapping[str, Any]) -> MetricsWriter:
    """The run's `MetricsWriter`, with TensorBoard and the other trackers `config` names, each given
    `run_config` (the resolved config as plain JSON types)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    trackers: list[Tracker] = []
    try:
        for name in config.trackers:
            if name == "wandb":
                trackers.append(WandbTracker(config.wandb, run_dir, run_config))
            elif name == "mlflow":
                trackers.append(MlflowTracker(config.mlflow, run_dir, run_config))
    except BaseException:
        for opened in trackers:
            opened.close()
        raise
    return MetricsWriter(run_dir, tensorboard="tensorboard" in config.trackers, trackers=trackers)


class WandbTracker:
    """A W&B run; every row is logged with its `step`, which is the x-axis of every chart (the
    background evaluation writes a step after later training steps, which W&B's own step would drop)."""

    def __init__(self, options: WandbOptions, run_dir: Path, run_config: Mapping[str, Any]) -> None:
        import wandb

        directory = Path(options.dir) if options.dir else run_dir
        directory.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=options.project,
            name=options.name or run_dir.resolve().name,
            dir=str(directory),
            config=dict(run_config),
            mode=options.mode,
            reinit="create_new",
            # console="off": W&B would wrap stdout, under the step display that redraws it.
            settings=wandb.Settings(console="off", silent=True),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({"step": step, **scalars})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


_PARAM_TEXT_CAP = 500
"""Longest config value logged as an MLflow param (MLflow caps params; a chat template is longer): the
whole config is the run's `config.json` artifact anyway."""


class MlflowTracker:
    """An MLflow run through `MlflowClient` (no process-global active run)."""

    def __init__(self, options: MlflowOptions, run_dir: Path, run_config: Mapping[str, Any]) -> None:
        uri = (
            options.tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or (run_dir / "mlruns").resolve().as_uri()
        )
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store (in maintenance) unless told; it is the store that needs no
            # database or server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(options.experiment)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(options.experiment)
        )
        run = self._client.create_run(experiment_id, run_name=options.run_name or run_dir.resolve().name)
        self.run_id: str | None = run.info.run_id
        params = [
            Param(key, text) for key, text in _flatten(run_config).items() if len(text) <= _PARAM_TEXT_CAP
        ]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self._client.log_batch(run.info.run_id, params=params[start : start + 100])
        self._client.log_dict(run.info.run_id, dict(run_config), "config.json")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            raise RuntimeError("the mlflow tracker is closed")
        now_ms = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now_ms, step) for name, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self._client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id)
            self.run_id = None


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys to JSON text: {"loop": {"steps": 3}} -> {"loop.steps": "3"}."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


__all__ = [
    "TRACKERS",
    "LoggingConfig",
    "MlflowOptions",
    "MlflowTracker",
    "Tracker",
    "WandbOptions",
    "WandbTracker",
    "open_metrics",
]
