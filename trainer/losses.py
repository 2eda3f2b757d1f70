"""Policy losses as pure functions: GRPO (token-level clip), GSPO and GSPO-token (sequence ratio),
each with an optional staleness-adaptive trust region (SAT); AReaL's decoupled PPO (with TIS); GMC-GRPO's
group-mass capping; and the helpers around them (k3 KL, entropy, token log-probs).
docs/algorithms.md §1, §2, §3, §5 and §7.

Shapes: `logprobs`, `old_logprobs`, `proximal_logprobs`, `behaviour_logprobs`: `[B, T]` per-token
log-probs of the sampled tokens (current policy, the ratio's anchor, the rollout engine); `mask`:
`[B, T]` bool, True on trainable (model) tokens; `advantages`: `[B]`, one per sequence. Losses are to
be minimised.

Micro-batching. A caller that splits one batch into parts and accumulates gradients passes each part the
whole batch's figures, so that the parts' losses sum to the whole batch's loss exactly, for token means
and sequence means alike: `denominator` (the batch's count of what the mean is over: trainable tokens for
token means, sequences with trainable tokens for sequence means; each loss declares which in
`pacerl.trainer.policy_losses`) and `sat_threshold` (SAT's quantile over the whole batch, from `sat_threshold`
on the batch's staleness).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

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
    masked_fraction: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """Share of trainable tokens dropped by a behaviour-weight cap (0 for losses without one)."""
    sat_active: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """Share (of the entries `clip_fraction` counts) whose active term is a bound SAT contracted and the
    base trust region would not have clipped: where SAT changed the gradient (0 without SAT)."""


def sequence_staleness(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's SAT input: per sequence, the mean over its trainable tokens of log π_θ - log μ (detached;
    0 for a sequence without trainable tokens). Shapes: `[B, T]` each → `[B]`."""
    weights = mask.to(logprobs.dtype)
    difference = torch.where(mask, logprobs.detach() - behaviour_logprobs.detach(), 0.0)
    return (difference * weights).sum(-1) / weights.sum(-1).clamp_min(1)


def sat_threshold(staleness_log_ratio: torch.Tensor, active: torch.Tensor, sat: SATConfig) -> torch.Tensor:
    """SAT's gate level q: the `sat.quantile` quantile (linear interpolation) of |d| over the active
    entries (0 when none). A caller that micro-batches takes it once over the whole batch and passes it
    to each part's loss, so that every part gates against the batch's level."""
    values = staleness_log_ratio.detach().abs()[active]
    if not values.numel():
        return staleness_log_ratio.new_zeros(())
    return torch.quantile(values.float(), sat.quantile).to(staleness_log_ratio.dtype)


