"""Which columns of SGLang's routed experts are the trained model's MoE layers, from the model's
config.json, and the checks on the routes an answer carries.

Written against sglang 0.5.23 (see `pacerl.agents.engine.sglang`), from these files of it:

- `python/sglang/srt/state_capturer/routed_experts.py`,
  `python/sglang/srt/managers/scheduler_components/batch_result_processor.py` and
  `python/sglang/srt/managers/detokenizer_manager.py`: routed experts are int32
  `(prompt + completion − 1, num_hidden_layers, num_experts_per_tok)` (rows of positions whose next
  token was computed), captured only with `--enable-return-routed-experts`, sent as base64 of the
  raw little-endian bytes.
- Dense layers: the array has a column for every decoder layer, and a layer without an MoE block
  leaves its column 0. `RoutedExpertsCapturer.__init__` (`state_capturer/routed_experts.py`, lines
  63-93) sizes the buffers by `num_hidden_layers`; `BaseDeviceCache` and `BaseHostCache`
  (`state_capturer/base.py`, lines 29-42, 63-75) allocate them zero-filled; only an MoE block's `TopK`
  writes a column, its own layer's (`capture_routed_experts_if_allowed`, `layers/moe/topk.py` lines
  2529-2545; `BaseDeviceCache.capture`, base.py lines 48-50). The layers with an MoE block
  (`routed_layers`): DeepSeek-V3's from `first_k_dense_replace` on, every `moe_layer_freq`-th
  (`DeepseekV2DecoderLayer._is_layer_sparse`, `models/deepseek_v2.py` lines 2785-2792); every layer of
  Qwen2-MoE and Qwen3-MoE, whose `mlp_only_layers` and `decoder_sparse_step` SGLang does not read
  (`stage_facts`, `models/qwen2_moe.py` line 1057, `models/qwen3_moe.py` line 877), so that it builds a
  checkpoint's dense layer as an MoE block whose weights `load_weights` never loads (it skips the dense
  MLP's names); every layer of Mixtral, OLMoE, GraniteMoE and gpt-oss.
- `routed_experts_start_len` (`GenerateReqInput` in `io_struct.py`: "Absolute start position for
  returned routings; response covers `[routed_experts_start_len, seqlen - 1)`. Must be in
  [0, prompt_tokens]. 0 = full sequence."): `SchedulerBatchResultProcessor._maybe_collect_routed_experts`
  in `batch_result_processor.py` passes it to `BaseTopkCapturer.get_topk`
  (`python/sglang/srt/state_capturer/base.py`), which returns the rows of positions
  `[start_len, seqlen - 1)` read from the host buffer by KV slot, so a prefix served from the radix
  cache keeps the rows of the forward that computed it; the scheduler aborts a request whose start
  exceeds the prompt ("... is higher than the number of input tokens"). The server's own test of the
  field: `test/registered/rl/test_return_routed_experts.py`, `TestRoutedExpertsStartLen` (the
  cropped rows are the tail of the full ones; `start_len == prompt_tokens` passes).

MoE layers only. A `Generation`'s routes have the embedded engine's shape, `[rows, MoE layers,
top_k]`: the client keeps the columns of the layers `routed_layers` finds in the model's config.json
(read at the server's model_path, else in `SGLangOptions.base_model_dir`), which must be the layers
transformers builds with a router, those the learner replays (`pacerl.agents.models.moe_info`), and checks
that the columns it drops are 0. A model SGLang builds with MoE blocks elsewhere (a Qwen-MoE
checkpoint with dense layers) is an `SGLangLayoutError` before any request asks for routes.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pacerl.agents.engine.protocol import FinishReason
from pacerl.agents.engine.sglang_protocol import SGLangProtocolError, positive_int
from pacerl.agents.models import MOE_ADAPTERS, moe_info

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where configs of MoE families (Qwen-MoE, Mixtral, DeepSeek) keep the experts per layer."""


class SGLangLayoutError(ValueError):
    """The routed experts SGLang returns for this model cannot be mapped onto the trained model's MoE
    layers (see `routed_layers`), or the options contradict the model's config.json: a configuration
    problem, raised to the caller rather than retried as a failed request."""


