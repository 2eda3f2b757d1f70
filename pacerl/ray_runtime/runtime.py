"""`runtime = "ray"`: engine replicas, environment workers and the trainer as Ray actors
(`pacerl.ray_runtime.engines`), under the local runtime's own rollout driver, pool, filter and loops.

The runtime only decides where each part runs. The driver process keeps the `Run`; it sees

- an `EngineRouter` where it had an engine: least-outstanding-requests balancing over the replicas,
  every turn of one episode on the same replica (its prefix cache), and a generation lost with its
  replica sent again to another one, so the driver sees one continuous generation;
- a `RemoteEnv` where it had an env: the episode lives on an environment worker; when the worker dies
  the episode is rebuilt on another one by replaying its completed actions (or, if that fails, the
  driver plays it again from the start: `agents.rollout.EpisodeLost`);
- a `RemoteLearner` where it had a learner: every call goes to the trainer actor, and published
  weights go from the trainer to the replicas through the object store (or a torch.distributed
  broadcast) without passing through the driver.

Dead engine replicas and environment workers are replaced by new actors (an engine loads the current
weights first) up to `ray.max_restarts` times each; every recovery is counted in the run's `faults`
(metrics `faults/*`, the summary, checkpoints) and logged in `faults.jsonl`. A dead trainer ends the
run (`TrainerLostError`) pointing at the checkpoint to resume from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from agents.engine.embedded import EmbeddedEngineConfig
from agents.engine.protocol import Generation, SamplingParams
from agents.rollout import EpisodeEnv
from agents.trajectory import Trajectory
from envs import Message, ToolEnv
from pacerl.config import RaySpec, RunConfig
from pacerl.ray_runtime.engines import (
    EngineActor,
    EngineSpec,
    ModelRecipe,
    ReplicaNotReady,
    TrainerActor,
    WeightSpec,
)
from pacerl.ray_runtime.envs import EnvWorker, Step
from trainer.checkpoint import latest_checkpoint
from trainer.learner import StepResult
from trainer.loop import Run

log = logging.getLogger(__name__)

NAMESPACE = "pacerl"
"""The Ray namespace of the actors of a run that connects by itself (`ray list actors`,
`ray.get_actor(name, namespace=NAMESPACE)`); each actor's name holds the run directory."""
FAULT_LOG = "faults.jsonl"
"""The run directory's log of every recovery, one JSON object a line."""
MAX_STICKY_SESSIONS = 100_000
"""Episodes whose replica the router remembers (the oldest are forgotten first)."""


class TrainerLostError(RuntimeError):
    """The trainer actor died: its weights and optimizer are gone, the run must resume a checkpoint."""


class ReplicasLostError(Exception):  # not a RuntimeError: the driver would retry it per request
    """Every engine replica (or environment worker) is dead and out of restarts: the run cannot go on."""


def connect(spec: RaySpec) -> bool:
    """Join the cluster at `spec.address`, or start a local one; True when this call did (so that
    `ray.shutdown` is the caller's to call), False when this process was already connected."""
    if ray.is_initialized():
        return False
    if spec.address is None:
        ray.init(num_cpus=spec.num_cpus, namespace=NAMESPACE)
    else:
        ray.init(address=spec.address, namespace=NAMESPACE)
    return True


