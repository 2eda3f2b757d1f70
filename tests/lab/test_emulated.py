"""Emulated-cluster training (`pacerl.lab.emulated`): the clock is `pacerl simulate`'s (the simulator's
own plan played through it gives the same run, figure for figure), the emulated sync arm trains on
exactly what `train_sync` trains on, and configs that cannot work are refused."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pacerl import plots
from pacerl.agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.models import load_model
from pacerl.agents.rollout import RolloutDriver, append_generation
from pacerl.agents.trajectory import Status, Trajectory
from pacerl.assembly import env_factory, num_experts, training_tasks
from pacerl.config import ConfigError, config_from_dict
from pacerl.lab.config import SimConfig
from pacerl.lab.config import config_from_dict as lab_config_from_dict
from pacerl.lab.costs import Distribution, InferenceConfig, WorkloadConfig
from pacerl.lab.emulated import EmulatedClock, Turn, clock_config, train_emulated
from pacerl.lab.engine import simulate_mode
from pacerl.lab.presets import PRESETS
from pacerl.lab.results import Mode
from pacerl.lab.state import Group
from pacerl.train import train
from pacerl.trainer.learner import Learner, StepResult
from pacerl.trainer.loop import Run, train_sync
from pacerl.trainer.metrics import read_metrics
from pacerl.trainer.pool import FilterConfig, PaceSettings, StalenessSummary, TrajectoryPool
from tests.helpers import small_run

# -- (1) the clock is the simulator's -----------------------------------------------------------------


class PlannedWorkload:
    """The simulator's own plan through the emulated clock: every episode plays the turns, response
    lengths and tool responses `launch_group` sampled for it (synthetic tokens), and the learner is a
    stand-in that always updates. Everything that decides time is then the clock's code."""

    drop_failed_groups = True

    def __init__(self) -> None:
        self.plans: dict[str, tuple[list[int], list[int]]] = {}
        self.records: dict[str, Trajectory] = {}
        self.turn: dict[str, int] = {}
        self.published: list[int] = []
        self.calls: list[str] = []

    def launch(self, group: Group) -> list[Turn | Trajectory]:
        turns: list[Turn | Trajectory] = []
        for episode in group.members:
            key = f"{group.id}/{episode.index}"
            self.plans[key] = (list(episode.responses), list(episode.tool_tokens))
            self.records[key] = Trajectory.start(
                f"{group.id}-{episode.index}", group.id, group.id, [0] * group.prompt
            )
            self.turn[key] = 0
            turns.append(self._turn(key))
        return turns

    def _turn(self, key: str) -> Turn:
        length = self.plans[key][0][self.turn[key]]
        return Turn(self.records[key].tokens.tolist(), SamplingParams(max_new_tokens=length), session=key)

    def generate(self, turns: Sequence[Turn], version: int) -> None:
        for turn in turns:
            rest = turn.sampling.max_new_tokens - len(turn.tokens)
            held = Generation((1,) * rest, (-1.0,) * rest, (version,) * rest, FinishReason.STOP)
            turn.hold(held, version, turn.turn_base)

    def complete(self, group_id: str, index: int, turn: Turn) -> Turn | Trajectory:
        key = f"{group_id}/{index}"
        record = self.records[key]
        append_generation(record, turn.result(), num_experts=0, started_at=0.0, ended_at=0.0)
        responses, tools = self.plans[key]
        done = self.turn[key]
        if done + 1 < len(responses):
            record.append_tool([2] * tools[done])
            self.turn[key] = done + 1
            return self._turn(key)
        record.finish(
            Status.COMPLETED,
            reason="answered",
            reward=0.0,
            completed_version=max(record.versions),
            completed_at=0.0,
        )
        return record

    def publish(self, version: int) -> None:
        self.published.append(version)

    def dropped(self, group_id: str) -> None:
        raise AssertionError(f"{group_id}: the plan fails no episode")

    def train(self, groups: list[list[Trajectory]], version: int) -> StepResult:
        ids = tuple(t.id for group in groups for t in group)
        self.calls.append("train")
        return StepResult(updated=True, skipped="", metrics={}, trajectory_ids=ids)

    def step_ended(self, result: StepResult, staleness: StalenessSummary, scalars: dict[str, float]) -> bool:
        self.calls.append("ended")
        return True

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float] | None:
        return None  # the simulator's drift model, as `pacerl simulate` ranks


