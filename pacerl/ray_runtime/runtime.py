"""`RayRuntime`: joins (or starts) the cluster, places a run's actors (the trainer, the engine replicas,
the environment workers) and hands the driver its handles on them, then stops them with the run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pacerl.agents.engine.embedded import EmbeddedEngineConfig
from pacerl.agents.engine.sglang import SGLangOptions
from pacerl.agents.rollout import EpisodeEnv
from pacerl.envs import ToolEnv
from pacerl.ray_runtime.engines import EngineActor, EngineRouter, EngineSpec
from pacerl.ray_runtime.envs import EnvWorker, RemoteEnv
from pacerl.ray_runtime.learner import RemoteLearner, TrainerActor
from pacerl.ray_runtime.supervisor import FaultLog, Slot, Supervisor, brief, quiet
from pacerl.ray_runtime.weights import ModelRecipe, WeightSpec
from pacerl.trainer.learner import LearnerConfig
from pacerl.trainer.loop import Run

if TYPE_CHECKING:
    from pacerl.config import RaySpec, RunConfig

NAMESPACE = "pacerl"
"""The Ray namespace of the actors of a run that connects by itself (`ray list actors`,
`ray.get_actor(name, namespace=NAMESPACE)`); each actor's name holds the run directory."""
FAULT_LOG = "faults.jsonl"
"""The run directory's log of every recovery, one JSON object a line."""


@dataclass(frozen=True)
class RaySettings:
    """What the Ray runtime reads of a run's config (`of` picks it out of a `RunConfig`)."""

    ray: RaySpec
    """The cluster and the actors' resources."""
    learner: LearnerConfig
    """The trainer actors' learner."""
    seed: int
    """The run's seed (the trainer actors seed torch with it)."""
    engine_backend: str
    """`embedded` (engine replicas hold the model) or `sglang` (replicas are clients of servers)."""
    engine: EmbeddedEngineConfig
    """The embedded replicas' engine (replica i seeded with `engine.seed + i`)."""
    sglang: SGLangOptions
    """The SGLang clients' options (one server per replica)."""
    model_path: str | None
    """The checkpoint SGLang servers load when `sglang.base_model_dir` is unset."""

    @classmethod
    def of(cls, config: RunConfig) -> RaySettings:
        return cls(
            config.ray,
            config.learner,
            config.seed,
            config.engine_backend,
            config.engine,
            config.sglang,
            config.model.path,
        )


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


class RayRuntime:
    """The actors of one run and the driver-side handles on them: `engine`, `learner` and `make_env`
    stand where the local runtime has an engine, a learner and an env maker."""

    def __init__(
        self,
        config: RaySettings,
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
        self._placement: Any = None
        try:
            self._start(config, run_dir, tokenizer, make_env)
        except BaseException:  # leave nothing running behind a run that could not start
            for handle in self._started:
                with quiet():
                    ray.kill(handle)
            self._remove_placement()
            if self.owns_ray:
                ray.shutdown()
            raise

    def _start(
        self, config: RaySettings, run_dir: Path, tokenizer: Any, make_env: Callable[[], ToolEnv]
    ) -> None:
        spec, model = self.spec, self.model
        prefix = f"pacerl:{run_dir.resolve()}"
        recipe = ModelRecipe(type(model), model.config)
        embedded = config.engine_backend == "embedded"
        initial = ray.put({name: tensor.detach() for name, tensor in model.state_dict().items()})
        trainers = self._start_trainers(config, prefix, recipe, initial, int(tokenizer.pad_token_id or 0))
        self.trainer: Any = trainers[0]
        """Rank 0's trainer actor (the only one unless `learner.parallel = "fsdp"`)."""
        engine_specs = _engine_specs(config, run_dir, recipe, tokenizer)

        def spawn_engine(slot: Slot, weights: Any = None, version: int = -1) -> Any:
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

        engines = [Slot(i, f"engine-{i}", None) for i in range(spec.num_engine_replicas)]
        for slot in engines:
            slot.handle = spawn_engine(slot, initial if embedded else None, 0)
        supervisor = Supervisor("engine", engines, spawn_engine, _nothing, spec, self.faults)
        self.workers: Supervisor | None = None
        worker_slots = [Slot(i, f"env-worker-{i}", None) for i in range(spec.num_env_workers)]

        def spawn_worker(slot: Slot) -> Any:
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
            self.workers = Supervisor("env_worker", worker_slots, spawn_worker, _nothing, spec, self.faults)
        self._wait_started([*trainers, *(s.handle for s in engines + worker_slots)])
        if len(trainers) > 1:  # the ranks form their group together, each building its shard
            address = ray.get(trainers[0].group_address.remote())
            ray.get([t.join_learner_group.remote(address, rank) for rank, t in enumerate(trainers)])
        ray.get([slot.handle.sync.remote(None, 0) for slot in engines])  # serve the initial weights
        self.learner = RemoteLearner(trainers, run_dir)
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
            for trainer in self.learner.handles:
                with quiet():
                    ray.kill(trainer)
            self._remove_placement()
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
            raise RuntimeError(f"an actor of the run failed to start: {brief(error)}") from None

    def _start_trainers(
        self, config: RaySettings, prefix: str, recipe: ModelRecipe, initial: Any, pad_id: int
    ) -> list[Any]:
        """The trainer actor, or with `learner.parallel = "fsdp"` one per rank, packed into one
        placement group (each bundle the CPUs and GPUs of `ray.trainer_cpus` and `ray.trainer_gpus`)."""
        spec, ranks = self.spec, config.learner.world_size
        options: dict[str, Any] = {
            "num_cpus": spec.trainer_cpus,
            "num_gpus": spec.trainer_gpus,
            "max_restarts": 0,
        }
        strategies: list[dict[str, Any]] = [{} for _ in range(ranks)]
        if config.learner.parallel == "fsdp":
            bundle = {"CPU": spec.trainer_cpus} | ({"GPU": spec.trainer_gpus} if spec.trainer_gpus else {})
            group = placement_group([bundle] * ranks, strategy="PACK")
            self._placement = group  # removed when the run is released
            strategies = [
                {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=i
                    )
                }
                for i in range(ranks)
            ]
        trainers = []
        for rank, strategy in enumerate(strategies):
            name = f"{prefix}:trainer" + (f"-{rank}" if rank else "")
            handle = (
                ray.remote(TrainerActor)
                .options(name=name, **options, **strategy)
                .remote(recipe, initial, config.learner, pad_id, _threads(spec.trainer_cpus), config.seed)
            )
            self._started.append(handle)
            trainers.append(handle)
        return trainers

    def _remove_placement(self) -> None:
        if self._placement is not None:
            with quiet():
                remove_placement_group(self._placement)
            self._placement = None

    def _open_broadcast(self, engines: list[Slot]) -> list[WeightSpec]:
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


def _engine_specs(
    config: RaySettings, run_dir: Path, recipe: ModelRecipe, tokenizer: Any
) -> list[EngineSpec]:
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
            recipe,
            tokenizer,
            EmbeddedEngineConfig(),
            replace(
                config.sglang,
                url=url,
                weights_dir=str(weights / f"replica-{i}"),  # each server loads its own copy
                base_model_dir=config.sglang.base_model_dir or config.model_path,
            ),
            threads,
            device,
        )
        for i, url in enumerate(urls)
    ]


def _threads(cpus: float) -> int:
    """torch threads for an actor given `cpus`: as many as it reserved, at least one."""
    return max(1, int(cpus))


async def _nothing(slot: Slot) -> None:
    return None
