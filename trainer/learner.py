"""The learner: one optimizer step on a batch of trajectory groups, with every loss of `trainer.losses`
one config switch away, R3 routing replay, and bad input turned into counted skips.

One update per batch (LEARNABILITY.md's recipe): the proximal policy of decoupled PPO and the
`recompute` ratio anchor are the weights before this update, which are the weights of this very
forward, so their log-probs are the detached current ones and no extra forward is spent on them.
With `ratio_anchor="behaviour"` the ratio is taken against the rollout engine's log-probs, as the SAT
paper does: then the clip itself bounds how far a stale sample may pull.

Skips, each counted in `Learner.counts` under its reason and never reaching the weights:
`failed_member` (a trajectory without a reward is left out of its group's advantages), `empty_response`
(no model token: nothing to train on, but its reward still counts in its group), `zero_advantage`
(a group whose rewards are all equal carries no signal), `no_signal` (nothing left in the batch: no
update), `nonfinite_logprobs` and `nonfinite_grad` (the step is abandoned, the weights stay as they
were). Routes recorded for another model shape are a configuration error: ValueError.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from agents.models import moe_info
from agents.trajectory import Trajectory
from trainer.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_baseline_advantages
from trainer.batch import TokenBatch, collate, forward_logprobs
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
)

LossName = Literal["gspo", "gspo_token", "grpo", "decoupled_ppo", "gmc"]
AdvantageName = Literal["grpo", "dr_grpo", "reinforce_pp"]
_WEIGHTED = (
    "loss",
    "entropy",
    "clip_fraction",
    "sat_gate_rate",
    "sat_contraction",
    "mismatch",
    "mismatch_fresh",
    "routing_disagreement",
    "r3_coverage",
    "kl",
)
"""Per-micro-batch figures, averaged over the step weighted by trainable tokens."""
LOSSES: tuple[LossName, ...] = ("gspo", "gspo_token", "grpo", "decoupled_ppo", "gmc")
ADVANTAGES: tuple[AdvantageName, ...] = ("grpo", "dr_grpo", "reinforce_pp")


@dataclass(frozen=True)
class LossConfig:
    """Which policy loss, its trust region and its regularisers."""

    name: LossName = "gspo"
    """gspo | gspo_token (GSPO, arXiv 2507.18071), grpo (token clip), decoupled_ppo (AReaL's proximal
    policy with a behaviour weight), gmc (group-mass capping, arXiv 2610.01896)."""
    eps_low: float = 0.2
    """Lower clip radius (the SAT paper's comparisons use 0.2 on both sides)."""
    eps_high: float = 0.2
    """Upper clip radius (DAPO's clip-higher sets it above eps_low)."""
    sat: bool = True
    """Staleness-adaptive trust region (SAT, arXiv 2607.18722) on gspo, gspo_token, grpo, decoupled_ppo."""
    sat_quantile: float = 0.9
    """SAT gates entries whose |log π_θ − log μ| exceeds this quantile of the micro-batch."""
    sat_kernel: Literal["cauchy", "rational"] = "cauchy"
    """SAT's contraction kernel (a reconstruction; see `trainer.losses.sat_bounds`)."""
    ratio_anchor: Literal["behaviour", "recompute"] = "behaviour"
    """The ratio's denominator for gspo/grpo: the rollout engine's log-probs (SAT, slime), or the
    trainer's own before the update (then the ratio starts at 1 and staleness is not corrected)."""
    aggregation: Literal["sequence", "token"] = "token"
    """grpo and decoupled_ppo: mean of per-sequence token means, or one mean over all tokens (DAPO)."""
    behaviour_weight: Literal["none", "mask", "truncate"] = "mask"
    """decoupled_ppo: π_prox/μ weight masked above the cap (AReaL), truncated at it (TIS), or off."""
    weight_cap: float = 5.0
    """decoupled_ppo: the cap of the behaviour weight."""
    gmc_eps: float = 0.2
    """gmc: the group's importance mass is capped at G·(1 + gmc_eps)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the initial policy (0: no reference model is kept)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (subtracted from the loss)."""

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss name must be one of {LOSSES}, got {self.name!r}")
        ClipConfig(self.eps_low, self.eps_high)
        SATConfig(self.sat_quantile, self.sat_kernel)
        if self.ratio_anchor not in ("behaviour", "recompute"):
            raise ValueError(f"ratio_anchor must be behaviour or recompute, got {self.ratio_anchor!r}")
        if self.aggregation not in ("sequence", "token"):
            raise ValueError(f"aggregation must be sequence or token, got {self.aggregation!r}")
        if self.behaviour_weight not in ("none", "mask", "truncate"):
            raise ValueError(
                f"behaviour_weight must be none, mask or truncate, got {self.behaviour_weight!r}"
            )
        if self.weight_cap <= 1 or self.gmc_eps <= 0 or self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("need weight_cap > 1, gmc_eps > 0, kl_coef >= 0 and entropy_coef >= 0")


@dataclass(frozen=True)
class LearnerConfig:
    """The optimizer step."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    advantage: AdvantageName = "grpo"
    """Advantage estimator: grpo (group mean/std), dr_grpo (group mean), reinforce_pp (group mean,
    batch std)."""
    lr: float = 1e-4
    """Adam learning rate (LEARNABILITY.md: 1e-4 is stable on the tiny MoE, 5e-4 spikes)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Adam betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    temperature: float = 1.0
    """The rollout's sampling temperature: log-probs are taken of logits / temperature, as sampled."""
    routing_replay: bool = True
    """R3: replay the engine's recorded experts in the training forward (MoE models)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (whole groups; gradients accumulate over micro-batches)."""
    drop_zero_advantage: bool = True
    """Leave out groups whose rewards are all equal (they carry no signal)."""

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}")
        if not (self.lr > 0 and self.grad_clip > 0 and self.temperature > 0 and self.micro_batch_size >= 1):
            raise ValueError("need lr > 0, grad_clip > 0, temperature > 0 and micro_batch_size >= 1")
        if not all(0 <= beta < 1 for beta in self.betas) or self.weight_decay < 0:
            raise ValueError(f"betas must lie in [0, 1) and weight_decay >= 0, got {self.betas}")


