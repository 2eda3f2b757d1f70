"""The learning side: advantages and losses (GRPO, GSPO, GSPO-token, SAT, AReaL's decoupled PPO with TIS,
GMC-GRPO, k3 KL, entropy), R3 routing replay, the learner's step, the trajectory pool with its staleness
filters (none, max_age, admission, PACE), SFT warm starts, metrics, checkpoints and the sync and async
loops. Imports only `agents` (and below) of the project."""

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
from trainer.sft import Demonstration, SFTConfig, demonstrations, render_demonstration, sft

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
    "sft",
    "staleness_summary",
    "token_logprobs",
    "train_async",
    "train_sync",
]
