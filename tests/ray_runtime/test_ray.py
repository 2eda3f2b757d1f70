"""`runtime = "ray"` on a local Ray cluster of 2 CPUs (one for the module): the default training config
with 2 engine replicas raises the reward as the local runtime does; killing an engine replica and an
environment worker mid-run loses no trajectory; a weight update reaches every replica, in-flight
generations included, with the right version tags, by a torch.distributed broadcast (gloo here; NCCL
in the GPU test) and through the object store; `pacerl train` joins the cluster by its address, and a
dead trainer ends it with the checkpoint to resume from.

Ray is required: without it this module fails at import, it is never skipped."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.models import load_model
from pacerl.assembly import env_factory, load_policy
from pacerl.config import ConfigError, config_from_dict, load_config
from pacerl.ray_runtime.runtime import FAULT_LOG, NAMESPACE, RayRuntime, RaySettings
from pacerl.train import train
from pacerl.trainer.checkpoint import latest_checkpoint, load_checkpoint
from pacerl.trainer.metrics import read_metrics
from tests.helpers import rewards, small_run

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = {"num_engine_replicas": 2, "num_env_workers": 1}
# Each test starts a run's actors (each process imports torch and transformers), and the first one also
# waits for the shared warm-up model and the cluster: on a busy 2-core machine that can pass 5 minutes.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """One local cluster for the module (starting one takes seconds); every run leaves it empty."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def actor(run_dir: Path, name: str) -> Any:
    """A run's actor by the name the runtime gives it."""
    return ray.get_actor(f"pacerl:{run_dir.resolve()}:{name}")


def actors_left() -> list[Any]:
    """Named actors still alive a moment after a run (ray.kill takes effect asynchronously)."""
    deadline = time.time() + 10
    while ray.util.list_named_actors() and time.time() < deadline:
        time.sleep(0.1)
    return list(ray.util.list_named_actors())


@pytest.mark.slow
def test_the_default_config_on_ray_raises_the_reward_like_local(
    cluster: None, warm_model: tuple[Path, Path], tmp_path: Path
) -> None:
    """tests/pacerl/test_train.py's async run, on 2 engine replicas, an environment worker and a trainer
    actor."""
    run_dir = tmp_path / "ray"
    evaluation = {"every": 8, "at_end": True, "tasks": str(warm_model[1])}
    settings = small_run(
        warm_model, run_dir, runtime="ray", ray=REPLICAS, evaluation=evaluation, loop={"steps": 32}
    )
    summary = asyncio.run(train(config_from_dict(settings)))
    # The background evaluations got the trainer actor's weights, the last one its final version.
    assert [(e["step"], e["version"]) for e in summary["evaluations"]][-1] == (32, summary["version"])
    assert [e["step"] for e in summary["evaluations"]] == [8, 16, 24, 32]
    curve = rewards(run_dir)
    assert summary["step"] == 32 and len(curve) == 32
    first, last = sum(curve[:5]) / 5, sum(curve[-8:]) / 8
    assert last > first + 0.15, curve
    # The trainer actor applied every update the loop counted: a step without signal (a batch of groups
    # whose members all scored alike, more of them the better the policy gets) leaves the version alone.
    assert summary["version"] == summary["updated_steps"] >= 16 and summary["faults"] == {}
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert all(row["r3_coverage"] == 1.0 for row in rows if row.get("updated"))  # the replicas sent routes
    assert max(row.get("staleness/mean_staleness", 0) for row in rows) > 0  # it really ran off-policy
    # The saved model is the trainer actor's, not the driver's untouched copy.
    trained, _ = load_model(run_dir / "model")
    warm, _ = load_model(warm_model[0])
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), warm.parameters(), strict=True))
    assert not actors_left()  # the run stopped its actors


