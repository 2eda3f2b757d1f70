"""Sparse upcycling (Komatsuzaki et al., "Sparse Upcycling: Training Mixture-of-Experts from Dense
Checkpoints", arXiv 2212.05055): a dense Llama-family model becomes a Mixtral-layout MoE whose every
expert is a copy of the dense layer's MLP, with a new, small, seeded router per layer.

    dense, tokenizer = load_model("smollm2-135m")
    moe = upcycle_to_mixtral(dense, num_experts=8, top_k=2, router_init_std=0.02, seed=0)
    save_model(moe, tokenizer, "runs/smollm2-8x")

At initialisation the MoE computes the dense model's function for any routing: each token's MoE output
is Σ_k w_k · MLP(x) with the top-k gate weights w renormalised to sum to 1 (Mixtral's router always
renormalises, and R3's replayed weights do too), so it is MLP(x) whichever experts are chosen, up to
float rounding. Training then lets the experts drift apart from real weights rather than from noise.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedModel

UPCYCLABLE: tuple[str, ...] = ("llama", "mistral")
"""Dense `model_type`s whose decoder layer is Mixtral's with a SwiGLU MLP in place of the MoE block:
bias-free q/k/v/o projections, RMSNorm before attention and MLP, rotary positions (Mistral adds a sliding
window, which Mixtral has too). Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma and Phi differ in the
attention or the norms and are refused."""

DEFAULT_ROUTER_STD = 0.02
"""Standard deviation of the new routers' weights: Mixtral's own `initializer_range`. Small, so the
routers start near-uniform and RL, not the initialisation, decides where tokens go."""


def mixtral_config(dense: Any, num_experts: int, top_k: int) -> MixtralConfig:
    """The Mixtral config of `dense` (a Llama or Mistral config) upcycled to `num_experts` experts,
    `top_k` per token: every shape, rotary and norm setting and token id carried over, the experts
    as wide as the dense MLP. ValueError for a family or setting Mixtral cannot reproduce."""
    family = getattr(dense, "model_type", None)
    if family not in UPCYCLABLE:
        raise ValueError(
            f"upcycling takes a dense Llama-family model ({', '.join(UPCYCLABLE)}), got model_type "
            f"{family!r}: its layers must be Mixtral's with a dense MLP (no attention biases, no q/k norms)"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(dense, flag, False):
            raise ValueError(f"this {family} model has {flag}=True; Mixtral's projections have no bias")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must lie in [1, num_experts={num_experts}], got {top_k}")
    return MixtralConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=getattr(dense, "head_dim", None) or dense.hidden_size // dense.num_attention_heads,
        hidden_act=dense.hidden_act,
        max_position_embeddings=dense.max_position_embeddings,
        initializer_range=dense.initializer_range,
        rms_norm_eps=dense.rms_norm_eps,
        pad_token_id=dense.pad_token_id,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        tie_word_embeddings=dense.tie_word_embeddings,
        sliding_window=getattr(dense, "sliding_window", None),  # Llama has none, Mistral may
        attention_dropout=dense.attention_dropout,
        rope_parameters=dict(dense.rope_parameters),
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        # Routing is what RL trains and R3 replays; a load-balancing term would be a second objective
        # (as in agents.models.hf_config). Jitter would make the routes of a forward unrepeatable.
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        router_jitter_noise=0.0,
        dtype=dense.dtype,
    )


def upcycle_to_mixtral(
    dense_model: PreTrainedModel,
    num_experts: int,
    top_k: int,
    *,
    router_init_std: float = DEFAULT_ROUTER_STD,
    seed: int = 0,
) -> MixtralForCausalLM:
    """A Mixtral MoE in eval mode, in `dense_model`'s dtype, that starts as `dense_model`.

    Embeddings, attention, norms and the LM head are copied exactly; each layer's experts
    (`mlp.experts.gate_up_proj [E, 2·I, H]`, `mlp.experts.down_proj [E, H, I]`) are `num_experts` copies
    of its MLP (`gate_proj`, `up_proj`, `down_proj`); each router (`mlp.gate.weight [E, H]`) is drawn
    from N(0, router_init_std²), layer by layer from one generator seeded with `seed`, so the same seed
    gives the same routers and the caller's torch RNG state is left as it was. ValueError for a model
    that is not Llama-family (`UPCYCLABLE`) or for bad sizes."""
    if not math.isfinite(router_init_std) or router_init_std < 0:
        raise ValueError(f"router_init_std must be a finite number >= 0, got {router_init_std}")
    config = mixtral_config(dense_model.config, num_experts, top_k)
    dtype = dense_model.dtype
    with torch.random.fork_rng(devices=[]):
        # from_config builds in `dtype` whatever the caller's default dtype is. Its random weights are
        # all overwritten below: load_state_dict is strict, so nothing is left random.
        moe = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    if not isinstance(moe, MixtralForCausalLM):
        raise TypeError(f"from_config built a {type(moe).__name__}")
    # Everything outside the MLPs has the same name and shape in both models.
    state = {name: tensor for name, tensor in dense_model.state_dict().items() if ".mlp." not in name}
    generator = torch.Generator().manual_seed(seed)
    for index, layer in enumerate(_dense_layers(dense_model)):
        mlp: Any = layer.mlp
        prefix = f"model.layers.{index}.mlp"
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)  # Mixtral chunks it in two
        # Broadcast views: load_state_dict copies them into each expert's own storage.
        state[f"{prefix}.experts.gate_up_proj"] = gate_up.detach().expand(num_experts, -1, -1)
        state[f"{prefix}.experts.down_proj"] = mlp.down_proj.weight.detach().expand(num_experts, -1, -1)
        router = torch.randn((num_experts, config.hidden_size), generator=generator) * router_init_std
        state[f"{prefix}.gate.weight"] = router.to(dtype)
    moe.load_state_dict(state, strict=True)
    moe.generation_config = copy.deepcopy(dense_model.generation_config)
    moe.train(False)  # eval(), which transformers leaves untyped
    return moe


def _dense_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"a {type(model).__name__} has no decoder layers at model.layers")
    return list(layers)
