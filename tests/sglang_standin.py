"""A stand-in for an SGLang 0.5.23 server: SGLang's native HTTP protocol over the embedded engine.

It lets `SGLangEngine` (and any SGLang client) run where SGLang cannot (a CPU, CI). Request and
response shapes, defaults, error bodies and the pause/update semantics follow sglang 0.5.23 (the PyPI
wheel `sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`, tag v0.5.23 of
github.com/sgl-project/sglang), these files of it:

- `python/sglang/srt/entrypoints/http_server.py`: the routes below, their answers, and the error
  bodies: a body that does not parse is HTTP 400 `{"object": "error", "message", "type": "Bad Request",
  "param": null, "code": 400}` (SGLang turns FastAPI's 422 into 400); a `/generate` the processing
  refuses is 400 `{"error": {"message"}}`; `/update_weights_from_disk` answers 400 with
  `success: false`.
- `python/sglang/srt/entrypoints/api_contract.py` and `python/sglang/api/v1/api_types.py`: the JSON
  contract gate of `/generate`, 400 `{"error": "<serde-style text>"}`: unknown `sampling_params` keys
  and wrongly typed values are refused ("unknown field `x`, expected one of ...", "invalid type:
  string \"a\", expected f64").
- `python/sglang/srt/managers/io_struct.py`: `GenerateReqInput`, `UpdateWeightFromDiskReqInput`,
  `AbortReq`, `PauseGenerationReqInput`, `ContinueGenerationReqInput` (field names and defaults).
- `python/sglang/srt/managers/tokenizer_manager.py`: the answer `{"text", "output_ids", "meta_info"}`
  and its meta_info keys; requests wait while paused, then hold a reader lock that a weight update
  (when not paused) takes as writer, so an update waits for running requests and new ones wait for
  it; `pause_generation(mode="abort")` aborts all and returns once none is left; a rid already
  running is refused ("Duplicate request ID detected"); too long a prompt is refused with "The input
  (N tokens) is longer than the model's context length (M tokens)."; `served_model_name` and
  `model_path` move to the loaded path on an update; a request whose client disconnected is aborted.
- `python/sglang/srt/managers/scheduler.py`: `abort_request` matches rids by prefix;
  `routed_experts_start_len` outside `[0, prompt_tokens]` is refused.
- `python/sglang/srt/managers/io_struct.py` (`GenerateReqInput.routed_experts_start_len`: "response
  covers `[routed_experts_start_len, seqlen - 1)`"), `scheduler_components/batch_result_processor.py`
  (`_maybe_collect_routed_experts`) and `state_capturer/base.py` (`BaseTopkCapturer.get_topk`, which
  clamps the start to `seqlen - 1`): only the rows of positions from the start on are returned.
- `python/sglang/srt/managers/schedule_batch.py`: the finish-reason objects.
- `python/sglang/srt/sampling/sampling_params.py`: defaults, temperature < 1e-6 is greedy, top_k -1
  (or 1 << 30) is off, and `verify()`'s messages.
- `python/sglang/srt/utils/weight_versions.py`: `weight_versions` spans.
- `python/sglang/srt/utils/common.py` (`add_api_key_middleware`, the server's `--api-key`): with a
  key, every request but OPTIONS and paths starting `/health` or `/metrics` needs the header
  `Authorization: Bearer <key>`, else HTTP 401 `{"error": "Unauthorized"}`.
- `python/sglang/srt/state_capturer/routed_experts.py`: routed experts `(prompt + completion − 1,
  layers, top_k)` int32, base64, only with the server flag (`enable_return_routed_experts` here).
- Routes of every decoder layer, dense ones zero (`sglang_routed_layers`, `as_sglang_builds`):
  `RoutedExpertsCapturer.__init__` (`state_capturer/routed_experts.py`, lines 63-93 of the wheel) sizes
  the capture buffers by `hf_text_config.num_hidden_layers` and `num_experts_per_tok`; `BaseDeviceCache`
  and `BaseHostCache` (`state_capturer/base.py`, lines 29-42 and 63-75) allocate them zero-filled, and
  `BaseDeviceCache.capture` (lines 48-50) writes the column of the one `layer_id` it is given. Only an
  MoE block's `TopK` calls it (`capture_routed_experts_if_allowed` in `layers/moe/topk.py`, lines
  2529-2545, with the TopK's `layer_id`, the decoder layer's index), and `on_forward_end` (base.py
  lines 190-221) copies whole rows, every layer's column, to the host buffer: a layer without an MoE
  block stays 0 in every answer. Which layers have one: DeepSeek-V3, `DeepseekV2DecoderLayer.
  _is_layer_sparse` (`models/deepseek_v2.py`, lines 2785-2792: `n_routed_experts` set, `layer_id >=
  first_k_dense_replace` and `layer_id % moe_layer_freq == 0`, an attribute a DeepSeek-V3 config.json
  carries and transformers' `DeepseekV3Config` does not define, so a config without it does not load);
  Qwen2-MoE and Qwen3-MoE, every layer (`stage_facts` in `models/qwen2_moe.py` line 1057 and
  `models/qwen3_moe.py` line 877: "all layers are sparse"; `mlp_only_layers` and `decoder_sparse_step`
  are not read), so a checkpoint's dense layer gets an MoE block whose router and experts
  `load_weights` never fills (`qwen2_moe.py` lines 1324-1408 skip names the model lacks, the dense
  MLP's among them); Mixtral, OLMoE, GraniteMoE and gpt-oss, every layer.
- Weights by broadcast: `http_server.py` (`/init_weights_update_group`, `/begin_weight_update`,
  `/update_weights_from_distributed`, `/end_weight_update`, `/destroy_weights_update_group`, each
  answering `{"success", "message"}`, 400 when false; `/server_info` with the resolved server args,
  `tp_size` among them), `io_struct.py` (`InitWeightsUpdateGroupReqInput`,
  `UpdateWeightsFromDistributedReqInput`, `BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`,
  `DestroyWeightsUpdateGroupReqInput`), `managers/tokenizer_control_mixin.py` (an update waits as the
  writer unless paused, like one from disk; `weight_version` is taken on success),
  `managers/scheduler_components/weight_updater.py` (a distributed update only inside a begin/end
  session, else refused before receiving; one session at a time; the messages),
  `model_executor/model_runner_components/weight_updater.py` (join as rank `rank_offset + tp_rank`; per
  name `torch.empty(shape, dtype=getattr(torch, dtype))` received by `broadcast(src=0, async_op=True)`
  in order, then all waited for and loaded; a failure while receiving is "Failed to receive weights:
  ...") and `utils/common.py` (`init_custom_process_group`: a `tcp://` rendezvous whose TCPStore rank 0
  hosts, `PrefixStore(group_name)`, torch's `_new_process_group_helper`, the group's ranks registered
  by hand). `join_weight_group` and `receive_weights` below do the same steps; the stand-in is one
  tensor-parallel worker (`tp_size` 1).

Weight names: SGLang's model classes load the checkpoint layout (`load_weights`, e.g. Qwen3-MoE's
`mlp.experts.<i>.gate_proj.weight` per expert) and skip names they do not know; the stand-in loads that
layout through transformers' own loading, refuses unknown names, and also takes the model's in-memory
names (transformers 5's fused `mlp.experts.gate_up_proj`), which the real server would skip.

Deviations, each refused with HTTP 400 and a message rather than faked: one prompt per request (no
batches), `input_ids` only (no `text`; pacerl never sends it), no streaming, no prompt log-probs
(`logprob_start_len` must be -1 or the prompt length), no top log-probs, no hidden states, grammars,
LoRA, penalties, `min_p`, `min_new_tokens`, `n > 1`, `max_new_tokens` 0; pause mode
"abort" only (SGLang's "retract" and "in_place" need an engine that can stop mid-step); token ids
outside the vocabulary are refused (SGLang would fail inside its kernels). The log-probs are the
embedded engine's: those of the distribution sampled from, which under top-k/top-p truncation are
renormalized, whereas SGLang's are taken before truncation. `/health_generate` answers at once
instead of polling each second. Weights by broadcast: gloo only (the stand-in runs on CPU); `names`,
`dtypes` and `shapes` of different lengths, a dtype torch does not name and a `load_format` are refused
before anything is received (SGLang zips the lists, fails at the bad dtype after posting the earlier
receives, and knows "flattened_bucket"); names and shapes that do not fit the model are refused after
receiving and before any copy, so the old weights stay whole (SGLang loads as far as it gets and says
the weights are partially updated); the session's begin and end do nothing to the weights (SGLang
unpacks and repacks quantized ones there). Dense layers: the MoE blocks SGLang builds in place of a
Qwen-MoE checkpoint's dense layers get a seeded random initialisation (`as_sglang_builds`), where
SGLang's keep whatever memory they were allocated in; a DeepSeek-V3 model whose `moe_layer_freq` is
not 1 (layers transformers builds with a router and SGLang without) is refused, not served.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import math
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import fastapi
import numpy as np
import pydantic
import torch
import torch.distributed as dist
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.models import checkpoint_layout, moe_info

TOP_K_ALL = 1 << 30
"""SGLang's "whole vocabulary" top_k (what -1 becomes)."""
_SAMPLING_EPS = 1e-6
DISCONNECT_POLL_S = 0.5
"""How often a running request's client is checked (SGLang: every `_REQUEST_STATE_WAIT_TIMEOUT`)."""
_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip
"""SGLang's `_FIELDS_SamplingParams`, in its order (the contract gate lists them in its error)."""
_INT_FIELDS = (
    "max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width",
)  # fmt: skip
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
)  # fmt: skip
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
_UNSUPPORTED_AT_DEFAULT: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "stop_regex": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None, "beam_width": None,
    "watermark": None, "choice": None,
}  # fmt: skip
"""Sampling fields the stand-in accepts only at their SGLang default."""