@pytest.mark.slow
def test_killed_engine_replica_and_env_worker_lose_no_trajectory(
    cluster: None, warm_model: tuple[Path, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    config = config_from_dict(
        small_run(
            warm_model,
            run_dir,
            runtime="ray",
            ray={"num_engine_replicas": 2, "num_env_workers": 2},
            evaluation={"every": 0},
            rollout={"group_size": 4},
            loop={"steps": 10, "batch_groups": 4},
            filter={"pace": {"target_groups": 4}, "max_concurrent_groups": 6},
        )
    )
    killed: list[str] = []

    def kill_when_busy(name: str, patience_s: float) -> None:
        """After two steps, ray.kill the actor while it holds work (generations, or episodes: an episode
        of Math-v0 lives for one step, so after `patience_s` it is killed anyway, and the next episode
        sent to it finds it dead)."""
        deadline = time.time() + 240
        while time.time() < deadline:
            batches = run_dir / "batches.jsonl"
            if batches.exists() and batches.read_text().count("\n") >= 2:
                target, since = actor(run_dir, name), time.time()
                while ray.get(target.load.remote()) == 0 and time.time() < since + patience_s:
                    time.sleep(0.005)
                ray.kill(target)
                killed.append(name)
                return
            time.sleep(0.01)

    def killer() -> None:
        kill_when_busy("engine-0", patience_s=60)
        kill_when_busy("env-worker-0", patience_s=2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    summary = asyncio.run(train(config))
    thread.join(timeout=5)
    assert killed == ["engine-0", "env-worker-0"]
    assert summary["step"] == 10  # the run finished
    faults = summary["faults"]
    assert faults["engine_replaced"] == 1 and faults["env_worker_replaced"] == 1
    assert faults["trajectories_resumed"] >= 1  # generations of the killed replica went on elsewhere
    assert faults["env_episode_resumed"] >= 1
    events = [json.loads(line) for line in (run_dir / FAULT_LOG).read_text().splitlines()]
    resumed = {e["trajectory"] for e in events if e["event"] == "engine_request_retried"}
    assert len(resumed) == faults["trajectories_resumed"]

    batches = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    trained = [i for b in batches for i in b["ids"]]
    rejected = [i for b in batches for i in b["rejected"]]
    assert len(trained) == len(set(trained)) and not set(trained) & set(rejected)  # none twice
    state = load_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state  # type: ignore[arg-type]
    pooled = [t["id"] for group in state["pool"].get("groups", []) for t in group]
    in_flight = [m["id"] for entry in state["in_flight"].values() for m in entry["members"]]
    accounted = trained + rejected + pooled + in_flight
    assert len(accounted) == len(set(accounted))
    dropped = set(state["dropped_groups"])
    # Every trajectory the kill hit is somewhere, once: trained, rejected, pooled or still in flight.
    assert all(i in accounted or i.split("/")[0] in dropped for i in resumed), (resumed, dropped)
    by_group: dict[str, int] = {}
    for trajectory_id in trained + rejected:
        by_group[trajectory_id.split("/")[0]] = by_group.get(trajectory_id.split("/")[0], 0) + 1
    pending = set(state["in_flight"]) | {i.split("/")[0] for i in pooled} | dropped
    # Every group ever started is trained or rejected whole, or still pooled, in flight or dropped.
    assert set(by_group) | pending == {f"g{n:07d}" for n in range(state["cursor"])}
    assert all(count == 4 for count in by_group.values()) and not set(by_group) & pending
    assert not actors_left()


@pytest.mark.slow
def test_a_weight_update_reaches_every_replica_with_its_version(
    cluster: None, warm_model: tuple[Path, Path], tmp_path: Path
) -> None:
    """Both replicas are generating when a version is published; each generation goes on under the new
    weights (its tokens tagged with the old version, then the new one), and afterwards every replica
    samples exactly as an engine holding the trainer's weights does. Version 1 goes by broadcast (gloo);
    then a replica is killed, its replacement joins with the current weights, and version 2 goes through
    the object store (a replacement is no member of the broadcast group)."""
    ray_spec = {**REPLICAS, "num_env_workers": 0, "weight_sync": "broadcast", "broadcast_backend": "gloo"}
    config = config_from_dict(small_run(warm_model, tmp_path / "run", runtime="ray", ray=ray_spec))
    model, tokenizer = load_policy(config)
    prompt = tokenizer.encode("What is 3 + 3?")
    long = SamplingParams(max_new_tokens=400, temperature=0.7, ignore_eos=True, seed=1)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    reference = EmbeddedEngine(model, tokenizer)

    async def publish_while_generating(runtime: RayRuntime, version: int) -> None:
        router, learner = runtime.engine, runtime.learner
        replicas = router.replicas
        running = [
            asyncio.ensure_future(replica.generate.remote(prompt, long, f"long-{version}-{i}", False))
            for i, replica in enumerate(replicas)
        ]
        # A one-token request sent after the long one joins the same engine step or a later one, so
        # when it is answered the long generation has its first tokens: it is surely in flight.
        one = SamplingParams(max_new_tokens=1, temperature=0.0)
        await asyncio.gather(*(replica.generate.remote(prompt, one, None, False) for replica in replicas))
        state = learner.state_dict()  # a new version: the weights moved, as by a training step
        state["model"] = {name: t + 0.01 * torch.randn_like(t) for name, t in state["model"].items()}
        state["version"] = version
        learner.load_state_dict(state)
        await router.update_weights(learner.weights(), version)
        assert router.version == version
        assert await asyncio.gather(*(r.version.remote() for r in replicas)) == [version, version]
        for generation in await asyncio.gather(*running):  # interrupted and resumed on every replica
            assert generation.versions[0] == version - 1 and generation.versions[-1] == version
            assert list(generation.versions) == sorted(generation.versions)
        await reference.update_weights(state["model"], version)
        expected = await reference.generate(prompt, greedy)
        for replica in replicas:
            got = await replica.generate.remote(prompt, greedy, None, False)
            assert got.tokens == expected.tokens and got.versions == (version,) * len(got.tokens)
            assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)

    async def scenario() -> None:
        runtime = RayRuntime(RaySettings.of(config), tmp_path / "run", model, tokenizer, env_factory(config))
        try:
            await publish_while_generating(runtime, 1)  # by broadcast
            ray.kill(runtime.engine.replicas[0])
            # Calls spread over both replicas: those sent to the dead one go to the other, which
            # answers them all under version 1, and the dead one is replaced.
            calls = [runtime.engine.generate(prompt, greedy, session=f"s{i}") for i in range(4)]
            assert all(g.versions == (1,) * 12 for g in await asyncio.gather(*calls))
            while runtime.engine.replica_states() != ["ready", "ready"]:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            assert await runtime.engine.replicas[0].version.remote() == 1  # joined with the current weights
            await publish_while_generating(runtime, 2)  # through the object store
            faults = runtime.faults.counts
            assert faults["engine_replaced"] == 1 and faults["weight_sync_fell_back_to_object_store"] == 1
            assert faults["engine_request_retried"] >= 1
        finally:
            await runtime.release()

    asyncio.run(scenario())
    assert not actors_left()


@pytest.mark.slow
def test_a_dead_trainer_ends_the_run_with_a_checkpoint_to_resume(
    cluster: None, warm_model: tuple[Path, Path], tmp_path: Path
) -> None:
    """`pacerl train runtime=ray ray.address=...` joins the running cluster from its own process; its
    trainer actor killed, the command ends with one line naming the checkpoint the run finishes from."""
    run_dir = tmp_path / "run"
    address = ray.get_runtime_context().gcs_address
    settings = small_run(
        warm_model,
        run_dir,
        runtime="ray",
        ray={**REPLICAS, "address": address},
        evaluation={"every": 0},
        rollout={"group_size": 4},
        loop={"steps": 4, "batch_groups": 4, "checkpoint_every": 2},
    )
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(settings))

    def kill_trainer() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if latest_checkpoint(run_dir / "checkpoints") is not None:
                ray.kill(ray.get_actor(f"pacerl:{run_dir.resolve()}:trainer", namespace=NAMESPACE))
                return
            time.sleep(0.01)

    thread = threading.Thread(target=kill_trainer, daemon=True)
    thread.start()
    command = [sys.executable, "-m", "pacerl", "train", "--config", str(config_file)]
    killed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    thread.join(timeout=5)
    assert killed.returncode != 0
    last = killed.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"pacerl: error: the trainer actor died \(.*\); the run stops: continue it from "
                        r"step-\d+ with `pacerl train --resume .*`", last), killed.stderr[-2000:]  # fmt: skip
    assert not actors_left()
    # A checkpoint does not depend on the runtime: this one finishes on the local runtime (quicker here).
    summary = asyncio.run(train(load_config(run_dir / "config.json", ["runtime=local"]), resume=True))
    assert summary["step"] == 4
    batches = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert [b["step"] for b in batches] == list(range(1, 5))  # the steps after the checkpoint were cut
    trained = [i for b in batches for i in b["ids"]]
    assert len(trained) == len(set(trained))


