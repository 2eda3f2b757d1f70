"""The embedded engine: a transformers causal LM on torch with continuous batching, a KV cache,
per-token log-probs and versions, routed-expert capture, and in-place weight updates.

Continuous batching: the running requests are the rows of one left-padded KV cache. Each engine step
first prefills the requests waiting to join (one at a time; each joins the batch by padding the
shorter side of the cache on the left), then decodes one token for every row. A finished or aborted
row leaves the batch at once and its caller is answered; padding columns that no row needs any more
are trimmed. Forward passes run on a worker thread, so the event loop (and the envs' tool calls) keep
going while the model computes.

A weight update waits for the current step, loads the new tensors in place and bumps the version;
in-flight requests carry on under the new weights. `interrupt="reprefill"` (AReaL-style) first
recomputes every running row's KV cache under the new weights; `interrupt="continue"` (PipelineRL-
style) keeps the cache built by the old ones. Either way each token records the version that
produced it, and the rollout driver makes a new segment where the version changes.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agents.engine.protocol import FinishReason, Generation, SamplingParams
from agents.models import moe_info


class ContextOverflowError(ValueError):
    """The prompt does not fit the engine's context (the driver ends such a trajectory `truncated`)."""


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """Options of the embedded engine."""

    max_batch: int = 64
    """Requests decoded together at most; more wait to join."""
    max_context: int | None = None
    """Prompt plus generation length at most; None takes the model's `max_position_embeddings`."""
    interrupt: Literal["reprefill", "continue"] = "reprefill"
    """On a weight update: recompute running requests' KV caches under the new weights (AReaL), or
    keep the caches and continue (PipelineRL)."""
    seed: int = 0
    """Seed of the engine's samplers (requests may bring their own)."""
    router_noise: float = 0.0
    """Relative spread of a fixed perturbation of the engine's MoE router weights: each router tensor
    gets Gaussian noise of this many times its RMS, drawn anew at every weight load (seeded by `seed`
    and the version). A stand-in for the kernel and precision differences that make an inference
    engine route some tokens to other experts than the trainer does (what R3 removes); 0: none."""

    def __post_init__(self) -> None:
        if not self.router_noise >= 0:
            raise ValueError(f"router_noise must be >= 0, got {self.router_noise}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.interrupt not in ("reprefill", "continue"):
            raise ValueError(f"interrupt must be reprefill or continue, got {self.interrupt!r}")


@dataclass
class _Request:
    id: str
    prompt: list[int]
    sampling: SamplingParams
    want_routes: bool
    routes_start: int
    future: asyncio.Future[Generation]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    """Per fed position, `[layers, top_k]` (prompt positions first, then every decoded input); the
    answer keeps those from `routes_start` on."""
    aborted: bool = False
    finish: FinishReason | None = None


class _GateRecorder:
    """Forward hooks on each MoE router that keep the last forward's top-k expert indices.

    Attached to this engine's model instance only (no module globals) and removed by `close`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.gates = _find_gates(model)
        self.indices: list[torch.Tensor | None] = [None] * len(self.gates)
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in enumerate(self.gates)]

    def _hook(self, layer: int) -> Any:
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            # An adapted router returns (logits, weights, indices) (agents.models.MoEAdapter).
            chosen = output[2]
            self.indices[layer] = chosen.detach().reshape(-1, chosen.shape[-1]).to("cpu")

        return record

    def take(self) -> np.ndarray | None:
        """`[positions, layers, top_k]` from the last forward, or None for a dense model."""
        if not self.gates or any(i is None for i in self.indices):
            return None
        stacked = np.stack([i.numpy() for i in self.indices if i is not None], axis=1)
        self.indices = [None] * len(self.gates)
        return stacked.astype(np.int32)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _find_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers R3 replays, in the same order (`moe_info`); none for a dense model, and none for an
    MoE family without an adapter: it generates, and the learner refuses it when R3 is on."""
    try:
        return list(moe_info(model).gates)
    except ValueError:  # dense, or UnsupportedMoEError
        return []


class EmbeddedEngine:
    """An in-process engine over a transformers causal LM (CPU or one GPU)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        config: EmbeddedEngineConfig | None = None,
        version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EmbeddedEngineConfig()
        self._version = version
        self.device = next(model.parameters()).device
        self.max_context = self.config.max_context or int(model.config.max_position_embeddings)
        eos = model.config.eos_token_id
        self._eos = {eos} if isinstance(eos, int) else set(eos or [])
        self._pad = int(model.config.pad_token_id or 0)
        self._recorder = _GateRecorder(model)
        gate_ids = {id(gate) for gate in self._recorder.gates}
        self._router_params = {
            f"{name}.{param_name}" if name else param_name: param
            for name, module in model.named_modules()
            if id(module) in gate_ids
            for param_name, param in module.named_parameters(recurse=False)
            if param.is_floating_point()
        }
        """The routers' own tensors by state-dict name: what `router_noise` perturbs."""
        self._perturb_routers(self._router_params, version)
        self._ids = itertools.count()
        self._pending: list[_Request] = []
        self._rows: list[_Request] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros((0, 0), dtype=torch.long)
        self._next_position = torch.zeros(0, dtype=torch.long)
        self._last = torch.zeros(0, dtype=torch.long)
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._bound_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.steps = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def is_moe(self) -> bool:
        return bool(self._recorder.gates)

    # -- the public protocol ------------------------------------------------------------------------

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
        """Generate from `input_ids`; returns when the request finishes or is aborted. Routes, when
        asked for, are those of every input position from `routed_experts_start_len` on (prompt
        positions from the prefill, then each decoded input), as SGLang returns them. `session` is
        for routers: one engine has nothing to route."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        self._bind()
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise ValueError("input_ids is empty")
        start = routed_experts_start_len
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(prompt):
            raise ValueError(
                f"routed_experts_start_len must be an int in [0, {len(prompt)}] (the prompt's length), "
                f"got {start!r}"
            )
        if len(prompt) >= self.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.max_context}"
            )
        generator = torch.Generator().manual_seed(
            sampling.seed if sampling.seed is not None else self.config.seed * 1_000_003 + next(self._ids)
        )
        loop = asyncio.get_running_loop()
        request = _Request(
            request_id or f"req-{next(self._ids)}",
            prompt,
            sampling,
            return_routed_experts,
            start,
            loop.create_future(),
            generator,
        )
        self._pending.append(request)
        self._ensure_loop()
        self._wake.set()
        return await request.future

    async def abort(self, request_id: str) -> None:
        """Stop a request; its caller gets what was generated so far with finish reason `abort`."""
        for request in [*self._pending, *self._rows]:
            if request.id == request_id:
                request.aborted = True
        self._wake.set()

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights in place between two steps and make `version` current."""
        if version <= self._version:
            raise ValueError(f"the new version {version} must exceed the current {self._version}")
        self._bind()
        async with self._step_lock:
            await asyncio.to_thread(self._load, state_dict, version)
            self._version = version
            if self.config.interrupt == "reprefill" and self._rows:
                await asyncio.to_thread(self._reprefill)

    async def health(self) -> bool:
        """True while the engine accepts requests and its loop is alive."""
        return not self._closed and (self._loop_task is None or not self._loop_task.done())

    async def aclose(self) -> None:
        """Abort everything and stop the loop. Idempotent."""
        self._closed = True
        for request in [*self._pending, *self._rows]:
            request.aborted = True
        self._wake.set()
        if self._loop_task is not None and self._bound_loop is asyncio.get_running_loop():
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._recorder.close()

    # -- the loop -------------------------------------------------------------------------------------

    def _bind(self) -> None:
        """Serve from the running event loop (a later `asyncio.run` gets fresh loop-bound state)."""
        loop = asyncio.get_running_loop()
        if self._bound_loop is loop:
            return
        if self._pending or self._rows:
            raise RuntimeError("the engine is serving requests on another event loop")
        self._bound_loop, self._loop_task = loop, None
        self._step_lock, self._wake = asyncio.Lock(), asyncio.Event()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                if not self._pending and not self._rows:
                    if self._closed:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                async with self._step_lock:
                    await asyncio.to_thread(self._step)
                    self._answer_finished()
                await asyncio.sleep(0)  # let callers, aborts and weight updates in between steps
        except BaseException as error:  # a model failure must reach every waiting caller, not vanish
            for request in [*self._pending, *self._rows]:
                if not request.future.done():
                    request.future.set_exception(RuntimeError(f"the engine failed: {error!r}"))
            self._pending, self._rows, self._cache = [], [], None
            raise

    def _step(self) -> None:
        """One engine step: admit waiting requests (one batched prefill), then decode every row."""
        admitted: list[_Request] = []
        for request in list(self._pending):
            if request.aborted:
                request.finish = FinishReason.ABORT
                self._pending.remove(request)
                self._resolve(request)
            elif len(self._rows) + len(admitted) < self.config.max_batch:
                self._pending.remove(request)
                admitted.append(request)
        if admitted:
            logits = self._prefill(admitted, [r.prompt for r in admitted], record=True)
            first_row = len(self._rows) - len(admitted)
            for offset, request in enumerate(admitted):
                self._emit(request, logits[offset], first_row + offset)
        if any(r.finish is None for r in self._rows):
            self._decode()
        self.steps += 1

    @torch.no_grad()
    def _prefill(self, requests: list[_Request], sequences: list[list[int]], record: bool) -> torch.Tensor:
        """Run `sequences` through the model as one left-padded batch, add them as rows, and return
        each one's next-token logits."""
        width = max(len(seq) for seq in sequences)
        ids = torch.tensor([[self._pad] * (width - len(seq)) + seq for seq in sequences], dtype=torch.long)
        mask = torch.tensor(
            [[0] * (width - len(seq)) + [1] * len(seq) for seq in sequences], dtype=torch.long
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            cache=cache,
            use_cache=True,
        )
        routes = self._recorder.take()  # [len(sequences) * width, layers, top_k]
        if record and routes is not None:
            per_row = routes.reshape(len(sequences), width, *routes.shape[1:])
            for request, seq, rows in zip(requests, sequences, per_row, strict=True):
                if request.want_routes:
                    request.routes.extend(rows[width - len(seq) :])
        self._join(requests, cache, mask)
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def _join(self, requests: list[_Request], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append prefilled rows to the batch, left-padding whichever side is shorter."""
        lengths = mask.sum(-1)
        if self._cache is None or not self._rows:
            self._cache, self._mask, self._rows = cache, mask, list(requests)
            self._next_position, self._last = lengths.clone(), torch.full((len(requests),), self._pad)
            return
        target = max(self._mask.shape[1], mask.shape[1])
        for mine, theirs in zip(_kv_layers(self._cache), _kv_layers(cache), strict=True):
            mine.keys, mine.values = (
                torch.cat([_left_pad(mine.keys, target), _left_pad(theirs.keys, target)]),
                torch.cat([_left_pad(mine.values, target), _left_pad(theirs.values, target)]),
            )
        self._mask = torch.cat([_left_pad_mask(self._mask, target), _left_pad_mask(mask, target)])
        self._rows += requests
        self._next_position = torch.cat([self._next_position, lengths])
        self._last = torch.cat([self._last, torch.full((len(requests),), self._pad)])

    @torch.no_grad()
    def _decode(self) -> None:
        assert self._cache is not None
        batch = len(self._rows)
        self._mask = torch.cat([self._mask, torch.ones(batch, 1, dtype=torch.long)], 1)
        out = self.model(
            input_ids=self._last[:, None].to(self.device),
            attention_mask=self._mask.to(self.device),
            position_ids=self._next_position[:, None].to(self.device),
            cache=self._cache,
            use_cache=True,
        )
        routes = self._recorder.take()
        self._next_position += 1
        for row, request in enumerate(self._rows):
            if request.finish is not None:
                continue
            if request.aborted:  # aborted while this step ran: its last input's route is not kept
                request.finish = FinishReason.ABORT
                continue
            if request.want_routes and routes is not None:
                request.routes.append(routes[row])
            self._emit(request, out.logits[row, -1], row)

    def _emit(self, request: _Request, logits: torch.Tensor, row: int) -> None:
        """Sample the next token of `request` from `logits` and decide whether it is finished."""
        if request.aborted:
            request.finish = FinishReason.ABORT
            return
        token, logprob = _sample(logits.float(), request.sampling, request.generator)
        request.tokens.append(token)
        request.logprobs.append(logprob)
        request.versions.append(self._version)
        self._last[row] = token
        sampling = request.sampling
        eos = token in self._eos and not sampling.ignore_eos
        if eos or token in sampling.stop_token_ids or self._hit_stop_string(request):
            request.finish = FinishReason.STOP
        elif (
            len(request.tokens) >= sampling.max_new_tokens
            or len(request.prompt) + len(request.tokens) >= self.max_context
        ):
            request.finish = FinishReason.LENGTH

    def _hit_stop_string(self, request: _Request) -> bool:
        if not request.sampling.stop_strings or self.tokenizer is None:
            return False
        longest = max(len(s) for s in request.sampling.stop_strings)
        tail = self.tokenizer.decode(request.tokens[-(longest + 8) :], skip_special_tokens=False)
        return any(tail.endswith(s) for s in request.sampling.stop_strings)

    def _answer_finished(self) -> None:
        for request in self._rows:
            if request.aborted and request.finish is None:
                request.finish = FinishReason.ABORT
        keep = [i for i, r in enumerate(self._rows) if r.finish is None]
        done = [r for r in self._rows if r.finish is not None]
        if not done:
            return
        for request in done:
            self._resolve(request)
        if not keep:
            self._rows, self._cache = [], None
            self._mask = torch.zeros((0, 0), dtype=torch.long)
            self._next_position = self._last = torch.zeros(0, dtype=torch.long)
            return
        index = torch.tensor(keep)
        assert self._cache is not None
        self._cache.batch_select_indices(index.to(self.device))
        self._rows = [self._rows[i] for i in keep]
        self._mask, self._next_position, self._last = (
            self._mask[index],
            self._next_position[index],
            self._last[index],
        )
        self._trim()

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row (left behind by a long row that left)."""
        used = self._mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else 0
        if start:
            assert self._cache is not None
            for layer in _kv_layers(self._cache):
                assert layer.keys is not None and layer.values is not None
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]
            self._mask = self._mask[:, start:]

    def _resolve(self, request: _Request) -> None:
        if request.future.done():
            return
        routes = None
        if request.want_routes and request.routes:
            # Every input whose next token was computed; a prefill whose token an abort discarded
            # leaves one row more, which is not part of the answer (SGLang's layout).
            end = len(request.prompt) + len(request.tokens) - 1
            kept = request.routes[request.routes_start : end]
            shape = request.routes[0].shape
            routes = np.stack(kept).astype(np.int32) if kept else np.zeros((0, *shape), dtype=np.int32)
        generation = Generation(
            tuple(request.tokens),
            tuple(request.logprobs),
            tuple(request.versions),
            request.finish or FinishReason.ABORT,
            routes,
            request.routes_start,
        )
        request.future.get_loop().call_soon_threadsafe(_set_result, request.future, generation)

    # -- weights --------------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        own = self.model.state_dict()
        unknown = set(state_dict) - set(own)
        if unknown:
            raise ValueError(f"unknown parameter names in the update: {sorted(unknown)[:5]}")
        for name, tensor in state_dict.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)} does not match {tuple(own[name].shape)}"
                )
            own[name].copy_(tensor)
        self._perturb_routers([name for name in state_dict if name in self._router_params], version)

    @torch.no_grad()
    def _perturb_routers(self, names: Iterable[str], version: int) -> None:
        """Add `router_noise` to the named router tensors just loaded as `version` (once per load)."""
        if not self.config.router_noise:
            return
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + version)
        for name in sorted(names):
            param = self._router_params[name]
            scale = self.config.router_noise * float(param.float().pow(2).mean().sqrt())
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_((noise * scale).to(device=param.device, dtype=param.dtype))

    @torch.no_grad()
    def _reprefill(self) -> None:
        """Rebuild every running row's KV cache under the current weights (AReaL's interruption)."""
        rows, self._rows, self._cache = self._rows, [], None
        # The last sampled token of each row has not been fed yet; everything before it is recomputed.
        # The routes recorded for those tokens stay: they are the ones the tokens were generated with.
        self._prefill(rows, [r.prompt + r.tokens[:-1] for r in rows], record=False)
        self._last = torch.tensor([r.tokens[-1] for r in rows])


