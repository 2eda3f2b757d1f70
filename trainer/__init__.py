"""The learning side: advantages and losses (GRPO, GSPO, GSPO-token, SAT, AReaL's decoupled PPO with TIS,
GMC-GRPO, k3 KL, entropy), R3 routing replay, the learner's step, the trajectory pool with its staleness
filters (none, max_age, admission, PACE), SFT warm starts, metrics, checkpoints and the sync and async
loops. Imports only `agents` (and below) of the project."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_baseline_advantages
    from trainer.batch import TokenBatch, collate, forward_logprobs
    from trainer.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint, save_checkpoint
    from trainer.learner import Learner, LearnerConfig, LossConfig, StepResult
    from trainer.loop import LoopConfig, Run, TaskCursor, train_async, train_sync
    from trainer.losses import (
        ClipConfig,
        LossOutput,
        SATConfig,
        decoupled_ppo_loss,
        entropy_from_logits,
        gmc_loss,
        grpo_loss,
        gspo_loss,
        kl_k3,
        sat_bounds,
        token_logprobs,
    )
    from trainer.metrics import MetricsWriter, read_metrics
    from trainer.pool import (
        FilterConfig,
        StalenessSummary,
        TrajectoryPool,
        admission_capacity,
        effective_staleness,
        pace_budget,
        percentile_ranks,
        prefix_drift,
        staleness_summary,
    )
    from trainer.replay import ReplayStats, check_routes, routing_replay
    from trainer.sft import Demonstration, SFTConfig, demonstrations, render_demonstration

_SOURCES = {
    "dr_grpo_advantages": "trainer.advantages",
    "grpo_advantages": "trainer.advantages",
    "reinforce_pp_baseline_advantages": "trainer.advantages",
    "TokenBatch": "trainer.batch",
    "collate": "trainer.batch",
    "forward_logprobs": "trainer.batch",
    "Checkpoint": "trainer.checkpoint",
    "latest_checkpoint": "trainer.checkpoint",
    "load_checkpoint": "trainer.checkpoint",
    "save_checkpoint": "trainer.checkpoint",
    "Learner": "trainer.learner",
    "LearnerConfig": "trainer.learner",
    "LossConfig": "trainer.learner",
    "StepResult": "trainer.learner",
    "LoopConfig": "trainer.loop",
    "Run": "trainer.loop",
    "TaskCursor": "trainer.loop",
    "train_async": "trainer.loop",
    "train_sync": "trainer.loop",
    "ClipConfig": "trainer.losses",
    "LossOutput": "trainer.losses",
    "SATConfig": "trainer.losses",
    "decoupled_ppo_loss": "trainer.losses",
    "entropy_from_logits": "trainer.losses",
    "gmc_loss": "trainer.losses",
    "grpo_loss": "trainer.losses",
    "gspo_loss": "trainer.losses",
    "kl_k3": "trainer.losses",
    "sat_bounds": "trainer.losses",
    "token_logprobs": "trainer.losses",
    "MetricsWriter": "trainer.metrics",
    "read_metrics": "trainer.metrics",
    "FilterConfig": "trainer.pool",
    "StalenessSummary": "trainer.pool",
    "TrajectoryPool": "trainer.pool",
    "admission_capacity": "trainer.pool",
    "effective_staleness": "trainer.pool",
    "pace_budget": "trainer.pool",
    "percentile_ranks": "trainer.pool",
    "prefix_drift": "trainer.pool",
    "staleness_summary": "trainer.pool",
    "ReplayStats": "trainer.replay",
    "check_routes": "trainer.replay",
    "routing_replay": "trainer.replay",
    "Demonstration": "trainer.sft",
    "SFTConfig": "trainer.sft",
    "demonstrations": "trainer.sft",
    "render_demonstration": "trainer.sft",
}
"""Where each name this package re-exports lives: loaded on first use, so that importing one
light module of the package (the simulator does) does not load torch with the rest."""


def __getattr__(name: str) -> object:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_SOURCES[name]), name)


__all__ = [
    "Checkpoint",
    "ClipConfig",
    "Demonstration",
    "FilterConfig",
    "Learner",
    "LearnerConfig",
    "LoopConfig",
    "LossConfig",
    "LossOutput",
    "MetricsWriter",
    "ReplayStats",
    "Run",
    "SATConfig",
    "SFTConfig",
    "StalenessSummary",
    "StepResult",
    "TaskCursor",
    "TokenBatch",
    "TrajectoryPool",
    "admission_capacity",
    "check_routes",
    "collate",
    "decoupled_ppo_loss",
    "demonstrations",
    "dr_grpo_advantages",
    "effective_staleness",
    "entropy_from_logits",
    "forward_logprobs",
    "gmc_loss",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "kl_k3",
    "latest_checkpoint",
    "load_checkpoint",
    "pace_budget",
    "percentile_ranks",
    "prefix_drift",
    "read_metrics",
    "reinforce_pp_baseline_advantages",
    "render_demonstration",
    "routing_replay",
    "sat_bounds",
    "save_checkpoint",
    "staleness_summary",
    "token_logprobs",
    "train_async",
    "train_sync",
]