def sglang_routed_layers(config: PretrainedConfig) -> tuple[int, ...]:
    """The decoder layers SGLang 0.5.23 builds with an MoE block for a model of `config`: the columns of
    its routed-experts answers that hold routes (see the module docstring, "Routes of every decoder
    layer"); the other columns stay 0."""
    text = config.get_text_config()
    layers = range(int(text.num_hidden_layers))
    if text.model_type != "deepseek_v3":
        return tuple(layers)  # every layer sparse, whatever the config says of dense layers
    frequency = getattr(text, "moe_layer_freq", None)
    if frequency is None:
        raise ValueError("SGLang 0.5.23 reads moe_layer_freq from a DeepSeek-V3 config, which this one lacks")
    sparse = [
        layer
        for layer in layers
        if text.n_routed_experts is not None
        and layer >= text.first_k_dense_replace
        and layer % frequency == 0
    ]
    return tuple(sparse)


def as_sglang_builds(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """The model SGLang 0.5.23 runs from `model`'s checkpoint: `model` itself, except for a Qwen2-MoE or
    Qwen3-MoE with dense layers (`mlp_only_layers`, `decoder_sparse_step` > 1), which SGLang builds
    sparse throughout, loading what fits the checkpoint's tensors and nothing into the routers and
    experts of the checkpoint's dense layers. Those keep a random initialisation here (seeded by
    `seed`), where SGLang keeps whatever memory they were allocated in."""
    config: Any = model.config
    family = config.model_type
    if family not in ("qwen2_moe", "qwen3_moe") or (
        not config.mlp_only_layers and config.decoder_sparse_step == 1
    ):
        if sglang_routed_layers(config) != moe_info(model).layers:
            raise ValueError(f"the stand-in does not build this {family} model as SGLang 0.5.23 would")
        return model
    sparse = copy.deepcopy(config)
    sparse.mlp_only_layers = []
    sparse.decoder_sparse_step = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        served = AutoModelForCausalLM.from_config(sparse, dtype=torch.float32)  # type: ignore[no-untyped-call]
    wanted = served.state_dict()
    checkpoint = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if name in wanted and wanted[name].shape == tensor.shape
    }
    served.load_state_dict(checkpoint, strict=False)
    served.train(False)
    if not isinstance(served, PreTrainedModel):
        raise TypeError(f"from_config built a {type(served).__name__}")
    return served


