"""From trajectory records to training tensors, and the training forward that scores them.

Layout (one row per trajectory, right-padded so position ids match generation):

    input_ids   [B, T]      every token; the forward reads positions 0..T-1
    targets     [B, T-1]    token t+1 predicted at input position t
    loss_mask   [B, T-1]    True where the target is a model token (prompt, tool and pad are out)
    behaviour   [B, T-1]    log μ of each target (the engine's log-prob; 0 off the mask)
    versions    [B, T-1]    policy version that generated each target (-1 off the mask)
    routes      [B, T, L, k] recorded experts at input position t = the routing that produced token t+1
    replay      [B, T]      True where `routes` holds a recorded row

The shift follows the trajectory record's convention (`Trajectory.routed_experts`): the route of token t
was computed with input t − 1, which is exactly where the training forward replays it. R3 replays the
whole sequence (docs/algorithms.md §8b, as slime and Megatron do): a record holds the rows of its prompt and
tool tokens too, so every input a model token depends on replays the engine's experts. Inputs without
a row keep the live router: padding, a row's last input (its prediction is not scored), a trailing
tool response no engine call followed, and everything but the model tokens of a format-1 record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pacerl.agents.models import check_replay_support
from pacerl.agents.trajectory import Trajectory
from pacerl.trainer.losses import token_logprobs
from pacerl.trainer.replay import ReplayStats, routing_replay


@dataclass(frozen=True)
class TokenBatch:
    """Padded tensors of a list of trajectories (see the module docstring for shapes)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behaviour: torch.Tensor
    versions: torch.Tensor
    routes: torch.Tensor | None
    """None when no trajectory recorded routes."""
    replay: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        """Trainable (model) tokens."""
        return int(self.loss_mask.sum())

    def replay_coverage(self) -> float:
        """Share of the inputs that trained tokens depend on whose routing is replayed: in each row,
        inputs 0..t of its last trained target t (prompt, tool and model positions alike); rows without
        trained tokens count in neither. 0 without routes; 1 when every such input has a recorded row."""
        trained = self.loss_mask.any(-1)
        if self.replay is None or not bool(trained.any()):
            return 0.0
        width = self.loss_mask.shape[1]
        last = width - 1 - self.loss_mask.flip(-1).int().argmax(-1)  # last trained target per row
        context = torch.arange(width, device=last.device)[None, :] <= last[:, None]
        context &= trained[:, None]
        return float((self.replay[:, :-1] & context).sum()) / float(context.sum())


def collate(
    trajectories: Sequence[Trajectory], pad_id: int, *, layers: int = 0, top_k: int = 0
) -> TokenBatch:
    """Pad `trajectories` into a `TokenBatch`. `layers` and `top_k` shape the routes tensor when any
    trajectory recorded routes (a recorded route of another shape is a ValueError)."""
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories")
    width = max(len(t.tokens) for t in trajectories)
    rows = len(trajectories)
    ids = np.full((rows, width), pad_id, dtype=np.int64)
    attention = np.zeros((rows, width), dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.bool_)
    behaviour = np.zeros((rows, width), dtype=np.float32)
    versions = np.full((rows, width), -1, dtype=np.int64)
    routes = np.zeros((rows, width, layers, top_k), dtype=np.int64) if layers else None
    replay = np.zeros((rows, width), dtype=np.bool_)
    for row, trajectory in enumerate(trajectories):
        length = len(trajectory.tokens)
        ids[row, :length] = trajectory.tokens
        attention[row, :length] = 1
        mask[row, :length] = trajectory.loss_mask
        behaviour[row, :length] = trajectory.behaviour_logprobs
        versions[row, :length] = trajectory.token_versions
        recorded = trajectory.routed_experts()
        if recorded is None:
            continue
        positions, experts = recorded
        if routes is None or experts.indices.shape[1:] != (layers, top_k):
            raise ValueError(
                f"trajectory {trajectory.id!r} recorded routes of shape [tokens, layers, top_k] = "
                f"{experts.indices.shape}, but the model has {layers} MoE layers with top_k={top_k}"
            )
        # The route of token p was produced by the forward of input p - 1 (p >= 1: the prompt leads).
        routes[row, positions - 1] = experts.indices
        replay[row, positions - 1] = True
    has_routes = routes is not None and bool(replay.any())
    return TokenBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attention),
        targets=torch.from_numpy(ids[:, 1:].copy()),
        loss_mask=torch.from_numpy(mask[:, 1:].copy()),
        behaviour=torch.from_numpy(behaviour[:, 1:].copy()),
        versions=torch.from_numpy(versions[:, 1:].copy()),
        routes=torch.from_numpy(routes) if has_routes and routes is not None else None,
        replay=torch.from_numpy(replay) if has_routes else None,
    )


def forward_logprobs(
    model: nn.Module, batch: TokenBatch, *, temperature: float, replay_routes: bool
) -> tuple[torch.Tensor, torch.Tensor, ReplayStats | None]:
    """The model's log-probs of every target `[B, T-1]` at the sampling temperature (the behaviour
    log-probs are those of logits / T), the logits `[B, T-1, V]`, and the replay stats when routes
    were replayed. Gradients flow unless the caller disables them. With `replay_routes`, an MoE whose
    family has no R3 adapter is an `UnsupportedMoEError`."""
    if replay_routes and batch.routes is not None and batch.replay is not None:
        with routing_replay(model, batch.routes, batch.replay) as stats:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        if not stats.layers_seen:
            raise RuntimeError("routing replay was on but no MoE router ran in the forward")
    else:
        if replay_routes:
            # No routes to replay: fine for a dense model, never a silent dense run of an MoE R3 cannot reach.
            check_replay_support(model)
        stats = None
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float()
    return token_logprobs(logits, batch.targets, temperature), logits, stats
