"""The engines of `runtime = "ray"`: `EngineActor`, one engine replica (an `EmbeddedEngine` on its own
copy of the model, on CPU or a GPU, or the client of one SGLang server), and `EngineRouter`, the engine
the driver talks to, spreading the episodes over the replicas and publishing weights to them."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError

from pacerl.agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from pacerl.agents.engine.protocol import Generation, SamplingParams
from pacerl.agents.engine.sglang import SGLangEngine, SGLangOptions
from pacerl.agents.models import layout_of
from pacerl.ray_runtime.supervisor import FaultLog, Slot, Supervisor, quiet
from pacerl.ray_runtime.weights import ModelRecipe, PublishedWeights, WeightSpec, join_broadcast_group

MAX_STICKY_SESSIONS = 100_000
"""Episodes whose replica the router remembers (the oldest are forgotten first)."""


class ReplicaNotReady(RuntimeError):  # noqa: N818 (a state, like the SGLang client's SGLangUnavailable)
    """The replica has not been told which weights to serve yet (it was just created)."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine replica."""

    recipe: ModelRecipe | None
    """The model of an embedded engine; of an SGLang client, the model whose checkpoint layout its
    published weights are renamed into (None: published as named)."""
    tokenizer: Any
    """The tokenizer (stop strings are matched on decoded text)."""
    embedded: EmbeddedEngineConfig
    """Options of an embedded engine."""
    sglang: SGLangOptions | None
    """The server of an SGLang client (None: embedded)."""
    threads: int
    """torch threads of the replica's process."""
    device: str
    """Where an embedded engine runs: `cpu`, or `cuda` on a replica that was given a GPU."""