class FaultLog:
    """Counts of what the runtime recovered from (the run's `faults`) and one line per event in
    `faults.jsonl`, naming the actor and, where one was hit, the trajectory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: Counter[str] = Counter()
        self._resumed: set[str] = set()

    def event(self, kind: str, **details: Any) -> None:
        self.counts[kind] += 1
        line = {"time": time.time(), "event": kind, **details}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")

    def resumed(self, trajectory_id: str | None, **details: Any) -> None:
        """A request of `trajectory_id` was lost with its actor and is being sent again."""
        if trajectory_id is not None and trajectory_id not in self._resumed:
            self._resumed.add(trajectory_id)
            self.counts["trajectories_resumed"] += 1
        self.event("engine_request_retried", trajectory=trajectory_id, **details)


class _Slot:
    """One supervised actor: its current handle, whether it may take work, and its load."""

    def __init__(self, index: int, name: str, handle: Any) -> None:
        self.index, self.name, self.handle = index, name, handle
        self.generation = 0
        """Actors that have held this slot before the current one (replacements)."""
        self.ready = True
        self.dead = False
        self.outstanding = 0
        self.assigned = 0
        self.lock = asyncio.Lock()
        self.recovering: asyncio.Future[None] | None = None


class _Supervisor:
    """Brings lost actors back: waits for one that is only unreachable to answer again, replaces one
    that is gone (a crash, `ray.kill`, a lost node), then `prepare`s it (an engine loads the current
    weights); a slot out of restarts is dead. `pick` waits for a ready slot.

    Ray's own actor restarts stay off: a restarted engine would come back with the weights it was
    created with, and Ray cannot hand it the current ones; a replacement is created with them."""

    def __init__(
        self,
        kind: str,
        slots: list[_Slot],
        spawn: Callable[[_Slot], Any],
        prepare: Callable[[_Slot], Awaitable[None]],
        spec: RaySpec,
        faults: FaultLog,
    ) -> None:
        self.kind, self.slots, self.spawn, self.prepare = kind, slots, spawn, prepare
        self.spec, self.faults = spec, faults
        self._changed = asyncio.Event()

    async def pick(self, prefer: _Slot | None = None) -> _Slot:
        """`prefer` if it is ready, else the ready slot with the fewest outstanding calls."""
        while True:
            changed = self._changed
            if prefer is not None and prefer.ready:
                return prefer
            ready = [slot for slot in self.slots if slot.ready]
            if ready:
                chosen = min(ready, key=lambda slot: (slot.outstanding, slot.assigned))
                chosen.assigned += 1
                return chosen
            if all(slot.dead for slot in self.slots):
                raise ReplicasLostError(f"every {self.kind} actor died and used up ray.max_restarts")
            await changed.wait()

    def lost(self, slot: _Slot, error: BaseException) -> None:
        """A call to `slot` failed because its actor is gone or not ready: recover it (once)."""
        if not slot.ready or slot.dead:
            return
        slot.ready = False
        log.warning("%s lost: %s", slot.name, _brief(error))
        self.faults.event(f"{self.kind}_lost", actor=slot.name, error=_brief(error))
        slot.recovering = asyncio.ensure_future(self._recover(slot))

    async def _recover(self, slot: _Slot) -> None:
        replace = False
        try:
            while True:
                if not replace and await self._answers(slot):  # only unreachable for a while
                    self.faults.event(f"{self.kind}_reconnected", actor=slot.name)
                else:
                    with _quiet():
                        ray.kill(slot.handle)
                    if slot.generation >= self.spec.max_restarts:
                        slot.dead = True
                        self.faults.event(f"{self.kind}_out_of_restarts", actor=slot.name)
                        return
                    slot.generation += 1
                    slot.handle = self.spawn(slot)
                    self.faults.event(f"{self.kind}_replaced", actor=slot.name, generation=slot.generation)
                try:
                    await asyncio.wait_for(self.prepare(slot), self.spec.restart_timeout_s)
                except (RayActorError, TimeoutError) as error:  # died again, or never came up
                    log.warning("%s lost again while recovering: %s", slot.name, _brief(error))
                    replace = True
                    continue
                slot.ready = True
                return
        finally:
            self._notify()

    async def _answers(self, slot: _Slot) -> bool:
        """True when the actor answers, False when it is gone or did not answer in `restart_timeout_s`."""
        deadline = time.monotonic() + self.spec.restart_timeout_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(slot.handle.ping.remote(), deadline - time.monotonic())
                return True
            except ActorDiedError:
                return False
            except RayActorError:  # unavailable (a network partition): calls fail fast until it is back
                await asyncio.sleep(0.2)
            except TimeoutError:
                return False
        return False

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def aclose(self) -> None:
        for slot in self.slots:
            if slot.recovering is not None:
                slot.recovering.cancel()
            with _quiet():
                ray.kill(slot.handle)
        pending = [slot.recovering for slot in self.slots if slot.recovering is not None]
        await asyncio.gather(*pending, return_exceptions=True)


class PublishedWeights(Mapping[str, torch.Tensor]):
    """The trainer's weights of one version, left in the trainer's process until someone reads them:
    the router hands the object-store reference to the replicas (the driver never holds a copy); a
    local reader (the background evaluator's engine) fetches them on first access."""

    def __init__(self, trainer: Any, version: int) -> None:
        self.trainer, self.version = trainer, version
        self._ref: Any = None
        self._state: dict[str, torch.Tensor] | None = None

    def ref(self) -> Any:
        """The object-store reference of the state dict (made once, on first use)."""
        if self._ref is None:
            self._ref = self.trainer.weights.remote(self.version)
        return self._ref

    def _fetched(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            self._state = ray.get(self.ref())
        return self._state

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._fetched()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetched())

    def __len__(self) -> int:
        return len(self._fetched())


class RemoteLearner:
    """The learner as the loop sees it (`trainer.learner.LearnerLike`), living in the trainer actor."""

    def __init__(self, handle: Any, run_dir: Path) -> None:
        self.handle, self.run_dir = handle, run_dir
        self.alive = True
        version, counts = self._call("status")
        self.version: int = version
        self.counts: Counter[str] = Counter(counts)

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> StepResult:
        result, self.version, counts = self._call("train_step", [list(group) for group in groups])
        self.counts = Counter(counts)
        return result  # type: ignore[no-any-return]

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return self._call("prefix_drift", list(trajectories))  # type: ignore[no-any-return]

    def weights(self) -> PublishedWeights:
        return PublishedWeights(self.handle, self.version)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, counts = self._call("load_state_dict", state)
        self.counts = Counter(counts)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.handle, method).remote(*args))
        except RayActorError as error:
            self.alive = False
            raise TrainerLostError(self._lost_message(error)) from None

    def _lost_message(self, error: BaseException) -> str:
        latest = latest_checkpoint(self.run_dir / "checkpoints")
        where = (
            f"continue it from {latest.name} with `pacerl train --resume {self.run_dir}`"
            if latest is not None
            else "it had no checkpoint yet (set loop.checkpoint_every): start it again"
        )
        return f"the trainer actor died ({_brief(error)}); the run stops: {where}"


