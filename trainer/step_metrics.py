"""The figures of one learner step (`StepResult.metrics`): running sums over its micro-batches, each
figure weighted by what it is a mean of, and the step's own counts and rates.

Per-token figures (`PER_TOKEN`) are weighted by the micro-batch's trainable tokens, shares
(`PER_UNIT`) by the entries they count (tokens, sequences or groups: `PolicyLoss.entries`), and the
engine-vs-trainer figures (`FIRST_PASS`) are taken in the first epoch only, each trajectory once,
weighted by tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pacerl.agents.trajectory import Trajectory
from pacerl.trainer.batch import TokenBatch
from pacerl.trainer.distributed import Ranks
from pacerl.trainer.losses import LossOutput
from pacerl.trainer.replay import ReplayStats

PER_TOKEN = ("loss", "entropy", "kl")
"""Per-micro-batch figures, averaged over every update of the step weighted by trainable tokens."""
PER_UNIT = ("clip_fraction", "sat_gate_rate", "sat_active_rate", "sat_contraction")
"""Shares, averaged over every update weighted by the entries they count (tokens, sequences, groups)."""
FIRST_PASS = ("mismatch", "mismatch_fresh", "routing_disagreement", "r3_coverage")
"""Engine-vs-trainer figures from the first epoch (each trajectory once), weighted by tokens."""


@dataclass
class StepTotals:
    """Running sums of the step's figures and their weights."""

    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, names: Sequence[str], values: Mapping[str, float], weight: float) -> None:
        """Add `values[name]` with weight `weight` for each of `names`."""
        for name in names:
            self.sums[name] = self.sums.get(name, 0.0) + values[name] * weight
            self.weights[name] = self.weights.get(name, 0.0) + weight

    def means(self) -> dict[str, float]:
        """Every figure's weighted mean (0 for a figure nothing was added to)."""
        names = (*PER_TOKEN, *PER_UNIT, *FIRST_PASS)
        return {
            name: self.sums[name] / self.weights[name] if self.weights.get(name) else 0.0 for name in names
        }

    def summed_over(self, ranks: Ranks) -> StepTotals:
        """The totals of every rank's micro-batches (each rank added up its own); these with one rank."""
        if ranks.size == 1:
            return self
        return StepTotals(ranks.sum_floats(self.sums), ranks.sum_floats(self.weights))


def add_micro_batch(
    totals: StepTotals,
    output: LossOutput,
    *,
    entropy: torch.Tensor,
    kl: torch.Tensor | None,
    share: float,
    tokens: int,
    entries: int,
) -> None:
    """One micro-batch's loss figures: `output` of its policy loss (normalised by the whole update, of
    which it holds `share` of the trainable tokens), its entropy and KL (token means), its trainable
    `tokens` and the `entries` its shares count."""
    totals.add(
        PER_TOKEN,
        {
            "loss": float(output.loss) / share if share else 0.0,
            "entropy": float(entropy),
            "kl": float(kl) if kl is not None else 0.0,
        },
        tokens,
    )
    totals.add(
        PER_UNIT,
        {
            "clip_fraction": float(output.clip_fraction),
            "sat_gate_rate": float(output.gate_rate),
            "sat_active_rate": float(output.sat_active),
            "sat_contraction": float(output.mean_contraction),
        },
        entries,
    )


def add_first_pass(
    totals: StepTotals, logprobs: torch.Tensor, batch: TokenBatch, stats: ReplayStats | None, version: int
) -> None:
    """One micro-batch's training–inference figures: mean |log π_θ − log μ| `[B, T-1]` over its trainable
    tokens, the same over those the engine generated at `version` (the trainer's), and R3's routing
    disagreement and coverage (0 without replay)."""
    mask = batch.loss_mask
    log_ratio = (logprobs - batch.behaviour)[mask]
    fresh = (batch.versions == version)[mask]
    totals.add(
        FIRST_PASS,
        {
            "mismatch": float(log_ratio.abs().mean()),
            "mismatch_fresh": float(log_ratio[fresh].abs().mean()) if bool(fresh.any()) else 0.0,
            "routing_disagreement": stats.disagreement if stats is not None else 0.0,
            "r3_coverage": batch.replay_coverage() if stats is not None else 0.0,
        },
        batch.num_tokens,
    )


def batch_figures(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    """What a batch brings before any training: its mean reward, its accuracy (share of rewards >= 1)
    over the trajectories with a reward, and its trajectories."""
    rewards = [t.reward for group in groups for t in group if t.reward is not None]
    return {
        "reward": mean(rewards),
        "accuracy": mean([float(r >= 1.0) for r in rewards]),
        "trajectories": float(sum(len(group) for group in groups)),
    }


def update_figures(
    grad_norms: Sequence[float],
    skips: Sequence[str],
    trajectories: Sequence[Trajectory],
    *,
    planned_updates: int,
    elapsed: float,
) -> dict[str, float]:
    """A step's updates: the mean gradient norm of those applied, how many were applied and skipped,
    the model tokens of the `trajectories` trained on, and those tokens times the `planned_updates` per
    second of `elapsed`."""
    tokens = sum(t.num_model_tokens for t in trajectories)
    return {
        "grad_norm": mean(grad_norms),
        "updates": float(len(grad_norms)),
        "skipped_updates": float(len(skips)),
        "tokens": float(tokens),
        "trained_trajectories": float(len(trajectories)),
        "step_s": elapsed,
        "tokens_per_s": tokens * planned_updates / elapsed,
    }


def mean(values: Sequence[float]) -> float:
    """The mean of `values`, 0 for none."""
    return sum(values) / len(values) if values else 0.0
