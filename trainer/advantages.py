"""Advantage estimators: pure functions over a `[groups, G]` reward tensor (docs/algorithms.md §1)."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, *, unbiased: bool = False) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv 2402.03300): (r - group mean) / group std.

    rewards: `[groups, G]`. The std is the population std of the group (Σ_i A_i² = G), or with
    `unbiased` the sample std (Bessel's correction, as verl's `compute_grpo_outcome_advantage` and TRL
    take it; a group of one member then has no std and gets 0). A group whose rewards are all equal gets
    advantage 0 for every member (it carries no signal; filters may drop it).
    """
    _check(rewards)
    centred = rewards - rewards.mean(-1, keepdim=True)
    if unbiased and rewards.shape[1] < 2:
        return torch.zeros_like(centred)
    std = rewards.std(-1, unbiased=unbiased, keepdim=True)
    return torch.where(std > eps, centred / std.clamp_min(eps), torch.zeros_like(centred))


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (arXiv 2503.20783): r - group mean, no std normalisation. rewards: `[groups, G]`."""
    _check(rewards)
    return rewards - rewards.mean(-1, keepdim=True)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with a group baseline (arXiv 2501.03262): subtract the group mean, then normalise by
    the mean and std of the whole batch. rewards: `[groups, G]`."""
    centred = dr_grpo_advantages(rewards)
    std = centred.std(unbiased=False)
    return (centred - centred.mean()) / std if std > eps else torch.zeros_like(centred)


def _check(rewards: torch.Tensor) -> None:
    if rewards.ndim != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must be [groups, G], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
