"""The SGLang engine: the Engine protocol over an SGLang server's native HTTP API, and its launch line.

Written against sglang 0.5.23, the version pyproject's `sglang` extra pins (the PyPI wheel
`sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`, tag v0.5.23 of github.com/sgl-project/sglang),
from these files of it:

- `python/sglang/srt/entrypoints/http_server.py`: the routes (`POST /generate`, `POST /abort_request`
  answering 200 with no body, `POST /pause_generation` and `/continue_generation` answering
  `{"message", "status": "ok"}`, `POST /update_weights_from_disk` answering `{"success", "message",
  "num_paused_requests"}` with HTTP 400 when `success` is false, `GET /health_generate` answering 200
  or 503 after generating one token, `GET /model_info` with `/get_model_info` its deprecated alias),
  and the error bodies: 400 `{"error": {"message"}}` for a refused generation, 400 `{"object": "error",
  "message", ...}` for a body that does not parse, 400 `{"error": "..."}` from the JSON contract gate.
- `python/sglang/srt/managers/io_struct.py`: `GenerateReqInput` (`input_ids`, `sampling_params`, `rid`,
  `return_logprob`, `logprob_start_len` (-1: no prompt log-probs), `return_routed_experts`),
  `UpdateWeightFromDiskReqInput` (`model_path`, `load_format`, `abort_all_requests`, `weight_version`),
  `AbortReq` (`rid`, `abort_all`), `PauseGenerationReqInput` (`mode`: abort | retract | in_place).
- `python/sglang/srt/managers/tokenizer_manager.py`: the answer `{"text", "output_ids", "meta_info"}`
  whose `meta_info` holds `id`, `finish_reason`, `prompt_tokens`, `completion_tokens`,
  `weight_version`, `output_token_logprobs` (`[logprob, token_id, text-or-None]` per generated token)
  and `routed_experts`; `pause_generation(mode="abort")` aborts every request, waits until none is
  left, and holds new ones until `continue_generation`; a request aborted while running comes back
  normally (HTTP 200) with its partial output and `finish_reason.type == "abort"`; `abort_request`
  aborts every request whose rid *starts with* the given one.
- `python/sglang/srt/managers/schedule_batch.py`: finish reasons `{"type": "stop", "matched": id or
  text}`, `{"type": "length", "length"}`, `{"type": "abort", "message", "status_code", "err_type"}`.
- `python/sglang/srt/sampling/sampling_params.py`: `top_k=-1` turns top-k off (0 is an error),
  temperature below 1e-6 is greedy, at most 32 stop strings, `sampling_seed`, `no_stop_trim`.
- `python/sglang/srt/layers/sampler.py`: the returned log-probs are `log_softmax(logits / T)` *before*
  top-k/top-p truncation (greedy: `log_softmax(logits)`), so they are the behaviour log-probs only
  while no truncation is on (see `SGLangOptions.allow_untruncated_logprobs`).
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
- `python/sglang/srt/utils/weight_versions.py`: `meta_info["weight_versions"]` spans
  `{"version", "start", "end"}` over the output tokens when the weights changed mid-request.
- `python/sglang/srt/arg_groups/fields/exec_.py` and `.../serving.py`: `--enable-return-routed-experts`,
  `--weight-version` (default "default"), `--host`, `--port`; `--model-path` in `.../model.py`.

Versions. A token's version is the server's `weight_version` (its spans when present) whenever that
is an integer, which it always is for a server launched by `launch_command` (`--weight-version`) and
updated by this client (`weight_version` is sent with every update); otherwise it is this client's
version when the request was sent. Requests wait while this client updates weights, so both agree.

MoE layers only. A `Generation`'s routes have the embedded engine's shape, `[rows, MoE layers,
top_k]`: the client keeps the columns of the layers `routed_layers` finds in the model's config.json
(read at the server's model_path, else in `SGLangOptions.base_model_dir`), which must be the layers
transformers builds with a router, those the learner replays (`agents.models.moe_info`), and checks
that the columns it drops are 0. A model SGLang builds with MoE blocks elsewhere (a Qwen-MoE
checkpoint with dense layers) is an `SGLangLayoutError` before any request asks for routes.

Routes of new positions only. A caller that holds the rows of the first positions of its sequence
(an earlier turn, or a generation interrupted by a weight update and now resumed) passes their count
as `routed_experts_start_len`; the client sends it as SGLang's field of that name, and the answer's
rows start there (`Generation.routed_experts_start`), instead of repeating the whole prompt's rows on
every turn.

Weight updates go through disk by default: a state_dict is written as safetensors (plus the base
model's config files) into `SGLangOptions.weights_dir`, then generation is paused with mode "abort" (or,
on a server without `/pause_generation`, every request is aborted by the update itself), the server
loads the directory, and generation continues. Each in-flight request comes back `FinishReason.ABORT`
with the tokens it had; the rollout driver resumes it from those tokens as a new segment under the new
version.

With `weight_transport="distributed"` the tensors go by torch.distributed broadcast instead (SGLang's
path for GPU clusters; `agents.engine.weight_group` cites the server's side): once, this client hosts
a rendezvous store, asks the server to join a group through it (`POST /init_weights_update_group`,
the server's tensor-parallel workers taking ranks 1..tp_size) and forms the group as rank 0; then each
publication pauses generation as above, opens a weight-update session (`POST /begin_weight_update`,
which sglang 0.5.23 requires around distributed updates), announces names, dtypes and shapes
(`POST /update_weights_from_distributed`) while broadcasting the tensors in that order, closes the
session (`POST /end_weight_update`) and continues.
The group is never torch.distributed's default one. A publication whose broadcast broke off (a dead
server, a timeout) discards the group; the next publication forms a new one under a new name.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agents.engine.protocol import ContextOverflowError, FinishReason, Generation, SamplingParams
from agents.engine.weight_group import GroupBackend, WeightBroadcastGroup, describe
from agents.models import MOE_ADAPTERS, WeightLayout, moe_info

_T = TypeVar("_T")
_log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 32
"""SGLang's `MAX_STOP_COUNT`: more stop strings are refused by the server."""