def _kv_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's per-layer key/value holders (every layer of a dense or MoE decoder is a DynamicLayer)."""
    layers = list(cache.layers)
    if not all(isinstance(layer, DynamicLayer) for layer in layers):
        raise TypeError("the embedded engine supports models whose cache layers are all DynamicLayer")
    return cast(list[DynamicLayer], layers)


def _left_pad(tensor: torch.Tensor | None, width: int) -> torch.Tensor:
    if tensor is None:
        raise ValueError("a cache layer holds no keys/values yet")
    missing = width - tensor.shape[2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros((*tensor.shape[:2], missing, tensor.shape[3]))
    return torch.cat([pad, tensor], dim=2)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return mask if missing <= 0 else torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], 1)


def _set_result(future: asyncio.Future[Generation], generation: Generation) -> None:
    if not future.done():
        future.set_result(generation)


def _sample(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """A token and its log-prob under the distribution it was drawn from (temperature, top-k and top-p
    applied and renormalized); greedy when temperature is 0 (log-prob of the untempered softmax)."""
    if sampling.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    scaled = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(ordered, -1).cumsum(-1)
        drop = cumulative - torch.softmax(ordered, -1) >= sampling.top_p
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    logprobs = torch.log_softmax(scaled, -1)
    token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, float(logprobs[token])