@pytest.mark.slow
def test_a_trainer_group_trains_one_fsdp_learner_over_its_ranks(
    cluster: None, warm_model: tuple[Path, Path], tmp_path: Path
) -> None:
    """learner.world_size=2 on Ray: two trainer actors in a placement group, one per rank, each holding
    half the model; the driver, pool and engine see one learner, and the checkpoint holds both shards."""
    run_dir = tmp_path / "group"
    settings = small_run(
        warm_model,
        run_dir,
        runtime="ray",
        ray={"num_engine_replicas": 1, "num_env_workers": 0},
        learner={"parallel": "fsdp", "world_size": 2},
        evaluation={"every": 0},
        loop={"steps": 4, "checkpoint_every": 4},
    )
    seen: list[list[str]] = []

    def watch() -> None:
        """The named actors while the run trains (rank 1 has its own)."""
        while not (run_dir / "batches.jsonl").exists():
            time.sleep(0.05)
        seen.append(sorted(name.rsplit(":", 1)[-1] for name in ray.util.list_named_actors()))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    summary = asyncio.run(train(config_from_dict(settings)))
    thread.join(timeout=30)
    assert summary["step"] == 4 and summary["version"] >= 1 and summary["faults"] == {}
    assert seen and {"trainer", "trainer-1", "engine-0"} <= set(seen[0])
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None
    assert len(list((checkpoint / "learner").glob("*.distcp"))) == 2  # one file per rank
    trained, _ = load_model(run_dir / "model")  # the full weights, gathered from both ranks
    warm, _ = load_model(warm_model[0])
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), warm.parameters(), strict=True))
    assert not actors_left()
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_ray_settings_are_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"runtime: Input should be 'local' or 'ray'"):
        load_config(None, ["runtime=cluster"])
    with pytest.raises(ConfigError, match=r"num_engine_replicas \(2\) must equal the SGLang servers \(1"):
        load_config(None, ["runtime=ray", "engine_backend=sglang", "model.path=m"])
    with pytest.raises(ConfigError, match=r"nccl needs ray\.engine_gpus"):
        load_config(None, ["ray.weight_sync=broadcast"])
    with pytest.raises(ConfigError, match=r"weight_sync=broadcast cannot serve a learner of 2 ranks"):
        group = ["learner.parallel=fsdp", "learner.world_size=2", "ray.broadcast_backend=gloo"]
        load_config(None, ["runtime=ray", "ray.weight_sync=broadcast", *group])
    assert load_config(None, ["runtime=ray", "ray.num_engine_replicas=3"]).ray.num_engine_replicas == 3


