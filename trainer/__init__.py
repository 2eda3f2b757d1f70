"""The learning side: advantages and losses so far (GRPO, GSPO, GSPO-token, SAT); routing replay, the
pool with staleness filters, and the loops follow. Imports only `agents` (and below) of the project."""

from trainer.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_baseline_advantages
from trainer.losses import ClipConfig, LossOutput, SATConfig, grpo_loss, gspo_loss, sat_bounds

__all__ = [
    "ClipConfig",
    "LossOutput",
    "SATConfig",
    "dr_grpo_advantages",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "reinforce_pp_baseline_advantages",
    "sat_bounds",
]