@dataclass(frozen=True)
class RoutesLayout:
    """The shape of the served model's routed experts."""

    num_layers: int
    """Decoder layers: the columns SGLang sends."""
    top_k: int
    num_experts: int | None
    """Experts per MoE layer (None: routed indices unchecked)."""
    moe_layers: tuple[int, ...]
    """The columns kept, those of the layers with a router."""


def resolve_layout(
    model_path: Any,
    *,
    base_model_dir: str | None,
    num_layers: int | None,
    top_k: int | None,
    num_experts: int | None,
    moe_layers: tuple[int, ...] | None,
) -> RoutesLayout:
    """The layout of the model whose config.json is at the server's `model_path`, else in
    `base_model_dir`, each given `SGLangOptions` value checked against it; without a config.json
    readable here, the given values (`num_layers` and `top_k` required)."""
    given: dict[str, Any] = {
        "num_layers": num_layers,
        "top_k": top_k,
        "num_experts": num_experts,
        "moe_layers": moe_layers,
    }
    directory = _config_dir(model_path, base_model_dir)
    if directory is None:
        if num_layers is None or top_k is None:
            raise SGLangProtocolError(
                "cannot tell the routed experts' layers and top_k: set SGLangOptions.num_layers and "
                f"top_k, or base_model_dir (the server's model_path {model_path!r} has no config.json "
                "readable here)"
            )
        return RoutesLayout(num_layers, top_k, num_experts, moe_layers or tuple(range(num_layers)))
    config = _read_config(directory) or {}
    found_layers = positive_int(config, "num_hidden_layers")
    found_top_k = positive_int(config, "num_experts_per_tok")
    if found_layers is None or found_top_k is None:
        raise SGLangProtocolError(
            f"the config.json in {directory} has no num_hidden_layers / num_experts_per_tok: "
            "set SGLangOptions.num_layers and top_k"
        )
    found = RoutesLayout(
        found_layers, found_top_k, positive_int(config, *_EXPERT_COUNT_KEYS), routed_layers(directory)
    )
    names = {
        "num_layers": "num_hidden_layers",
        "top_k": "num_experts_per_tok",
        "num_experts": "the experts per layer",
        "moe_layers": "the layers routed",
    }
    for option, meaning in names.items():
        value = getattr(found, option)
        if given[option] is not None and value is not None and given[option] != value:
            raise SGLangLayoutError(
                f"SGLangOptions.{option}={given[option]!r}, but the model at {directory} has {meaning} = "
                f"{value!r} (SGLang's routed experts have a column per decoder layer, dense ones "
                "included): leave it unset to take the model's"
            )
    if found.num_experts is None and num_experts is not None:
        found = RoutesLayout(found.num_layers, found.top_k, num_experts, found.moe_layers)
    return found


def decode_routes(
    encoded: Any, rows: int, start: int, finish: FinishReason, layout: RoutesLayout, where: str
) -> np.ndarray | None:
    """An answer's `routed_experts` (`rows` of them from position `start` on) as `[rows, MoE layers,
    top_k]`, the dense layers' columns (which must be 0) dropped; None for a request aborted before
    it ran."""
    if encoded is None:
        if finish is FinishReason.ABORT:
            return None  # aborted before it ran: SGLang captures routes of requests that ran
        raise SGLangProtocolError(
            f"{where} returned no routed_experts although they were asked for: the server needs "
            "--enable-return-routed-experts and a MoE model"
        )
    if not isinstance(encoded, str):
        raise SGLangProtocolError(f"{where}: routed_experts must be a base64 string")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error as error:
        raise SGLangProtocolError(f"{where}: routed_experts is not valid base64: {error}") from None
    expected = rows * layout.num_layers * layout.top_k * 4
    if len(raw) != expected:
        raise SGLangProtocolError(
            f"{where}: routed_experts has {len(raw)} bytes; (prompt + completion - 1 - "
            f"routed_experts_start_len {start} = {rows}) x {layout.num_layers} layers x top_k "
            f"{layout.top_k} x 4 bytes = {expected}"
        )
    shape = (rows, layout.num_layers, layout.top_k)
    every = np.frombuffer(raw, dtype="<i4").astype(np.int32).reshape(shape)
    dense = [layer for layer in range(layout.num_layers) if layer not in layout.moe_layers]
    routed = [layer for layer in dense if every[:, layer].any()]
    if routed:
        raise SGLangProtocolError(
            f"{where}: routed_experts holds nonzero expert ids at layer "
            f"{', '.join(map(str, routed))}, which the model's config makes dense (SGLang leaves the "
            "column of a layer without an MoE block 0): the server does not run this model"
        )
    routes = np.ascontiguousarray(every[:, list(layout.moe_layers)]) if dense else every
    if routes.size and (
        routes.min() < 0 or (layout.num_experts is not None and routes.max() >= layout.num_experts)
    ):
        raise SGLangProtocolError(
            f"{where}: routed expert indices span [{routes.min()}, {routes.max()}], outside "
            f"[0, {layout.num_experts})"
        )
    return routes