_RETRY_STATUS = frozenset({500, 502, 503, 504})
_OVERFLOW = re.compile(r"longer than the model's context length|exceeds the model's maximum context length")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_CHECKPOINT = re.compile(r"version-(\d+)")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where configs of MoE families (Qwen-MoE, Mixtral, DeepSeek) keep the experts per layer."""


class SGLangError(RuntimeError):
    """A failure talking to an SGLang server."""


class SGLangUnavailable(SGLangError):  # noqa: N818 (the name the rollout side catches)
    """The server could not be reached, or gave no answer in time, after the allowed retries."""


class SGLangRequestError(SGLangError):
    """The server refused a request (HTTP 4xx, or a weight update it reported as failed)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class SGLangProtocolError(SGLangError):
    """The server's answer is not what SGLang 0.5.23 sends (or lacks something pacerl asked for)."""


class SGLangLayoutError(ValueError):
    """The routed experts SGLang returns for this model cannot be mapped onto the trained model's MoE
    layers (see `routed_layers`), or the options contradict the model's config.json: a configuration
    problem, raised to the caller rather than retried as a failed request."""


@dataclass(frozen=True)
class SGLangOptions:
    """How to reach one SGLang server and publish weights to it."""

    url: str = "http://127.0.0.1:30000"
    """Base URL of the server (`http(s)://host:port`)."""
    connect_timeout_s: float = 5.0
    """Seconds to open a connection before the attempt counts as failed."""
    generate_timeout_s: float = 3600.0
    """Seconds one `/generate` may take (a long generation in a busy server's queue included)."""
    control_timeout_s: float = 60.0
    """Seconds for `/abort_request`, `/pause_generation` (which waits for aborted requests to
    drain), `/continue_generation` and `/model_info`."""
    update_timeout_s: float = 1800.0
    """Seconds for `/update_weights_from_disk` (reading a checkpoint from disk)."""
    health_timeout_s: float = 30.0
    """Seconds `health()` waits; SGLang's own check may take up to 20 s before it answers 503."""
    retries: int = 2
    """Further attempts after a connection failure (any call) or an HTTP 5xx / dropped connection
    (calls that are safe to repeat: abort, pause, continue, model info)."""
    backoff_s: float = 0.2
    """Wait before the first retry; it doubles for each further retry."""
    max_connections: int = 1024
    """HTTP connections open at once; more requests wait for a free one."""
    weights_dir: str | None = None
    """Where `update_weights` writes a state_dict for the server to load, one `version-N` directory
    per version. Must be readable by the server under the same path. Required to publish a state_dict."""
    base_model_dir: str | None = None
    """The base checkpoint whose non-weight files (config.json, tokenizer files, ...) are copied
    next to each published state_dict, so every version directory is a complete checkpoint."""
    keep_checkpoints: int = 1
    """Version directories kept in `weights_dir` after a successful update (the loaded one included)."""
    max_shard_bytes: int = 5 * 2**30
    """Largest safetensors file written; a bigger state_dict is sharded with an index file."""
    num_layers: int | None = None
    """Decoder layers of the served model (its `num_hidden_layers`): SGLang's routed-experts array has
    a column for each, dense layers included. None: from the model's config.json, read at the server's
    `model_path` (from `/model_info`) when this machine has it, else in `base_model_dir`; when one is
    readable, every value given here must agree with it."""
    top_k: int | None = None
    """Experts per token in the routed-experts array (`num_experts_per_tok`); None: from config.json."""
    num_experts: int | None = None
    """Experts per MoE layer, to check every routed index; None: from config.json, else unchecked."""
    moe_layers: tuple[int, ...] | None = None
    """The decoder layers with a router, whose columns of the routed-experts array are kept (the
    trained model's MoE layers, `agents.models.moe_info(model).layers`; the other columns must be 0).
    None: from config.json (`routed_layers`), else every layer."""
    allow_untruncated_logprobs: bool = False
    """SGLang returns log-probs before top-k/top-p truncation, not those of the distribution sampled
    from; requests with truncation are refused unless this accepts those log-probs."""
    api_key_env: str | None = None
    """Name of the environment variable holding the server's API key (SGLang's `--api-key`), sent
    with every request as `Authorization: Bearer <key>`; None: no key. Named but unset is an error
    when the client is built. The name, not the key, so that a saved config holds no secret."""
    weight_transport: Literal["disk", "distributed"] = "disk"
    """How a published state_dict reaches the server: "disk", safetensors under `weights_dir` that
    the server loads (`/update_weights_from_disk`); "distributed", a torch.distributed broadcast from
    this process, which the server receives through a group it joins (`/init_weights_update_group`,
    `/update_weights_from_distributed`; see the module docstring). A checkpoint directory given
    instead of a state_dict always goes through disk."""
    weight_group_backend: Literal["gloo", "nccl"] | None = None
    """The distributed transport's torch.distributed backend: nccl between GPUs, gloo over TCP (CPU
    tensors); None: nccl when this process sees a CUDA device, else gloo."""
    weight_group_address: str | None = None
    """This machine's address as the server reaches it: the distributed transport's rendezvous store
    listens here and the server is told to connect to it; None: the local address of the route to
    the server's host."""
    weight_group_port: int = 0
    """Port of that rendezvous store; 0 picks a free one."""
    weight_group_ranks: int | None = None
    """Server ranks that join the group (SGLang's `--tp-size`: one per tensor-parallel worker);
    None: `tp_size` from the server's `/server_info`."""
    weight_group_timeout_s: float = 600.0
    """Seconds the distributed transport waits for the server to join the group, and for each
    tensor's broadcast to complete: the bound on a broadcast to a server that stopped receiving."""

    def __post_init__(self) -> None:
        try:
            parsed = httpx.URL(self.url)
        except httpx.InvalidURL as error:
            raise ValueError(f"SGLangOptions.url={self.url!r} is not a URL: {error}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"SGLangOptions.url must be http(s)://host[:port], got {self.url!r}")
        checks = [
            ("connect_timeout_s", 0 < self.connect_timeout_s <= 600),
            ("generate_timeout_s", 0 < self.generate_timeout_s <= 7 * 86400),
            ("control_timeout_s", 0 < self.control_timeout_s <= 86400),
            ("update_timeout_s", 0 < self.update_timeout_s <= 86400),
            ("health_timeout_s", 0 < self.health_timeout_s <= 3600),
            ("retries", 0 <= self.retries <= 100),
            ("backoff_s", 0 <= self.backoff_s <= 600),
            ("max_connections", 1 <= self.max_connections <= 100_000),
            ("keep_checkpoints", 1 <= self.keep_checkpoints <= 1000),
            ("max_shard_bytes", self.max_shard_bytes >= 1),
            ("weight_group_port", 0 <= self.weight_group_port <= 65535),
            ("weight_group_timeout_s", 0 < self.weight_group_timeout_s <= 86400),
        ]
        for name, ok in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not ok or not math.isfinite(value):
                raise ValueError(f"SGLangOptions.{name}={value!r} is out of range")
        for name in ("num_layers", "top_k", "num_experts", "weight_group_ranks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"SGLangOptions.{name} must be None or an int >= 1, got {value!r}")
        if self.moe_layers is not None:
            layers = self.moe_layers
            valid = all(isinstance(layer, int) and not isinstance(layer, bool) for layer in layers)
            if not layers or not valid or layers[0] < 0 or any(b <= a for a, b in itertools.pairwise(layers)):
                raise ValueError(
                    f"SGLangOptions.moe_layers must be None or ascending layer indices >= 0, got {layers!r}"
                )
            if self.num_layers is not None and layers[-1] >= self.num_layers:
                raise ValueError(
                    f"SGLangOptions.moe_layers {layers!r} name a layer beyond num_layers={self.num_layers}"
                )
        if self.weight_transport not in ("disk", "distributed"):
            raise ValueError(
                f"SGLangOptions.weight_transport must be disk or distributed, got {self.weight_transport!r}"
            )
        if self.weight_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                "SGLangOptions.weight_group_backend must be None, gloo or nccl, "
                f"got {self.weight_group_backend!r}"
            )
        if self.weight_group_address is not None and not self.weight_group_address.strip():
            raise ValueError("SGLangOptions.weight_group_address must be None or a host name or address")


@dataclass(frozen=True)
class _Layout:
    num_layers: int
    top_k: int
    num_experts: int | None
    moe_layers: tuple[int, ...]


class SGLangEngine:
    """An SGLang server behind the Engine protocol (see the module docstring)."""

    def __init__(
        self, options: SGLangOptions | None = None, version: int = 0, *, layout: WeightLayout | None = None
    ) -> None:
        self.options = options or SGLangOptions()
        self.layout = layout
        """Renames a published state dict into the layout the server loads (`agents.models.layout_of`:
        a checkpoint's, not transformers' fused in-memory experts); None publishes names as given."""
        self._base = self.options.url.rstrip("/")
        self._version = version
        self._client: httpx.AsyncClient | None = None
        self._updating = asyncio.Lock()
        self._no_update = asyncio.Event()
        self._no_update.set()
        self._layout: _Layout | None = None
        self._group: WeightBroadcastGroup | None = None
        self._closed = False
        self._headers: dict[str, str] = {}
        key_env = self.options.api_key_env
        if key_env:
            key = os.environ.get(key_env, "")
            if not key:
                raise ValueError(f"SGLangOptions.api_key_env names {key_env!r}, but that variable is unset")
            self._headers["Authorization"] = f"Bearer {key}"

    @property
    def version(self) -> int:
        """The version of the weights this client last loaded into the server."""
        return self._version

    # -- the protocol --------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        session: str | None = None,
    ) -> Generation:
        """Generate from `input_ids` on the server. An abort (by `abort` or a weight update) returns
        the tokens generated so far with `FinishReason.ABORT`. With `return_routed_experts`, the
        routes of input positions `routed_experts_start_len` (in `[0, len(input_ids)]`) onward (see
        the module docstring). `session` is for routers over several servers (one server's radix
        cache finds the shared prefix by itself)."""
        self._check_open()
        prompt = _prompt(input_ids)
        start = routed_experts_start_len
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(prompt):
            raise ValueError(
                f"routed_experts_start_len must be an int in [0, {len(prompt)}] (the prompt's length), "
                f"got {start!r}"
            )
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        body = {
            "rid": rid,
            "input_ids": prompt,
            "sampling_params": self._sampling_params(sampling),
            "return_logprob": True,
            "logprob_start_len": -1,
            "return_routed_experts": bool(return_routed_experts),
            "stream": False,
        }
        if return_routed_experts and start:
            body["routed_experts_start_len"] = start
        if return_routed_experts:
            await self._routes_layout()  # a model whose routes cannot be mapped fails before generating
        await self._no_update.wait()
        sent_version = self._version
        response = await self._request(
            "POST", "/generate", body, self.options.generate_timeout_s, repeatable=False
        )
        if response.status_code != 200:
            message = _error_text(response)
            if response.status_code == 400 and _OVERFLOW.search(message):
                raise ContextOverflowError(message)
            raise self._refused("/generate", response)
        answer = _json(response, self._base + "/generate")
        routes_from = start if return_routed_experts else 0
        return await self._generation(answer, len(prompt), sent_version, return_routed_experts, routes_from)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its `generate` returns what it had with `FinishReason.ABORT`.

        SGLang aborts every request whose id starts with `request_id`; ids made by this client are
        uuid4 hex strings of one length, so none is a prefix of another."""
        self._check_open()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        response = await self._request(
            "POST", "/abort_request", {"rid": request_id}, self.options.control_timeout_s, repeatable=True
        )
        if response.status_code != 200:
            raise self._refused("/abort_request", response)

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | str | os.PathLike[str], version: int
    ) -> None:
        """Make `version` current: write `state_dict` under `weights_dir` (or take a directory that
        already holds a safetensors checkpoint), pause the server (aborting in-flight requests), load
        it, continue. The version changes only when the server reports success. With
        `weight_transport="distributed"` a state_dict goes by `update_weights_distributed` instead."""
        if not isinstance(state_dict, str | os.PathLike) and self.layout is not None:
            state_dict = await asyncio.to_thread(self.layout, state_dict)
        if self.options.weight_transport == "distributed" and not isinstance(state_dict, str | os.PathLike):
            await self.update_weights_distributed(state_dict, version)
            return
        self._check_open()
        _check_version_type(version)
        async with self._updating:
            self._check_version(version)
            if isinstance(state_dict, str | os.PathLike):
                # Absolute: the server resolves paths against its own working directory.
                path, written = await asyncio.to_thread(os.path.abspath, os.fspath(state_dict)), False
            else:
                path, written = await asyncio.to_thread(self._write_checkpoint, state_dict, version), True
            await self._publish(version, lambda abort_all: self._load(path, version, abort_all=abort_all))
            if written:
                await asyncio.to_thread(self._prune, version)

    async def update_weights_distributed(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Make `version` current by broadcast: form the weight group with the server if there is none
        yet, pause the server (aborting in-flight requests), announce the tensors and broadcast them
        in that order, continue. The version changes only when the server reports success; a server
        that dies or stops receiving mid-broadcast raises `SGLangUnavailable` within
        `weight_group_timeout_s` (per tensor) and the group is discarded."""
        self._check_open()
        _check_version_type(version)
        manifest = describe(weights)  # every tensor checked before the server is asked anything
        async with self._updating:
            self._check_version(version)
            group = await self._weight_group()
            body = {
                "names": list(manifest.names),
                "dtypes": list(manifest.dtypes),
                "shapes": [list(shape) for shape in manifest.shapes],
                "group_name": group.group_name,
                "flush_cache": True,  # cached prefixes hold KV of the old weights
                "weight_version": str(version),
            }

            async def load(abort_all: bool) -> None:
                # SGLang 0.5.23 takes distributed updates only inside a weight-update session.
                session = await self._session_call("/begin_weight_update", {"selector": "all"})
                try:
                    await self._broadcast_load(group, {**body, "abort_all_requests": abort_all}, weights)
                except BaseException as error:
                    if session:
                        try:
                            await self._session_call("/end_weight_update", {})
                        except SGLangError as also:
                            error.add_note(f"and the weight-update session could not be closed: {also}")
                    raise
                if session:
                    await self._session_call("/end_weight_update", {})

            await self._publish(version, load)

    async def _publish(self, version: int, load: Callable[[bool], Awaitable[None]]) -> None:
        """Hold new requests, pause the server (or, without `/pause_generation`, let `load` abort
        everything: its argument), `load`, continue; `version` becomes current when `load` returns."""
        self._no_update.clear()
        try:
            paused = await self._pause()
            try:
                await load(not paused)
                self._version = version
            except BaseException as error:
                if paused:
                    try:
                        await self._continue()
                    except SGLangError as also:
                        # The load's failure says what went wrong; this one only follows from it.
                        error.add_note(f"and generation could not be continued: {also}")
                raise
            if paused:
                await self._continue()
        finally:
            self._no_update.set()

    def _check_version(self, version: int) -> None:
        if version <= self._version:
            raise ValueError(f"the new version {version} must exceed the current {self._version}")

    async def health(self) -> bool:
        """True when the server generates (`/health_generate` answers 200 within `health_timeout_s`);
        False on any failure, never an exception."""
        if self._closed:
            return False
        limit = self.options.health_timeout_s
        try:
            async with asyncio.timeout(limit):
                response = await self._http().get(
                    self._base + "/health_generate",
                    timeout=httpx.Timeout(limit, connect=min(limit, self.options.connect_timeout_s)),
                )
        except (httpx.HTTPError, TimeoutError):
            return False
        return response.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        """The server's `/model_info` (`/get_model_info` on servers older than 0.5.23)."""
        self._check_open()
        timeout = self.options.control_timeout_s
        response = await self._request("GET", "/model_info", None, timeout, repeatable=True)
        path = "/model_info"
        if response.status_code == 404:
            path = "/get_model_info"
            response = await self._request("GET", path, None, timeout, repeatable=True)
        if response.status_code != 200:
            raise self._refused(path, response)
        answer = _json(response, self._base + path)
        if not isinstance(answer, dict):
            raise SGLangProtocolError(f"{self._base}{path} answered {type(answer).__name__}, not an object")
        return answer

    async def aclose(self) -> None:
        """Leave the weight group (asking the server to destroy its side: a failure to is logged, the
        server may be gone) and close the HTTP client. Idempotent; the server keeps running."""
        if not self._closed and self._group is not None:
            group, self._group = self._group, None
            body = {"group_name": group.group_name}
            try:
                response = await self._request(
                    "POST",
                    "/destroy_weights_update_group",
                    body,
                    self.options.control_timeout_s,
                    repeatable=True,
                )
                if response.status_code != 200:
                    raise self._refused("/destroy_weights_update_group", response)
            except SGLangError as error:
                _log.warning("weight group %s left on the server: %s", group.group_name, error)
            finally:
                group.close()
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # -- requests ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the SGLang engine client is closed")

    def _http(self) -> httpx.AsyncClient:
        # Built on first use so that its connections belong to the loop that runs the requests.
        if self._client is None:
            limit = self.options.max_connections
            self._client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                headers=self._headers,
            )
        return self._client

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float, *, repeatable: bool
    ) -> httpx.Response:
        """One call with bounded retries. A connection that never opened is retried for any call;
        a dropped connection or HTTP 5xx only for `repeatable` calls (a repeated /generate would run
        twice). Returns the last response; raises `SGLangUnavailable` when none came."""
        options = self.options
        url = self._base + path
        budget = httpx.Timeout(timeout_s, connect=options.connect_timeout_s)
        deadline = options.connect_timeout_s + timeout_s
        failure = ""
        for attempt in range(options.retries + 1):
            if attempt:
                await asyncio.sleep(options.backoff_s * 2 ** (attempt - 1))
            try:
                async with asyncio.timeout(deadline):
                    response = await self._http().request(method, url, json=body, timeout=budget)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                failure = f"cannot connect to the SGLang server at {url}: {_describe(error)}"
                continue
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as error:
                failure = f"the SGLang server at {url} dropped the connection: {_describe(error)}"
                if repeatable:
                    continue
                raise SGLangUnavailable(failure) from error
            except (TimeoutError, httpx.TimeoutException) as error:
                raise SGLangUnavailable(
                    f"the SGLang server at {url} gave no answer within {deadline:g} s"
                ) from error
            if response.status_code in _RETRY_STATUS and repeatable:
                text = _error_text(response)
                failure = f"the SGLang server at {url} answered HTTP {response.status_code}: {text}"
                continue
            return response
        raise SGLangUnavailable(f"{failure} (gave up after {options.retries + 1} attempts)")

    def _refused(self, path: str, response: httpx.Response) -> SGLangError:
        text, status, where = _error_text(response), response.status_code, self._base + path
        if status >= 500:
            return SGLangUnavailable(f"the SGLang server at {where} failed: HTTP {status}: {text}")
        if status == 401:
            sent = "the key" if self._headers else "no key"
            text += f" (sent {sent}: does SGLangOptions.api_key_env name the server's --api-key?)"
        return SGLangRequestError(
            f"the SGLang server at {where} refused the request (HTTP {status}): {text}", status
        )

    # -- generation ----------------------------------------------------------------------------------

    def _sampling_params(self, sampling: SamplingParams) -> dict[str, Any]:
        """SGLang's `sampling_params` for `sampling`; what SGLang would refuse fails here, first."""
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        truncated = sampling.top_p < 1 or sampling.top_k > 0
        if sampling.temperature > 0 and truncated and not self.options.allow_untruncated_logprobs:
            raise ValueError(
                "SGLang returns log-probs before top-k/top-p truncation, not those of the distribution "
                f"sampled from (top_p={sampling.top_p}, top_k={sampling.top_k}); use top_p=1 and top_k=0, "
                "or set SGLangOptions.allow_untruncated_logprobs=True to accept them"
            )
        if len(sampling.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(
                f"SGLang takes at most {MAX_STOP_STRINGS} stop strings, got {len(sampling.stop_strings)}"
            )
        if sampling.seed is not None and not -(2**63) <= sampling.seed < 2**63:
            raise ValueError(f"seed must fit in a signed 64-bit int, got {sampling.seed}")
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            # The raw tokens are what is trained on; keep special tokens and stop strings in the text too.
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if sampling.ignore_eos:
            params["ignore_eos"] = True
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.stop_strings:
            params["stop"] = list(sampling.stop_strings)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        return params

    async def _generation(
        self, answer: Any, prompt_len: int, sent_version: int, want_routes: bool, routes_start: int
    ) -> Generation:
        where = self._base + "/generate"
        if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
            raise SGLangProtocolError(f"{where} answered without a meta_info object")
        meta: dict[str, Any] = answer["meta_info"]
        finish = _finish_reason(meta.get("finish_reason"), where)
        tokens = _int_list(answer.get("output_ids"), "output_ids", where)
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(tokens):
            raise SGLangProtocolError(
                f"{where}: meta_info.output_token_logprobs must hold one entry per output token "
                f"({len(tokens)}), got {_brief(entries)}"
            )
        logprobs = []
        for position, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
            if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token:
                raise SGLangProtocolError(
                    f"{where}: output_token_logprobs[{position}] should be [logprob, {token}, text], "
                    f"got {entry!r}"
                )
            value = entry[0]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise SGLangProtocolError(f"{where}: output_token_logprobs[{position}] has logprob {value!r}")
            logprobs.append(float(value))
        for key, expected in (("completion_tokens", len(tokens)), ("prompt_tokens", prompt_len)):
            if key in meta and meta[key] != expected:
                raise SGLangProtocolError(f"{where}: meta_info.{key} is {meta[key]!r}, expected {expected}")
        versions = _token_versions(meta, len(tokens), sent_version, where)
        routes = None
        if want_routes:
            # SGLang clamps the start to seqlen - 1: an answer without tokens may hold no rows at all.
            rows = max(0, prompt_len + len(tokens) - 1 - routes_start)
            routes = await self._routes(meta.get("routed_experts"), rows, routes_start, finish)
        return Generation(tuple(tokens), tuple(logprobs), versions, finish, routes, routes_start)

    async def _routes(self, encoded: Any, rows: int, start: int, finish: FinishReason) -> np.ndarray | None:
        where = self._base + "/generate"
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
        layout = await self._routes_layout()
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

    async def _routes_layout(self) -> _Layout:
        if self._layout is not None:
            return self._layout
        options = self.options
        model_path = (await self.model_info()).get("model_path")
        directory = await asyncio.to_thread(_config_dir, model_path, options.base_model_dir)
        if directory is None:
            if options.num_layers is None or options.top_k is None:
                raise SGLangProtocolError(
                    "cannot tell the routed experts' layers and top_k: set SGLangOptions.num_layers and "
                    f"top_k, or base_model_dir (the server's model_path {model_path!r} has no config.json "
                    "readable here)"
                )
            layers = options.num_layers
            moe_layers = options.moe_layers or tuple(range(layers))
            self._layout = _Layout(layers, options.top_k, options.num_experts, moe_layers)
            return self._layout
        config = await asyncio.to_thread(_read_config, directory) or {}
        found_layers = _config_int(config, "num_hidden_layers")
        found_top_k = _config_int(config, "num_experts_per_tok")
        if found_layers is None or found_top_k is None:
            raise SGLangProtocolError(
                f"the config.json in {directory} has no num_hidden_layers / num_experts_per_tok: "
                "set SGLangOptions.num_layers and top_k"
            )
        found = _Layout(
            found_layers,
            found_top_k,
            _config_int(config, *_EXPERT_COUNT_KEYS),
            await asyncio.to_thread(routed_layers, directory),
        )
        names = {
            "num_layers": "num_hidden_layers",
            "top_k": "num_experts_per_tok",
            "num_experts": "the experts per layer",
            "moe_layers": "the layers routed",
        }
        for option, meaning in names.items():
            given, value = getattr(options, option), getattr(found, option)
            if given is not None and value is not None and given != value:
                raise SGLangLayoutError(
                    f"SGLangOptions.{option}={given!r}, but the model at {directory} has {meaning} = "
                    f"{value!r} (SGLang's routed experts have a column per decoder layer, dense ones "
                    "included): leave it unset to take the model's"
                )
        if found.num_experts is None and options.num_experts is not None:
            found = _Layout(found.num_layers, found.top_k, options.num_experts, found.moe_layers)
        self._layout = found
        return self._layout

    # -- weights -------------------------------------------------------------------------------------

    async def _pause(self) -> bool:
        """Pause with mode "abort"; False on a server without `/pause_generation` (nothing paused)."""
        response = await self._request(
            "POST", "/pause_generation", {"mode": "abort"}, self.options.control_timeout_s, repeatable=True
        )
        if response.status_code == 404:
            return False
        if response.status_code != 200:
            raise self._refused("/pause_generation", response)
        return True

    async def _continue(self) -> None:
        response = await self._request(
            "POST", "/continue_generation", {}, self.options.control_timeout_s, repeatable=True
        )
        if response.status_code != 200:
            raise self._refused("/continue_generation", response)

    async def _load(self, path: str, version: int, *, abort_all: bool) -> None:
        body = {"model_path": path, "weight_version": str(version), "abort_all_requests": abort_all}
        response = await self._request(
            "POST", "/update_weights_from_disk", body, self.options.update_timeout_s, repeatable=False
        )
        if response.status_code >= 500:
            raise self._refused("/update_weights_from_disk", response)
        answer = _json(response, self._base + "/update_weights_from_disk")
        if not isinstance(answer, dict) or not isinstance(answer.get("success"), bool):
            raise SGLangProtocolError(
                f"{self._base}/update_weights_from_disk answered {_brief(answer)}, not {{success, message}}"
            )
        if response.status_code != 200 or not answer["success"]:
            raise SGLangRequestError(
                f"the SGLang server at {self._base} did not load the weights from {path}: "
                f"{answer.get('message', '(no message)')}",
                response.status_code,
            )

    async def _weight_group(self) -> WeightBroadcastGroup:
        """The weight group, formed with the server on first use: this process hosts the rendezvous
        store and joins as rank 0 while the server, asked by `/init_weights_update_group`, joins
        through the same store."""
        if self._group is not None:
            return self._group
        options = self.options
        ranks = options.weight_group_ranks or await self._server_ranks()
        address = options.weight_group_address
        if address is None:
            address = await asyncio.to_thread(_local_address, self._base)
        backend: GroupBackend = options.weight_group_backend or (
            "nccl" if torch.cuda.is_available() else "gloo"
        )
        # A fresh name each time: a server keeps a broken group's name registered until it is destroyed.
        name = f"pacerl-weights-{uuid.uuid4().hex[:12]}"
        try:
            group = WeightBroadcastGroup(
                address=address,
                port=options.weight_group_port,
                world_size=ranks + 1,
                group_name=name,
                backend=backend,
                timeout_s=options.weight_group_timeout_s,
            )
        except RuntimeError as error:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
            raise SGLangError(
                f"cannot host the weight group's rendezvous store on {address}:{options.weight_group_port} "
                f"(SGLangOptions.weight_group_address / weight_group_port): {error}"
            ) from None
        body = {
            "master_address": address,
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": ranks + 1,
            "group_name": name,
            "backend": backend,
        }
        joined = _in_thread(group.connect)
        try:
            await self._alongside(
                "/init_weights_update_group",
                body,
                options.weight_group_timeout_s,
                joined,
                "forming the weight group",
                settle_on_refusal=False,  # a server that did not join leaves this side waiting in vain
            )
        except BaseException:
            _discard(group, joined)
            raise
        self._group = group
        return group

    async def _broadcast_load(
        self, group: WeightBroadcastGroup, body: dict[str, Any], weights: Mapping[str, torch.Tensor]
    ) -> None:
        """Announce the tensors and broadcast them, together. Only a refusal after a complete
        broadcast leaves the group's ranks in step; after any other failure the group is discarded."""
        sent = _in_thread(group.broadcast, list(weights.items()))
        try:
            await self._alongside(
                "/update_weights_from_distributed",
                body,
                self.options.update_timeout_s,
                sent,
                "the weight broadcast",
                settle_on_refusal=True,
            )
        except BaseException as error:
            in_step = sent.done() and not sent.cancelled() and sent.exception() is None
            if not (in_step and isinstance(error, SGLangRequestError)):
                if self._group is group:
                    self._group = None
                _discard(group, sent)
            raise

    async def _alongside(
        self,
        path: str,
        body: dict[str, Any],
        timeout_s: float,
        work: asyncio.Future[None],
        what: str,
        *,
        settle_on_refusal: bool,
    ) -> None:
        """POST `body` to `path` while `work` (this process's part of the same collective, on a
        thread) runs: the server answers only once its ranks are done, so both must run at once. The
        first failure of either ends the wait. With `settle_on_refusal`, a refusal first waits for
        `work` to end, at most the group's timeout: a server that refuses the tensors it received has
        received them all, so `work` ends at once and the group stays in step."""
        where = self._base + path
        call = asyncio.ensure_future(self._request("POST", path, body, timeout_s, repeatable=False))
        try:
            # FIRST_COMPLETED, not FIRST_EXCEPTION: a refusal is an answer, not an exception.
            both: list[asyncio.Future[Any]] = [call, work]
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if work.done() and work.exception() is not None:
                raise SGLangUnavailable(
                    f"{what} with the SGLang server at {where} failed: {work.exception()}"
                ) from work.exception()
            response = await call
        finally:
            call.cancel()
        if response.status_code >= 500:
            raise self._refused(path, response)
        answer = _json(response, where)
        if not isinstance(answer, dict) or not isinstance(answer.get("success"), bool):
            raise SGLangProtocolError(f"{where} answered {_brief(answer)}, not {{success, message}}")
        refused = response.status_code != 200 or not answer["success"]
        if not refused or settle_on_refusal:
            await asyncio.wait([work])
            if work.exception() is not None:
                raise SGLangUnavailable(
                    f"{what} with the SGLang server at {where} failed: {work.exception()}"
                ) from work.exception()
        if refused:
            raise SGLangRequestError(
                f"the SGLang server at {self._base} refused {what}: {answer.get('message', '(no message)')}",
                response.status_code,
            )

    async def _session_call(self, path: str, body: dict[str, Any]) -> bool:
        """`/begin_weight_update` or `/end_weight_update`; False when the server has no such route
        (SGLang before weight-update sessions, which takes distributed updates without one)."""
        response = await self._request("POST", path, body, self.options.control_timeout_s, repeatable=False)
        if response.status_code == 404:
            return False
        if response.status_code >= 500:
            raise self._refused(path, response)
        answer = _json(response, self._base + path)
        if not isinstance(answer, dict) or not isinstance(answer.get("success"), bool):
            raise SGLangProtocolError(
                f"{self._base}{path} answered {_brief(answer)}, not {{success, message}}"
            )
        if response.status_code != 200 or not answer["success"]:
            raise SGLangRequestError(
                f"the SGLang server at {self._base}{path} refused: {answer.get('message', '(no message)')}",
                response.status_code,
            )
        return True

    async def _server_ranks(self) -> int:
        """The server's tensor-parallel size, from `/server_info` (`/get_server_info` on older servers)."""
        timeout = self.options.control_timeout_s
        path = "/server_info"
        response = await self._request("GET", path, None, timeout, repeatable=True)
        if response.status_code == 404:
            path = "/get_server_info"
            response = await self._request("GET", path, None, timeout, repeatable=True)
        if response.status_code != 200:
            raise self._refused(path, response)
        answer = _json(response, self._base + path)
        ranks = _config_int(answer, "tp_size") if isinstance(answer, dict) else None
        if ranks is None:
            raise SGLangProtocolError(
                f"{self._base}{path} has no tp_size to size the weight group with: "
                "set SGLangOptions.weight_group_ranks"
            )
        return ranks

    def _write_checkpoint(self, state_dict: Mapping[str, torch.Tensor], version: int) -> str:
        """`state_dict` as a safetensors checkpoint in `weights_dir/version-N`; the path."""
        if self.options.weights_dir is None:
            raise ValueError(
                "SGLangOptions.weights_dir must be set to publish a state_dict "
                "(SGLang loads weights from disk)"
            )
        if not state_dict:
            raise ValueError("the state_dict is empty")
        root = Path(self.options.weights_dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"version-{version}"
        scratch = Path(tempfile.mkdtemp(prefix=f".version-{version}-", dir=root))
        try:
            if self.options.base_model_dir is not None:
                _copy_config_files(Path(self.options.base_model_dir), scratch)
            save_sharded(state_dict, scratch, self.options.max_shard_bytes)
            if final.exists():
                shutil.rmtree(final)  # left by an update the server did not take
            scratch.rename(final)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        return str(final)

    def _prune(self, current: int) -> None:
        """Delete older version directories beyond `keep_checkpoints` (never the loaded one)."""
        if self.options.weights_dir is None:
            return
        root = Path(self.options.weights_dir).resolve()
        versions = sorted(
            (int(match[1]), path)
            for path in root.iterdir()
            if (match := _CHECKPOINT.fullmatch(path.name)) and path.is_dir() and int(match[1]) <= current
        )
        for _, path in versions[: -self.options.keep_checkpoints]:
            shutil.rmtree(path)


# -- helpers -------------------------------------------------------------------------------------------


def save_sharded(state_dict: Mapping[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    """Write `state_dict` as `model.safetensors`, or as shards of at most `max_shard_bytes` (a single
    bigger tensor gets its own shard) with the `model.safetensors.index.json` transformers writes."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    used = 0
    total = 0
    for name, tensor in state_dict.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"state_dict entries must be str -> torch.Tensor, got {name!r}")
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
        total += size
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file_name, shard in zip(names, shards, strict=True):
        tensors = {}
        for name in shard:
            tensor = state_dict[name].detach().to("cpu")
            # safetensors refuses tensors that share memory (tied weights, views): give each its own.
            tensors[name] = tensor.clone(memory_format=torch.contiguous_format)
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: file for file, shard in zip(names, shards, strict=True) for name in shard},
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _check_version_type(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"version must be an int, got {version!r}")


def _in_thread(function: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
    """`function(*args)` on a daemon thread of its own, as a future of the running loop. Not the
    loop's executor: a collective stays blocked until its timeout, and nothing may wait for it at
    the loop's shutdown."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = function(*args)
        except BaseException as raised:
            error = raised
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits the outcome
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="pacerl-weight-group", daemon=True).start()
    return future


def _discard(group: WeightBroadcastGroup, work: asyncio.Future[Any]) -> None:
    """Close `group` once `work` (its collective still running, perhaps until its timeout) ends,
    and take the outcome so that asyncio does not report it as never retrieved."""

    def close(done: asyncio.Future[Any]) -> None:
        if not done.cancelled():
            done.exception()
        group.close()

    work.add_done_callback(close)


def _local_address(base_url: str) -> str:
    """This machine's address on the route to the server's host. A UDP socket's connect only picks
    the route; nothing is sent."""
    url = httpx.URL(base_url)
    host = url.host
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        # IPv4 first: SGLang joins through "tcp://{master_address}:{master_port}", unbracketed.
        infos.sort(key=lambda info: info[0] != socket.AF_INET)
        family, kind, protocol, _, address = infos[0]
        with socket.socket(family, kind, protocol) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as error:
        raise SGLangError(
            f"cannot tell this machine's address towards {host}: {error}; "
            "set SGLangOptions.weight_group_address"
        ) from None


def _copy_config_files(source: Path, target: Path) -> None:
    if not source.is_dir():
        raise ValueError(f"SGLangOptions.base_model_dir {str(source)!r} is not a directory")
    for path in source.iterdir():
        if (
            path.is_file()
            and not path.name.endswith(_WEIGHT_SUFFIXES)
            and not path.name.endswith(".index.json")
        ):
            shutil.copy2(path, target / path.name)


def _prompt(input_ids: Sequence[int]) -> list[int]:
    prompt = list(input_ids)
    if not prompt:
        raise ValueError("input_ids is empty")
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, int | np.integer) or token < 0:
            raise ValueError(f"input_ids must be non-negative ints, got {token!r}")
    return [int(token) for token in prompt]


def _finish_reason(value: Any, where: str) -> FinishReason:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise SGLangProtocolError(
            f"{where}: meta_info.finish_reason must be {{'type': 'stop' | 'length' | 'abort', ...}}, "
            f"got {value!r}"
        )
    return FinishReason(str(kind))


def _int_list(value: Any, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise SGLangProtocolError(f"{where}: {what} must be a list of token ids, got {_brief(value)}")
    return value


def _version_number(name: Any) -> int | None:
    """A weight_version as an int, or None when it is not one (SGLang's default is "default")."""
    if isinstance(name, str) and re.fullmatch(r"-?\d+", name.strip()):
        return int(name)
    return None


def _token_versions(meta: dict[str, Any], count: int, sent_version: int, where: str) -> tuple[int, ...]:
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans:
        versions: list[int] = []
        for span in spans:
            number = _version_number(span.get("version")) if isinstance(span, dict) else None
            if number is None:
                break
            start, end = span.get("start"), span.get("end")
            if start != len(versions) or not isinstance(end, int) or end < start:
                raise SGLangProtocolError(f"{where}: meta_info.weight_versions are not contiguous: {spans!r}")
            versions.extend([number] * (end - start))
        else:
            if len(versions) != count:
                raise SGLangProtocolError(
                    f"{where}: meta_info.weight_versions cover {len(versions)} of {count} output tokens"
                )
            return tuple(versions)
    number = _version_number(meta.get("weight_version"))
    return (sent_version if number is None else number,) * count


def routed_layers(model_dir: str | os.PathLike[str]) -> tuple[int, ...]:
    """The decoder layers whose columns of SGLang 0.5.23's routed experts hold routes, for the model
    whose config.json is in `model_dir`: those SGLang builds with an MoE block (see the module
    docstring). For a family with an R3 adapter they must be the layers transformers builds with a
    router, which the learner replays (`agents.models.moe_info`), else `SGLangLayoutError`; a family
    without one: every layer."""
    raw = _read_config(str(model_dir))
    layers = _config_int(raw or {}, "num_hidden_layers")
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


def _config_int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _json(response: httpx.Response, url: str) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SGLangProtocolError(
            f"{url} answered HTTP {response.status_code} with a body that is not JSON: {error}"
        ) from None


def _error_text(response: httpx.Response) -> str:
    """The message of any of SGLang's error bodies, else the body's start."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for candidate in (error, body.get("message"), body.get("detail")):
            if isinstance(candidate, str):
                return candidate
    return json.dumps(body)[:500]


def _brief(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list | str | int | float | None) else repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def launch_command(
    model: str,
    port: int,
    python: str,
    extra: Sequence[str] = (),
    *,
    moe: bool = True,
    host: str = "127.0.0.1",
    weight_version: int | None = 0,
) -> list[str]:
    """The argv that starts an SGLang server for pacerl with `python` (an environment where sglang
    is installed): routed experts returned for a MoE model (R3), an integer `--weight-version` so
    every token's version is the server's own, then `extra` unchanged (later flags win)."""
    if not model:
        raise ValueError("model is empty")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    if not python:
        raise ValueError("python is empty")
    argv = [python, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port), "--host", host]
    if moe:
        argv.append("--enable-return-routed-experts")
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    return argv + list(extra)