class _RefusedError(ValueError):
    """A request SGLang (or this stand-in) refuses: HTTP 400 `{"error": {"message"}}`."""


class _ContractError(ValueError):
    """A `/generate` body the JSON contract gate refuses: HTTP 400 `{"error": "..."}`."""


class GenerateBody(pydantic.BaseModel):
    """The fields of `GenerateReqInput` the stand-in reads; any other key is ignored, as SGLang does
    for fields that keep their defaults. Types are checked by the contract gate."""

    model_config = pydantic.ConfigDict(extra="ignore")

    rid: Any = None
    text: Any = None
    input_ids: Any = None
    input_embeds: Any = None
    sampling_params: Any = None
    return_logprob: Any = None
    logprob_start_len: Any = None
    top_logprobs_num: Any = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: Any = None
    stream: Any = False
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    routed_experts_start_len: Any = 0
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_sampling_mask: Any = None


class UpdateWeightFromDiskBody(pydantic.BaseModel):
    """SGLang's `UpdateWeightFromDiskReqInput`."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None
    rid: str | None = None


class AbortBody(pydantic.BaseModel):
    """SGLang's `AbortReq` (the fields a client sends)."""

    rid: str | None = None
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None


class InitWeightsUpdateGroupBody(pydantic.BaseModel):
    """SGLang's `InitWeightsUpdateGroupReqInput`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedBody(pydantic.BaseModel):
    """SGLang's `UpdateWeightsFromDistributedReqInput`."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False
    rid: str | None = None


class DestroyWeightsUpdateGroupBody(pydantic.BaseModel):
    """SGLang's `DestroyWeightsUpdateGroupReqInput`."""

    group_name: str = "weight_update_group"
    rid: str | None = None


class BeginWeightUpdateBody(pydantic.BaseModel):
    """SGLang's `BeginWeightUpdateReqInput`."""

    selector: Literal["target", "draft", "all"] = "all"
    rid: str | None = None


class EndWeightUpdateBody(pydantic.BaseModel):
    """SGLang's `EndWeightUpdateReqInput`."""

    rid: str | None = None


class PauseBody(pydantic.BaseModel):
    """SGLang's `PauseGenerationReqInput`."""

    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: str | None = None


class ContinueBody(pydantic.BaseModel):
    """SGLang's `ContinueGenerationReqInput`."""

    torch_empty_cache: bool = True
    rid: str | None = None


@dataclass(frozen=True)
class _Job:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    return_logprob: bool
    text_in_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    want_routes: bool
    routes_start: int