def routed_layers(model_dir: str | os.PathLike[str]) -> tuple[int, ...]:
    """The decoder layers whose columns of SGLang 0.5.23's routed experts hold routes, for the model
    whose config.json is in `model_dir`: those SGLang builds with an MoE block (see the module
    docstring). For a family with an R3 adapter they must be the layers transformers builds with a
    router, which the learner replays (`pacerl.agents.models.moe_info`), else `SGLangLayoutError`; a family
    without one: every layer."""
    raw = _read_config(str(model_dir))
    layers = positive_int(raw or {}, "num_hidden_layers")
    if raw is None or layers is None:
        raise SGLangLayoutError(f"{model_dir} has no config.json with num_hidden_layers")
    family = raw.get("model_type")
    if family not in MOE_ADAPTERS:
        return tuple(range(layers))
    config: Any = AutoConfig.from_pretrained(model_dir).get_text_config()
    served = _sglang_moe_layers(config)
    with torch.device("meta"):  # the layers transformers builds, without allocating a weight
        shape = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # untyped there
    trained = moe_info(shape).layers
    if served != trained:
        qwen = (
            "it reads neither mlp_only_layers nor decoder_sparse_step, and loads no weights into the "
            "MoE blocks of the checkpoint's dense layers"
        )
        why = {
            "qwen2_moe": qwen,
            "qwen3_moe": qwen,
            "deepseek_v3": "every moe_layer_freq-th layer from first_k_dense_replace on; transformers "
            "reads no moe_layer_freq",
        }.get(family, "its own layer rule")
        raise SGLangLayoutError(
            f"SGLang 0.5.23 builds layers {list(served)} of this {family} model with an MoE block "
            f"({why}), but the trained model's MoE layers are {list(trained)}: the server does not "
            "run this checkpoint as trained, and its routes cannot be replayed. Generate with the "
            "embedded engine (engine_backend=embedded)"
        )
    return served


def _sglang_moe_layers(config: Any) -> tuple[int, ...]:
    """The layers SGLang 0.5.23 gives an MoE block, by its model classes' rules (module docstring)."""
    layers = range(int(config.num_hidden_layers))
    if config.model_type != "deepseek_v3":
        return tuple(layers)
    # SGLang reads config.moe_layer_freq unguarded: a config without it does not load there at all.
    frequency = int(getattr(config, "moe_layer_freq", 1))
    first_dense = int(config.first_k_dense_replace)
    routed = config.n_routed_experts is not None
    return tuple(layer for layer in layers if routed and layer >= first_dense and layer % frequency == 0)


def _config_dir(model_path: Any, base_model_dir: str | None) -> str | None:
    """The first of the server's model_path and `base_model_dir` with a config.json readable here."""
    for candidate in (model_path, base_model_dir):
        if isinstance(candidate, str) and candidate and (Path(candidate) / "config.json").is_file():
            return candidate
    return None


def _read_config(model_path: Any) -> dict[str, Any] | None:
    if not isinstance(model_path, str) or not model_path:
        return None
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        return None
    text_config = config.get("text_config")
    # Multimodal checkpoints keep the language model's sizes in text_config (SGLang's hf_text_config).
    return {**config, **text_config} if isinstance(text_config, dict) else config
