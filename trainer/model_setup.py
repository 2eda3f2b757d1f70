"""What the learner reads from and does to the model it is given, before any training: its MoE layout
(the shape of the routes R3 replays), gradient checkpointing, and the frozen copy the KL is taken to.
"""

from __future__ import annotations

import copy
from typing import Any, cast

from torch import nn

from pacerl.agents.models import moe_info


def moe_layout(model: nn.Module) -> tuple[int, int]:
    """(MoE layers, experts per token) of `model`; (0, 0) for a dense model (nothing to replay)."""
    try:
        info = moe_info(model)
    except ValueError:
        return 0, 0
    return info.num_layers, info.top_k


def enable_gradient_checkpointing(model: nn.Module, *, moe: bool) -> None:
    """`learner.gradient_checkpointing` on a dense transformers model; ValueError where it cannot be."""
    name = type(model).__name__
    if moe:
        # R3's replay (and the route capture beside it) are hooks that live through the forward only: the
        # backward's recomputation would route afresh and differ from the forward it replaces.
        raise ValueError(f"learner.gradient_checkpointing works on dense models, not on the MoE {name}")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"learner.gradient_checkpointing: {name} does not support it")
    enable = cast(Any, model).activation_checkpointing_enable  # transformers' PreTrainedModel
    enable(activation_checkpointing_kwargs={"use_reentrant": False})


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` in eval mode without gradients: the KL reference, the initial policy."""
    reference = copy.deepcopy(model).eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference
