"""The learning side: advantages and losses so far (GRPO, GSPO, GSPO-token, SAT, AReaL's decoupled PPO
with TIS, GMC-GRPO, k3 KL, entropy, token log-probs); routing replay, the
pool with staleness filters, and the loops follow. Imports only `agents` (and below) of the project."""

from trainer.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_baseline_advantages
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

__all__ = [
    "ClipConfig",
    "LossOutput",
    "SATConfig",
    "decoupled_ppo_loss",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "gmc_loss",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "kl_k3",
    "reinforce_pp_baseline_advantages",
    "sat_bounds",
    "token_logprobs",
]
