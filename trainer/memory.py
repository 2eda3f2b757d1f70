"""Memory planning: the bytes one GPU holds for parameters, gradients and AdamW state when a model is
trained with PyTorch FSDP2 (`fully_shard` on every decoder layer and on the root, full sharding over
`num_ranks` GPUs), plus the parameters FSDP2 all-gathers for the layers it is running (docs/scaling.md,
"Memory per GPU under FSDP2"). Activations are not counted: they depend on batch, sequence length and
checkpointing, not on the sharding.

    counts = config_parameter_counts(qwen3_30b_a3b_config())          # meta device: allocates nothing
    plan = fsdp2_memory(padded_parameters(counts.shapes, 8), 8, counts.largest_layer, counts.root)
    plan.total / 2**30                                                 # GiB per GPU

`python -m trainer.memory` prints the table of docs/scaling.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, OlmoeConfig, PretrainedConfig, Qwen3MoeConfig

GIB = 2**30
"""Bytes in a GiB, the unit of the table."""


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts of a transformers causal LM, as FSDP2 wraps it: one unit per decoder layer and
    the root unit for the rest."""

    total: int
    """All parameters (a tied embedding counted once)."""
    largest_layer: int
    """Parameters of the largest decoder layer (`model.model.layers[i]`): the largest unit FSDP2
    all-gathers while it runs that layer."""
    root: int
    """Parameters outside the decoder layers (embeddings, final norm, LM head): the root unit's own."""
    shapes: tuple[tuple[int, ...], ...]
    """Every parameter's shape, for `padded_parameters`."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one GPU holds under FSDP2 full sharding, activations excluded."""

    parameters: int
    """The sharded master parameters."""
    gradients: int
    """The sharded gradients, kept in the parameters' dtype whatever the reduce dtype."""
    optimizer: int
    """The sharded optimizer states (AdamW: exp_avg and exp_avg_sq)."""
    gathered_layers: int
    """Two decoder layers all-gathered in the compute dtype: the one running and the one prefetched."""
    gathered_root: int
    """The root unit all-gathered in the compute dtype: FSDP2 keeps it unsharded from the start of the
    forward to the end of the backward, since the backward needs it again at once."""
    gradient_reduction: int
    """In the backward: one layer's unsharded gradients in the compute dtype, plus the reduce-scatter
    buffer of a layer's gradients in the reduce dtype."""

    @property
    def total(self) -> int:
        """All of the above."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.gathered_layers
            + self.gathered_root
            + self.gradient_reduction
        )


def fsdp2_memory(
    parameters: int,
    num_ranks: int,
    largest_unit_parameters: int,
    root_unit_parameters: int,
    *,
    parameter_bytes: int = 4,
    compute_bytes: int = 2,
    reduce_bytes: int = 4,
    optimizer_bytes: int = 8,
    prefetched_units: int = 2,
) -> MemoryPlan:
    """Per-GPU bytes of a model trained with FSDP2 full sharding over `num_ranks` GPUs.

    parameters: all parameters; each rank holds `ceil(parameters / num_ranks)` of them. FSDP2 pads each
    parameter's dim 0 to a multiple of `num_ranks`, so pass `padded_parameters(shapes, num_ranks)` for
    the exact shard. largest_unit_parameters: the largest decoder layer's parameters;
    root_unit_parameters: those outside every layer (`ParameterCounts.root`). The defaults are float32
    master weights and AdamW states (2 × 4 bytes) under `MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)` (compute_bytes 2, reduce_bytes 4), with `prefetched_units` layers gathered at
    once (the running one and the prefetched one). The sharded gradients take `parameter_bytes`: FSDP2
    casts the reduce-scatter's output back to the parameters' dtype.
    """
    counts = {
        "parameters": parameters,
        "largest_unit_parameters": largest_unit_parameters,
        "root_unit_parameters": root_unit_parameters,
    }
    for name, count in counts.items():
        if count < 0:
            raise ValueError(f"{name} must be >= 0, got {count}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if largest_unit_parameters + root_unit_parameters > parameters:
        raise ValueError(
            f"largest_unit_parameters ({largest_unit_parameters}) + root_unit_parameters "
            f"({root_unit_parameters}) exceed the model's parameters ({parameters})"
        )
    widths = {
        "parameter_bytes": parameter_bytes,
        "compute_bytes": compute_bytes,
        "reduce_bytes": reduce_bytes,
        "optimizer_bytes": optimizer_bytes,
        "prefetched_units": prefetched_units,
    }
    for name, width in widths.items():
        if width < 1:
            raise ValueError(f"{name} must be >= 1, got {width}")
    shard = math.ceil(parameters / num_ranks)
    return MemoryPlan(
        parameters=shard * parameter_bytes,
        gradients=shard * parameter_bytes,
        optimizer=shard * optimizer_bytes,
        gathered_layers=prefetched_units * largest_unit_parameters * compute_bytes,
        gathered_root=root_unit_parameters * compute_bytes,
        gradient_reduction=largest_unit_parameters * (compute_bytes + reduce_bytes),
    )


def padded_parameters(shapes: Iterable[Sequence[int]], num_ranks: int) -> int:
    """All parameters once FSDP2 has padded each one's dim 0 to a multiple of `num_ranks` (it shards a
    parameter of shape `[d0, *rest]` into chunks of `ceil(d0 / num_ranks)` rows, the last ones padded).
    A multiple of `num_ranks`: divided by it, the elements each rank holds."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    total = 0
    for shape in shapes:
        if len(shape) == 0:
            raise ValueError("a 0-d parameter: FSDP2 shards on dim 0, which it lacks")
        if any(size < 0 for size in shape):
            raise ValueError(f"a parameter shape with a negative size: {tuple(shape)}")
        rows = math.ceil(shape[0] / num_ranks) * num_ranks
        total += rows * math.prod(shape[1:])
    return total