def multi_turn(**changes: Any) -> SimConfig:
    """Long-tailed multi-turn episodes on engines whose KV cache overflows (retractions), PACE."""
    workload = WorkloadConfig(
        group_size=4,
        prompt_tokens=Distribution.lognormal(40, 0.5, maximum=128),
        turns=Distribution.lognormal(2, 0.6, minimum=1, maximum=5),
        response_tokens=Distribution.lognormal(60, 1.0, maximum=400),
        tool_tokens=Distribution.lognormal(20, 0.5, maximum=64),
        tool_latency_s=Distribution.lognormal(0.3, 1.0, maximum=5),
    )
    inference = InferenceConfig(
        gpus_per_engine=1,
        step_base_s=0.01,
        step_per_row_s=0.001,
        step_per_kv_token_s=1e-7,
        prefill_tokens_per_s=20_000.0,
        kv_capacity_tokens=3_000,
        max_running=16,
    )
    base = SimConfig(
        inference_gpus=2,
        trainer_gpus=1,
        steps=40,
        batch_groups=4,
        filter=FilterConfig(name="pace", max_concurrent_groups=16, pace=PaceSettings(target_groups=4)),
        weight_sync_s=0.2,
        token_block=1,
        workload=workload,
        inference=inference,
    )
    return dataclasses.replace(base, **changes)


def _pacerl_cpu() -> SimConfig:
    return dataclasses.replace(PRESETS["pacerl-cpu"]().config, steps=40)


@pytest.mark.parametrize(
    "name, config",
    [
        ("pacerl-cpu", _pacerl_cpu()),
        ("multi-turn pace", multi_turn()),
        ("multi-turn max_age, S=2", multi_turn(sync_interval=2, filter=FilterConfig(name="max_age"))),
        ("multi-turn sync", multi_turn(sync_steps=10)),
    ],
)
def test_the_simulators_plan_through_the_emulated_clock_is_pacerl_simulate(
    name: str, config: SimConfig
) -> None:
    # Compared: the whole ModeResult of the mode, i.e. every step's end time, trajectories, pool and mean
    # GS/WS, the GS and WS histograms, rejections by reason, interruptions, retractions, tokens generated,
    # wasted and trained, utilization; equal to the last bit. All but the model segments per trajectory:
    # the simulator's records start a segment where the KV cache retracted a turn, the emulated ones
    # (the driver's) one per run of a version, as an engine reports a turn (a retraction is invisible to
    # the caller); the tokens and their versions are the same.
    mode: Mode = "sync" if "sync" in name else "async"
    reference = simulate_mode(config, mode)
    workload = PlannedWorkload()
    emulated = EmulatedClock(config, mode, workload).run()
    assert emulated.model_segments_per_trajectory <= reference.model_segments_per_trajectory
    assert dataclasses.replace(emulated, model_segments_per_trajectory=0.0) == dataclasses.replace(
        reference, model_segments_per_trajectory=0.0
    )
    assert reference.steps == config.steps if mode == "async" else config.baseline_steps
    assert sum(reference.staleness.gs_hist) > 0
    steps = reference.steps
    assert workload.calls == ["train", "ended"] * steps  # a step is recorded before the next one trains
    if mode == "async":  # the runs are not trivial: publications cut turns, and the filters worked
        assert reference.interruptions > 0 and sum(reference.staleness.gs_hist[1:]) > 0
        assert workload.published == list(range(config.sync_interval, config.steps, config.sync_interval))
    if name.startswith("multi-turn pace"):
        assert reference.rejected_groups and reference.retractions > 0


