"""trainer/memory.py: FSDP2 memory planning against counts and bytes worked out by hand."""

from __future__ import annotations

import pytest
from torch import nn

from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, hf_config, parameter_count
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.trainer.memory import (
    GIB,
    MemoryPlan,
    ParameterCounts,
    config_parameter_counts,
    count_parameters,
    fsdp2_memory,
    memory_table,
    olmoe_1b_7b_config,
    padded_parameters,
    qwen3_30b_a3b_config,
)

# The tiny MoE's default shape (hidden 128, 4 layers, 4 heads and 2 kv heads of 32, 8 experts of width
# 128) with the tiny tokenizer's 512 tokens, written out from its modules.
TINY_LAYER = (
    128 * 128  # q_proj
    + 64 * 128  # k_proj
    + 64 * 128  # v_proj
    + 128 * 128  # o_proj
    + 32 + 32  # q_norm, k_norm
    + 8 * 256 * 128  # experts' gate_up_proj
    + 8 * 128 * 128  # experts' down_proj
    + 8 * 128  # router
    + 128 + 128  # the two layer norms
)  # fmt: skip
TINY_ROOT = 512 * 128 + 128 + 512 * 128  # embeddings, final norm, untied LM head
TINY_TOTAL = 4 * TINY_LAYER + TINY_ROOT


def test_tiny_counts_match_the_model_and_the_hand_count() -> None:
    model = build_tiny_moe()
    counts = count_parameters(model)
    assert TINY_LAYER == 443_712
    assert TINY_TOTAL == 1_906_048
    assert counts.total == parameter_count(model) == TINY_TOTAL
    assert counts.largest_layer == sum(p.numel() for p in model.model.layers[0].parameters()) == TINY_LAYER
    assert counts.root == TINY_ROOT
    assert len(counts.shapes) == len(list(model.parameters()))
    assert sum(_numel(shape) for shape in counts.shapes) == TINY_TOTAL


def test_the_largest_layer_is_the_largest_not_the_first() -> None:
    model = build_tiny_moe()
    extra = nn.Parameter(model.model.layers[0].input_layernorm.weight.new_zeros(7, 3))
    model.model.layers[2].register_parameter("extra", extra)
    counts = count_parameters(model)
    assert counts.largest_layer == TINY_LAYER + 21
    assert counts.total == TINY_TOTAL + 21
    assert counts.root == TINY_ROOT


def test_config_counts_on_the_meta_device_match_the_built_model() -> None:
    tokenizer = tiny_tokenizer()
    counts = config_parameter_counts(hf_config(TinyMoEConfig(), tokenizer))
    assert counts == count_parameters(build_tiny_moe(TinyMoEConfig(), tokenizer))
    assert counts.total == TINY_TOTAL


def test_qwen3_30b_a3b_counts() -> None:
    layer = (
        2048 * 32 * 128  # q_proj
        + 2 * 2048 * 4 * 128  # k_proj, v_proj
        + 32 * 128 * 2048  # o_proj
        + 2 * 128  # q_norm, k_norm
        + 128 * 3 * 2048 * 768  # 128 SwiGLU experts
        + 128 * 2048  # router
        + 2 * 2048  # layer norms
    )
    root = 2 * 151936 * 2048 + 2048
    counts = config_parameter_counts(qwen3_30b_a3b_config())
    assert counts.largest_layer == layer
    assert counts.root == root
    assert counts.total == 48 * layer + root == 30_532_122_624  # "30.5B" on its model card


def test_olmoe_1b_7b_counts() -> None:
    layer = (
        4 * 2048 * 2048  # q, k, v, o (16 heads of 128, no grouped-query attention)
        + 2 * 2048  # q_norm, k_norm over the whole width
        + 64 * 3 * 2048 * 1024  # 64 SwiGLU experts
        + 64 * 2048  # router
        + 2 * 2048  # layer norms
    )
    root = 2 * 50304 * 2048 + 2048
    counts = config_parameter_counts(olmoe_1b_7b_config())
    assert counts.largest_layer == layer
    assert counts.root == root
    assert counts.total == 16 * layer + root == 6_919_161_856  # "6.9B total" on its model card


