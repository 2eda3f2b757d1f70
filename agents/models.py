"""Model factories: the tiny MoE built from a config (docs/learnability.md's 1.9M-parameter recipe), any local
Hugging Face checkpoint, and, through one adapter per MoE family (`MOE_ADAPTERS`), where each MoE layer's
router sits and how R3 routing replay reads and forces its experts.

    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)        # milliseconds, deterministic per seed
    save_model(model, tokenizer, "runs/init")
    model, tokenizer = load_model("runs/init")
    info = moe_info(model)                                     # info.gates[i]: layer i's router
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
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
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from pacerl.agents.gguf import checkpoint_source
from pacerl.agents.tokenizer import tiny_tokenizer

Family = Literal["qwen3_moe", "mixtral"]
ExpertsImplementation = Literal["grouped_mm", "batched_mm", "eager"]

FAMILIES: tuple[Family, ...] = ("qwen3_moe", "mixtral")
"""MoE families `build_tiny_moe` builds (transformers `model_type`s); R3 supports all of `MOE_FAMILIES`."""


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


WeightLayout = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
"""Turns a model's in-memory state dict into another naming (see `checkpoint_layout`)."""


def checkpoint_layout(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (named and shaped as `model` holds it in memory) in the layout its checkpoints are saved
    in, the one an inference server loads: transformers 5 fuses the experts of a layer into one tensor in
    memory (`mlp.experts.gate_up_proj`) where checkpoints keep one per expert and projection
    (`mlp.experts.0.gate_proj.weight`, ...); a server that skips names it does not know (SGLang does)
    would keep its experts at the old weights. Other models come back unchanged. `model` may live on
    the meta device: only its class and config are read."""
    if not isinstance(model, PreTrainedModel):
        return dict(state)
    from transformers.core_model_loading import revert_weight_conversion

    converted: dict[str, torch.Tensor] = revert_weight_conversion(model, dict(state))
    return converted


def layout_of(model_class: type[nn.Module], config: Any) -> WeightLayout:
    """`checkpoint_layout` for models of `model_class` with `config`, from a copy on the meta device
    (no memory is allocated)."""
    with torch.device("meta"):
        shape = model_class(config)
    return lambda state: checkpoint_layout(shape, state)


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
    """`(model, tokenizer)` from a local checkpoint directory, a `.gguf` file or a shipped model's short
    name (`pacerl.agents.gguf`: converted once into a cached checkpoint directory), or from a hub name like
    `Qwen/Qwen3-30B-A3B` when the hub (or its local cache) has it. The model comes back in eval mode, on
    the CPU, in `dtype` (`"auto"`: the checkpoint's own). FileNotFoundError names what is missing,
    ValueError a file that is no model."""
    source = checkpoint_source(source)
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

RouteWeights = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""`(router, logits [T, num_experts], chosen [T, top_k]) -> weights [T, top_k]`: the gate weights a
router gives the experts `chosen`, by the router's own arithmetic."""


class UnsupportedMoEError(ValueError):
    """A model whose config declares experts but whose family has no adapter in `MOE_ADAPTERS`:
    R3 cannot reach its routers, and training it with routing replay on would silently run without it."""


def _softmax_weights(router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    # Softmax over all experts in float32, the chosen subset, renormalised when the router does
    # (Qwen-MoE and OLMoE: iff `norm_topk_prob`; Mixtral, which lacks the attribute: always).
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, chosen)
    if bool(getattr(router, "norm_topk_prob", True)):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights


def _chosen_softmax_weights(router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    # Softmax over the chosen experts' logits only (GraniteMoE; gpt-oss, whose logits carry its bias).
    return torch.softmax(logits.gather(-1, chosen), dim=-1)


def _sigmoid_weights(router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    # DeepSeek-V3: sigmoid scores of the chosen experts. The correction bias and the group-limited
    # top-k only decide which experts are chosen, so they do not enter the weights.
    settings: Any = router  # DeepseekV3TopkRouter's plain attributes, which nn.Module's typing hides
    weights = logits.sigmoid().gather(-1, chosen)
    if settings.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    scaled: torch.Tensor = weights * settings.routed_scaling_factor
    return scaled


@dataclass(frozen=True)
class MoEAdapter:
    """How R3 reaches one MoE family's routers (transformers 5.x).

    Every adapted router is a module whose `forward(hidden_states)` returns the tuple

        (router_logits  [T, num_experts],
         weights        [T, top_k]   gate weights of the chosen experts,
         indices        [T, top_k]   int64 expert ids)

    with T = batch * seq (row-major, padding included; batch * new tokens when decoding with a KV cache),
    and whose MoE block feeds `indices` and `weights` to its experts and nothing else of the routing.
    It has the attributes `num_experts`, `top_k` and `weight` (`[num_experts, hidden]`).
    So a forward hook on the router reads the chosen experts (`output[2]`, what the embedded engine
    records) and, returning `(logits, weights(router, logits, recorded), recorded)`, forces them (what
    R3 replays). Shared experts (Qwen2-MoE, DeepSeek-V3) and dense layers (DeepSeek-V3's
    `first_k_dense_replace`, Qwen-MoE's `mlp_only_layers`) have no router and are left alone.
    """

    router: type[nn.Module]
    """The router class; one instance per MoE layer."""
    path: str
    """Where a decoder layer holds its router, e.g. `mlp.gate` (`model.layers.<i>.<path>`)."""
    weights: RouteWeights
    """The router's gate weights for given experts, from its logits (replay of the live choice gives
    the live weights bit for bit)."""


MOE_ADAPTERS: dict[str, MoEAdapter] = {
    "qwen2_moe": MoEAdapter(Qwen2MoeTopKRouter, "mlp.gate", _softmax_weights),
    "qwen3_moe": MoEAdapter(Qwen3MoeTopKRouter, "mlp.gate", _softmax_weights),
    "mixtral": MoEAdapter(MixtralTopKRouter, "mlp.gate", _softmax_weights),
    "olmoe": MoEAdapter(OlmoeTopKRouter, "mlp.gate", _softmax_weights),
    "deepseek_v3": MoEAdapter(DeepseekV3TopkRouter, "mlp.gate", _sigmoid_weights),
    "gpt_oss": MoEAdapter(GptOssTopKRouter, "mlp.router", _chosen_softmax_weights),
    "granitemoe": MoEAdapter(GraniteMoeTopKRouter, "block_sparse_moe.router", _chosen_softmax_weights),
}
"""R3 adapters by transformers `model_type`: adding a family is one entry (docs/training.md,
"MoE families")."""

MOE_FAMILIES: tuple[str, ...] = tuple(MOE_ADAPTERS)
"""The MoE families R3 supports (`moe_info` understands)."""

_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MOE_MODEL_TYPES = frozenset({"dbrx", "jamba", "nllb_moe", "switch_transformers", "llama4", "minimax"})
"""MoE `model_type`s whose config names its expert count otherwise and whose name lacks "moe"."""


def declares_moe(config: Any) -> bool:
    """Whether a transformers config describes a mixture of experts: an expert count above 0
    (`num_experts`, `num_local_experts`, `n_routed_experts`, `moe_num_experts`, in the config or its
    text config), or a `model_type` known to be MoE."""
    configs = [config]
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        configs.append(get_text_config())
    for candidate in configs:
        model_type = str(getattr(candidate, "model_type", ""))
        if "moe" in model_type or model_type in _MOE_MODEL_TYPES:
            return True
        for key in _EXPERT_COUNTS:
            count = getattr(candidate, key, None)
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                return True
    return False


def _unsupported(family: object, reason: str) -> UnsupportedMoEError:
    return UnsupportedMoEError(
        f"{family!r} is a mixture-of-experts model, but {reason}: R3 routing replay cannot reach its "
        f"routers. Supported MoE families: {', '.join(MOE_FAMILIES)}. Add an adapter to "
        "pacerl.agents.models.MOE_ADAPTERS (docs/training.md, MoE families), or train without R3 "
        "(learner.routing_replay=false)."
    )


def check_replay_support(model: nn.Module) -> None:
    """Raise `UnsupportedMoEError` when `model` is an MoE of a family without an R3 adapter; a dense
    model or a supported family passes (a cheap look at the config, no module walk)."""
    config: Any = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if config is not None and family not in MOE_ADAPTERS and declares_moe(config):
        raise _unsupported(family, "its family has no R3 adapter")


@dataclass(frozen=True)
class MoEInfo:
    """Where a model routes tokens to experts: one router ("gate") module per MoE layer, found by its
    family's `MoEAdapter` (which documents the router's contract)."""

    family: str
    """The model's `model_type`."""
    layers: tuple[int, ...]
    """Indices of the decoder layers that have an MoE block (DeepSeek-V3 starts dense)."""
    num_experts: int
    """Experts per MoE layer."""
    top_k: int
    """Experts each token is routed to."""
    gate_names: tuple[str, ...]
    """Qualified module names of the gates, one per entry of `layers` (`model.get_submodule(name)`)."""
    gates: tuple[nn.Module, ...] = field(repr=False, compare=False)
    """The gate modules themselves, in layer order."""
    adapter: MoEAdapter = field(repr=False, compare=False)
    """The family's adapter: `adapter.weights` recomputes gate weights for replayed experts."""

    @property
    def num_layers(self) -> int:
        """MoE layers: the `layers` axis of routed experts `[tokens, layers, top_k]`."""
        return len(self.layers)


def moe_info(model: nn.Module) -> MoEInfo:
    """The MoE layout of a model of a family in `MOE_ADAPTERS` (built here or loaded from a checkpoint).
    `UnsupportedMoEError` for an MoE without an adapter; a plain ValueError for a dense model."""
    config: Any = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    adapter = MOE_ADAPTERS.get(family) if isinstance(family, str) else None
    if adapter is None or not isinstance(family, str):
        check_replay_support(model)
        raise ValueError(f"moe_info knows the MoE families {MOE_FAMILIES}, not {family!r} (a dense model?)")
    pattern = re.compile(rf"^model\.layers\.(\d+)\.{re.escape(adapter.path)}$")
    found: list[tuple[int, str, Any]] = []
    for name, module in model.named_modules():
        if isinstance(module, adapter.router):
            # A bare decoder (`model.model`) names its layers without the causal-LM prefix.
            qualified = name if name.startswith("model.") else f"model.{name}"
            match = pattern.match(qualified)
            if match is None:
                raise ValueError(f"a {adapter.router.__name__} at an unexpected place: {name}")
            found.append((int(match.group(1)), name, module))
    if not found:
        if declares_moe(config):
            raise _unsupported(
                family, f"no {adapter.router.__name__} sits at model.layers.<i>.{adapter.path}"
            )
        raise ValueError(f"this {family} model has no MoE layer")
    found.sort(key=lambda item: item[0])
    shapes = {(int(module.num_experts), int(module.top_k)) for _, _, module in found}
    if len(shapes) != 1:
        raise ValueError(f"this {family} model's routers disagree on (num_experts, top_k): {sorted(shapes)}")
    ((num_experts, top_k),) = shapes
    return MoEInfo(
        family=family,
        layers=tuple(index for index, _, _ in found),
        num_experts=num_experts,
        top_k=top_k,
        gate_names=tuple(name for _, name, _ in found),
        gates=tuple(module for _, _, module in found),
        adapter=adapter,
    )