class ResizedWorkload(PlannedWorkload):
    """Episodes whose real turns and tool responses are not the plan's: every turn `response` tokens,
    every tool response `tool` tokens, whatever `launch_group` sampled."""

    def __init__(self, response: int, tool: int) -> None:
        super().__init__()
        self.response, self.tool = response, tool

    def launch(self, group: Group) -> list[Turn | Trajectory]:
        turns = super().launch(group)  # the clock's plan stays as sampled: only the episodes differ
        for key, (responses, tools) in list(self.plans.items()):
            self.plans[key] = ([self.response] * len(responses), [self.tool] * len(tools))
        for turn in turns:
            assert isinstance(turn, Turn)
            turn.sampling = SamplingParams(max_new_tokens=self.response)
        return turns


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_clock_runs_on_the_real_lengths_not_the_planned_ones(mode: Mode) -> None:
    # The plan says 100-token turns and 20-token tool responses, the episodes play 37 and 7: the clock
    # must time the episodes as played, i.e. as `pacerl simulate` times a workload of 37 and 7 (constant
    # lengths draw no samples, so every other sample, prompts, turns, latencies, is the same in both).
    planned = multi_turn(steps=25, sync_steps=8)
    workload = dataclasses.replace(
        planned.workload, response_tokens=Distribution.constant(100), tool_tokens=Distribution.constant(20)
    )
    played = dataclasses.replace(
        workload, response_tokens=Distribution.constant(37), tool_tokens=Distribution.constant(7)
    )
    emulated = EmulatedClock(
        dataclasses.replace(planned, workload=workload), "async", ResizedWorkload(37, 7)
    ).run()
    reference = simulate_mode(dataclasses.replace(planned, workload=played), "async")
    planned_run = simulate_mode(dataclasses.replace(planned, workload=workload), "async")
    assert emulated.step_end_s != planned_run.step_end_s
    assert dataclasses.replace(emulated, model_segments_per_trajectory=0.0) == dataclasses.replace(
        reference, model_segments_per_trajectory=0.0
    )
    assert reference.interruptions > 0 or mode == "sync"


def test_token_scale_makes_each_real_token_cost_as_many_simulated_ones() -> None:
    # 40-token prompts, 37-token turns and 7-token tool responses at token_scale 2 are timed as 80, 74 and
    # 14 are by `pacerl simulate` (the sync arm: no publication cuts a turn, whose rest would be rounded
    # to whole real tokens); the records keep the real tokens, half the simulator's.
    planned = multi_turn(sync_steps=6)
    workload = dataclasses.replace(
        planned.workload,
        prompt_tokens=Distribution.constant(40),
        response_tokens=Distribution.constant(100),
        tool_tokens=Distribution.constant(20),
    )
    played = dataclasses.replace(
        workload,
        prompt_tokens=Distribution.constant(80),
        response_tokens=Distribution.constant(74),
        tool_tokens=Distribution.constant(14),
    )
    clock = EmulatedClock(
        dataclasses.replace(planned, workload=workload), "sync", ResizedWorkload(37, 7), token_scale=2
    )
    emulated = clock.run()
    reference = simulate_mode(dataclasses.replace(planned, workload=played), "sync")
    assert emulated.step_end_s == reference.step_end_s
    assert emulated.trained_tokens == reference.trained_tokens
    assert emulated.generated_tokens == reference.generated_tokens
    assert emulated.inference_utilization == reference.inference_utilization
    assert 2 * emulated.staleness.model_tokens == reference.staleness.model_tokens > 0