def test_padding_rounds_each_dim_0_up_to_a_multiple_of_the_ranks() -> None:
    shapes = [(5, 3), (4,), (1, 2)]
    assert padded_parameters(shapes, 1) == 15 + 4 + 2
    # 5 rows -> chunks of 3 rows -> 6 rows; 4 stays 4; 1 row -> chunks of 1 -> 2 rows.
    assert padded_parameters(shapes, 2) == 6 * 3 + 4 + 2 * 2
    # 5 rows -> chunks of 2 -> 8 rows; 4 -> 4; 1 -> 4 rows.
    assert padded_parameters(shapes, 4) == 8 * 3 + 4 + 4 * 2


def test_padding_of_the_tiny_model_at_three_ranks() -> None:
    # At 3 ranks every dim 0 of d rows is padded to 3 * ceil(d / 3): 128 -> 129, 64 -> 66, 32 -> 33,
    # 8 -> 9 (the experts' and the router's), 512 -> 513.
    layer = (
        2 * 129 * 128  # q_proj, o_proj
        + 2 * 66 * 128  # k_proj, v_proj
        + 2 * 33  # q_norm, k_norm
        + 9 * 256 * 128  # experts' gate_up_proj
        + 9 * 128 * 128  # experts' down_proj
        + 9 * 128  # router
        + 2 * 129  # layer norms
    )
    root = 2 * 513 * 128 + 129
    shapes = count_parameters(build_tiny_moe()).shapes
    assert padded_parameters(shapes, 3) == 4 * layer + root
    assert padded_parameters(shapes, 2) == TINY_TOTAL  # every dim 0 even: no padding


def test_tiny_plan_on_one_and_two_ranks() -> None:
    # fp32 master weights (4 bytes) and gradients (4), AdamW's two fp32 states (8), all divided over the
    # ranks; two bf16 layers and the bf16 root gathered; one layer's bf16 gradients and fp32
    # reduce-scatter buffer.
    one = fsdp2_memory(TINY_TOTAL, 1, TINY_LAYER, TINY_ROOT)
    assert one == MemoryPlan(
        parameters=1_906_048 * 4,
        gradients=1_906_048 * 4,
        optimizer=1_906_048 * 8,
        gathered_layers=2 * 443_712 * 2,
        gathered_root=131_200 * 2,
        gradient_reduction=443_712 * (2 + 4),
    )
    assert one.total == 1_906_048 * 16 + 443_712 * 10 + 131_200 * 2 == 35_196_288
    two = fsdp2_memory(
        padded_parameters(count_parameters(build_tiny_moe()).shapes, 2), 2, TINY_LAYER, TINY_ROOT
    )
    assert two == MemoryPlan(
        parameters=953_024 * 4,
        gradients=953_024 * 4,
        optimizer=953_024 * 8,
        gathered_layers=2 * 443_712 * 2,
        gathered_root=131_200 * 2,
        gradient_reduction=443_712 * (2 + 4),
    )
    assert two.total == 953_024 * 16 + 443_712 * 10 + 131_200 * 2 == 19_947_904


def test_an_uneven_total_rounds_the_shard_up() -> None:
    plan = fsdp2_memory(7, 2, 2, 1)
    assert plan == MemoryPlan(
        parameters=4 * 4,
        gradients=4 * 4,
        optimizer=4 * 8,
        gathered_layers=2 * 2 * 2,
        gathered_root=1 * 2,
        gradient_reduction=2 * 6,
    )