class EngineRouter:
    """The engine protocol over N replicas (see the module docstring). `version` is the last version
    published to every replica."""

    def __init__(
        self,
        supervisor: _Supervisor,
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
        self._sessions: OrderedDict[str, _Slot] = OrderedDict()
        self._requests: dict[str, _Slot] = {}
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
        input position `routed_experts_start_len` on (`agents.engine.protocol.EngineWithRoutesStart`)."""
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
            with _quiet():
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

    async def _sync_live(self, slot: _Slot) -> None:
        try:
            await self._sync(slot)
        except RayActorError as error:
            self.supervisor.lost(slot, error)

    async def _sync(self, slot: _Slot) -> None:
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

    def _remember(self, session: str, slot: _Slot) -> None:
        self._sessions[session] = slot
        self._sessions.move_to_end(session)
        while len(self._sessions) > MAX_STICKY_SESSIONS:
            self._sessions.popitem(last=False)


class RemoteEnv:
    """An episode played on an environment worker, with the env interface the driver uses.

    `reset` runs on a local env of the same maker (a reset only poses the task, and the loop must not
    wait on a worker for it); the worker's env is reset by the first step. The actions stepped so far
    are kept, so that a worker lost mid-episode is replaced by another one replaying them."""

    def __init__(self, workers: _Supervisor, make_env: Callable[[], EpisodeEnv]) -> None:
        self._workers, self._make_env = workers, make_env
        self._key = uuid.uuid4().hex
        self._options: dict[str, Any] | None = None
        self._schemas: list[dict[str, Any]] = []
        self._actions: list[str] = []
        self._slot: _Slot | None = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        self.close()
        local = self._make_env()
        try:
            observation, info = local.reset(seed=seed, options=options)
            self._schemas = local.tool_schemas()
        finally:
            local.close()
        self._options, self._actions = dict(options or {}), []
        return observation, info

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self._schemas

    async def astep(self, action: str) -> Step:
        if self._options is None:
            raise RuntimeError("step before reset")
        while True:
            fresh = self._slot is None
            if self._slot is None:
                self._slot = await self._workers.pick()
                self._slot.outstanding += 1
            slot = self._slot
            try:
                step: Step = await slot.handle.step.remote(
                    self._key, action, self._options if fresh else None, list(self._actions) if fresh else []
                )
            except RayActorError as error:
                self._workers.lost(slot, error)
                self._release_slot()
                replayed = len(self._actions)
                self._workers.faults.event("env_episode_resumed", actor=slot.name, replayed=replayed)
                continue
            self._actions.append(action)
            return step

    def close(self) -> None:
        if self._slot is not None:
            self._slot.handle.close.remote(self._key)  # nothing to wait for
            self._release_slot()

    def _release_slot(self) -> None:
        if self._slot is not None:
            self._slot.outstanding -= 1
            self._slot = None


class RayRuntime:
    """The actors of one run and the driver-side handles on them: `engine`, `learner` and `make_env`
    stand where the local runtime has an engine, a learner and an env maker."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        model: Any,
        tokenizer: Any,
        make_env: Callable[[], ToolEnv],
    ) -> None:
        spec = config.ray
        self.spec, self.model = spec, model
        self.owns_ray = connect(spec)
        self.faults = FaultLog(run_dir / FAULT_LOG)
        self._started: list[Any] = []
        try:
            self._start(config, run_dir, tokenizer, make_env)
        except BaseException:  # leave nothing running behind a run that could not start
            for handle in self._started:
                with _quiet():
                    ray.kill(handle)
            if self.owns_ray:
                ray.shutdown()
            raise

    def _start(
        self, config: RunConfig, run_dir: Path, tokenizer: Any, make_env: Callable[[], ToolEnv]
    ) -> None:
        spec, model = self.spec, self.model
        prefix = f"pacerl:{run_dir.resolve()}"
        recipe = ModelRecipe(type(model), model.config)
        embedded = config.engine_backend == "embedded"
        initial = ray.put({name: tensor.detach() for name, tensor in model.state_dict().items()})
        self.trainer: Any = (
            ray.remote(TrainerActor)
            .options(
                name=f"{prefix}:trainer",
                num_cpus=spec.trainer_cpus,
                num_gpus=spec.trainer_gpus,
                max_restarts=0,
            )
            .remote(
                recipe,
                initial,
                config.learner,
                int(tokenizer.pad_token_id or 0),
                _threads(spec.trainer_cpus),
                config.seed,
            )
        )
        self._started.append(self.trainer)
        engine_specs = _engine_specs(config, run_dir, recipe, tokenizer)

        def spawn_engine(slot: _Slot, weights: Any = None, version: int = -1) -> Any:
            """A replica for `slot`; by default without weights: the supervisor's `prepare` loads the
            current ones before it takes work."""
            name = f"{prefix}:engine-{slot.index}" + (f".{slot.generation}" if slot.generation else "")
            handle = (
                ray.remote(EngineActor)
                .options(
                    name=name,
                    num_cpus=spec.engine_cpus,
                    num_gpus=spec.engine_gpus,
                    max_restarts=0,  # replaced by the supervisor instead, with the current weights
                )
                .remote(engine_specs[slot.index], weights, version)
            )
            self._started.append(handle)
            return handle

        engines = [_Slot(i, f"engine-{i}", None) for i in range(spec.num_engine_replicas)]
        for slot in engines:
            slot.handle = spawn_engine(slot, initial if embedded else None, 0)
        supervisor = _Supervisor("engine", engines, spawn_engine, _nothing, spec, self.faults)
        self.workers: _Supervisor | None = None
        worker_slots = [_Slot(i, f"env-worker-{i}", None) for i in range(spec.num_env_workers)]

        def spawn_worker(slot: _Slot) -> Any:
            name = f"{prefix}:env-worker-{slot.index}" + (f".{slot.generation}" if slot.generation else "")
            handle = (
                ray.remote(EnvWorker)
                .options(name=name, num_cpus=spec.env_cpus, max_restarts=0)
                .remote(make_env)
            )
            self._started.append(handle)
            return handle

        for slot in worker_slots:
            slot.handle = spawn_worker(slot)
        if worker_slots:
            self.workers = _Supervisor("env_worker", worker_slots, spawn_worker, _nothing, spec, self.faults)
        self._wait_started([self.trainer, *(s.handle for s in engines + worker_slots)])
        ray.get([slot.handle.sync.remote(None, 0) for slot in engines])  # serve the initial weights
        self.learner = RemoteLearner(self.trainer, run_dir)
        broadcast = self._open_broadcast(engines) if spec.weight_sync == "broadcast" else None
        self.engine = EngineRouter(supervisor, self.faults, self.trainer, initial, 0, broadcast)
        workers = self.workers
        self.make_env: Callable[[], EpisodeEnv] = (
            make_env if workers is None else (lambda: RemoteEnv(workers, make_env))
        )

    def attach(self, run: Run) -> None:
        """Report into `run` (its `faults`) and stop the actors when it is released."""
        run.faults = self.faults.counts
        run.on_release.append(self.release)

    async def release(self) -> None:
        """Copy the trained weights into the driver's model (what the run saves), stop every actor, and
        disconnect from Ray if this runtime connected."""
        try:
            if self.learner.alive:
                state = await asyncio.to_thread(ray.get, self.trainer.weights.remote(self.learner.version))
                self.model.load_state_dict(state)
        finally:
            await self.engine.aclose()
            if self.workers is not None:
                await self.workers.aclose()
            with _quiet():
                ray.kill(self.trainer)
            if self.owns_ray:
                ray.shutdown()

    def _wait_started(self, handles: list[Any]) -> None:
        try:
            ray.get([handle.ping.remote() for handle in handles], timeout=self.spec.restart_timeout_s)
        except GetTimeoutError:
            raise RuntimeError(
                f"the run's actors did not start within {self.spec.restart_timeout_s:.0f} s: the cluster may "
                "lack the CPUs/GPUs ray.engine_cpus, env_cpus and trainer_cpus ask for (see `ray status`)"
            ) from None
        except RayActorError as error:
            raise RuntimeError(f"an actor of the run failed to start: {_brief(error)}") from None

    def _open_broadcast(self, engines: list[_Slot]) -> list[WeightSpec]:
        """Form the torch.distributed group trainer (rank 0) + replicas; the tensors a broadcast sends."""
        backend = self.spec.broadcast_backend
        address = ray.get(self.trainer.group_address.remote())
        world = len(engines) + 1
        trainer = self.trainer.join_group.remote(address, world, backend)
        joined = [
            slot.handle.join_group.remote(address, world, rank, backend)
            for rank, slot in enumerate(engines, start=1)
        ]
        specs, *_ = ray.get([trainer, *joined], timeout=self.spec.restart_timeout_s)
        return list(specs)