class FailingPlannedWorkload(PlannedWorkload):
    """The plan, but the first member of every third group fails before its first turn (an env that
    could not start), which drops its group."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped_ids: list[str] = []

    def launch(self, group: Group) -> list[Turn | Trajectory]:
        actions = super().launch(group)
        if int(group.id[1:]) % 3 == 0:
            record = self.records[f"{group.id}/0"]
            record.finish(
                Status.FAILED, reason="env failed", reward=None, completed_version=0, completed_at=0.0
            )
            actions[0] = record
        return actions

    def dropped(self, group_id: str) -> None:
        self.dropped_ids.append(group_id)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_groups_with_an_episode_that_failed_before_its_first_turn_are_dropped(mode: Mode) -> None:
    # the sync arm trains each round on the groups left, as train_sync does
    config = multi_turn(steps=12, sync_steps=12)
    workload = FailingPlannedWorkload()
    trained: list[str] = []
    clock = EmulatedClock(config, mode, workload)
    step = workload.train

    def train(groups: list[list[Trajectory]], version: int) -> StepResult:
        trained.extend(group[0].group_id for group in groups)
        return step(groups, version)

    workload.train = train  # type: ignore[method-assign]
    result = clock.run()
    assert result.steps == 12 and len(trained) == len(set(trained))
    assert result.trained_trajectories == len(trained) * config.workload.group_size
    assert workload.dropped_ids and all(int(g[1:]) % 3 == 0 for g in workload.dropped_ids)
    assert not set(workload.dropped_ids) & set(trained)
    assert all(int(g[1:]) % 3 for g in trained)


def test_a_turn_cut_by_publications_keeps_each_versions_tokens_and_routes() -> None:
    turn = Turn([5, 6, 7], SamplingParams(max_new_tokens=10), routes_start=1)
    rows = torch.arange(30).reshape(-1, 1, 1).numpy()

    def generation(tokens: int, version: int, first_input: int, inputs: int) -> Generation:
        routes = rows[first_input : inputs + tokens - 1]
        return Generation(
            tuple(range(100 * version, 100 * version + tokens)),
            (-0.5,) * tokens,
            (version,) * tokens,
            FinishReason.STOP,
            routes,
            first_input,
        )

    assert turn.request() == ([5, 6, 7], SamplingParams(max_new_tokens=10), 1)
    turn.hold(generation(6, 0, 1, 3), 0, 0)
    turn.commit(2)  # a publication after two tokens of version 0
    tokens, sampling, start = turn.request()
    assert tokens == [5, 6, 7, 0, 1] and sampling.max_new_tokens == 8 and start == 4
    turn.hold(generation(3, 1, 4, 5), 1, 2)
    turn.commit(0)  # another one before version 1 decoded anything
    assert turn.request()[2] == 4
    turn.hold(generation(4, 2, 4, 5), 2, 2)
    result = turn.result()
    assert result.tokens == (0, 1, 200, 201, 202, 203)
    assert result.versions == (0, 0, 2, 2, 2, 2)
    assert result.routed_experts_start == 1
    assert result.routed_experts is not None
    # rows of inputs 1..7: 1 and 2 (prompt) and 3 (version 0's first token kept) from the first call
    assert result.routed_experts[:, 0, 0].tolist() == list(range(1, 8))
    with pytest.raises(RuntimeError, match="cannot keep"):
        turn.commit(4)


# -- (2) the emulated sync arm trains on exactly what train_sync trains on ----------------------------


class SeededEngine:
    """The embedded engine with each request's sampler seeded by its session and input length, so that
    a request samples the same tokens whichever order the two loops issue it in; one row at a time, so
    that batching cannot change a logit."""

    def __init__(self, inner: EmbeddedEngine) -> None:
        self.inner = inner
        self.max_context = inner.max_context

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, **kwargs: Any) -> Generation:
        seed = zlib.crc32(f"{kwargs.get('session')}:{len(input_ids)}".encode())
        return await self.inner.generate(input_ids, dataclasses.replace(sampling, seed=seed), **kwargs)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        await self.inner.update_weights(state_dict, version)

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _sync_run(warm_model: tuple[Path, Path], run_dir: Path) -> tuple[Run, Any]:
    config = config_from_dict(
        small_run(
            warm_model,
            run_dir,
            rollout={"group_size": 4},
            loop={"mode": "sync", "steps": 3, "batch_groups": 3},
            filter={"pace": {"target_groups": 3}, "max_concurrent_groups": 3},
        )
    )
    torch.manual_seed(0)
    model, tokenizer = load_model(warm_model[0])
    make_env = env_factory(config)
    twin, _ = load_model(warm_model[0])
    engine = SeededEngine(EmbeddedEngine(twin, tokenizer, EmbeddedEngineConfig(max_batch=1)))
    learner = Learner(model, config.learner, pad_id=int(tokenizer.pad_token_id or 0))
    driver = RolloutDriver(engine, tokenizer, make_env, config.rollout, num_experts=num_experts(model))
    run = Run(
        learner=learner,
        engine=engine,
        driver=driver,
        tasks=training_tasks(make_env),
        pool=TrajectoryPool(config.filter),
        config=config.loop,
        run_dir=run_dir,
    )
    return run, config


def _batches(run_dir: Path) -> list[list[str]]:
    return [json.loads(line)["ids"] for line in (run_dir / "batches.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_emulated_sync_arm_trains_on_exactly_what_train_sync_trains_on(
    warm_model: tuple[Path, Path], tmp_path: Path
) -> None:
    plain, config = _sync_run(warm_model, tmp_path / "plain")
    emulated, _ = _sync_run(warm_model, tmp_path / "emulated")
    clock = clock_config(
        "areal",
        inference_gpus=96,
        trainer_gpus=32,
        token_scale=1,
        mode="sync",
        steps=config.loop.steps,
        batch_groups=config.loop.batch_groups,
        sync_interval=1,
        group_size=config.rollout.group_size,
        max_total_tokens=config.rollout.max_total_tokens,
        filter_config=config.filter,
        seed=config.seed,
    )
    trained: dict[str, list[Trajectory]] = {"plain": [], "emulated": []}
    for name, run in (("plain", plain), ("emulated", emulated)):
        step = run.learner.train_step

        def recording(
            groups: Sequence[Sequence[Trajectory]], name: str = name, step: Any = step
        ) -> StepResult:
            trained[name] += [t for group in groups for t in group]
            result: StepResult = step(groups)
            return result

        run.learner.train_step = recording  # type: ignore[method-assign]
    plain_summary = asyncio.run(train_sync(plain))
    emulated_summary = asyncio.run(train_emulated(emulated, clock, "sync"))
    assert plain_summary["version"] >= 1, "no step updated: the comparison would be vacuous"
    assert emulated_summary["step"] == plain_summary["step"] == 3
    assert emulated_summary["version"] == plain_summary["version"]
    assert _batches(tmp_path / "emulated") == _batches(tmp_path / "plain")
    pairs = list(zip(trained["plain"], trained["emulated"], strict=True))
    assert pairs and all(a.tokens.tolist() == b.tokens.tolist() for a, b in pairs)
    assert all(a.token_versions.tolist() == b.token_versions.tolist() for a, b in pairs)
    assert all(a.reward == b.reward for a, b in pairs)
    plain_weights, emulated_weights = plain.learner.weights(), emulated.learner.weights()
    assert all(torch.equal(plain_weights[k], emulated_weights[k]) for k in plain_weights)
    rows = read_metrics(tmp_path / "emulated" / "metrics.jsonl")
    times = [row["sim/time_s"] for row in rows]
    assert len(times) == 3 and times == sorted(times) and times[0] > 0
    assert [row["sim/gpu_hours"] for row in rows] == pytest.approx([128 * t / 3600 for t in times])
    assert (tmp_path / "emulated" / "emulation.json").is_file()
    saved = lab_config_from_dict(SimConfig(), json.loads((tmp_path / "emulated" / "clock.json").read_text()))
    assert saved == clock  # what `pacerl simulate --config clock.json` runs
    # A GPU-hour budget (`emulation.max_gpu_hours`, equal-cost comparisons) between the first two steps'
    # figures ends the same run after its second step, the first to reach it, at that step's figure.
    hours = [row["sim/gpu_hours"] for row in rows]
    budgeted, _ = _sync_run(warm_model, tmp_path / "budgeted")
    budget = (hours[0] + hours[1]) / 2
    summary = asyncio.run(train_emulated(budgeted, clock, "sync", max_gpu_hours=budget))
    assert summary["step"] == summary["emulation"]["steps"] == 2
    assert [row["sim/gpu_hours"] for row in read_metrics(tmp_path / "budgeted" / "metrics.jsonl")] == hours[
        :2
    ]


# -- (3) bad configs ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_emulated_async_run_trains_on_turns_the_clock_cut_between_versions(
    warm_model: tuple[Path, Path], tmp_path: Path
) -> None:
    # pacerl-cpu's engine with every real token costing 20: a turn of the tiny model decodes for about as
    # long as a training step takes, so publications land inside turns and the real engine regenerates
    # their rest under the new weights. Eight steps: the warm model solves few sums, and in five steps a
    # run can draw no reward at all, so it never updates (and nothing is interrupted).
    run_dir = tmp_path / "run"
    config = config_from_dict(
        small_run(
            warm_model,
            run_dir,
            rollout={"group_size": 4},
            loop={"mode": "async", "steps": 8, "batch_groups": 2},
            filter={"name": "none", "max_concurrent_groups": 4},
            emulation={"clock": "emulated", "preset": "pacerl-cpu", "token_scale": 20},
        )
    )
    summary = asyncio.run(train(config))
    figures = summary["emulation"]
    assert summary["step"] == figures["steps"] == 8
    assert figures["interruptions"] > 0 and sum(figures["gs_hist"][1:]) > 0  # tokens of older versions
    rows = read_metrics(run_dir / "metrics.jsonl")
    times = [row["sim/time_s"] for row in rows]
    assert len(rows) == 8 and times == sorted(times) and times[-1] == pytest.approx(figures["simulated_s"])
    assert max(row["staleness/mean_gs"] for row in rows) > 0
    assert json.loads((run_dir / "emulation.json").read_text())["token_scale"] == 20
    clock = lab_config_from_dict(SimConfig(), json.loads((run_dir / "clock.json").read_text()))
    assert clock.inference_gpus == 1 and clock.steps == 8 and clock.filter.name == "none"
    assert clock.workload.group_size == 4 and clock.token_block == 1
    assert len(_batches(run_dir)) == 8


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"runtime": "ray"}, "runtime=ray"),
        ({"engine": {"interrupt": "continue"}}, "engine.interrupt=continue"),
        ({"loop": {"mode": "sync", "lag": 2}}, "loop.lag=2"),
        ({"emulation": {"clock": "emulated", "preset": "h100"}}, "emulation.preset must be one of"),
        ({"emulation": {"clock": "emulated", "token_scale": 0}}, "token_scale must be an integer >= 1"),
        ({"emulation": {"clock": "emulated", "inference_gpus": 0}}, "inference_gpus must be an integer >= 1"),
        ({"emulation": {"clock": "fast"}}, "emulation.clock: .*real.*emulated"),
        ({"emulation": {"clock": "emulated", "max_gpu_hours": 0}}, "max_gpu_hours must be > 0 or None"),
    ],
)
def test_configs_the_emulated_clock_cannot_run_are_refused_at_load(
    changes: dict[str, Any], message: str
) -> None:
    data: dict[str, Any] = {"emulation": {"clock": "emulated"}}
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_sglang_is_refused_under_the_emulated_clock(tmp_path: Path) -> None:
    data = {"model": {"path": str(tmp_path)}, "engine_backend": "sglang", "emulation": {"clock": "emulated"}}
    with pytest.raises(ConfigError, match="engine_backend=sglang"):
        config_from_dict(data)
    config_from_dict({**data, "emulation": {"clock": "real"}})  # the real clock runs it


def test_train_refuses_a_resume_and_a_clock_that_cannot_hold_a_context_before_writing(tmp_path: Path) -> None:
    emulated = {"clock": "emulated", "preset": "pacerl-cpu"}
    config = config_from_dict({"run_dir": str(tmp_path / "a"), "emulation": emulated})
    with pytest.raises(ConfigError, match="cannot be resumed"):
        asyncio.run(train(config, resume=True))
    # pacerl-cpu's engine caches 65,536 tokens; 256-token episodes at 512 simulated tokens each do not fit
    config = config_from_dict({"run_dir": str(tmp_path / "b"), "emulation": {**emulated, "token_scale": 512}})
    with pytest.raises(ConfigError, match="exceeds the KV capacity"):
        asyncio.run(train(config))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_plots_second_scale_is_the_simulated_clock_when_a_run_has_one(tmp_path: Path) -> None:
    rows = [{"step": step, "elapsed_s": 9.0 * step, "sim/time_s": 2.5 * step} for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    found = plots._elapsed(plots.load_run_metrics(tmp_path))
    assert found is not None and found[1] == "simulated s (emulated cluster)"
    assert found[0].tolist() == [2.5, 5.0, 7.5]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({**row, "sim/time_s": None}) + "\n" for row in rows)
    )
    found = plots._elapsed(plots.load_run_metrics(tmp_path))
    assert found is not None and found[1] == "elapsed s" and found[0].tolist() == [9.0, 18.0, 27.0]