def test_other_precisions() -> None:
    # bf16 master weights, an 8-bit compute dtype, fp32 reduction, three fp32 optimizer states, three
    # layers gathered at once: widths that all differ, so that using one for another shows.
    plan = fsdp2_memory(
        100,
        4,
        10,
        20,
        parameter_bytes=2,
        compute_bytes=1,
        reduce_bytes=4,
        optimizer_bytes=12,
        prefetched_units=3,
    )
    assert plan == MemoryPlan(
        parameters=25 * 2,
        gradients=25 * 2,
        optimizer=25 * 12,
        gathered_layers=3 * 10 * 1,
        gathered_root=20 * 1,
        gradient_reduction=10 * (1 + 4),
    )
    assert plan.total == 50 + 50 + 300 + 30 + 20 + 50


def test_qwen3_30b_a3b_on_eight_gpus() -> None:
    counts = config_parameter_counts(qwen3_30b_a3b_config())
    assert padded_parameters(counts.shapes, 8) == counts.total  # every dim 0 divides by 8
    plan = fsdp2_memory(counts.total, 8, counts.largest_layer, counts.root)
    assert plan.parameters == 30_532_122_624 // 8 * 4
    assert plan.total == 30_532_122_624 * 2 + 623_120_640 * 10 + 622_331_904 * 2
    assert round(plan.total / GIB, 2) == 63.83


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((10, 0, 1, 1), "num_ranks must be >= 1, got 0"),
        ((10, -2, 1, 1), "num_ranks must be >= 1, got -2"),
        ((-1, 2, 0, 0), "parameters must be >= 0, got -1"),
        ((10, 2, -1, 1), "largest_unit_parameters must be >= 0, got -1"),
        ((10, 2, 1, -1), "root_unit_parameters must be >= 0, got -1"),
        ((10, 2, 8, 3), r"largest_unit_parameters \(8\) \+ root_unit_parameters \(3\) exceed"),
    ],
)
def test_bad_counts_raise(arguments: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fsdp2_memory(*arguments)


@pytest.mark.parametrize(
    "width", ["parameter_bytes", "compute_bytes", "reduce_bytes", "optimizer_bytes", "prefetched_units"]
)
def test_bad_widths_raise(width: str) -> None:
    with pytest.raises(ValueError, match=f"{width} must be >= 1, got 0"):
        fsdp2_memory(10, 2, 1, 1, **{width: 0})


def test_bad_padding_input_raises() -> None:
    with pytest.raises(ValueError, match="num_ranks must be >= 1, got 0"):
        padded_parameters([(4, 4)], 0)
    with pytest.raises(ValueError, match="0-d parameter"):
        padded_parameters([()], 2)
    with pytest.raises(ValueError, match="negative size"):
        padded_parameters([(4, -1)], 2)


def test_a_module_without_decoder_layers_raises() -> None:
    with pytest.raises(ValueError, match=r"a Linear without decoder layers at model\.model\.layers"):
        count_parameters(nn.Linear(2, 2))


def test_a_model_with_no_decoder_layers_raises() -> None:
    model = build_tiny_moe()
    model.model.layers = nn.ModuleList()
    with pytest.raises(ValueError, match=r"without decoder layers at model\.model\.layers"):
        count_parameters(model)


def test_the_table_has_one_row_per_model_and_rank_count() -> None:
    counts = ParameterCounts(total=2 * GIB, largest_layer=GIB // 4, root=GIB // 2, shapes=((2 * GIB,),))
    table = memory_table({"toy": counts}, (1, 2)).splitlines()
    assert len(table) == 4
    # 2 Gi parameters: 8 GiB of fp32 weights on one GPU; 2 bf16 layers of 1/4 Gi: 1 GiB; root 1 GiB;
    # reduction 1/4 Gi × 6 bytes: 1.5 GiB.
    assert table[2] == "| toy | 2.15B | 1 | 8.00 | 8.00 | 16.00 | 1.00 | 1.00 | 1.50 | 35.50 |"
    assert table[3] == "| toy | 2.15B | 2 | 4.00 | 4.00 | 8.00 | 1.00 | 1.00 | 1.50 | 19.50 |"


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