class EngineActor:
    """One engine replica. It refuses work (`ReplicaNotReady`) until the router has told it which
    weights to serve (`sync`): a replacement starts without the current weights and must not generate
    before it holds them."""

    def __init__(self, spec: EngineSpec, state: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """`state` of `version` for an embedded engine (an SGLang server holds its own), or None with
        version -1: no weights yet, the first `sync` brings them (a replacement)."""
        torch.set_num_threads(spec.threads)
        self.engine: EmbeddedEngine | SGLangEngine
        if spec.sglang is not None:
            layout = (
                None if spec.recipe is None else layout_of(spec.recipe.model_class, spec.recipe.model_config)
            )
            self.engine = SGLangEngine(spec.sglang, version=version, layout=layout)
        else:
            if spec.recipe is None or (state is None and version >= 0):
                raise ValueError("an embedded replica needs the model recipe, and the weights of its version")
            model = spec.recipe.build(state, spec.device)
            self.engine = EmbeddedEngine(model, spec.tokenizer, spec.embedded, version=version)
        self.serving = False
        self.outstanding = 0
        """Generations running now (what the router's least-outstanding balancing estimates)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str | None,
        return_routed_experts: bool,
        routed_experts_start_len: int = 0,
    ) -> Generation:
        if not self.serving:
            raise ReplicaNotReady("this engine replica has not been synced since it started")
        self.outstanding += 1
        try:
            return await self.engine.generate(
                input_ids,
                sampling,
                request_id=request_id,
                return_routed_experts=return_routed_experts,
                routed_experts_start_len=routed_experts_start_len,
            )
        finally:
            self.outstanding -= 1

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def sync(self, state: Mapping[str, torch.Tensor] | None, version: int) -> int:
        """Serve `version`: load `state` unless this replica already holds that version or a newer one
        (in-flight generations go on under the new weights, each token tagged). Its version after."""
        if version > self.engine.version:
            if state is None:
                raise ValueError(
                    f"version {version} (this replica: {self.engine.version}) came without weights"
                )
            await self.engine.update_weights(state, version)
        self.serving = True
        return self.engine.version

    async def version(self) -> int:
        """The version of the weights this replica serves."""
        return self.engine.version

    async def ping(self) -> int:
        """The process id (answers as soon as the actor is up)."""
        return os.getpid()

    async def load(self) -> int:
        """Generations running now."""
        return self.outstanding

    async def join_group(self, address: str, world_size: int, rank: int, backend: str) -> None:
        """Join the trainer's broadcast group (blocks until every member has joined)."""
        await asyncio.to_thread(join_broadcast_group, address, world_size, rank, backend)

    async def receive_weights(self, specs: Sequence[WeightSpec], version: int) -> int:
        """Receive one broadcast of the trainer's weights and serve them as `version`."""
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"

        def receive() -> dict[str, torch.Tensor]:
            received = {}
            for name, shape, dtype in specs:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(buffer, src=0)
                received[name] = buffer
            return received

        state = await asyncio.to_thread(receive)
        return await self.sync(state, version)

    async def aclose(self) -> None:
        await self.engine.aclose()


class EngineRouter:
    """The engine protocol over N replicas (see the package docstring). `version` is the last version
    published to every replica."""

    def __init__(
        self,
        supervisor: Supervisor,
        faults: FaultLog,
        trainer: Any,
        initial: Any,
        version: int = 0,
        broadcast: list[WeightSpec] | None = None,
    ) -> None:
        self.supervisor, self.faults, self.trainer = supervisor, faults, trainer
        self._version = version
        self._latest: tuple[Any, int] | None = (initial, version)
        """The reference and version of the last weights published through the object store (None
        after a broadcast, which leaves no copy there: a replica that comes back then loads a snapshot
        of the trainer's current weights, tagged with their own version)."""
        self._broadcast = broadcast
        self._sessions: OrderedDict[str, Slot] = OrderedDict()
        self._requests: dict[str, Slot] = {}
        supervisor.prepare = self._sync

    @property
    def version(self) -> int:
        return self._version

    @property
    def replicas(self) -> list[Any]:
        """The current actor handle of each replica."""
        return [slot.handle for slot in self.supervisor.slots]

    def replica_states(self) -> list[str]:
        """`ready`, `recovering` or `dead`, per replica."""
        return ["dead" if s.dead else "ready" if s.ready else "recovering" for s in self.supervisor.slots]

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        return_routed_experts: bool = False,
        session: str | None = None,
        routed_experts_start_len: int = 0,
    ) -> Generation:
        """Generate on the session's replica (a new session: the least loaded one); a generation lost
        with its replica is sent again, from the same tokens, to a live one. Routes are returned from
        input position `routed_experts_start_len` on
        (`pacerl.agents.engine.protocol.EngineWithRoutesStart`)."""
        request_id = request_id or uuid.uuid4().hex
        tokens = list(input_ids)
        while True:
            slot = await self.supervisor.pick(self._sessions.get(session) if session is not None else None)
            if session is not None:
                self._remember(session, slot)
            slot.outstanding += 1
            self._requests[request_id] = slot
            try:
                generation: Generation = await slot.handle.generate.remote(
                    tokens, sampling, request_id, return_routed_experts, routed_experts_start_len
                )
                return generation
            except (RayActorError, ReplicaNotReady) as error:
                self.supervisor.lost(slot, error)
                self.faults.resumed(session, actor=slot.name, tokens=len(tokens))
            finally:
                slot.outstanding -= 1
                self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        slot = self._requests.get(request_id)
        if slot is not None:
            with quiet():
                await slot.handle.abort.remote(request_id)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Make `version` current on every live replica (one copy in the object store, or one broadcast);
        replicas recovering meanwhile load it when they are back."""
        if version <= self._version:
            raise ValueError(f"the new version {version} must exceed the current {self._version}")
        self._version = version
        slots = self.supervisor.slots
        if self._broadcast is not None and any(slot.generation or not slot.ready for slot in slots):
            # A replacement is no member of the broadcast group, and a lost member would hang it.
            self._broadcast = None
            self.faults.event("weight_sync_fell_back_to_object_store")
        if self._broadcast is not None:
            self._latest = None
            await asyncio.gather(
                self.trainer.broadcast_weights.remote(version),
                *(slot.handle.receive_weights.remote(self._broadcast, version) for slot in slots),
            )
            return
        ref = state_dict.ref() if isinstance(state_dict, PublishedWeights) else ray.put(dict(state_dict))
        self._latest = (ref, version)
        await asyncio.gather(*(self._sync_live(slot) for slot in slots if slot.ready))

    async def _sync_live(self, slot: Slot) -> None:
        try:
            await self._sync(slot)
        except RayActorError as error:
            self.supervisor.lost(slot, error)

    async def _sync(self, slot: Slot) -> None:
        """Bring `slot`'s replica to the latest published weights and let it serve."""
        async with slot.lock:
            if self._latest is None:
                version, ref = await self.trainer.snapshot.remote()
            else:
                ref, version = self._latest
            await slot.handle.sync.remote(ref, version)

    async def health(self) -> bool:
        return any(slot.ready for slot in self.supervisor.slots)

    async def aclose(self) -> None:
        await self.supervisor.aclose()

    def _remember(self, session: str, slot: Slot) -> None:
        self._sessions[session] = slot
        self._sessions.move_to_end(session)
        while len(self._sessions) > MAX_STICKY_SESSIONS:
            self._sessions.popitem(last=False)
