"""Model factories: the tiny MoE built from a config (docs/learnability.md's 1.9M-parameter recipe), any local
Hugging Face checkpoint, and where each MoE layer's router sits (what R3 routing replay hooks).

    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)        # milliseconds, deterministic per seed
    save_model(model, tokenizer, "runs/init")
    model, tokenizer = load_model("runs/init")
    info = moe_info(model)                                     # info.gates[i]: layer i's router
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
)
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from agents.tokenizer import tiny_tokenizer

Family = Literal["qwen3_moe", "mixtral"]
ExpertsImplementation = Literal["grouped_mm", "batched_mm", "eager"]

FAMILIES: tuple[Family, ...] = ("qwen3_moe", "mixtral")
"""MoE families `build_tiny_moe` builds and `moe_info` understands (transformers `model_type`s)."""

_ROUTERS: dict[str, type[nn.Module]] = {"qwen3_moe": Qwen3MoeTopKRouter, "mixtral": MixtralTopKRouter}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


@dataclass(frozen=True)
class TinyMoEConfig:
    """Shape of the tiny MoE. The defaults are docs/learnability.md's measured model (≈1.9M parameters)."""

    family: Family = "qwen3_moe"
    """Architecture: `qwen3_moe` (Qwen3-30B-A3B's) or `mixtral`."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Decoder layers, each with attention and an MoE block."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); divides `num_heads`."""
    head_dim: int = 32
    """Width of one attention head."""
    num_experts: int = 8
    """Experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    moe_intermediate_size: int = 128
    """Hidden width of one expert's SwiGLU MLP."""
    max_position: int = 1024
    """Longest sequence (prompt, tool turns and generation together)."""
    experts_implementation: ExpertsImplementation = "grouped_mm"
    """How transformers runs the experts; `grouped_mm` is the fast one on CPU (docs/learnability.md)."""
    seed: int = 0
    """Seed of the weight initialisation: the same seed gives the same weights."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        sizes = {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "moe_intermediate_size": self.moe_intermediate_size,
            "max_position": self.max_position,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings), got {self.head_dim}")
        if self.experts_implementation not in ("grouped_mm", "batched_mm", "eager"):
            raise ValueError(f"unknown experts_implementation {self.experts_implementation!r}")


def hf_config(config: TinyMoEConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config of the tiny MoE, sized to `tokenizer` (its full length, added tokens
    included) and carrying its pad and eos ids."""
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer needs a pad and an eos token")
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "num_experts_per_tok": config.top_k,
        "max_position_embeddings": config.max_position,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
        # Routing is what RL trains and R3 replays; a load-balancing term would be a second objective.
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "experts_implementation": config.experts_implementation,
        "attn_implementation": "sdpa",
        "dtype": torch.float32,
    }
    if config.family == "qwen3_moe":
        return Qwen3MoeConfig(
            num_experts=config.num_experts,
            moe_intermediate_size=config.moe_intermediate_size,
            intermediate_size=config.moe_intermediate_size,  # only dense layers use it; there are none
            # Renormalised top-k weights, as Qwen3-30B-A3B and Mixtral use them.
            norm_topk_prob=True,
            **common,
        )
    return MixtralConfig(
        num_local_experts=config.num_experts,
        intermediate_size=config.moe_intermediate_size,
        router_jitter_noise=0.0,
        **common,
    )


def build_tiny_moe(
    config: TinyMoEConfig | None = None, tokenizer: PreTrainedTokenizerBase | None = None
) -> PreTrainedModel:
    """A freshly initialised tiny MoE in eval mode and float32 (default config and `tiny_tokenizer()`).
    The same `config.seed` gives the same weights; the caller's torch RNG state is left as it was."""
    config = config or TinyMoEConfig()
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    transformers_config = hf_config(config, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        # from_config, not the class: it builds in `dtype` whatever the caller's default dtype is.
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # untyped in transformers
            transformers_config, dtype=torch.float32
        )
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"from_config built a {type(model).__name__}")
    model.train(False)  # eval(), which transformers leaves untyped
    return model


def parameter_count(model: nn.Module) -> int:
    """All parameters (embeddings and every expert included)."""
    return sum(parameter.numel() for parameter in model.parameters())


# -- checkpoints ---------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike[str]
) -> Path:
    """Write a Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer files)
    that `load_model` (or any transformers loader) reads back."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_model(
    source: str | os.PathLike[str],
    *,
    dtype: torch.dtype | Literal["auto"] = torch.float32,
    local_files_only: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`(model, tokenizer)` from a local checkpoint directory, or from a hub name like `Qwen/Qwen3-30B-A3B`
    when the hub (or its local cache) has it. The model comes back in eval mode, on the CPU, in `dtype`
    (`"auto"`: the checkpoint's own). FileNotFoundError names what is missing."""
    directory = Path(source).expanduser()
    from_hub = not directory.exists()
    if not from_hub:
        _check_checkpoint_dir(directory)
    elif not (isinstance(source, str) and _HUB_ID.match(source)):
        raise FileNotFoundError(f"no checkpoint directory at {directory}")
    name = source if from_hub else str(directory)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=local_files_only)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
    except OSError as error:
        if not from_hub:
            raise
        raise FileNotFoundError(
            f"{source!r} is no local directory and could not be loaded from the Hugging Face hub "
            f"(offline, or no such model?): {error}"
        ) from error
    if not isinstance(model, PreTrainedModel) or not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"{name} gave a {type(model).__name__} and a {type(tokenizer).__name__}")
    model.train(False)  # eval(), which transformers leaves untyped
    return model, tokenizer


