"""Policy losses as pure functions: GRPO (token-level clip), GSPO and GSPO-token (sequence ratio),
each with an optional staleness-adaptive trust region (SAT). ALGORITHMS.md §1, §3 and §5.

Shapes: `logprobs`, `old_logprobs`, `behaviour_logprobs`: `[B, T]` per-token log-probs of the
sampled tokens (current policy, the ratio's anchor, the rollout engine); `mask`: `[B, T]` bool, True
on trainable (model) tokens; `advantages`: `[B]`, one per sequence. Losses are to be minimised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class ClipConfig:
    """The trust region of the surrogate."""

    eps_low: float = 0.2
    """Lower clip radius: the ratio is clipped at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip radius (DAPO's asymmetric clip sets it higher than eps_low)."""

    def __post_init__(self) -> None:
        if not (0 < self.eps_low < 1 and self.eps_high > 0):
            raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got {self.eps_low}, {self.eps_high}")


@dataclass(frozen=True)
class SATConfig:
    """Staleness-adaptive trust region (SAT, arXiv 2607.18722). The kernel and the gate level are
    reconstructions (the paper's code was not available): see `sat_bounds`."""

    quantile: float = 0.9
    """Tokens whose |log π_θ - log μ| exceeds this quantile of the batch are gated."""
    kernel: Literal["cauchy", "rational"] = "cauchy"
    """Contraction k(x) for x > q: cauchy 1/(1+((x-q)/q)^2) or rational 2q²/(q²+x²); both are 1 at q."""

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise ValueError(f"quantile must be in (0, 1), got {self.quantile}")
        if self.kernel not in ("cauchy", "rational"):
            raise ValueError(f"kernel must be cauchy or rational, got {self.kernel!r}")


@dataclass(frozen=True)
class LossOutput:
    """A loss and its diagnostics (all detached but `loss`)."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    """Share of (tokens or sequences) whose clipped term was the active one."""
    gate_rate: torch.Tensor
    """Share gated by SAT (0 without SAT)."""
    mean_contraction: torch.Tensor
    """Mean contraction factor over gated entries (1 when none)."""


def sat_bounds(
    staleness_log_ratio: torch.Tensor, active: torch.Tensor, clip: ClipConfig, sat: SATConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-entry clip bounds (lo, hi) under SAT, plus the gate mask and the contraction factors.

    d = staleness_log_ratio (detached log π_θ - log μ), q = the `sat.quantile` quantile of |d| over
    active entries. An entry with |d| > q > 0 is gated: only the endpoint on the side it already moved
    to is contracted by k(|d|) (d > 0: the upper one; d < 0: the lower one), so pull-back updates toward
    r = 1 keep the base trust region, and nothing gated reduces to the base loss.
    """
    d = staleness_log_ratio.detach()
    magnitude = d.abs()
    values = magnitude[active]
    q = torch.quantile(values.float(), sat.quantile) if values.numel() else magnitude.new_zeros(())
    gated = active & (magnitude > q) & (q > 0)
    if sat.kernel == "cauchy":
        k = 1.0 / (1.0 + ((magnitude - q) / q.clamp_min(1e-12)) ** 2)
    else:
        k = 2 * q**2 / (q**2 + magnitude**2)
    k = torch.where(gated, k, torch.ones_like(k))
    c_high = torch.where(gated & (d > 0), k, torch.ones_like(k))
    c_low = torch.where(gated & (d < 0), k, torch.ones_like(k))
    return 1 - clip.eps_low * c_low, 1 + clip.eps_high * c_high, gated, k


def _surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r·A, clip(r, lo, hi)·A) and whether the clipped term was the active one."""
    unclipped = ratio * advantages
    clipped = torch.maximum(torch.minimum(ratio, hi), lo) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig = ClipConfig(),
    aggregation: Literal["sequence", "token"] = "sequence",
    sat: SATConfig | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """GRPO's token-level clipped surrogate (DeepSeekMath Eq. 3; DAPO's asymmetric clip via `clip`).

    aggregation: `sequence` = mean over sequences of the token mean (GRPO), `token` = sum over all
    tokens / number of tokens (DAPO). With `sat`, the per-token bounds come from `sat_bounds` on
    log π_θ - log μ (`behaviour_logprobs`, default `old_logprobs`).
    """
    _check_shapes(logprobs, old_logprobs, mask, advantages)
    ratio = torch.exp(logprobs - old_logprobs)
    lo, hi, gated, k = _bounds(logprobs, old_logprobs, behaviour_logprobs, mask, clip, sat)
    per_token, was_clipped = _surrogate(ratio, advantages[:, None], lo, hi)
    weights = mask.float()
    if aggregation == "token":
        loss = (per_token * weights).sum() / weights.sum().clamp_min(1)
    else:
        loss = ((per_token * weights).sum(-1) / weights.sum(-1).clamp_min(1)).mean()
    return _output(loss, was_clipped[mask], gated[mask], k[gated])


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig = ClipConfig(),
    token_level: bool = False,
    sat: SATConfig | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """GSPO (arXiv 2507.18071): the length-normalised sequence ratio s_i = exp(mean_t log r_t), clipped.

    `token_level` gives GSPO-token: s_{i,t} = sg[s_i]·π_θ/sg[π_θ], equal to GSPO in value and gradient
    when advantages are per sequence. With `sat`, the gate works on each sequence's mean
    log π_θ - log μ (a reconstruction: the paper leaves token- vs sequence-level gating open).
    """
    _check_shapes(logprobs, old_logprobs, mask, advantages)
    weights = mask.float()
    lengths = weights.sum(-1).clamp_min(1)
    sequence_log_ratio = ((logprobs - old_logprobs) * weights).sum(-1) / lengths
    behaviour = old_logprobs if behaviour_logprobs is None else behaviour_logprobs
    staleness = ((logprobs - behaviour).detach() * weights).sum(-1) / lengths
    present = weights.sum(-1) > 0
    if sat is None:
        lo = torch.full_like(sequence_log_ratio, 1 - clip.eps_low)
        hi = torch.full_like(sequence_log_ratio, 1 + clip.eps_high)
        gated, k = torch.zeros_like(present), torch.ones_like(sequence_log_ratio)
    else:
        lo, hi, gated, k = sat_bounds(staleness, present, clip, sat)
    if token_level:
        token_ratio = torch.exp(sequence_log_ratio.detach()[:, None] + logprobs - logprobs.detach())
        per_token, was_clipped = _surrogate(token_ratio, advantages[:, None], lo[:, None], hi[:, None])
        per_sequence = (per_token * weights).sum(-1) / lengths
        clipped_share = was_clipped[mask]
    else:
        per_sequence, was_clipped = _surrogate(torch.exp(sequence_log_ratio), advantages, lo, hi)
        clipped_share = was_clipped[present]
    loss = per_sequence[present].mean() if present.any() else per_sequence.sum() * 0
    return _output(loss, clipped_share, gated[present], k[gated])


def _bounds(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    clip: ClipConfig,
    sat: SATConfig | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if sat is None:
        lo = torch.full_like(logprobs, 1 - clip.eps_low)
        hi = torch.full_like(logprobs, 1 + clip.eps_high)
        return lo, hi, torch.zeros_like(mask), torch.ones_like(logprobs)
    behaviour = old_logprobs if behaviour_logprobs is None else behaviour_logprobs
    return sat_bounds(logprobs - behaviour, mask, clip, sat)


def _output(loss: torch.Tensor, clipped: torch.Tensor, gated: torch.Tensor, k: torch.Tensor) -> LossOutput:
    def share(flags: torch.Tensor) -> torch.Tensor:
        return flags.float().mean() if flags.numel() else torch.zeros(())

    mean_k = k.detach().mean() if k.numel() else torch.ones(())
    return LossOutput(loss, share(clipped), share(gated), mean_k)


def _check_shapes(
    logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor
) -> None:
    if logprobs.ndim != 2 or logprobs.shape != old.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must share a [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError("mask must be a bool tensor")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}], got {tuple(advantages.shape)}")
    for name, tensor in (("logprobs", logprobs), ("old_logprobs", old), ("advantages", advantages)):
        if not torch.isfinite(tensor[mask] if tensor.ndim == 2 else tensor).all():
            raise ValueError(f"{name} contain NaN or inf on trainable tokens")