@dataclass(frozen=True)
class StepResult:
    """What one `train_step` did."""

    updated: bool
    """Whether the weights changed (False: the step was skipped; see `skipped`)."""
    skipped: str
    """Why no update happened ("" when updated)."""
    metrics: dict[str, float]
    """Per-step figures: reward, accuracy, entropy, grad_norm, clip_fraction, sat_gate_rate,
    sat_contraction, mismatch, routing_disagreement, r3_coverage, tokens, tokens_per_s, ..."""
    trajectory_ids: tuple[str, ...]
    """Every trajectory of the batch (trained on or skipped: none of them will be seen again)."""


class LearnerLike(Protocol):
    """What the training loop needs of a learner: a `Learner` in this process, or a handle on one that
    runs elsewhere (a Ray actor, `pacerl.runtime_ray.RemoteLearner`)."""

    version: int
    """Updates applied so far."""
    counts: Counter[str]
    """Skips and leave-outs by reason."""

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> StepResult: ...

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]: ...

    def weights(self) -> Mapping[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class _Prepared:
    trajectories: list[Trajectory]
    advantages: list[float]
    group_index: list[int]


class Learner:
    """Owns the trained model and its optimizer; `version` counts the updates made."""

    def __init__(self, model: nn.Module, config: LearnerConfig | None = None, *, pad_id: int = 0) -> None:
        self.model = model
        self.config = config or LearnerConfig()
        self.pad_id = pad_id
        self.version = 0
        """Updates applied so far: the policy version of the weights now in `model`."""
        self.counts: Counter[str] = Counter()
        """Skips and leave-outs by reason (see the module docstring)."""
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        try:
            info = moe_info(model)
            self._layers, self._top_k = info.num_layers, info.top_k
        except ValueError:  # a dense model: nothing to replay
            self._layers, self._top_k = 0, 0
        self.reference = self._frozen_copy() if self.config.loss.kl_coef > 0 else None

    # -- training -------------------------------------------------------------------------------------

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> StepResult:
        """One optimizer update on `groups` (each the trajectories of one prompt)."""
        started = time.perf_counter()
        ids = tuple(t.id for group in groups for t in group)
        rewards = [t.reward for group in groups for t in group if t.reward is not None]
        metrics: dict[str, float] = {
            "reward": _mean(rewards),
            "accuracy": _mean([float(r >= 1.0) for r in rewards]),
            "trajectories": float(len(ids)),
        }
        prepared = self._prepare(groups)
        if not prepared.trajectories:
            return self._skip("no_signal", metrics, ids)
        chunks = self._micro_batches(prepared)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = dict.fromkeys(_WEIGHTED, 0.0)
        tokens = sum(t.num_model_tokens for t in prepared.trajectories)
        try:
            for chunk in chunks:
                reason = self._accumulate(prepared, chunk, tokens, totals)
                if reason:
                    self.optimizer.zero_grad(set_to_none=True)
                    return self._skip(reason, metrics, ids)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip))
            if not math.isfinite(grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                return self._skip("nonfinite_grad", metrics, ids)
            self.optimizer.step()
        finally:
            self.model.eval()
        self.version += 1
        elapsed = time.perf_counter() - started
        metrics.update({name: value / tokens for name, value in totals.items()})
        metrics.update(
            grad_norm=grad_norm,
            tokens=float(tokens),
            trained_trajectories=float(len(prepared.trajectories)),
            step_s=elapsed,
            tokens_per_s=tokens / elapsed,
        )
        return StepResult(True, "", metrics, ids)

    def _prepare(self, groups: Sequence[Sequence[Trajectory]]) -> _Prepared:
        prepared = _Prepared([], [], [])
        kept_groups = 0
        for group in groups:
            members = [t for t in group if t.reward is not None]
            self.counts["failed_member"] += len(group) - len(members)
            if not members:
                continue
            values = torch.tensor([[float(t.reward or 0.0) for t in members]], dtype=torch.float64)
            if self.config.drop_zero_advantage and bool((values == values[0, 0]).all()):
                self.counts["zero_advantage"] += 1
                continue
            advantages = self._advantages(values)
            index, kept_groups = kept_groups, kept_groups + 1
            for trajectory, advantage in zip(members, advantages.tolist(), strict=True):
                if trajectory.num_model_tokens == 0:
                    self.counts["empty_response"] += 1
                    continue
                prepared.trajectories.append(trajectory)
                prepared.advantages.append(advantage)
                prepared.group_index.append(index)
        if self.config.advantage == "reinforce_pp" and prepared.advantages:
            # REINFORCE++'s normalisation is over the whole batch, not one group.
            centred = torch.tensor([prepared.advantages], dtype=torch.float64)
            prepared.advantages = reinforce_pp_baseline_advantages(centred)[0].tolist()
        return prepared

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        if self.config.advantage == "grpo":
            return grpo_advantages(rewards)[0]
        return dr_grpo_advantages(rewards)[0]  # reinforce_pp: centred here, normalised per batch later

    def _micro_batches(self, prepared: _Prepared) -> list[list[int]]:
        """Indices of whole groups, about `micro_batch_size` sequences per chunk."""
        chunks: list[list[int]] = [[]]
        # A group's members are appended together, so they are one consecutive run of indices.
        positions = range(len(prepared.group_index))
        for _, run in itertools.groupby(positions, key=prepared.group_index.__getitem__):
            members = list(run)
            if chunks[-1] and len(chunks[-1]) + len(members) > self.config.micro_batch_size:
                chunks.append([])
            chunks[-1].extend(members)
        return chunks

    def _accumulate(
        self, prepared: _Prepared, chunk: list[int], total_tokens: int, totals: dict[str, float]
    ) -> str:
        """Forward and backward one micro-batch; returns a skip reason or ""."""
        trajectories = [prepared.trajectories[i] for i in chunk]
        batch = self.collate(trajectories)
        logprobs, logits, stats = forward_logprobs(
            self.model, batch, temperature=self.config.temperature, replay_routes=self.config.routing_replay
        )
        mask = batch.loss_mask
        if not bool(torch.isfinite(logprobs[mask]).all()):
            return "nonfinite_logprobs"
        advantages = torch.tensor([prepared.advantages[i] for i in chunk], dtype=logprobs.dtype)
        groups = torch.tensor([prepared.group_index[i] for i in chunk], dtype=torch.long)
        output = self._loss(logprobs, batch, advantages, groups)
        loss = output.loss
        entropy = entropy_from_logits(logits, mask, self.config.temperature)
        if self.config.loss.entropy_coef:
            loss = loss - self.config.loss.entropy_coef * entropy
        kl = self._kl(logprobs, batch)
        if kl is not None:
            loss = loss + self.config.loss.kl_coef * kl
        chunk_tokens = batch.num_tokens
        # Weight each micro-batch by its share of tokens, so the accumulated gradient is that of the
        # whole batch for token-mean losses (and close to it for sequence means of similar lengths).
        scaled: torch.Tensor = loss * (chunk_tokens / total_tokens)
        torch.autograd.backward(scaled)
        with torch.no_grad():
            log_ratio = (logprobs - batch.behaviour)[mask]
            fresh = (batch.versions == self.version)[mask]
            weighted = {
                "loss": float(loss),
                "entropy": float(entropy),
                "clip_fraction": float(output.clip_fraction),
                "sat_gate_rate": float(output.gate_rate),
                "sat_contraction": float(output.mean_contraction),
                "mismatch": float(log_ratio.abs().mean()),
                "mismatch_fresh": float(log_ratio[fresh].abs().mean()) if bool(fresh.any()) else 0.0,
                "routing_disagreement": stats.disagreement if stats is not None else 0.0,
                "r3_coverage": _replayed_share(batch, chunk_tokens) if stats is not None else 0.0,
                "kl": float(kl) if kl is not None else 0.0,
            }
        for name in _WEIGHTED:
            totals[name] += weighted[name] * chunk_tokens
        return ""

    def _loss(
        self, logprobs: torch.Tensor, batch: TokenBatch, advantages: torch.Tensor, groups: torch.Tensor
    ) -> LossOutput:
        cfg = self.config.loss
        clip = ClipConfig(cfg.eps_low, cfg.eps_high)
        sat = SATConfig(cfg.sat_quantile, cfg.sat_kernel) if cfg.sat else None
        mask, behaviour = batch.loss_mask, batch.behaviour.to(logprobs.dtype)
        old = behaviour if cfg.ratio_anchor == "behaviour" else logprobs.detach()
        if cfg.name in ("gspo", "gspo_token"):
            return gspo_loss(
                logprobs,
                old,
                advantages,
                mask,
                clip,
                cfg.name == "gspo_token",
                sat,
                behaviour_logprobs=behaviour,
            )
        if cfg.name == "grpo":
            return grpo_loss(logprobs, old, advantages, mask, clip, cfg.aggregation, sat, behaviour)
        if cfg.name == "decoupled_ppo":
            return decoupled_ppo_loss(
                logprobs,
                logprobs.detach(),
                behaviour,
                advantages,
                mask,
                clip,
                behaviour_weight=cfg.behaviour_weight,
                weight_cap=cfg.weight_cap,
                aggregation=cfg.aggregation,
                sat=sat,
            )
        return gmc_loss(logprobs, behaviour, advantages, mask, groups, eps=cfg.gmc_eps)

    def _kl(self, logprobs: torch.Tensor, batch: TokenBatch) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            reference, _, _ = forward_logprobs(
                self.reference,
                batch,
                temperature=self.config.temperature,
                replay_routes=self.config.routing_replay,
            )
        return kl_k3(logprobs, reference, batch.loss_mask)

    def _skip(self, reason: str, metrics: dict[str, float], ids: tuple[str, ...]) -> StepResult:
        self.counts[reason] += 1
        return StepResult(False, reason, metrics, ids)

    # -- scoring without training ---------------------------------------------------------------------

    def collate(self, trajectories: Sequence[Trajectory]) -> TokenBatch:
        """Pad trajectories for this model (routes shaped to its MoE layout)."""
        return collate(trajectories, self.pad_id, layers=self._layers, top_k=self._top_k)

    @torch.no_grad()
    def logprobs(
        self, trajectories: Sequence[Trajectory], *, replay_routes: bool | None = None
    ) -> tuple[TokenBatch, torch.Tensor, float]:
        """Current-policy log-probs of `trajectories` (no gradient): the batch, `[B, T-1]` log-probs and
        the share of replayed routes the live router disagrees with (0 without replay)."""
        replay = self.config.routing_replay if replay_routes is None else replay_routes
        batch = self.collate(trajectories)
        logprobs, _, stats = forward_logprobs(
            self.model, batch, temperature=self.config.temperature, replay_routes=replay
        )
        return batch, logprobs, stats.disagreement if stats is not None else 0.0

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """PACE's forgetting score per trajectory: mean |log π_now − log μ| over its model tokens."""
        drifts: list[float] = []
        size = self.config.micro_batch_size
        for start in range(0, len(trajectories), size):
            batch, logprobs, _ = self.logprobs(trajectories[start : start + size])
            gap = (logprobs - batch.behaviour).abs() * batch.loss_mask
            drifts += (gap.sum(-1) / batch.loss_mask.sum(-1).clamp_min(1)).tolist()
        return drifts

    def mismatch(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Training–inference mismatch with and without R3: mean |log π_θ − log μ| over model tokens,
        and the share of (token, layer) routes where the live router disagrees with the engine's."""
        result: dict[str, float] = {}
        for label, replay in (("r3", True), ("live", False)):
            batch, logprobs, disagreement = self.logprobs(trajectories, replay_routes=replay)
            gap = (logprobs - batch.behaviour)[batch.loss_mask].abs()
            result[f"mismatch_{label}"] = float(gap.mean())
            result[f"mismatch_{label}_max"] = float(gap.max())
            if replay:
                result["routing_disagreement"] = disagreement
        return result

    # -- weights and state ----------------------------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights to publish (detached views; the engine copies them)."""
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, version and counts (for checkpoints)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "counts": dict(self.counts),
            "reference": None if self.reference is None else self.reference.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of `state_dict`."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.counts = Counter(state["counts"])
        if self.reference is not None and state.get("reference") is not None:
            self.reference.load_state_dict(state["reference"])

    def _frozen_copy(self) -> nn.Module:
        reference = copy.deepcopy(self.model).eval()
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference


def _replayed_share(batch: TokenBatch, tokens: int) -> float:
    """Share of trained tokens whose producing forward replayed a recorded route."""
    if batch.replay is None or not tokens:
        return 0.0
    # Input position t replays the route that produced token t + 1, the target at index t.
    return float((batch.replay[:, :-1] & batch.loss_mask).sum()) / tokens


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