def _check_checkpoint_dir(directory: Path) -> None:
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is a file; a checkpoint is a directory")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json: not a Hugging Face checkpoint directory "
            "(expected config.json, *.safetensors and tokenizer files)"
        )
    if not any(directory.glob("*.safetensors")) and not any(directory.glob("*.bin")):
        raise FileNotFoundError(f"{directory} has a config.json but no weights (*.safetensors)")
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer (tokenizer.json / tokenizer_config.json)")


# -- MoE routers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEInfo:
    """Where a model routes tokens to experts: one router ("gate") module per MoE layer.

    The gates (transformers 5.x, both families): `model.model.layers[i].mlp.gate`, a
    `Qwen3MoeTopKRouter` or `MixtralTopKRouter` (Mixtral's block was `block_sparse_moe` before 5.0).
    Its `forward(hidden_states)` flattens the input to `[T, hidden]`, T = batch * seq (row-major,
    padding positions included; T = batch * new tokens when decoding with a KV cache), and returns
    the tuple

        (router_logits  [T, num_experts]  pre-softmax, in the hidden states' dtype,
         router_scores  [T, top_k]        weights of the chosen experts,
         router_indices [T, top_k]        int64 expert ids, by descending probability).

    Top-k happens inside the gate: softmax over all experts in float32, `torch.topk`, then the k
    probabilities are renormalised to sum to 1 (Qwen3-MoE: iff `config.norm_topk_prob`, true for the
    tiny model and Qwen3-30B-A3B, and cast back to the logits' dtype; Mixtral: always, left in float32).
    The MoE block then calls `experts(hidden, router_indices, router_scores)` and discards the logits.
    So a forward hook on a gate sees each layer's routing (`output[2]`) and, by returning a new tuple,
    replaces it: routing replay (R3) returns the recorded indices with scores recomputed from this
    forward's logits at those indices. `output_router_logits=True` collects `output[0]`.
    """

    family: str
    """The model's `model_type`."""
    layers: tuple[int, ...]
    """Indices of the decoder layers that have an MoE block (all of them in the tiny model)."""
    num_experts: int
    """Experts per MoE layer."""
    top_k: int
    """Experts each token is routed to."""
    gate_names: tuple[str, ...]
    """Qualified module names of the gates, one per entry of `layers` (`model.get_submodule(name)`)."""
    gates: tuple[nn.Module, ...] = field(repr=False, compare=False)
    """The gate modules themselves, in layer order."""

    @property
    def num_layers(self) -> int:
        """MoE layers: the `layers` axis of routed experts `[tokens, layers, top_k]`."""
        return len(self.layers)


def moe_info(model: nn.Module) -> MoEInfo:
    """The MoE layout of a Qwen3-MoE or Mixtral model (built here or loaded from a checkpoint);
    ValueError for any other model."""
    config: Any = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if not isinstance(family, str) or family not in _ROUTERS:
        raise ValueError(f"moe_info knows the MoE families {FAMILIES}, not {family!r}")
    router = _ROUTERS[family]
    found: list[tuple[int, str, Any]] = []
    for name, module in model.named_modules():
        if isinstance(module, router):
            # A bare decoder (`model.model`) names its layers without the causal-LM prefix.
            qualified = name if name.startswith("model.") else f"model.{name}"
            match = _LAYER_RE.match(qualified)
            if match is None:
                raise ValueError(f"a {router.__name__} at an unexpected place: {name}")
            found.append((int(match.group(1)), name, module))
    if not found:
        raise ValueError(f"this {family} model has no MoE layer")
    found.sort(key=lambda item: item[0])
    num_experts = int(config.num_experts)  # Mixtral's `num_local_experts`, through its attribute_map
    top_k = int(config.num_experts_per_tok)
    for _, name, module in found:
        if (module.num_experts, module.top_k) != (num_experts, top_k):
            raise ValueError(
                f"{name} routes to {module.top_k} of {module.num_experts} experts, unlike its config"
            )
    return MoEInfo(
        family=family,
        layers=tuple(index for index, _, _ in found),
        num_experts=num_experts,
        top_k=top_k,
        gate_names=tuple(name for _, name, _ in found),
        gates=tuple(module for _, _, module in found),
    )