def test_environment_workers_import_no_torch() -> None:
    """Ray imports the worker's module (and its package) in every environment worker: no torch there."""
    check = (
        "import sys, pacerl.ray_runtime.envs; print(sorted({'torch', 'transformers'} & sys.modules.keys()))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]"


@pytest.mark.gpu
def test_nccl_broadcast_between_gpus(warm_model: tuple[Path, Path], tmp_path: Path) -> None:
    """The NCCL path: trainer and one replica on two GPUs (NCCL refuses two members on one device)."""
    assert torch.cuda.device_count() >= 2, "the NCCL broadcast test needs two CUDA GPUs"
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        spec = {"num_engine_replicas": 1, "num_env_workers": 0, "weight_sync": "broadcast"}
        spec |= {"broadcast_backend": "nccl", "engine_gpus": 1, "trainer_gpus": 1}
        config = config_from_dict(small_run(warm_model, tmp_path / "run", runtime="ray", ray=spec))
        model, tokenizer = load_policy(config)

        async def scenario() -> None:
            runtime = RayRuntime(
                RaySettings.of(config), tmp_path / "run", model, tokenizer, env_factory(config)
            )
            try:
                state = runtime.learner.state_dict()
                state["model"] = {name: t + 0.01 * torch.randn_like(t) for name, t in state["model"].items()}
                state["version"] = 1
                runtime.learner.load_state_dict(state)
                await runtime.engine.update_weights(runtime.learner.weights(), 1)
                replica = runtime.engine.replicas[0]
                assert await replica.version.remote() == 1
                greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
                got = await replica.generate.remote(tokenizer.encode("What is 1 + 1?"), greedy, None, False)
                assert got.versions == (1,) * len(got.tokens)
            finally:
                await runtime.release()

        asyncio.run(scenario())
    finally:
        ray.shutdown()
