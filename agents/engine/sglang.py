"""The SGLang engine: the Engine protocol over an SGLang server's native HTTP API, and its launch line.

Written against sglang 0.5.23, the version pyproject's `sglang` extra pins (the PyPI wheel
`sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`, tag v0.5.23 of github.com/sgl-project/sglang).
`SGLangEngine` coordinates three parts, each in its own module with the server's files it follows:

- `pacerl.agents.engine.sglang_protocol`: the HTTP API (routes, request bodies, the checks on every answer,
  bounded retries) and the errors of talking to a server.
- `pacerl.agents.engine.sglang_layout`: which columns of the routed experts are the trained model's MoE
  layers, from the model's config.json (`routed_layers`), and the checks on the routes of an answer.
- `pacerl.agents.engine.sglang_weights`: weight updates, through disk or by torch.distributed broadcast.

The launch line (`launch_command`) follows `python/sglang/srt/arg_groups/fields/exec_.py` and
`.../serving.py` (`--enable-return-routed-experts`, `--weight-version` (default "default"), `--host`,
`--port`) and `.../model.py` (`--model-path`).

Versions. A token's version is the server's `weight_version` (its spans when present) whenever that
is an integer, which it always is for a server launched by `launch_command` (`--weight-version`) and
updated by this client (`weight_version` is sent with every update); otherwise it is this client's
version when the request was sent. Requests wait while this client updates weights, so both agree.

MoE layers only. A `Generation`'s routes have the embedded engine's shape, `[rows, MoE layers,
top_k]` (`pacerl.agents.engine.sglang_layout`): SGLang's columns of dense layers are checked to be 0 and
dropped, and a model SGLang builds with MoE blocks elsewhere is an `SGLangLayoutError` before any
request asks for routes.

Routes of new positions only. A caller that holds the rows of the first positions of its sequence
(an earlier turn, or a generation interrupted by a weight update and now resumed) passes their count
as `routed_experts_start_len`; the client sends it as SGLang's field of that name, and the answer's
rows start there (`Generation.routed_experts_start`), instead of repeating the whole prompt's rows on
every turn.

Weight updates pause generation: each in-flight request comes back `FinishReason.ABORT` with the
tokens it had, and the rollout driver resumes it from those tokens as a new segment under the new
version (`pacerl.agents.engine.sglang_weights`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import torch

from pacerl.agents.engine.protocol import ContextOverflowError, Generation, SamplingParams
from pacerl.agents.engine.sglang_layout import RoutesLayout, decode_routes, resolve_layout
from pacerl.agents.engine.sglang_protocol import (
    SGLangError,
    SGLangProtocolError,
    Transport,
    auth_headers,
    error_text,
    is_overflow,
    json_answer,
    parse_answer,
    prompt_ids,
    sampling_params,
)
from pacerl.agents.engine.sglang_weights import (
    WeightGroupLink,
    load_from_disk,
    pause,
    prune,
    resume,
    write_checkpoint,
)
from pacerl.agents.engine.weight_group import describe
from pacerl.agents.models import WeightLayout


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
    trained model's MoE layers, `pacerl.agents.models.moe_info(model).layers`; the other columns must be 0).
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
    `/update_weights_from_distributed`; see `pacerl.agents.engine.sglang_weights`). A checkpoint directory
    given instead of a state_dict always goes through disk."""
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