class _Server:
    """The stand-in's state: the pause flag and the reader/writer discipline of SGLang's
    TokenizerManager, the rids running, and the weight version names."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        model_path: str,
        weight_version: str,
        routed_experts: bool,
        group_timeout_s: float = 1800.0,
    ) -> None:
        self.engine = engine
        self.model_path = model_path
        self.load_format = "auto"
        self.weight_version = weight_version
        self.names: dict[int, str] = {engine.version: weight_version}
        """The weight_version string of each of the engine's integer versions."""
        self.routed_experts = routed_experts
        self.paused = False
        self.readers = 0
        self.writer = False
        self.running: set[str] = set()
        self.cond = asyncio.Condition()
        self.groups: dict[str, dist.ProcessGroup] = {}
        """Weight groups joined, by name (SGLang's `_model_update_group`)."""
        self.group_timeout_s = group_timeout_s
        self.session_open = False
        """Whether a weight-update session is open (`/begin_weight_update` .. `/end_weight_update`)."""
        self.vocab_size = int(engine.model.config.vocab_size)
        self.num_layers = 0
        """Columns of a routed-experts answer: the model's decoder layers."""
        self.moe_layers: tuple[int, ...] = ()
        """The columns the engine's routes (MoE layers only) fill; the others stay 0."""
        if engine.is_moe:
            self.num_layers = int(engine.model.config.get_text_config().num_hidden_layers)
            self.moe_layers = moe_info(engine.model).layers
            sglang_layers = sglang_routed_layers(engine.model.config)
            if sglang_layers != self.moe_layers:
                raise ValueError(
                    f"SGLang 0.5.23 builds the MoE layers {list(sglang_layers)} of this "
                    f"{engine.model.config.model_type} model, which has them at {list(self.moe_layers)}: "
                    "serve as_sglang_builds(model), the model SGLang runs from its checkpoint"
                )
        eos = engine.model.config.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or [])

    async def run(self, job: _Job) -> Generation:
        """Generate as SGLang schedules a request: after any pause, under the reader lock."""
        async with self.cond:
            await self.cond.wait_for(lambda: not self.paused and not self.writer)
            if job.rid in self.running:
                raise _RefusedError(f"Duplicate request ID detected: {job.rid}")
            self.readers += 1
            self.running.add(job.rid)
        try:
            # No await between registering the rid and the engine queueing it: an abort always finds it.
            return await self.engine.generate(
                job.prompt,
                job.sampling,
                request_id=job.rid,
                return_routed_experts=job.want_routes,
                routed_experts_start_len=job.routes_start if job.want_routes else 0,
            )
        finally:
            async with self.cond:
                self.running.discard(job.rid)
                self.readers -= 1
                self.cond.notify_all()

    async def abort(self, rid: str, abort_all: bool) -> None:
        for running in list(self.running):
            if abort_all or running.startswith(rid):
                await self.engine.abort(running)

    async def pause(self) -> None:
        async with self.cond:
            self.paused = True
            # SGLang repeats abort-all until no request holds the reader lock.
            while self.readers:
                await self.abort("", abort_all=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.cond.wait_for(lambda: not self.readers), 0.05)

    async def resume(self) -> None:
        async with self.cond:
            self.paused = False
            self.cond.notify_all()

    async def update_from_disk(self, body: UpdateWeightFromDiskBody) -> tuple[bool, str]:
        return await self._as_writer(body.abort_all_requests, lambda: self._load(body))

    async def update_from_distributed(self, body: UpdateWeightsFromDistributedBody) -> tuple[bool, str]:
        return await self._as_writer(body.abort_all_requests, lambda: self._receive(body))

    async def _as_writer(
        self, abort_all: bool, update: Callable[[], Awaitable[tuple[bool, str]]]
    ) -> tuple[bool, str]:
        """Run a weight update as SGLang does: after aborting all if asked, and unless paused, as the
        writer, once running requests are done, while new ones wait."""
        if abort_all:
            await self.abort("", abort_all=True)
        async with self.cond:
            exclusive = not self.paused
            if exclusive:
                await self.cond.wait_for(lambda: not self.writer and not self.readers)
                self.writer = True
        try:
            return await update()
        finally:
            if exclusive:
                async with self.cond:
                    self.writer = False
                    self.cond.notify_all()

    async def init_group(self, body: InitWeightsUpdateGroupBody) -> tuple[bool, str]:
        """Join the weight group as rank `rank_offset` (tp_rank 0), blocking until all ranks are in."""
        if body.backend != "gloo":
            return False, (
                f"Failed to initialize custom process group: the pacerl stand-in runs on CPU and joins "
                f"with gloo, not {body.backend!r}."
            )
        try:
            group = await asyncio.to_thread(
                join_weight_group,
                body.master_address,
                body.master_port,
                body.rank_offset,
                body.world_size,
                body.group_name,
                self.group_timeout_s,
            )
        except (RuntimeError, ValueError) as error:
            return False, f"Failed to initialize custom process group: {error}."
        self.groups[body.group_name] = group
        return True, "Succeeded to initialize custom process group."

    async def session(self, begin: bool) -> tuple[bool, str]:
        """Open (`begin`) or close the weight-update session, as the writer unless paused."""

        async def toggle() -> tuple[bool, str]:
            if begin and self.session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            if not begin and not self.session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.session_open = begin
            return True, "Success"

        return await self._as_writer(False, toggle)

    def destroy_group(self, body: DestroyWeightsUpdateGroupBody) -> tuple[bool, str]:
        group = self.groups.pop(body.group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        dist.destroy_process_group(group)
        return True, "Succeeded to destroy custom process group."

    async def _receive(self, body: UpdateWeightsFromDistributedBody) -> tuple[bool, str]:
        if not self.session_open:
            return False, (
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        group = self.groups.get(body.group_name)
        if group is None:
            return False, (
                f"Failed to receive weights: Group {body.group_name} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first."
            )
        if body.load_format is not None:
            return False, f"load_format {body.load_format!r} is not supported by the pacerl stand-in"
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            return False, "names, dtypes and shapes must have one entry per tensor (the pacerl stand-in)"
        for dtype in body.dtypes:
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                return False, f"Failed to receive weights: module 'torch' has no attribute '{dtype}'"
        try:
            received = await asyncio.to_thread(receive_weights, group, body.names, body.dtypes, body.shapes)
        except RuntimeError as error:
            return False, f"Failed to receive weights: {error}"
        tensors = dict(received)
        problems = self._misfits(tensors)
        if problems:
            return False, f"Failed to update parameter online: {'; '.join(problems[:5])}."
        await self._install(tensors, body.weight_version)
        message = "Succeeded to update parameter online."
        if body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return True, message

    def _layout_of(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's own tensors in the naming `tensors` use: the checkpoint's (what SGLang loads:
        one tensor per expert and projection) unless every name is one of the in-memory state dict's
        (a deviation the client tests lean on; SGLang would skip such names)."""
        own = self.engine.model.state_dict()
        return own if set(tensors) <= set(own) else checkpoint_layout(self.engine.model, own)

    def _in_memory(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint-named `tensors` (some or all) as the model's in-memory tensors: loaded the way
        SGLang loads a checkpoint, through the model's own weight loading (transformers' here)."""
        if set(tensors) <= set(self.engine.model.state_dict()):
            return tensors
        from safetensors.torch import save_file

        model = self.engine.model
        merged = {**self._layout_of(tensors), **tensors}
        with tempfile.TemporaryDirectory() as scratch:
            save_file({name: t.contiguous() for name, t in merged.items()}, f"{scratch}/model.safetensors")
            model.config.save_pretrained(scratch)
            loaded = type(model).from_pretrained(scratch, dtype=next(model.parameters()).dtype)
        return {name: t.detach() for name, t in loaded.state_dict().items()}

    def _misfits(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """What keeps `tensors` from loading into the model: unknown names, other shapes."""
        own = self._layout_of(tensors)
        return [f"unknown parameter {name!r}" for name in tensors if name not in own] + [
            f"{name}: shape {tuple(t.shape)} does not match {tuple(own[name].shape)}"
            for name, t in tensors.items()
            if name in own and own[name].shape != t.shape
        ]

    async def _install(self, tensors: dict[str, torch.Tensor], weight_version: str | None) -> None:
        """Copy `tensors` into the model (cast to each parameter's dtype, as SGLang's loaders do) as
        the engine's next version."""
        number = _version_number(weight_version)
        current = self.engine.version
        new = number if number is not None and number > current else current + 1
        await self.engine.update_weights(await asyncio.to_thread(self._in_memory, tensors), new)
        if weight_version is not None:
            self.weight_version = weight_version
        self.names[new] = self.weight_version

    async def _load(self, body: UpdateWeightFromDiskBody) -> tuple[bool, str]:
        load_format = body.load_format or self.load_format
        if load_format not in ("auto", "safetensors"):
            return False, f"Failed to get model loader: the stand-in loads safetensors, not {load_format!r}."
        try:
            tensors = await asyncio.to_thread(read_safetensors, Path(body.model_path))
        except (OSError, ValueError) as error:
            return False, f"Failed to get weights iterator: {error}."
        problems = self._misfits(tensors)
        if problems:
            # Checked before any copy, so a refused checkpoint leaves the old weights whole (as
            # SGLang's rollback does).
            listed = "; ".join(problems[:5])
            return False, f"Failed to update weights: {listed}.\nRolling back to original weights."
        await self._install(tensors, body.weight_version)
        self.model_path = body.model_path
        self.load_format = load_format
        message = "Succeeded to update model weights."
        if body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return True, message

    def answer(self, job: _Job, generation: Generation, latency: float) -> dict[str, Any]:
        """SGLang's `/generate` answer for a finished (or aborted) request."""
        tokens = list(generation.tokens)
        tokenizer = self.engine.tokenizer
        finish = self._finish_json(job, generation)
        meta: dict[str, Any] = {
            "id": job.rid,
            "finish_reason": finish,
            "prompt_tokens": len(job.prompt),
            "weight_version": self.names.get(generation.versions[-1], self.weight_version)
            if tokens
            else self.weight_version,
            "num_retractions": 0,
        }
        distinct = list(dict.fromkeys(generation.versions))
        if len(distinct) > 1:
            spans: list[dict[str, Any]] = []
            for position, version in enumerate(generation.versions):
                if spans and spans[-1]["version"] == self.names[version]:
                    spans[-1]["end"] = position + 1
                else:
                    spans.append({"version": self.names[version], "start": position, "end": position + 1})
            meta["weight_versions"] = spans
        if job.return_logprob:
            texts: list[str | None] = [None] * len(tokens)
            if job.text_in_logprobs and tokenizer is not None:
                texts = [tokenizer.decode([t]) for t in tokens]
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp if math.isfinite(lp) else None, t, text]
                for lp, t, text in zip(generation.logprobs, tokens, texts, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(tokens)
        meta.update({"reasoning_tokens": 0, "completion_tokens": len(tokens), "cached_tokens": 0})
        routes = generation.routed_experts
        if job.want_routes and self.routed_experts and routes is not None:
            # The engine answers the rows of positions [routes_start, prompt + completion - 1) at its
            # MoE layers; SGLang's rows have a column per decoder layer, 0 where there is no router.
            rows = np.zeros((len(routes), self.num_layers, routes.shape[2]), dtype="<i4")
            rows[:, self.moe_layers] = routes
            meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode("ascii")
        meta["e2e_latency"] = latency
        answer: dict[str, Any] = {}
        if tokenizer is not None:  # without a tokenizer SGLang runs skip_tokenizer_init: no text
            answer["text"] = self._text(job, tokens, finish)
        answer["output_ids"] = tokens
        answer["meta_info"] = meta
        return answer

    def _finish_json(self, job: _Job, generation: Generation) -> dict[str, Any]:
        if generation.finish_reason is FinishReason.ABORT:
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        count = len(generation.tokens)
        if generation.finish_reason is FinishReason.LENGTH:
            return {"type": "length", "length": job.max_new_tokens if count == job.max_new_tokens else count}
        last = generation.tokens[-1]
        if (last in self.eos and not job.sampling.ignore_eos) or last in job.sampling.stop_token_ids:
            return {"type": "stop", "matched": last}
        # The same tail the embedded engine decoded when it stopped on a stop string.
        longest = max((len(s) for s in job.sampling.stop_strings), default=0)
        tail = self._decode(list(generation.tokens[-(longest + 8) :]), skip_special_tokens=False)
        matched = next((s for s in job.sampling.stop_strings if tail.endswith(s)), None)
        if matched is None:
            raise RuntimeError(f"the engine stopped {job.rid} on no stop token or string it was given")
        return {"type": "stop", "matched": matched}

    def _text(self, job: _Job, tokens: list[int], finish: dict[str, Any]) -> str:
        matched = finish.get("matched")
        if isinstance(matched, int) and not job.no_stop_trim:
            tokens = tokens[:-1]
        text = self._decode(tokens, skip_special_tokens=job.skip_special_tokens)
        if isinstance(matched, str) and not job.no_stop_trim and text.endswith(matched):
            text = text[: -len(matched)]
        return text

    def _decode(self, tokens: list[int], skip_special_tokens: bool) -> str:
        assert self.engine.tokenizer is not None
        return str(self.engine.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

    def model_info(self) -> dict[str, Any]:
        config = self.engine.model.config
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": self.load_format,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }


def join_weight_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float
) -> dist.ProcessGroup:
    """Join a gloo weight group as SGLang's `init_custom_process_group` does: a `tcp://` rendezvous
    (a TCPStore client of rank 0's store), `PrefixStore(group_name)`, torch's own group helper, and
    the group's ranks registered so that `dist.broadcast(..., group=)` maps rank 0."""
    from torch.distributed.distributed_c10d import Backend, GroupName, _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)  # type: ignore[attr-defined]
    group: dist.ProcessGroup
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend("gloo"),
        store,
        group_name=GroupName(group_name),
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def receive_weights(
    group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[tuple[str, torch.Tensor]]:
    """Receive one broadcast from rank 0 per name, in order, as SGLang's model runner does: all
    posted at once, then waited for."""
    received, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(dist.broadcast(tensor, src=0, group=group, async_op=True))
        received.append((name, tensor))
    for handle in handles:
        assert handle is not None
        handle.wait()
    return received


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in `directory` (its index file decides the shards)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not directory.is_dir():
        raise ValueError(f"{str(directory)!r} is not a directory")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(directory)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except SafetensorError as error:
            raise ValueError(f"{file.name}: {error}") from None
    return tensors


def _version_number(name: str | None) -> int | None:
    if name is not None and name.strip().lstrip("-").isdecimal():
        return int(name)
    return None


# -- parsing /generate ------------------------------------------------------------------------------


def _unexpected(value: Any) -> str:
    """serde's rendering of an unexpected value, as SGLang's contract gate writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    return "map" if isinstance(value, dict) else type(value).__name__


def _expect(value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise _ContractError(f"invalid type: {_unexpected(value)}, expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_strings(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _check_contract(raw: dict[str, Any]) -> None:
    """The part of SGLang's `GenerateRequest` contract the stand-in's fields touch."""
    for key in ("stream", "return_text_in_logprobs"):
        if raw.get(key) is not None:
            _expect(raw[key], isinstance(raw[key], bool), "a boolean")
    for key in ("rid", "text"):
        value = raw.get(key)
        if value is not None:
            _expect(value, _is_strings(value), "a string or a list of strings")
    ids = raw.get("input_ids")
    if ids is not None:
        flat = isinstance(ids, list) and all(_is_int(v) for v in ids)
        nested = isinstance(ids, list) and all(isinstance(r, list) and all(map(_is_int, r)) for r in ids)
        _expect(ids, flat or nested, "token ids or a list of token ids")
    for key in ("logprob_start_len", "top_logprobs_num"):
        if raw.get(key) is not None:
            _expect(raw[key], _is_int(raw[key]), "i64")
    if "routed_experts_start_len" in raw:
        _expect(raw["routed_experts_start_len"], _is_int(raw["routed_experts_start_len"]), "i64")
    if raw.get("return_logprob") is not None:
        _expect(raw["return_logprob"], isinstance(raw["return_logprob"], bool | list), "a boolean")
    params = raw.get("sampling_params")
    if params is None or isinstance(params, list):
        return
    _expect(params, isinstance(params, dict), "struct SamplingParams")
    for key, value in params.items():
        if key not in _SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in _SAMPLING_FIELDS)
            raise _ContractError(f"unknown field `{key}`, expected one of {listed}")
        if value is None:
            continue
        if key in _INT_FIELDS:
            _expect(value, _is_int(value), "i64")
        elif key in _FLOAT_FIELDS:
            _expect(value, _is_int(value) or isinstance(value, float), "f64")
        elif key in _BOOL_FIELDS:
            _expect(value, isinstance(value, bool), "a boolean")
        elif key in _STR_FIELDS:
            _expect(value, isinstance(value, str), "a string")
        elif key == "stop":
            _expect(value, _is_strings(value), "a string or a list of strings")
        elif key == "stop_token_ids":
            _expect(value, isinstance(value, list) and all(_is_int(v) for v in value), "a sequence of i64")


def _sampling(params: dict[str, Any], vocab_size: int) -> tuple[SamplingParams, dict[str, Any]]:
    """SGLang's SamplingParams defaults and `verify()`, mapped onto the embedded engine's."""
    for key, default in _UNSUPPORTED_AT_DEFAULT.items():
        if params.get(key) not in (None, default):
            raise _RefusedError(f"sampling parameter {key}={params[key]!r} is not supported by the stand-in")

    def get(key: str, default: Any) -> Any:
        value = params.get(key)
        return default if value is None else value

    max_new_tokens = get("max_new_tokens", 128)
    temperature = float(get("temperature", 1.0))
    top_p = float(get("top_p", 1.0))
    top_k = get("top_k", TOP_K_ALL)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise _RefusedError(f"temperature must be a non-negative finite number, got {temperature}.")
    if 0 <= temperature < _SAMPLING_EPS:
        temperature, top_k = 0.0, 1  # SGLang: greedy is top_k = 1
    top_k = TOP_K_ALL if top_k == -1 else top_k
    if not 0.0 < top_p <= 1.0:
        raise _RefusedError(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 1:
        raise _RefusedError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new_tokens < 0:
        raise _RefusedError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    if max_new_tokens == 0:
        raise _RefusedError("max_new_tokens=0 is not supported by the pacerl stand-in")
    seed = params.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise _RefusedError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    stop = get("stop", [])
    stop = [stop] if isinstance(stop, str) else list(stop)
    if len(stop) > 32:
        raise _RefusedError(f"at most 32 stop strings are allowed, got {len(stop)}")
    stop_ids = sorted({int(t) for t in get("stop_token_ids", [])})
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise _RefusedError(f"stop_token_ids must lie in [0, {vocab_size}), got {stop_ids}")
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if temperature == 0 or top_k >= vocab_size else top_k,
        stop_token_ids=tuple(stop_ids),
        stop_strings=tuple(s for s in stop if s),
        seed=seed,
        ignore_eos=bool(get("ignore_eos", False)),
    )
    text_options = {
        "skip_special_tokens": get("skip_special_tokens", True),
        "no_stop_trim": get("no_stop_trim", False),
    }
    return sampling, text_options


def _job(body: GenerateBody, server: _Server) -> _Job:
    """Validate one `/generate` request as SGLang does (after the contract gate)."""
    unsupported = {
        "input_embeds": body.input_embeds,
        "image_data": body.image_data,
        "video_data": body.video_data,
        "audio_data": body.audio_data,
        "lora_path": body.lora_path,
        "session_params": body.session_params,
        "custom_logit_processor": body.custom_logit_processor,
        "token_ids_logprob": body.token_ids_logprob,
        "return_sampling_mask": body.return_sampling_mask,
        "return_hidden_states": body.return_hidden_states,
        "top_logprobs_num": body.top_logprobs_num,
        "stream": body.stream,
    }
    for name, value in unsupported.items():
        if value:
            raise _RefusedError(f"{name} is not supported by the pacerl stand-in")
    if (body.text is None) == (body.input_ids is None):
        raise _RefusedError("Either text, input_ids or input_embeds should be provided.")
    if body.text is not None:
        raise _RefusedError("the pacerl stand-in takes input_ids, not text")
    if isinstance(body.rid, list) or (body.input_ids and isinstance(body.input_ids[0], list)):
        raise _RefusedError("the pacerl stand-in serves one prompt per request, not a batch")
    if isinstance(body.sampling_params, list) or isinstance(body.return_logprob, list):
        raise _RefusedError("the pacerl stand-in serves one prompt per request, not a batch")
    prompt: list[int] = body.input_ids
    if not prompt:
        raise _RefusedError("input_ids is empty")
    for token in prompt:
        if not 0 <= token < server.vocab_size:
            raise _RefusedError(f"Token ID {token} is out of vocabulary (vocab size: {server.vocab_size})")
    context = server.engine.max_context
    if len(prompt) >= context:
        raise _RefusedError(
            f"The input ({len(prompt)} tokens) is longer than the model's context length ({context} tokens)."
        )
    sampling, text_options = _sampling(body.sampling_params or {}, server.vocab_size)
    if sampling.stop_strings and server.engine.tokenizer is None:
        raise _RefusedError("stop strings need a tokenizer; this stand-in's engine has none")
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    if start not in (-1, len(prompt)):
        raise _RefusedError(
            "Prompt input logprobs (logprob_start_len) are not supported by the pacerl stand-in; "
            "omit logprob_start_len to get output logprobs."
        )
    routes_start = body.routed_experts_start_len
    if body.return_routed_experts and routes_start < 0:
        raise _RefusedError(
            f"recv_req.routed_experts_start_len={routes_start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if body.return_routed_experts and routes_start > len(prompt):
        raise _RefusedError(
            f"recv_req.routed_experts_start_len={routes_start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller routed_experts_start_len."
        )
    return _Job(
        rid=body.rid if body.rid else uuid.uuid4().hex,
        prompt=prompt,
        sampling=sampling,
        max_new_tokens=sampling.max_new_tokens,
        return_logprob=bool(body.return_logprob),
        text_in_logprobs=bool(body.return_text_in_logprobs),
        skip_special_tokens=bool(text_options["skip_special_tokens"]),
        no_stop_trim=bool(text_options["no_stop_trim"]),
        want_routes=body.return_routed_experts,
        routes_start=routes_start,
    )


async def _abort_when_disconnected(request: fastapi.Request, server: _Server, rid: str) -> None:
    """SGLang checks a waiting non-streaming request's client every few seconds and aborts the
    request once it has gone; here every `DISCONNECT_POLL_S`."""
    # Starlette only answers "disconnected?" when asked; there is no event to wait on.
    while True:
        if await request.is_disconnected():
            await server.abort(rid, abort_all=False)
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def _refusal(error: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": str(error)}}, status_code=400)


def create_standin_app(
    engine: EmbeddedEngine,
    *,
    model_path: str = "pacerl-standin",
    weight_version: str = "default",
    enable_return_routed_experts: bool = True,
    health_timeout_s: float = 20.0,
    close_on_shutdown: bool = True,
    api_key: str | None = None,
    weight_group_timeout_s: float = 1800.0,
) -> fastapi.FastAPI:
    """The stand-in's ASGI app over `engine`, which it drives from the app's event loop.

    `model_path` is what `/model_info` reports until a weight update moves it (a directory with the
    model's config.json lets a client read the routed-experts layout from it); `weight_version` is
    SGLang's `--weight-version`; `enable_return_routed_experts` its `--enable-return-routed-experts`
    (without it, routed experts are left out of answers however a request asks, as SGLang does);
    `api_key` its `--api-key`; `weight_group_timeout_s` bounds the weight group's joining and each
    broadcast (SGLang: torch's default of 30 minutes).
    """
    server = _Server(engine, model_path, weight_version, enable_return_routed_experts, weight_group_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_on_shutdown:
                await engine.aclose()

    app = fastapi.FastAPI(
        title="pacerl SGLang stand-in",
        summary="SGLang 0.5.23's native HTTP API over pacerl's embedded engine",
        description=__doc__,
        lifespan=lifespan,
    )

    if api_key is not None:

        @app.middleware("http")
        async def authentication(request: fastapi.Request, call_next: Any) -> Response:
            path = request.url.path
            exempt = request.method == "OPTIONS" or path.startswith(("/health", "/metrics"))
            if not exempt and request.headers.get("Authorization") != "Bearer " + api_key:
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            response: Response = await call_next(request)
            return response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: fastapi.Request, error: RequestValidationError) -> JSONResponse:
        # SGLang's handler: FastAPI's 422 becomes 400 in its ErrorResponse shape.
        errors = [{k: v for k, v in e.items() if k != "input"} for e in error.errors()]
        message = f"{error} {errors}" if str(errors) != str(error) else str(error)
        content = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        return JSONResponse(content, status_code=400)

    @app.api_route("/generate", methods=["POST", "PUT"], tags=["generate"])
    async def generate(body: GenerateBody, request: fastapi.Request) -> Response:
        """One generation (see the module docstring for what the stand-in serves)."""
        try:
            _check_contract(await request.json())
        except _ContractError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        started = time.monotonic()
        try:
            job = _job(body, server)
        except _RefusedError as error:
            return _refusal(error)
        watch = asyncio.ensure_future(_abort_when_disconnected(request, server, job.rid))
        try:
            generation = await server.run(job)
        except _RefusedError as error:
            return _refusal(error)
        finally:
            watch.cancel()
        return JSONResponse(server.answer(job, generation, time.monotonic() - started))

    @app.post("/abort_request", tags=["control"])
    async def abort_request(body: AbortBody) -> Response:
        """Abort the requests whose rid starts with `rid` (or all); 200 with no body."""
        rid = body.rid or ""
        if rid or body.abort_all:  # SGLang ignores an empty rid without abort_all
            await server.abort(rid, body.abort_all)
        return Response(status_code=200)

    @app.post("/pause_generation", tags=["control"])
    async def pause_generation(body: PauseBody) -> JSONResponse:
        """Mode "abort": abort every request, hold new ones until `/continue_generation`."""
        if body.mode != "abort":
            return _refusal(ValueError(f"pause mode {body.mode!r} is not supported by the pacerl stand-in"))
        await server.pause()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation", tags=["control"])
    async def continue_generation(body: ContinueBody) -> JSONResponse:
        """Let held and new requests run."""
        await server.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/update_weights_from_disk", tags=["weights"])
    async def update_weights_from_disk(body: UpdateWeightFromDiskBody) -> JSONResponse:
        """Load a safetensors checkpoint directory into the engine as its next version."""
        success, message = await server.update_from_disk(body)
        content = {"success": success, "message": message, "num_paused_requests": 0}
        return JSONResponse(content, status_code=200 if success else 400)

    @app.post("/init_weights_update_group", tags=["weights"])
    async def init_weights_update_group(body: InitWeightsUpdateGroupBody) -> JSONResponse:
        """Join the trainer's weight group (rank 0 is the trainer); answers once all ranks joined."""
        success, message = await server.init_group(body)
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/update_weights_from_distributed", tags=["weights"])
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody) -> JSONResponse:
        """Receive the named tensors by broadcast from rank 0, in order, and load them."""
        success, message = await server.update_from_distributed(body)
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/begin_weight_update", tags=["weights"])
    async def begin_weight_update(body: BeginWeightUpdateBody) -> JSONResponse:
        """Open the weight-update session a distributed update needs."""
        success, message = await server.session(begin=True)
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/end_weight_update", tags=["weights"])
    async def end_weight_update(body: EndWeightUpdateBody) -> JSONResponse:
        """Close the weight-update session."""
        success, message = await server.session(begin=False)
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/destroy_weights_update_group", tags=["weights"])
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupBody) -> JSONResponse:
        """Leave a weight group."""
        success, message = server.destroy_group(body)
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.get("/server_info", tags=["info"])
    async def server_info() -> dict[str, Any]:
        """The part of SGLang's server args and scheduler info a client reads."""
        return {
            "model_path": server.model_path,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "enable_return_routed_experts": server.routed_experts,
            "weight_version": server.weight_version,
            "version": "0.5.23",
        }

    @app.get("/health", tags=["health"])
    async def health() -> Response:
        """Liveness without generating (SGLang's default `/health`)."""
        return Response(status_code=200 if await engine.health() else 503)

    @app.get("/health_generate", tags=["health"])
    async def health_generate() -> Response:
        """200 once the engine generates one token (through pause and locks, as SGLang's check)."""
        if not await engine.health():
            return Response(status_code=503)
        probe = _Job(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt=[0], sampling=SamplingParams(1, temperature=0),
            max_new_tokens=1, return_logprob=False, text_in_logprobs=False, skip_special_tokens=True,
            no_stop_trim=False, want_routes=False, routes_start=0,
        )  # fmt: skip
        try:
            async with asyncio.timeout(health_timeout_s):
                await server.run(probe)
        except (TimeoutError, RuntimeError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info", tags=["info"])
    async def model_info() -> dict[str, Any]:
        """What SGLang's `/model_info` reports."""
        return server.model_info()

    @app.get("/get_model_info", tags=["info"])
    async def get_model_info() -> dict[str, Any]:
        """The deprecated alias of `/model_info`."""
        return server.model_info()

    return app
