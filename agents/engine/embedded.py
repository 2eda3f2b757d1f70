"""The embedded engine: a transformers causal LM on torch with continuous batching, a KV cache,
per-token log-probs and versions, routed-expert capture, and in-place weight updates.

Continuous batching: the running requests are the rows of one left-padded KV cache held in buffers
that are allocated once and grown rarely (`slot_cache.SlotCache`): every row's last input sits in the same
column, so one decode step writes one column for all rows. Each engine step is one forward: every
running row feeds its last sampled token, and the prompts of the requests waiting to join follow in
the same sequence of tokens, unpadded, their keys going straight into free rows of the buffers. The
engine's own attention function (registered in transformers' AttentionInterface, switched on for the
engine's forwards only) lets each running row attend over its own columns and each prompt causally
over itself. A model whose attention it cannot reproduce (a sliding window) gets a prefill forward,
then a decode forward, per step, through its own attention. A finished or aborted row leaves the
batch at once and its caller is answered; the last row moves into its place (one row copied), and
columns no row needs any more are dropped by moving the cache's start (nothing copied). Sampling,
log-probs and routed experts are computed for all rows together, with one transfer to the host per
forward. Forward passes run on a worker thread, so the event loop (and the envs' tool calls) keep
going while the model computes; the worker steps back to back while there is work (one hand-over
per burst, not per step) and hands the batch back when a weight update waits.

A weight update waits for the current step, loads the new tensors in place and bumps the version;
in-flight requests carry on under the new weights. `interrupt="reprefill"` (AReaL-style) first
recomputes every running row's KV cache under the new weights; `interrupt="continue"` (PipelineRL-
style) keeps the cache built by the old ones. Either way each token records the version that
produced it, and the rollout driver makes a new segment where the version changes.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import torch

from pacerl.agents.engine.protocol import ContextOverflowError, FinishReason, Generation, SamplingParams
from pacerl.agents.engine.slot_cache import SlotCache, packable, register_slot_attention, slot_attention_on
from pacerl.agents.models import moe_info


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
    rng: random.Random
    """This request's own stream of uniforms: its draws depend on its seed alone."""
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

    Attached to this engine's model instance only (no module globals) and removed by `close`. The
    indices stay on the model's device until `take` moves all layers to the host in one transfer.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.gates = _find_gates(model)
        self.indices: list[torch.Tensor | None] = [None] * len(self.gates)
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in enumerate(self.gates)]

    def _hook(self, layer: int) -> Any:
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            # An adapted router returns (logits, weights, indices) (agents.models.MoEAdapter).
            chosen = output[2]
            self.indices[layer] = chosen.detach().reshape(-1, chosen.shape[-1])

        return record

    def take(self) -> np.ndarray | None:
        """`[positions, layers, top_k]` from the last forward, or None for a dense model."""
        if not self.gates or any(i is None for i in self.indices):
            return None
        stacked = torch.stack(cast(list[torch.Tensor], self.indices), dim=1).to(torch.int32)
        self.clear()
        return stacked.cpu().numpy()

    def clear(self) -> None:
        """Forget the last forward's indices (nobody asked for them)."""
        self.indices = [None] * len(self.gates)

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
        self._text_config = model.config.get_text_config(decoder=True)
        layers = int(self._text_config.num_hidden_layers)
        self._cache = SlotCache(layers, self.config.max_batch, self.device)
        self._packed = packable(model)
        """One forward per step, the joining prompts packed after the running rows' tokens (the engine's
        own attention), where the model's attention allows; else a prefill forward, then a decode one."""
        self._joining: list[_Request] = []
        """The requests joining in this step's packed forward."""
        if self._packed:
            register_slot_attention()
        self._positions = torch.zeros(self.config.max_batch, dtype=torch.long, device=self.device)
        """Each row's next input position."""
        self._last = torch.zeros(self.config.max_batch, dtype=torch.long, device=self.device)
        """Each row's last sampled token: its next input."""
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._pausing = 0
        """Weight updates waiting for the worker to hand the batch back."""
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
        seed = sampling.seed if sampling.seed is not None else self.config.seed * 1_000_003 + next(self._ids)
        loop = asyncio.get_running_loop()
        request = _Request(
            request_id or f"req-{next(self._ids)}",
            prompt,
            sampling,
            return_routed_experts,
            start,
            loop.create_future(),
            random.Random(seed),
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
        self._pausing += 1  # the worker hands the batch back after its current step
        try:
            async with self._step_lock:
                await asyncio.to_thread(self._load, state_dict, version)
                self._version = version
                if self.config.interrupt == "reprefill" and self._rows:
                    await asyncio.to_thread(self._reprefill)
        finally:
            self._pausing -= 1

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
                    await asyncio.to_thread(self._serve)
                await asyncio.sleep(0)  # let a weight update in
        except BaseException as error:  # a model failure must reach every waiting caller, not vanish
            for request in [*self._pending, *self._rows]:
                if not request.future.done():
                    request.future.set_exception(RuntimeError(f"the engine failed: {error!r}"))
            self._pending, self._rows = [], []
            self._cache.clear()
            raise

    @torch.inference_mode()  # the cache and every forward: no autograd bookkeeping at all
    def _serve(self) -> None:
        """Step until no request is left or a weight update waits: one hand-over to the worker thread
        for a burst of steps, not one per step. Requests, aborts and closing reach the steps through
        `_pending` and the requests' flags."""
        with self._own_attention():
            while (self._pending or self._rows) and not self._pausing:
                self._step()

    def _own_attention(self) -> AbstractContextManager[None]:
        """The engine's attention switched on for the model (packed forwards need it), while inside."""
        return slot_attention_on(self._text_config) if self._packed else nullcontext()

    def _step(self) -> None:
        """One engine step: admit waiting requests (one batched prefill), then decode every row. Rows
        that finish (or were aborted) leave and are answered as soon as they do."""
        self._release()
        admitted: list[_Request] = []
        for request in list(self._pending):
            if request.aborted:
                request.finish = FinishReason.ABORT
                self._pending.remove(request)
                self._resolve(request)
            elif len(self._rows) + len(admitted) < self.config.max_batch:
                self._pending.remove(request)
                admitted.append(request)
        if self._packed:
            self._joining = admitted
        elif admitted:
            first_row = len(self._rows)
            logits = self._prefill(admitted, [r.prompt for r in admitted], record=True)
            self._emit(admitted, first_row, logits, None)
            self._release()
        if self._rows or self._joining:
            self._decode()
            self._release()
        self.steps += 1

    def _prefill(self, requests: list[_Request], sequences: list[list[int]], record: bool) -> torch.Tensor:
        """Run `sequences` through the model as one left-padded batch straight into free rows of the
        cache, add them as rows, and return each one's next-token logits."""
        width = max(len(seq) for seq in sequences)
        ids = torch.tensor([[self._pad] * (width - len(seq)) + seq for seq in sequences], dtype=torch.long)
        lengths = torch.tensor([len(seq) for seq in sequences])
        mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        mask = mask.to(self.device)
        first_row = len(self._rows)
        self._cache.join(mask, [len(seq) for seq in sequences])
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask,
            position_ids=positions.to(self.device),
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if record and any(r.want_routes for r in requests):
            routes = self._recorder.take()  # [len(sequences) * width, layers, top_k]
        else:
            routes = None
            self._recorder.clear()
        if routes is not None:
            per_row = routes.reshape(len(sequences), width, *routes.shape[1:])
            for request, seq, rows in zip(requests, sequences, per_row, strict=True):
                if request.want_routes:
                    request.routes.extend(rows[width - len(seq) :])
        self._rows += requests
        self._positions[first_row : first_row + len(requests)] = lengths.to(self.device)
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def _decode(self) -> None:
        """Decode one token for every row (packed: and prefill the requests joining in this step)."""
        if self._packed:
            joining, self._joining = self._joining, []
            logits, routes = self._forward_packed(joining, [r.prompt for r in joining], record=True)
            self._emit(self._rows, 0, logits, routes)
            return
        rows = len(self._rows)
        mask = self._cache.decode()
        out = self.model(
            input_ids=self._last[:rows, None],
            attention_mask=mask,
            position_ids=self._positions[:rows, None],
            cache=self._cache,
            use_cache=True,
        )
        self._cache.advance()
        self._positions[:rows] += 1
        if any(r.want_routes for r in self._rows):
            routes = self._recorder.take()
        else:
            routes = None
            self._recorder.clear()
        self._emit(self._rows, 0, out.logits[:, -1], routes)

    def _forward_packed(
        self, joining: list[_Request], sequences: list[list[int]], record: bool
    ) -> tuple[torch.Tensor, np.ndarray | None]:
        """One forward for the whole batch: every running row feeds its last token, and `sequences` (of
        the `joining` requests) are prefilled into new rows, all packed into one sequence of tokens
        without padding. Adds the new rows; returns every row's next-token logits `[rows, vocab]` and,
        when a running row wants them, the running rows' input routes `[running rows, layers, top_k]`."""
        rows, lengths = len(self._rows), [len(seq) for seq in sequences]
        ids, positions = self._last[:rows], self._positions[:rows]
        mask, keep, ends = None, None, list(itertools.accumulate(lengths, initial=rows - 1))[1:]
        if sequences:  # else every position's logits are kept: one per running row
            width = max(lengths)
            padding = width - torch.tensor(lengths)
            mask = (torch.arange(width)[None, :] >= padding[:, None]).to(self.device)
            prompts = torch.tensor([token for seq in sequences for token in seq], device=self.device)
            steps = torch.tensor([step for length in lengths for step in range(length)], device=self.device)
            ids, positions = torch.cat([ids, prompts]), torch.cat([positions, steps])
            keep = torch.tensor([*range(rows), *ends], device=self.device)
        packed = self._cache.pack(mask, lengths)
        out = self.model(  # inside `_own_attention`
            input_ids=ids[None],
            position_ids=positions[None],
            cache=self._cache,
            use_cache=True,
            logits_to_keep=0 if keep is None else keep,
            slot_plan=packed,
        )
        if packed.calls != len(self._cache.slot_layers):
            raise RuntimeError(
                f"{packed.calls} attention calls for {len(self._cache.slot_layers)} layers: this model's "
                "attention does not go through transformers' AttentionInterface"
            )
        self._cache.advance()
        self._positions[:rows] += 1
        wanted = any(r.want_routes for r in self._rows) or (record and any(r.want_routes for r in joining))
        routes = self._recorder.take() if wanted else None  # [tokens, layers, top_k]
        if routes is None:
            self._recorder.clear()
        elif record:
            for request, end, length in zip(joining, ends, lengths, strict=True):
                if request.want_routes:
                    request.routes.extend(routes[end + 1 - length : end + 1])
        if joining:
            self._rows += joining
            self._positions[rows : rows + len(joining)] = torch.tensor(lengths, device=self.device)
        logits: torch.Tensor = out.logits[0]
        return logits, None if routes is None else routes[:rows]

    def _emit(
        self, requests: Sequence[_Request], first_row: int, logits: torch.Tensor, routes: np.ndarray | None
    ) -> None:
        """Sample the next token of rows `first_row`.. (`requests`, in order) from `logits`
        `[rows, vocab]`, record it with the row's input route (`routes` covers the first rows, those
        that fed a decoded token), and decide which rows are finished. A row aborted meanwhile gets
        no token (and its last input's route is not kept)."""
        uniforms = [
            r.rng.random() if r.finish is None and not r.aborted and r.sampling.temperature != 0 else 0.0
            for r in requests
        ]
        tokens, logprobs = _sample(logits.float(), [r.sampling for r in requests], uniforms)
        self._last[first_row : first_row + len(requests)] = tokens
        drawn = torch.stack([tokens.double(), logprobs.double()]).cpu().tolist()  # one transfer
        for row, (request, token, logprob) in enumerate(zip(requests, *drawn, strict=True)):
            if request.finish is not None:
                continue
            if request.aborted:
                request.finish = FinishReason.ABORT
                continue
            if routes is not None and row < len(routes) and request.want_routes:
                request.routes.append(routes[row])
            token = int(token)
            request.tokens.append(token)
            request.logprobs.append(logprob)
            request.versions.append(self._version)
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

    def _release(self) -> None:
        """Answer the finished and aborted rows and take them out of the batch."""
        leaving = []
        for row, request in enumerate(self._rows):
            if request.finish is None and request.aborted:
                request.finish = FinishReason.ABORT
            if request.finish is not None:
                leaving.append(row)
                self._resolve(request)
        if not leaving:
            return
        movers, holes = self._cache.remove(leaving)
        if holes:
            source = torch.tensor(movers, device=self.device)
            target = torch.tensor(holes, device=self.device)
            self._positions[target] = self._positions[source]
            self._last[target] = self._last[source]
            for hole, mover in zip(holes, movers, strict=True):
                self._rows[hole] = self._rows[mover]
        del self._rows[len(self._rows) - len(leaving) :]

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

    @torch.inference_mode()
    def _reprefill(self) -> None:
        """Rebuild every running row's KV cache under the current weights (AReaL's interruption)."""
        rows, self._rows = self._rows, []
        self._cache.clear()
        # The last sampled token of each row has not been fed yet; everything before it is recomputed.
        # The routes recorded for those tokens stay: they are the ones the tokens were generated with.
        sequences = [r.prompt + r.tokens[:-1] for r in rows]
        if self._packed:
            with self._own_attention():
                self._forward_packed(rows, sequences, record=False)
        else:
            self._prefill(rows, sequences, record=False)
        self._last[: len(rows)] = torch.tensor([r.tokens[-1] for r in rows], device=self.device)


def _set_result(future: asyncio.Future[Generation], generation: Generation) -> None:
    if not future.done():
        future.set_result(generation)


def _sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens `[rows]` and their log-probs `[rows]` from `logits` `[rows, vocab]` (float32), all
    rows at once. A greedy row (temperature 0) takes the argmax and its log-prob under the untempered
    softmax. Any other row draws by inverse CDF at its `uniforms` entry (in [0, 1)) from the
    distribution with its temperature, top-k and top-p applied and renormalized, and gets its token's
    log-prob under that distribution."""
    tokens = logits.argmax(-1)
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    drawn = [row for row, p in enumerate(params) if p.temperature != 0]
    if not drawn:
        return tokens, logprobs
    device, vocab = logits.device, logits.shape[-1]
    chosen = [params[row] for row in drawn]
    index = torch.tensor(drawn, device=device)
    temperature = torch.tensor([p.temperature for p in chosen], dtype=logits.dtype, device=device)
    scaled = logits[index] / temperature[:, None]
    if any(p.top_k for p in chosen):
        keep = torch.tensor([min(p.top_k, vocab) if p.top_k else vocab for p in chosen], device=device)
        kth = torch.sort(scaled, -1, descending=True).values.gather(-1, keep[:, None] - 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if any(p.top_p < 1 for p in chosen):
        top_p = torch.tensor([p.top_p for p in chosen], dtype=logits.dtype, device=device)[:, None]
        ordered, order = torch.sort(scaled, -1, descending=True)
        mass = torch.softmax(ordered, -1)
        drop = (mass.cumsum(-1) - mass >= top_p) & (top_p < 1)
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    table = torch.log_softmax(scaled, -1)
    cdf = table.exp().double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    at = torch.tensor([uniforms[row] for row in drawn], dtype=torch.float64, device=device)[:, None] * total
    # `right=True` never lands on a token of probability 0; the bound guards `at` rounded up to the total.
    picked = torch.minimum(torch.searchsorted(cdf, at, right=True), torch.searchsorted(cdf, total))
    tokens[index] = picked.squeeze(-1)
    logprobs[index] = table.gather(-1, picked).squeeze(-1)
    return tokens, logprobs
