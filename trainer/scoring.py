"""The trained model's log-probs of trajectories, taken as the learner takes them: collated for the
model's MoE layout (the shape of the routes R3 replays) onto its device, at the rollout's sampling
temperature, with the engine's routes replayed when `learner.routing_replay` is on.

`Scorer.proximal` is the no-grad pass over a whole batch before its first update (decoupled PPO's
π_prox, the `recompute` ratio anchor), shared out over the learner's ranks; `prefix_drift` (PACE's
forgetting score) and `mismatch` (the training–inference gap with and without R3) score trajectories
without training on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pacerl.agents.trajectory import Trajectory
from pacerl.trainer.batch import TokenBatch, collate, forward_logprobs
from pacerl.trainer.distributed import Ranks
from pacerl.trainer.replay import ReplayStats


@dataclass(frozen=True)
class Scorer:
    """Log-probs of trajectories under `model` (see the module docstring)."""

    model: nn.Module
    """The trained model (a sharded one holds this rank's shards)."""
    pad_id: int
    """The token rows are right-padded with."""
    layers: int
    """MoE layers whose routes a trajectory records (0: a dense model)."""
    top_k: int
    """Experts per token and layer (0: a dense model)."""
    device: torch.device
    """Where the model computes: every batch is moved there."""
    temperature: float
    """The rollout's sampling temperature: log-probs are those of logits / temperature."""
    replay_routes: bool
    """R3: replay the engine's recorded experts in the forward."""

    def collate(self, trajectories: Sequence[Trajectory]) -> TokenBatch:
        """Pad trajectories for this model (routes shaped to its MoE layout), on its device."""
        batch = collate(trajectories, self.pad_id, layers=self.layers, top_k=self.top_k)
        if self.device.type == "cpu":
            return batch
        moved = {
            name: value.to(self.device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for name, value in vars(batch).items()
        }
        return dataclasses.replace(batch, **moved)

    def forward(
        self, batch: TokenBatch, *, replay_routes: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, ReplayStats | None]:
        """`pacerl.trainer.batch.forward_logprobs` of the model at the sampling temperature, replaying routes
        as configured unless `replay_routes` says otherwise. Gradients flow unless the caller disables
        them."""
        replay = self.replay_routes if replay_routes is None else replay_routes
        return forward_logprobs(self.model, batch, temperature=self.temperature, replay_routes=replay)

    @torch.no_grad()
    def logprobs(
        self, trajectories: Sequence[Trajectory], *, replay_routes: bool | None = None
    ) -> tuple[TokenBatch, torch.Tensor, float]:
        """Current-policy log-probs of `trajectories` (no gradient): the batch, `[B, T-1]` log-probs and
        the share of replayed routes the live router disagrees with (0 without replay)."""
        batch = self.collate(trajectories)
        logprobs, _, stats = self.forward(batch, replay_routes=replay_routes)
        return batch, logprobs, stats.disagreement if stats is not None else 0.0

    def prefix_drift(self, trajectories: Sequence[Trajectory], micro_batch_size: int) -> list[float]:
        """PACE's forgetting score per trajectory: mean |log π_now − log μ| over its model tokens (scored
        `micro_batch_size` trajectories at a time)."""
        drifts: list[float] = []
        for start in range(0, len(trajectories), micro_batch_size):
            batch, logprobs, _ = self.logprobs(trajectories[start : start + micro_batch_size])
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

    @torch.no_grad()
    def proximal(
        self, trajectories: Sequence[Trajectory], micro_batch_size: int, ranks: Ranks
    ) -> list[torch.Tensor]:
        """Log-probs of every trajectory's targets under the current weights, `[T-1]` each (a no-grad
        pass in micro-batches of `micro_batch_size`, each rank its share, then gathered on every rank)."""
        count = len(trajectories)
        rows: dict[int, torch.Tensor] = {}
        for start, mine in ranks.share(range(0, count, micro_batch_size)):
            chunk = trajectories[start : start + micro_batch_size]
            logprobs, _, _ = self.forward(self.collate(chunk))
            if mine:
                rows.update({start + row: logprobs[row, : len(t.tokens) - 1] for row, t in enumerate(chunk)})
        if ranks.size > 1:
            # Through the CPU: the object group pickles what it gathers.
            shared = ranks.gather({index: row.cpu() for index, row in rows.items()})
            rows = {index: row.to(self.device) for part in shared for index, row in part.items()}
        return [rows[index] for index in range(count)]


def padded(rows: Sequence[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Per-trajectory `[T_i - 1]` rows right-padded with 0 into `shape` (a collated batch's)."""
    out = torch.zeros(shape, dtype=rows[0].dtype, device=rows[0].device)
    for row, values in enumerate(rows):
        out[row, : values.shape[0]] = values
    return out