def _engine_specs(config: RunConfig, run_dir: Path, recipe: ModelRecipe, tokenizer: Any) -> list[EngineSpec]:
    spec = config.ray
    threads = _threads(spec.engine_cpus)
    device = "cuda" if spec.engine_gpus > 0 else "cpu"
    if config.engine_backend == "embedded":
        # Each replica its own seed: replicas sampling in lockstep would correlate a group's members.
        def seeded(i: int) -> EmbeddedEngineConfig:
            return replace(config.engine, seed=config.engine.seed + i)

        return [
            EngineSpec(recipe, tokenizer, seeded(i), None, threads, device)
            for i in range(spec.num_engine_replicas)
        ]
    urls = spec.sglang_urls or (config.sglang.url,)
    weights = Path(config.sglang.weights_dir or run_dir / "weights")
    return [
        EngineSpec(
            None,
            tokenizer,
            EmbeddedEngineConfig(),
            replace(
                config.sglang,
                url=url,
                weights_dir=str(weights / f"replica-{i}"),  # each server loads its own copy
                base_model_dir=config.sglang.base_model_dir or config.model.path,
            ),
            threads,
            device,
        )
        for i, url in enumerate(urls)
    ]


def _threads(cpus: float) -> int:
    """torch threads for an actor given `cpus`: as many as it reserved, at least one."""
    return max(1, int(cpus))


async def _nothing(slot: _Slot) -> None:
    return None


def _quiet() -> contextlib.suppress:
    """For best-effort calls to an actor that may be gone (killing it, aborting on it)."""
    return contextlib.suppress(RayActorError)


def _brief(error: BaseException) -> str:
    """The first line of an error (Ray's carry the remote traceback below it)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