class SGLangEngine:
    """An SGLang server behind the Engine protocol (see the module docstring)."""

    def __init__(
        self, options: SGLangOptions | None = None, version: int = 0, *, layout: WeightLayout | None = None
    ) -> None:
        self.options = options = options or SGLangOptions()
        self.layout = layout
        """Renames a published state dict into the layout the server loads (`pacerl.agents.models.layout_of`:
        a checkpoint's, not transformers' fused in-memory experts); None publishes names as given."""
        self._version = version
        self._transport = Transport(
            options.url,
            connect_timeout_s=options.connect_timeout_s,
            retries=options.retries,
            backoff_s=options.backoff_s,
            max_connections=options.max_connections,
            headers=auth_headers(options.api_key_env),
        )
        self._link = WeightGroupLink(
            self._transport,
            ranks=options.weight_group_ranks,
            address=options.weight_group_address,
            port=options.weight_group_port,
            backend=options.weight_group_backend,
            timeout_s=options.weight_group_timeout_s,
            update_timeout_s=options.update_timeout_s,
            control_timeout_s=options.control_timeout_s,
        )
        self._updating = asyncio.Lock()
        self._no_update = asyncio.Event()
        self._no_update.set()
        self._routes_layout: RoutesLayout | None = None
        self._closed = False

    @property
    def version(self) -> int:
        """The version of the weights this client last loaded into the server."""
        return self._version

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
        prompt = prompt_ids(input_ids)
        start = routed_experts_start_len
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(prompt):
            raise ValueError(
                f"routed_experts_start_len must be an int in [0, {len(prompt)}] (the prompt's length), "
                f"got {start!r}"
            )
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        allow = self.options.allow_untruncated_logprobs
        body = {
            "rid": rid,
            "input_ids": prompt,
            "sampling_params": sampling_params(sampling, allow_untruncated_logprobs=allow),
            "return_logprob": True,
            "logprob_start_len": -1,
            "return_routed_experts": bool(return_routed_experts),
            "stream": False,
        }
        if return_routed_experts and start:
            body["routed_experts_start_len"] = start
        if return_routed_experts:
            await self._layout_of_routes()  # a model whose routes cannot be mapped fails before generating
        await self._no_update.wait()
        sent_version = self._version
        response = await self._transport.request(
            "POST", "/generate", body, self.options.generate_timeout_s, repeatable=False
        )
        if response.status_code != 200:
            message = error_text(response)
            if response.status_code == 400 and is_overflow(message):
                raise ContextOverflowError(message)
            raise self._transport.refused("/generate", response)
        where = self._transport.base + "/generate"
        answer = parse_answer(json_answer(response, where), len(prompt), sent_version, where)
        if not return_routed_experts:
            return Generation(answer.tokens, answer.logprobs, answer.versions, answer.finish, None, 0)
        # SGLang clamps the start to seqlen - 1: an answer without tokens may hold no rows at all.
        rows = max(0, len(prompt) + len(answer.tokens) - 1 - start)
        layout = await self._layout_of_routes()
        routes = decode_routes(answer.routed_experts, rows, start, answer.finish, layout, where)
        return Generation(answer.tokens, answer.logprobs, answer.versions, answer.finish, routes, start)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its `generate` returns what it had with `FinishReason.ABORT`.

        SGLang aborts every request whose id starts with `request_id`; ids made by this client are
        uuid4 hex strings of one length, so none is a prefix of another."""
        self._check_open()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        response = await self._transport.request(
            "POST", "/abort_request", {"rid": request_id}, self.options.control_timeout_s, repeatable=True
        )
        if response.status_code != 200:
            raise self._transport.refused("/abort_request", response)

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
        options = self.options
        async with self._updating:
            self._check_version(version)
            if isinstance(state_dict, str | os.PathLike):
                # Absolute: the server resolves paths against its own working directory.
                path, written = await asyncio.to_thread(os.path.abspath, os.fspath(state_dict)), False
            else:
                path = await asyncio.to_thread(
                    write_checkpoint,
                    state_dict,
                    version,
                    weights_dir=options.weights_dir,
                    base_model_dir=options.base_model_dir,
                    max_shard_bytes=options.max_shard_bytes,
                )
                written = True

            async def load(abort_all: bool) -> None:
                await load_from_disk(
                    self._transport, path, version, abort_all=abort_all, timeout_s=options.update_timeout_s
                )

            await self._publish(version, load)
            if written:
                await asyncio.to_thread(prune, options.weights_dir, version, options.keep_checkpoints)

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
            group = await self._link.joined()

            async def load(abort_all: bool) -> None:
                await self._link.send(group, manifest, weights, version, abort_all=abort_all)

            await self._publish(version, load)

    async def health(self) -> bool:
        """True when the server generates (`/health_generate` answers 200 within `health_timeout_s`);
        False on any failure, never an exception."""
        if self._closed:
            return False
        return await self._transport.answers("/health_generate", self.options.health_timeout_s)

    async def model_info(self) -> dict[str, Any]:
        """The server's `/model_info` (`/get_model_info` on servers older than 0.5.23)."""
        self._check_open()
        path, answer = await self._transport.get_json(
            "/model_info", "/get_model_info", self.options.control_timeout_s
        )
        if not isinstance(answer, dict):
            raise SGLangProtocolError(
                f"{self._transport.base}{path} answered {type(answer).__name__}, not an object"
            )
        return answer

    async def aclose(self) -> None:
        """Leave the weight group (asking the server to destroy its side: a failure to is logged, the
        server may be gone) and close the HTTP client. Idempotent; the server keeps running."""
        if not self._closed:
            await self._link.leave()
        self._closed = True
        await self._transport.aclose()

    async def _publish(self, version: int, load: Callable[[bool], Awaitable[None]]) -> None:
        """Hold new requests, pause the server (or, without `/pause_generation`, let `load` abort
        everything: its argument), `load`, continue; `version` becomes current when `load` returns."""
        transport, timeout = self._transport, self.options.control_timeout_s
        self._no_update.clear()
        try:
            paused = await pause(transport, timeout)
            try:
                await load(not paused)
                self._version = version
            except BaseException as error:
                if paused:
                    try:
                        await resume(transport, timeout)
                    except SGLangError as also:
                        # The load's failure says what went wrong; this one only follows from it.
                        error.add_note(f"and generation could not be continued: {also}")
                raise
            if paused:
                await resume(transport, timeout)
        finally:
            self._no_update.set()

    async def _layout_of_routes(self) -> RoutesLayout:
        """The served model's routes layout, read once
        (`pacerl.agents.engine.sglang_layout.resolve_layout`)."""
        if self._routes_layout is None:
            options = self.options
            model_path = (await self.model_info()).get("model_path")
            self._routes_layout = await asyncio.to_thread(
                resolve_layout,
                model_path,
                base_model_dir=options.base_model_dir,
                num_layers=options.num_layers,
                top_k=options.top_k,
                num_experts=options.num_experts,
                moe_layers=options.moe_layers,
            )
        return self._routes_layout

    def _check_version(self, version: int) -> None:
        if version <= self._version:
            raise ValueError(f"the new version {version} must exceed the current {self._version}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the SGLang engine client is closed")


def _check_version_type(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"version must be an int, got {version!r}")


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