def count_parameters(model: nn.Module) -> ParameterCounts:
    """The counts of a transformers causal LM whose decoder layers are `model.model.layers`."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"a {type(model).__name__} without decoder layers at model.model.layers "
            "(a transformers causal LM has them)"
        )
    parameters = list(model.parameters())
    total = sum(parameter.numel() for parameter in parameters)
    per_layer = [sum(parameter.numel() for parameter in layer.parameters()) for layer in layers]
    return ParameterCounts(
        total=total,
        largest_layer=max(per_layer),
        root=total - sum(per_layer),
        shapes=tuple(tuple(parameter.shape) for parameter in parameters),
    )


def config_parameter_counts(config: PretrainedConfig) -> ParameterCounts:
    """The counts of the causal LM a transformers config describes, without its weights: the model is
    built on the meta device, which gives every tensor a shape and allocates no memory."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # untyped upstream
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_config built a {type(model).__name__}")
    return count_parameters(model)


def qwen3_30b_a3b_config() -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's shape (its config.json on the hub), written out so that it needs no download."""
    # Not a declared field of Qwen3MoeConfig, whose model falls back to hidden_size / heads = 64 without
    # it; Qwen3-30B-A3B's heads are 128 wide.
    undeclared: dict[str, Any] = {"head_dim": 128}
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,  # dense layers only; it has none
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        **undeclared,
    )


def olmoe_1b_7b_config() -> OlmoeConfig:
    """OLMoE-1B-7B's shape (allenai/OLMoE-1B-7B-0924's config.json), written out likewise."""
    return OlmoeConfig(
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def memory_table(models: Mapping[str, ParameterCounts], ranks: Sequence[int]) -> str:
    """A markdown table of `fsdp2_memory` (default precision, padded shards) in GiB per GPU: one row per
    model and rank count."""
    header = (
        "| model | parameters | GPUs | parameters (fp32) | gradients (fp32) | AdamW states (fp32) "
        "| 2 gathered layers (bf16) | gathered root (bf16) | gradient reduction | total |"
    )
    lines = [header, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, counts in models.items():
        for num_ranks in ranks:
            plan = fsdp2_memory(
                padded_parameters(counts.shapes, num_ranks), num_ranks, counts.largest_layer, counts.root
            )
            cells = [
                plan.parameters,
                plan.gradients,
                plan.optimizer,
                plan.gathered_layers,
                plan.gathered_root,
                plan.gradient_reduction,
                plan.total,
            ]
            gib = " | ".join(f"{cell / GIB:.2f}" for cell in cells)
            lines.append(f"| {name} | {counts.total / 1e9:.2f}B | {num_ranks} | {gib} |")
    return "\n".join(lines)


def main() -> None:
    """Print docs/scaling.md's table: Qwen3-30B-A3B and OLMoE-1B-7B on 8, 16 and 32 GPUs."""
    models = {
        "Qwen3-30B-A3B": config_parameter_counts(qwen3_30b_a3b_config()),
        "OLMoE-1B-7B": config_parameter_counts(olmoe_1b_7b_config()),
    }
    print(memory_table(models, (8, 16, 32)))


if __name__ == "__main__":
    main()
