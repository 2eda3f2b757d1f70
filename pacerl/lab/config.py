"""One simulation's config (`SimConfig`): the cluster, the loop's knobs (batch, publication interval,
the pool's filter) and the sections of the cost models (`pacerl.lab.costs`), read from settings by the
project's one loader (`pacerl.settings`). Two of its knobs in more words:

- **The synchronous baseline** on the same GPUs: `colocated` (every GPU generates, then every GPU trains,
  switching costs `colocated_switch_s` per round; what AReaL and verl compare against) or `split` (the
  same engines and trainer as async, used in turn). A round generates S·B groups with the current
  weights, trains S updates on them, publishes.
- **Record tokens** (`token_block`): records hold synthetic token ids, and with `token_block` > 1 one
  record token stands for that many real tokens (segment lengths rounded, at least one), which keeps
  30k-token trajectories cheap; the timing and token accounting use exact counts, the staleness
  statistics the record's (block-rounded) ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from pacerl.lab.costs import InferenceConfig, TrainerConfig, WorkloadConfig, check_float, check_int
from pacerl.settings import settings_into
from pacerl.trainer.pool import FilterConfig, PaceSettings

Interrupt: TypeAlias = Literal["reprefill", "continue"]
SyncBaseline: TypeAlias = Literal["colocated", "split"]


def cluster_filter(batch_groups: int) -> FilterConfig:
    """The simulator's filter for batches of `batch_groups` groups: PACE with a target of one batch
    waiting and eight batches in flight, enough rows to keep a cluster's engines busy. (A training run's
    own defaults, `pacerl.trainer.pool.FilterConfig`, fit the batches of a laptop run instead.)"""
    return FilterConfig(
        name="pace", max_concurrent_groups=8 * batch_groups, pace=PaceSettings(target_groups=batch_groups)
    )


def _default_filter() -> FilterConfig:
    return cluster_filter(SimConfig.batch_groups)


@dataclass(frozen=True)
class SimConfig:
    """One simulation: the cluster, the workload, the models and the loop's knobs."""

    inference_gpus: int = 96
    """GPUs running inference engines (async and split sync). >= gpus_per_engine."""
    trainer_gpus: int = 32
    """GPUs training (async and split sync). >= 1."""
    steps: int = 1000
    """Trainer steps (updates) to simulate in async mode. >= 1."""
    sync_steps: int | None = None
    """Steps of the synchronous baseline; None: min(steps, 100). Every sync round starts from idle
    engines with fresh samples, so rounds are independent and fewer steps estimate the same mean."""
    batch_groups: int = 32
    """B: groups per training batch. >= 1."""
    sync_interval: int = 1
    """S: weights are published every S updates (sync: a round generates S·B groups). >= 1."""
    filter: FilterConfig = field(default_factory=_default_filter)
    """The pool's staleness filter and its knobs (`pacerl.trainer.pool.FilterConfig`), including
    `max_concurrent_groups`, the producer's in-flight cap; default `cluster_filter(batch_groups)`."""
    seed: int = 0
    """Seed of every sample (lengths, latencies, drift sensitivities). >= 0."""
    weight_sync_s: float = 3.0
    """Seconds to publish weights from the trainer to the engines (async and split sync). >= 0."""
    colocated_switch_s: float = 10.0
    """Colocated sync: seconds per round to switch the GPUs between generating and training (offload,
    reload, reshard, load the weights into the engine). >= 0."""
    interrupt: Interrupt = "reprefill"
    """What an engine does with running sequences on a weight update: `reprefill` (AReaL: recompute
    their caches) or `continue` (PipelineRL: keep the stale caches)."""
    sync_baseline: SyncBaseline = "colocated"
    """The synchronous baseline's hardware use: `colocated` or `split` (see the module docstring)."""
    token_block: int | None = None
    """Real tokens per record token (see the module docstring). >= 1; None: a mean turn of about 8
    record tokens (1 for turns that short), which keeps building records cheap."""
    pool_cap_groups: int | None = None
    """The simulator stops starting groups while this many wait in the pool (None: 16·B). The real loop
    has no such cap; it only keeps an unfiltered run whose generation outpaces training bounded in
    memory, and the time it holds the producer back is reported (`pool_cap_held_s`)."""
    drift_sigma: float = 1.0
    """Spread (log-space std) of the per-trajectory drift sensitivity of the PACE drift model. >= 0."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """Episode shape: group size, lengths, turns, tools."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """Decode-throughput model of one engine."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Step-time model of the trainer."""

    def __post_init__(self) -> None:
        check_int("inference_gpus", self.inference_gpus, 1)
        check_int("trainer_gpus", self.trainer_gpus, 1)
        check_int("steps", self.steps, 1)
        if self.sync_steps is not None:
            check_int("sync_steps", self.sync_steps, 1)
        check_int("batch_groups", self.batch_groups, 1)
        check_int("sync_interval", self.sync_interval, 1)
        eta = self.filter.admission.max_offpolicyness
        if self.filter.name == "admission" and eta < self.sync_interval - 1:
            raise ValueError(
                f"filter.admission.max_offpolicyness ({eta}) must be >= sync_interval - 1 "
                f"({self.sync_interval - 1}): the trainer takes S batches of one published version"
            )
        check_int("seed", self.seed, 0)
        if self.token_block is not None:
            check_int("token_block", self.token_block, 1)
        if self.pool_cap_groups is not None:
            check_int("pool_cap_groups", self.pool_cap_groups, self.batch_groups)
        check_float("weight_sync_s", self.weight_sync_s, 0.0)
        check_float("colocated_switch_s", self.colocated_switch_s, 0.0)
        check_float("drift_sigma", self.drift_sigma, 0.0)
        if self.interrupt not in ("reprefill", "continue"):
            raise ValueError(f"interrupt must be reprefill or continue, got {self.interrupt!r}")
        if self.sync_baseline not in ("colocated", "split"):
            raise ValueError(f"sync_baseline must be colocated or split, got {self.sync_baseline!r}")
        for name, kind in (
            ("filter", FilterConfig),
            ("workload", WorkloadConfig),
            ("inference", InferenceConfig),
            ("trainer", TrainerConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}")
        if self.inference_gpus < self.inference.gpus_per_engine:
            raise ValueError(
                f"inference_gpus ({self.inference_gpus}) must be at least inference.gpus_per_engine "
                f"({self.inference.gpus_per_engine})"
            )
        if self.workload.max_context > self.inference.kv_capacity_tokens:
            raise ValueError(
                f"inference.kv_capacity_tokens ({self.inference.kv_capacity_tokens}) must hold the longest "
                f"possible context ({self.workload.max_context} tokens of prompt, turns and tool responses)"
            )

    @property
    def engines(self) -> int:
        """Engine replicas of the async (and split sync) setup."""
        return self.inference_gpus // self.inference.gpus_per_engine

    @property
    def baseline_steps(self) -> int:
        """The effective `sync_steps`."""
        return min(self.steps, 100) if self.sync_steps is None else self.sync_steps

    @property
    def block(self) -> int:
        """The effective `token_block`."""
        if self.token_block is not None:
            return self.token_block
        return max(1, math.floor(self.workload.response_tokens.mean() / 8))

    @property
    def pool_cap(self) -> int:
        """The effective `pool_cap_groups`."""
        return 16 * self.batch_groups if self.pool_cap_groups is None else self.pool_cap_groups


def config_from_dict(base: SimConfig, data: Mapping[str, Any]) -> SimConfig:
    """`base` with the settings of `data` applied (`pacerl.settings.settings_into`, the project's one
    loader): nested sections by their field name, a section given in part keeps the rest of `base`;
    lists become tuples and the string "inf" a float. Unknown keys and invalid values raise a ValueError
    (`ConfigError`) naming the key."""
    return settings_into(base, data, unknown="setting")