def sat_bounds(
    staleness_log_ratio: torch.Tensor,
    active: torch.Tensor,
    clip: ClipConfig,
    sat: SATConfig,
    threshold: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-entry clip bounds (lo, hi) under SAT, plus the gate mask and the contraction factors.

    d = staleness_log_ratio (detached log π_θ - log μ), q = `threshold`, by default `sat_threshold` of
    these entries (the `sat.quantile` quantile of |d| over active entries). An entry with |d| > q > 0 is
    gated: only the endpoint on the side it already moved to is contracted by k(|d|) (d > 0: the upper
    one; d < 0: the lower one), so pull-back updates toward r = 1 keep the base trust region, and nothing
    gated reduces to the base loss.
    """
    d = staleness_log_ratio.detach()
    magnitude = d.abs()
    if threshold is None:
        q = sat_threshold(d, active, sat)
    else:
        q = torch.as_tensor(threshold, dtype=magnitude.dtype)
        if not (bool(torch.isfinite(q)) and float(q) >= 0 and q.ndim == 0):
            raise ValueError(f"threshold must be a finite scalar >= 0, got {threshold}")
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


def _sat_acted(
    ratio: torch.Tensor, advantages: torch.Tensor, clip: ClipConfig, was_clipped: torch.Tensor
) -> torch.Tensor:
    """Entries clipped under SAT's bounds that the base bounds would have left unclipped."""
    ratio = ratio.detach()
    base = torch.clamp(ratio, 1 - clip.eps_low, 1 + clip.eps_high) * advantages < ratio * advantages
    return was_clipped & ~base


def _batch_mean(values: torch.Tensor, denominator: float | None) -> torch.Tensor:
    """Σ values / denominator: the mean over these entries, or (given the whole batch's count) this part's
    share of the whole batch's mean."""
    if denominator is None:
        return values.sum() / max(values.numel(), 1)
    if not (math.isfinite(denominator) and denominator > 0):
        raise ValueError(f"denominator must be a positive count, got {denominator}")
    return values.sum() / denominator


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig = ClipConfig(),
    aggregation: Literal["sequence", "token"] = "sequence",
    sat: SATConfig | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    *,
    sat_threshold: torch.Tensor | float | None = None,
    denominator: float | None = None,
) -> LossOutput:
    """GRPO's token-level clipped surrogate (DeepSeekMath Eq. 3; DAPO's asymmetric clip via `clip`).

    aggregation: `sequence` = mean over sequences with trainable tokens of each one's token mean (GRPO,
    verl's seq-mean-token-mean: a row with none would only dilute the others), `token` = sum over all
    tokens / number of tokens (DAPO). With `sat`, the per-token bounds come from `sat_bounds` on
    log π_θ - log μ (`behaviour_logprobs`, default `old_logprobs`). `sat_threshold` and `denominator`:
    the whole batch's, when this call holds a part of it (module docstring).
    """
    _check_shapes(mask, advantages, logprobs=logprobs, old_logprobs=old_logprobs)
    logprobs, old_logprobs = _off_mask_zeroed(mask, logprobs, old_logprobs)
    if behaviour_logprobs is not None:
        (behaviour_logprobs,) = _off_mask_zeroed(mask, behaviour_logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    lo, hi, gated, k = _bounds(logprobs, old_logprobs, behaviour_logprobs, mask, clip, sat, sat_threshold)
    per_token, was_clipped = _surrogate(ratio, advantages[:, None], lo, hi)
    if aggregation == "token":
        loss = _batch_mean(per_token[mask], denominator)
    else:
        counts = mask.sum(-1)
        per_sequence = torch.where(mask, per_token, 0.0).sum(-1) / counts.clamp_min(1)
        loss = _batch_mean(per_sequence[counts > 0], denominator)
    acted = _sat_acted(ratio, advantages[:, None], clip, was_clipped) & gated
    return _output(loss, was_clipped[mask], gated[mask], k[gated], sat_active=acted[mask])


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig = ClipConfig(),
    token_level: bool = False,
    sat: SATConfig | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    *,
    sat_threshold: torch.Tensor | float | None = None,
    denominator: float | None = None,
) -> LossOutput:
    """GSPO (arXiv 2507.18071): the length-normalised sequence ratio s_i = exp(mean_t log r_t), clipped.

    `token_level` gives GSPO-token: s_{i,t} = sg[s_i]·π_θ/sg[π_θ], equal to GSPO in value and gradient
    when advantages are per sequence. With `sat`, the gate works on each sequence's mean
    log π_θ - log μ (`sequence_staleness`; a reconstruction: the paper leaves token- vs sequence-level
    gating open). The loss is the mean over sequences with trainable tokens; `sat_threshold` and
    `denominator`: the whole batch's, when this call holds a part of it (module docstring).
    """
    _check_shapes(mask, advantages, logprobs=logprobs, old_logprobs=old_logprobs)
    logprobs, old_logprobs = _off_mask_zeroed(mask, logprobs, old_logprobs)
    if behaviour_logprobs is not None:
        (behaviour_logprobs,) = _off_mask_zeroed(mask, behaviour_logprobs)
    weights = mask.float()
    lengths = weights.sum(-1).clamp_min(1)
    sequence_log_ratio = ((logprobs - old_logprobs) * weights).sum(-1) / lengths
    behaviour = old_logprobs if behaviour_logprobs is None else behaviour_logprobs
    present = weights.sum(-1) > 0
    if sat is None:
        lo = torch.full_like(sequence_log_ratio, 1 - clip.eps_low)
        hi = torch.full_like(sequence_log_ratio, 1 + clip.eps_high)
        gated, k = torch.zeros_like(present), torch.ones_like(sequence_log_ratio)
    else:
        staleness = sequence_staleness(logprobs, behaviour, mask)
        lo, hi, gated, k = sat_bounds(staleness, present, clip, sat, sat_threshold)
    if token_level:
        token_ratio = torch.exp(sequence_log_ratio.detach()[:, None] + logprobs - logprobs.detach())
        per_token, was_clipped = _surrogate(token_ratio, advantages[:, None], lo[:, None], hi[:, None])
        per_sequence = (per_token * weights).sum(-1) / lengths
        acted = _sat_acted(token_ratio, advantages[:, None], clip, was_clipped) & gated[:, None]
        # Per-sequence advantages give every token of a row the value s_i: a row is clipped whole, so
        # the shares are of sequences, as GSPO's.
        clipped_share, acted_share = (was_clipped & mask).any(-1)[present], (acted & mask).any(-1)[present]
    else:
        ratio = torch.exp(sequence_log_ratio)
        per_sequence, was_clipped = _surrogate(ratio, advantages, lo, hi)
        acted = _sat_acted(ratio, advantages, clip, was_clipped) & gated
        clipped_share, acted_share = was_clipped[present], acted[present]
    loss = _batch_mean(per_sequence[present], denominator)
    return _output(loss, clipped_share, gated[present], k[gated], sat_active=acted_share)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig = ClipConfig(),
    *,
    behaviour_weight: Literal["none", "mask", "truncate"] = "mask",
    weight_cap: float | None = 5.0,
    aggregation: Literal["sequence", "token"] = "token",
    dual_clip: float | None = None,
    sat: SATConfig | None = None,
    sat_threshold: torch.Tensor | float | None = None,
    denominator: float | None = None,
) -> LossOutput:
    """AReaL's decoupled PPO (arXiv 2505.24298; `ppo_actor_loss_fn`; docs/algorithms.md §2): the trust region
    is anchored at the proximal policy and the off-policy correction is a separate, detached weight.

    Per token: u = exp(log π_θ - log π_prox), pg = max(-A·u, -A·clip(u, lo, hi)); with `dual_clip` c > 1,
    pg = min(pg, c·|A|) as AReaL writes it, which binds only for A < 0 (for A >= 0, pg <= 0 <= c·|A|).
    The behaviour weight is w = π_prox/π_behav:

    - `mask`: tokens with w > `weight_cap` are dropped (AReaL's `behav_imp_weight_cap`), the rest keep w;
    - `truncate`: w = min(w, `weight_cap`), truncated importance sampling (TIS; Yao et al. 2025, "Your
      efficient RL framework secretly brings you off-policy RL training");
    - `none`: w = 1, i.e. plain PPO-clip against π_prox.

    `weight_cap=None` applies w uncapped in `mask` and `truncate`. aggregation: `token` = Σ pg·w over
    trainable tokens / their number (AReaL); `sequence` = mean over sequences with trainable tokens of
    each one's token mean. Dropped tokens stay in the denominators, as in AReaL: the cap removes a token's
    contribution without inflating the others'. With `sat`, the bounds come from `sat_bounds` on
    log π_θ - log μ (μ = `behaviour_logprobs`). Both anchors are constants (detached), so an approximate
    π_prox built from π_θ (A-3PO's log-linear mix) cannot leak a gradient into the surrogate.
    `sat_threshold` and `denominator`: the whole batch's, when this call holds a part of it (module
    docstring).

    Shapes: `logprobs`, `proximal_logprobs`, `behaviour_logprobs`, `mask` `[B, T]`; `advantages` `[B]`.
    clip_fraction, gate_rate and masked_fraction are shares of the trainable tokens.
    """
    _check_shapes(
        mask,
        advantages,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        behaviour_logprobs=behaviour_logprobs,
    )
    if behaviour_weight not in ("none", "mask", "truncate"):
        raise ValueError(f"behaviour_weight must be none, mask or truncate, got {behaviour_weight!r}")
    if aggregation not in ("sequence", "token"):
        raise ValueError(f"aggregation must be sequence or token, got {aggregation!r}")
    if weight_cap is not None and not weight_cap > 1:
        raise ValueError(f"weight_cap must be > 1 (w = 1 on policy), got {weight_cap}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    logprobs, proximal, behaviour = _off_mask_zeroed(mask, logprobs, proximal_logprobs, behaviour_logprobs)
    proximal, behaviour = proximal.detach(), behaviour.detach()
    lo, hi, gated, k = _bounds(logprobs, proximal, behaviour, mask, clip, sat, sat_threshold)
    advantage = advantages[:, None]
    ratio = torch.exp(logprobs - proximal)
    per_token, was_clipped = _surrogate(ratio, advantage, lo, hi)
    acted = _sat_acted(ratio, advantage, clip, was_clipped) & gated
    if dual_clip is not None:
        per_token = torch.minimum(per_token, dual_clip * advantage.abs())
    weight = torch.exp(proximal - behaviour)
    dropped = torch.zeros_like(mask)
    if behaviour_weight == "none":
        weight = torch.ones_like(weight)
    elif behaviour_weight == "mask" and weight_cap is not None:
        dropped = mask & (weight > weight_cap)
        weight = torch.where(dropped, 0.0, weight)
    elif weight_cap is not None:
        weight = weight.clamp_max(weight_cap)
    weighted = per_token * torch.where(mask, weight, 0.0)
    counts = mask.sum(-1)
    if aggregation == "token":
        loss = _batch_mean(weighted[mask], denominator)
    else:
        per_sequence = weighted.sum(-1) / counts.clamp_min(1)
        loss = _batch_mean(per_sequence[counts > 0], denominator)
    return _output(loss, was_clipped[mask], gated[mask], k[gated], dropped[mask], acted[mask])


def gmc_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    *,
    eps: float = 0.2,
    length_normalized: bool = True,
    denominator: float | None = None,
) -> LossOutput:
    """Group-Mass Capping (GMC-GRPO, arXiv 2610.01896; docs/algorithms.md §7). A reconstruction: only the
    abstract and one third-party formula, w_i = ρ_i·min(1, C/Σ_j ρ_j), were available, so C = G(1+eps),
    the detached scale and the length treatment of ρ are our reading, not the paper's code.

    ρ_i = π_θ(y_i)/μ(y_i), the trajectory ratio (as in TIC-GRPO, arXiv 2508.02833), in log space: exp of
    Σ_t (log π_θ - log μ) over its trainable tokens, or of their mean when `length_normalized` (the
    default, GSPO's geometric mean). The raw ratio of a long response is the exp of a sum of many token
    log-ratios and explodes or vanishes, so one sequence would carry its group's whole mass; the mean
    keeps ρ near 1 for any length. For each group g, scale_g = sg[min(1, C_g/Σ_{j∈g} ρ_j)] with
    C_g = G_g(1 + eps) and G_g its members present in the batch: a group whose importance mass exceeds the
    cap is rescaled as a whole instead of clipping trajectories one by one. Loss = -(1/N) Σ_i
    scale_{g(i)}·ρ_i·Â_i over the N sequences with trainable tokens (each group weighted by its members;
    a sequence without trainable tokens is no member of its group).

    Shapes: `logprobs`, `behaviour_logprobs`, `mask` `[B, T]`; `advantages` `[B]`; `group_index` `[B]`
    integer (any ids, equal ids share a group). clip_fraction is the share of groups whose scale is < 1.
    A caller that splits a batch keeps each group whole in one part and passes `denominator` = the
    batch's N.
    """
    _check_shapes(mask, advantages, logprobs=logprobs, behaviour_logprobs=behaviour_logprobs)
    if group_index.shape != advantages.shape:
        raise ValueError(f"group_index must be [B] = [{mask.shape[0]}], got {tuple(group_index.shape)}")
    if group_index.dtype.is_floating_point or group_index.dtype.is_complex or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must be an integer tensor, got {group_index.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    logprobs, behaviour = _off_mask_zeroed(mask, logprobs, behaviour_logprobs)
    counts = mask.sum(-1)
    log_rho = (logprobs - behaviour.detach()).sum(-1)
    if length_normalized:
        log_rho = log_rho / counts.clamp_min(1)
    present = counts > 0
    log_rho, advantage = log_rho[present], advantages[present]
    groups, member_of = torch.unique(group_index[present], return_inverse=True)
    no_gate = torch.zeros(0, dtype=torch.bool)
    if not groups.numel():
        return _output(logprobs.sum() * 0, no_gate, no_gate, torch.ones(0))
    # log Σ_{j∈g} ρ_j as a per-group logsumexp: ρ itself can overflow float32 when log ρ is large.
    detached = log_rho.detach()
    peak = detached.new_full(groups.shape, -math.inf).scatter_reduce(0, member_of, detached, reduce="amax")
    shifted = detached.new_zeros(groups.shape).index_add(0, member_of, torch.exp(detached - peak[member_of]))
    members = torch.bincount(member_of, minlength=groups.numel()).to(detached.dtype)
    log_cap_share = torch.log(members * (1 + eps)) - shifted.log()
    capped = log_cap_share < peak
    # scale·ρ_i = C_g·ρ_i/Σ_j ρ_j <= C_g, from log ρ_i - peak (exact for the largest ratio rather than a
    # difference of two large logs); the gradient flows through ρ_i alone (scale is detached).
    log_weight = torch.where(capped[member_of], log_rho - peak[member_of] + log_cap_share[member_of], log_rho)
    loss = _batch_mean(-(torch.exp(log_weight) * advantage), denominator)
    return _output(loss, capped, no_gate, torch.ones(0))


KL_LOG_RATIO_BOUND = 20.0
"""|log π_ref - log π_θ| past which k3 stops growing (verl's low_var_kl clamps the same)."""
KL_TOKEN_BOUND = 10.0
"""The most one token adds to k3 (verl's low_var_kl bound)."""


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL[π_θ‖π_ref] (Schulman 2020, "Approximating KL divergence"), GRPO's KL term
    (DeepSeekMath, arXiv 2402.03300, Eq. 4): per token exp(δ) - δ - 1 with δ = log π_ref - log π_θ,
    non-negative and unbiased on tokens sampled from π_θ.

    Shapes: `logprobs`, `reference_logprobs`, `mask` `[B, T]`. Returns the mean over trainable tokens, a
    scalar; gradients flow to `logprobs` only (the reference is frozen).

    Bounded as verl's `low_var_kl`: δ is clamped to [-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND] and each
    token's value to at most KL_TOKEN_BOUND, so one token whose log-ratio ran away (25 gives 7e10
    unclamped) cannot swamp the step; past either bound that token's gradient is zero.
    """
    _check_shapes(mask, None, logprobs=logprobs, reference_logprobs=reference_logprobs)
    logprobs, reference = _off_mask_zeroed(mask, logprobs, reference_logprobs)
    delta = torch.clamp(reference.detach() - logprobs, -KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    per_token = torch.clamp(torch.exp(delta) - delta - 1, max=KL_TOKEN_BOUND)
    per_token = torch.where(mask, per_token, 0.0)
    return per_token.sum() / mask.sum().clamp_min(1)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean entropy over trainable tokens of softmax(logits / temperature), the policy-entropy diagnostic
    and bonus of PPO (Schulman et al. 2017, arXiv 1707.06347); a scalar with gradient.

    Shapes: `logits` `[B, T, V]`, `mask` `[B, T]` bool. Only the trainable rows are normalised (one
    log_softmax over `[N, V]`, N = trainable tokens), so prompt, tool and padding rows cost nothing and may
    hold anything. A -inf logit (a banned token) is allowed and contributes 0; NaN or +inf on a trainable
    row is a ValueError. Computed in at least float32.
    """
    _check_temperature(temperature)
    if logits.ndim != 3 or logits.shape[:2] != mask.shape:
        raise ValueError(
            f"logits must be [B, T, V] and mask [B, T], got {tuple(logits.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError("mask must be a bool tensor")
    rows = logits[mask]
    log_p = torch.log_softmax(_scaled(rows, temperature), dim=-1)
    # A banned token has p = 0 and log p = -inf; flooring log p keeps p·log p at 0 (and its gradient
    # finite) instead of 0·(-inf) = NaN.
    log_p = log_p.clamp_min(torch.finfo(log_p.dtype).min)
    per_token = -(log_p.exp() * log_p).sum(-1)
    # NaN or +inf in a row makes its entropy NaN, so the rows are searched only then (two passes
    # over [N, V] saved otherwise); a row of -inf alone is NaN too, and allowed.
    if torch.isnan(per_token).any() and (torch.isnan(rows).any() or torch.isposinf(rows).any()):
        raise ValueError("logits contain NaN or +inf on trainable tokens")
    return per_token.mean() if per_token.numel() else per_token.sum()


class _TokenLogprobs(torch.autograd.Function):
    """`token_logprobs`'s z_target - logsumexp(z) with the gradient autograd derives for it, to the bit,
    in one tensor: -g·exp(z - logsumexp z), plus g at the target, divided by T. Autograd builds the
    gather's part as a separate zero-filled `[B, T, V]` tensor and adds the two, two more passes over
    the largest tensor of the step. (The only difference: where autograd adds +0 to a -0 it gets +0.)"""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        scaled = _scaled(logits, temperature)
        lse = torch.logsumexp(scaled, dim=-1)
        ctx.save_for_backward(scaled, lse, targets)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return scaled.gather(-1, targets[..., None]).squeeze(-1) - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        scaled, lse, targets = ctx.saved_tensors
        # logsumexp's backward of -grad, as autograd computes it, then the gather's grad added in place
        grad_scaled = (scaled - lse[..., None]).exp_().mul_(-grad[..., None])
        grad_scaled.scatter_add_(-1, targets[..., None], grad[..., None])
        if ctx.temperature != 1.0:
            grad_scaled.div_(ctx.temperature)
        return grad_scaled.to(ctx.dtype), None, None


_apply_token_logprobs = typing.cast(
    Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], _TokenLogprobs.apply
)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`, in at least float32.

    Shapes: `logits` `[B, T, V]`, `targets` `[B, T]` integer ids in [0, V) → `[B, T]`. The caller aligns
    positions (the logits at t - 1 score token t). Pass the rollout's sampling temperature: the engine's
    behaviour log-probs (docs/algorithms.md §2, §5) are those of the tempered distribution the tokens
    were drawn from. Computed as z_target - logsumexp(z), z = logits / T, so the backward keeps no
    second `[B, T, V]` tensor of log-probs; the backward is autograd's, fused into one `[B, T, V]`
    tensor (`_TokenLogprobs`).
    """
    _check_temperature(temperature)
    if logits.ndim != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and targets [B, T], got {tuple(logits.shape)}, {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if targets.numel() and not (targets.min() >= 0 and targets.max() < logits.shape[-1]):
        raise ValueError(
            f"targets must be token ids in [0, {logits.shape[-1]}), got {targets.min()}..{targets.max()}"
        )
    return _apply_token_logprobs(logits, targets, temperature)


def _bounds(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    clip: ClipConfig,
    sat: SATConfig | None,
    threshold: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if sat is None:
        lo = torch.full_like(logprobs, 1 - clip.eps_low)
        hi = torch.full_like(logprobs, 1 + clip.eps_high)
        return lo, hi, torch.zeros_like(mask), torch.ones_like(logprobs)
    behaviour = old_logprobs if behaviour_logprobs is None else behaviour_logprobs
    return sat_bounds(logprobs - behaviour, mask, clip, sat, threshold)


def _output(
    loss: torch.Tensor,
    clipped: torch.Tensor,
    gated: torch.Tensor,
    k: torch.Tensor,
    dropped: torch.Tensor | None = None,
    sat_active: torch.Tensor | None = None,
) -> LossOutput:
    def share(flags: torch.Tensor | None) -> torch.Tensor:
        return flags.float().mean() if flags is not None and flags.numel() else torch.zeros(())

    mean_k = k.detach().mean() if k.numel() else torch.ones(())
    return LossOutput(loss, share(clipped), share(gated), mean_k, share(dropped), share(sat_active))


def _off_mask_zeroed(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` with 0 off the mask: padding may hold NaN, and a NaN that reaches exp() poisons the
    backward even where torch.where later discards it (its gradient is 0·NaN)."""
    return tuple(torch.where(mask, tensor, 0.0) for tensor in tensors)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # Low-precision logits lose the small differences between large values that log-probs depend on.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1.0 else logits / temperature


def _check_temperature(temperature: float) -> None:
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be positive and finite, got {temperature}")


def _check_shapes(mask: torch.Tensor, advantages: torch.Tensor | None, **per_token: torch.Tensor) -> None:
    """Every `per_token` tensor is `[B, T]` like the bool `mask`, `advantages` (when given) `[B]`, and all
    are finite where they count: on trainable tokens (padding may hold anything)."""
    if mask.ndim != 2 or any(tensor.shape != mask.shape for tensor in per_token.values()):
        shapes = ", ".join(str(tuple(tensor.shape)) for tensor in (*per_token.values(), mask))
        raise ValueError(f"{', '.join(per_token)} and mask must share a [B, T] shape, got {shapes}")
    if mask.dtype != torch.bool:
        raise ValueError("mask must be a bool tensor")
    if advantages is not None and advantages.shape != mask.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{mask.shape[0]}], got {tuple(advantages.shape)}")
    for name, tensor in per_token.items():
        if not torch.isfinite(tensor[mask]).all():
            raise ValueError(f"{name} contain NaN or inf on trainable tokens")
    if advantages is not None and not torch.isfinite(advantages).all():
        raise ValueError("advantages contain NaN or inf")
