"""R3, Rollout Routing Replay (Ma et al., arXiv 2510.11370; docs/algorithms.md §4): in the training forward,
each MoE router's top-k *selection* is replaced by the experts the rollout engine recorded, and the
gate weights are recomputed from the training router's live logits over those experts, so gradients
still reach the router:

    g_i = I_infer,i · softmax(s_train)_i / Σ_j I_infer,j · softmax(s_train)_j   (norm_topk_prob models)

Each family's router arithmetic comes from its adapter (`pacerl.agents.models.MOE_ADAPTERS`): Qwen-MoE without
`norm_topk_prob` keeps the un-renormalised probabilities, GraniteMoE and gpt-oss take a softmax over the
chosen logits, DeepSeek-V3 sigmoid scores times its scaling factor, exactly as each router does.

The replay is injected by `routing_replay(...)`, a context manager that hooks the routers of one model
instance and always removes its hooks; nothing global is patched. Every position with a recorded route
replays it: prompt and tool positions as well as generated ones, since the keys and values of every
earlier position shape a generated token's log-prob (slime's and Megatron's router replay cover the
whole sequence too). Positions without one (padding, a row's last input, format-1 records' prompt and
tool tokens) keep the live router's choice. It also measures how often the live router disagrees with
the recorded one (the training–inference routing mismatch R3 removes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pacerl.agents.models import MoEInfo, RouteWeights, moe_info


@dataclass
class ReplayStats:
    """What one replayed forward saw, filled in by the hooks."""

    replayed_rows: int = 0
    """(position, layer) pairs whose selection was replaced by the recorded one."""
    disagreeing_rows: int = 0
    """Of those, pairs where the live router would have chosen another set of experts."""
    layers_seen: set[int] = field(default_factory=set)
    """MoE layers whose router ran under the replay."""

    @property
    def disagreement(self) -> float:
        """Share of replayed (position, layer) pairs whose live top-k set differs from the recorded."""
        return self.disagreeing_rows / self.replayed_rows if self.replayed_rows else 0.0


def check_routes(routes: torch.Tensor, replay: torch.Tensor, input_shape: torch.Size, info: MoEInfo) -> None:
    """Validate replay data against a batch of input ids `[B, T]` and the model's MoE layout.

    routes: `[B, T, layers, top_k]` integer expert ids (row at input position p = the routing of the
    forward whose input was p); replay: `[B, T]` bool, True where `routes` holds a recorded row.
    """
    expected = (*input_shape, info.num_layers, info.top_k)
    if routes.ndim != 4 or tuple(routes.shape) != expected:
        raise ValueError(
            f"routed experts must be [batch, positions, layers, top_k] = {expected} for this model, "
            f"got {tuple(routes.shape)}"
        )
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"routed experts must be integer expert ids, got dtype {routes.dtype}")
    if replay.shape != input_shape or replay.dtype != torch.bool:
        raise ValueError(f"replay mask must be bool of shape {tuple(input_shape)}, got {replay.shape}")
    chosen = routes[replay]
    if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= info.num_experts):
        raise ValueError(f"routed expert ids must lie in [0, {info.num_experts}), got {int(chosen.max())}")
    if chosen.numel() and _has_repeats(chosen.reshape(-1, info.top_k)):
        raise ValueError("a recorded route names the same expert twice for one token and layer")


def _has_repeats(rows: torch.Tensor) -> bool:
    ordered = rows.sort(dim=-1).values
    return bool((ordered[:, 1:] == ordered[:, :-1]).any())


@contextmanager
def routing_replay(model: nn.Module, routes: torch.Tensor, replay: torch.Tensor) -> Iterator[ReplayStats]:
    """Replay `routes` in every forward of `model` inside the block (one batch shape `[B, T]`).

    routes: `[B, T, layers, top_k]`; replay: `[B, T]` bool (see `check_routes`). Yields the stats the
    hooks fill in. The hooks are removed on exit, also when the block raises.
    """
    info = moe_info(model)
    check_routes(routes, replay, replay.shape, info)
    flat_routes = routes.reshape(-1, info.num_layers, info.top_k).long()
    flat_replay = replay.reshape(-1)
    stats = ReplayStats()
    handles = [
        gate.register_forward_hook(_replay_hook(layer, flat_routes, flat_replay, info.adapter.weights, stats))
        for layer, gate in enumerate(info.gates)
    ]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def _replay_hook(
    layer: int, routes: torch.Tensor, replay: torch.Tensor, weights: RouteWeights, stats: ReplayStats
) -> Any:
    def hook(module: nn.Module, inputs: Any, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, _, live = output
        if logits.shape[0] != replay.shape[0]:
            raise ValueError(
                f"routing replay was set up for {replay.shape[0]} positions but layer {layer}'s router "
                f"saw {logits.shape[0]}: run exactly the batch the routes were built for"
            )
        recorded = routes[:, layer, :].to(live.device)
        mask = replay.to(live.device)
        chosen = torch.where(mask[:, None], recorded, live)
        # The router's own arithmetic (its family's adapter), so a replay of the live choice
        # reproduces its scores bit for bit.
        scores = weights(module, logits, chosen).to(output[1].dtype)
        with torch.no_grad():
            if bool(mask.any()):
                same = live[mask].sort(-1).values == recorded[mask].sort(-1).values
                stats.replayed_rows += int(mask.sum())
                stats.disagreeing_rows += int((~same.all(-1)).sum())
        stats.layers_seen.add(layer)
        return logits, scores, chosen

    return hook
