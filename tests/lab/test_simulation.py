"""`pacerl simulate`: the discrete-event simulation's accounting on small cases worked out by hand, the
filters' guarantees as seen through it, determinism, and the command."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pacerl.agents.trajectory import Origin, Segment, Status, Trajectory
from pacerl.cli import main
from pacerl.config import EMULATION_PRESETS
from pacerl.lab import simulate_cli as cli_simulate
from pacerl.lab.config import SimConfig, config_from_dict
from pacerl.lab.costs import Distribution, InferenceConfig, TrainerConfig, WorkloadConfig
from pacerl.lab.engine import simulate, simulate_mode
from pacerl.lab.presets import PRESETS
from pacerl.lab.results import ModeResult, bounds
from pacerl.lab.traces import workload_from_trace
from pacerl.settings import config_to_dict
from pacerl.trainer.filters import BUILT_IN_FILTERS
from pacerl.trainer.pool import (
    AdmissionSettings,
    FilterConfig,
    MaxAgeSettings,
    PaceSettings,
    staleness_summary,
)

# Every response 100 tokens after a 10-token prompt, one turn: a wave of 8 rows on an engine takes
# 100 steps of τ(8) = 0.01 + 8 · 0.001 = 0.018 s, i.e. 1.8 s, and nothing else costs time.
CONSTANT = WorkloadConfig(
    group_size=8,
    prompt_tokens=Distribution.constant(10),
    turns=Distribution.constant(1),
    response_tokens=Distribution.constant(100),
    tool_tokens=Distribution.constant(1),
    tool_latency_s=Distribution.constant(0.0),
)
ENGINE = InferenceConfig(
    gpus_per_engine=1,
    step_base_s=0.01,
    step_per_row_s=0.001,
    step_per_kv_token_s=0.0,
    prefill_tokens_per_s=math.inf,
    kv_capacity_tokens=10_000,
    max_running=8,
)
TOKENS_PER_STEP = 16 * 110  # B·G trajectories of 110 tokens


def small(**changes: object) -> SimConfig:
    """2 inference engines + 1 trainer GPU, batches of 2 groups × 8, nothing costs time but decoding
    and training: a training step is 0.1 s + 1760 tokens / 1760 tok/s = 1.1 s."""
    config = SimConfig(
        inference_gpus=2,
        trainer_gpus=1,
        steps=40,
        batch_groups=2,
        sync_interval=1,
        filter=FilterConfig(name="none", max_concurrent_groups=4),
        weight_sync_s=0.0,
        colocated_switch_s=0.5,
        token_block=1,
        workload=CONSTANT,
        inference=ENGINE,
        trainer=TrainerConfig(tokens_per_gpu_s=TOKENS_PER_STEP, step_fixed_s=0.1, recompute_async=False),
    )
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def test_constant_lengths_generation_bound_async_equals_the_analytic_pipeline() -> None:
    config = small()
    generation = 2 * 8 / (100 * 0.018)  # two engines, 8 rows each, one wave per 1.8 s: 8.89 traj/s
    training = 16 / 1.1  # 14.5 traj/s
    run = simulate_mode(config, "async")
    assert run.steady_trajectories_per_s == pytest.approx(min(generation, training), rel=1e-9)
    assert bounds(config).generation_trajectories_per_s == pytest.approx(generation)
    assert bounds(config).training_trajectories_per_s == pytest.approx(training)
    assert run.trained_tokens == 40 * TOKENS_PER_STEP
    assert run.rejected_groups == {} and run.wasted_tokens == 0 and run.retractions == 0


def test_constant_lengths_training_bound_async_equals_the_analytic_pipeline() -> None:
    slow = TrainerConfig(tokens_per_gpu_s=TOKENS_PER_STEP / 3, step_fixed_s=0.1, recompute_async=False)
    run = simulate_mode(small(trainer=slow), "async")
    assert run.steady_trajectories_per_s == pytest.approx(16 / 3.1, rel=1e-9)
    # the trainer waits only for the first wave (1.8 s), then never again: the pool keeps filling
    assert run.trainer_utilization == pytest.approx(40 * 3.1 / (1.8 + 40 * 3.1), rel=1e-9)
    assert run.staleness.mean_ws > 1  # and what waits there ages


def test_sync_is_the_serial_sum_and_has_no_staleness() -> None:
    # Colocated: 3 engines share the 16 trajectories round-robin (6, 5, 5 rows): the round's generation
    # ends with the 6-row engine after 100 · (0.01 + 6 · 0.001) = 1.6 s; training on all 3 GPUs takes
    # 0.1 + 1760 / (3 · 1760) s; then 0.5 s to switch back.
    colocated = simulate_mode(small(), "sync")
    step = 1.6 + (0.1 + 1 / 3) + 0.5
    assert colocated.steady_trajectories_per_s == pytest.approx(16 / step, rel=1e-9)
    assert (
        colocated.staleness.mean_gs == colocated.staleness.mean_ws == colocated.staleness.max_staleness == 0
    )
    assert colocated.interruptions == 0 and colocated.model_segments_per_trajectory == 1
    # Split: the async engines (8 rows each, 1.8 s), then the trainer (1.1 s), then a 0.25 s weight sync.
    split = simulate_mode(small(sync_baseline="split", weight_sync_s=0.25), "sync")
    assert split.steady_trajectories_per_s == pytest.approx(16 / (1.8 + 1.1 + 0.25), rel=1e-9)


def test_speedup_is_the_ratio_of_the_two_runs() -> None:
    result = simulate(small(steps=12, sync_steps=12))
    assert result.speedup == pytest.approx(
        result.async_run.trajectories_per_s / result.sync_run.trajectories_per_s
    )
    assert set(result.to_json()) == {
        "config",
        "async",
        "sync",
        "bounds",
        "speedup",
        "steady_speedup",
        "wall_s",
    }


def test_decode_time_is_closed_form_with_a_growing_cache() -> None:
    # One engine, one row, a 10-token prompt: step s costs 0.01 + 0.001 + 1e-4 · (10 + s), so 100 steps
    # take 100 · 0.012 + 1e-4 · (0 + 1 + ... ) = 1.2 + 1e-4 · 100²/2 (continuous progress: ∫ s ds).
    engine = dataclasses.replace(ENGINE, step_per_kv_token_s=1e-4)
    one = dataclasses.replace(CONSTANT, group_size=1)
    trainer = TrainerConfig(tokens_per_gpu_s=1e9, step_fixed_s=0.0, recompute_async=False)
    config = small(
        inference_gpus=1,
        batch_groups=1,
        steps=1,
        workload=one,
        inference=engine,
        trainer=trainer,
        filter=FilterConfig(name="none", max_concurrent_groups=1),
    )
    run = simulate_mode(config, "async")
    assert run.step_end_s[0] == pytest.approx(1.2 + 1e-4 * 100**2 / 2 + 110 / 1e9, rel=1e-9)


def test_prefill_stalls_the_batch() -> None:
    # 10-token prompts of 8 rows prefilled at 80 tok/s: 1 s before the first decode step.
    engine = dataclasses.replace(ENGINE, prefill_tokens_per_s=80.0)
    trainer = TrainerConfig(tokens_per_gpu_s=1e9, step_fixed_s=0.0, recompute_async=False)
    config = small(inference_gpus=1, batch_groups=1, steps=1, inference=engine, trainer=trainer)
    assert simulate_mode(config, "async").step_end_s[0] == pytest.approx(1.0 + 1.8 + 880 / 1e9, rel=1e-9)


def test_async_records_carry_versions_and_their_staleness_is_the_pools() -> None:
    """The statistics come from the records: they equal `staleness_summary` of the drawn batches, and a
    generation interrupted by a weight update continues as a new segment with the new version."""
    batches: list[tuple[list[Trajectory], int]] = []
    config = small(
        workload=dataclasses.replace(CONSTANT, response_tokens=Distribution.lognormal(100, 0.8, 400))
    )
    run = simulate_mode(config, "async", lambda batch, v: batches.append(([t for g in batch for t in g], v)))
    summaries = [staleness_summary(trajectories, v) for trajectories, v in batches]
    assert tuple(np.sum([s.gs_hist for s in summaries], axis=0)) == run.staleness.gs_hist
    assert tuple(np.sum([s.ws_hist for s in summaries], axis=0)) == run.staleness.ws_hist
    assert run.staleness.max_staleness == max(s.max_staleness for s in summaries)
    assert run.staleness.mean_gs > 0 and run.interruptions > 0
    spanning = [t for trajectories, _ in batches for t in trajectories if len(t.versions) > 1]
    assert spanning, "some generation spans a weight update"
    for trajectory in spanning:
        model = [s for s in trajectory.segments if s.origin is Origin.MODEL]
        assert [s.finish_reason for s in model[:-1]] == ["abort"] * (len(model) - 1)
        versions = [s.version for s in model if s.version is not None]
        assert len(versions) == len(model) and versions == sorted(versions)
        assert all(a.ended_at <= b.started_at for a, b in itertools.pairwise(model))  # type: ignore[operator]
    assert all(t.status is Status.COMPLETED for trajectories, _ in batches for t in trajectories)
    # every record passes the record's own validation from scratch
    for trajectories, _ in batches:
        for trajectory in trajectories:
            assert Trajectory.from_json(json.loads(json.dumps(trajectory.to_json()))) == trajectory


def test_max_age_never_trains_older_tokens() -> None:
    fast = TrainerConfig(tokens_per_gpu_s=1e9, step_fixed_s=0.05, recompute_async=False)
    long_tail = dataclasses.replace(CONSTANT, response_tokens=Distribution.lognormal(60, 1.0, 1000))
    config = small(
        steps=60,
        workload=long_tail,
        trainer=fast,
        inference=dataclasses.replace(ENGINE, max_running=64),
        filter=FilterConfig(name="max_age", max_concurrent_groups=16, max_age=MaxAgeSettings(versions=1)),
    )
    run = simulate_mode(config, "async")
    assert run.rejected_groups["max_age"] > 0
    assert run.rejected_trajectories == 8 * run.rejected_groups["max_age"]
    assert run.wasted_tokens > 0
    assert run.staleness.max_staleness <= 1


def test_admission_caps_groups_in_flight_at_areals_capacity() -> None:
    # (η + v + 1)·B − accepted ≥ running ⇒ in flight + pooled ≤ (η + 1)·B, whatever the engines could do.
    for eta in (0, 2):
        config = small(
            steps=20,
            inference=dataclasses.replace(ENGINE, max_running=256),
            filter=FilterConfig(
                name="admission",
                max_concurrent_groups=1000,
                admission=AdmissionSettings(max_offpolicyness=eta),
            ),
        )
        run = simulate_mode(config, "async")
        assert run.max_outstanding_groups == (eta + 1) * 2
        assert run.rejected_groups == {}
    # η = 0 keeps every token on the trainer's version when it was generated (the sync limit)
    assert (
        simulate_mode(
            dataclasses.replace(
                config,
                filter=FilterConfig(name="admission", admission=AdmissionSettings(max_offpolicyness=0)),
            ),
            "async",
        ).staleness.max_staleness
        <= 1
    )


def test_admission_keeps_its_bound_when_weights_are_published_every_s_updates() -> None:
    """η = S − 1 with S = 2 and 3: admission counts the engines' lag behind the trainer, so no trained
    token is more than η versions old (without the lag term it reaches η + S − 1); η < S − 1 is refused."""
    long_tail = dataclasses.replace(CONSTANT, response_tokens=Distribution.lognormal(60, 1.0, 600))
    for interval in (2, 3):
        eta = interval - 1
        config = small(
            steps=24,
            sync_interval=interval,
            workload=long_tail,
            inference=dataclasses.replace(ENGINE, max_running=256),
            filter=FilterConfig(
                name="admission",
                max_concurrent_groups=1000,
                admission=AdmissionSettings(max_offpolicyness=eta),
            ),
        )
        run = simulate_mode(config, "async")
        assert run.staleness.max_staleness == eta, (interval, run.staleness.max_staleness)
    with pytest.raises(ValueError, match=r"max_offpolicyness \(1\) must be >= sync_interval - 1 \(2\)"):
        small(
            sync_interval=3,
            filter=FilterConfig(name="admission", admission=AdmissionSettings(max_offpolicyness=1)),
        )


def test_pace_rejections_are_counted() -> None:
    slow = TrainerConfig(tokens_per_gpu_s=TOKENS_PER_STEP / 3, step_fixed_s=0.1, recompute_async=False)
    config = small(
        steps=30,
        trainer=slow,
        filter=FilterConfig(
            name="pace", max_concurrent_groups=4, pace=PaceSettings(target_groups=2, ema=0.0)
        ),
    )
    run = simulate_mode(config, "async")
    rejected = run.rejected_groups["pace_budget"]
    assert rejected > 0
    assert run.rejected_trajectories == 8 * rejected
    assert run.wasted_tokens == 100 * 8 * rejected
    assert run.generated_tokens >= run.trained_tokens - 10 * run.trained_trajectories + run.wasted_tokens


def test_deterministic_given_the_seed() -> None:
    config = small(
        steps=15,
        sync_steps=5,
        workload=dataclasses.replace(CONSTANT, response_tokens=Distribution.lognormal(80, 1.0, 500)),
    )

    def run(seed: int) -> dict[str, object]:
        data = simulate(dataclasses.replace(config, seed=seed)).to_json()
        data.pop("wall_s")
        return data

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_kv_overflow_retracts_and_still_finishes() -> None:
    # A cache of 1,500 tokens cannot hold 8 rows growing to 110 tokens each: retractions, no loss.
    engine = dataclasses.replace(ENGINE, kv_capacity_tokens=600, admit_kv_fraction=0.5)
    run = simulate_mode(small(steps=6, inference=engine), "async")
    assert run.retractions > 0 and run.trained_trajectories == 6 * 16
    assert run.trained_tokens == 6 * TOKENS_PER_STEP


def test_config_validation_and_round_trip() -> None:
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        small(inference=dataclasses.replace(ENGINE, kv_capacity_tokens=50))
    with pytest.raises(ValueError, match="inference_gpus"):
        small(inference_gpus=0)
    with pytest.raises(ValueError, match=r"unknown setting inference\.nope"):
        config_from_dict(small(), {"inference": {"nope": 1}})
    with pytest.raises(ValueError, match=r"workload\.group_size"):
        config_from_dict(small(), {"workload": {"group_size": 0}})
    changed = config_from_dict(small(), {"steps": 7, "workload": {"response_tokens": {"median": 50}}})
    assert changed.steps == 7 and changed.workload.response_tokens.median == 50
    assert config_from_dict(small(), json.loads(json.dumps(config_to_dict(small())))) == small()
    for name, preset in PRESETS.items():
        assert preset().config.steps >= 1, name


def test_distribution_means() -> None:
    capped = Distribution.lognormal(100, 1.0, maximum=300)
    samples = capped.sample(np.random.default_rng(0), 400_000)
    assert samples.max() == 300 and samples.mean() == pytest.approx(capped.mean(), rel=5e-3)
    assert Distribution.empirical([1, 2, 6]).mean() == 3


def test_workload_from_a_trace() -> None:
    def trajectory(index: int) -> Trajectory:
        record = Trajectory.start(f"t{index}", "g0", "task", [5] * 7)
        record.append_model(
            [1] * 4, [-1.0] * 4, version=0, started_at=0.0, ended_at=1.0, finish_reason="abort"
        )
        record.append_model(
            [1] * 6, [-1.0] * 6, version=1, started_at=1.5, ended_at=2.0, finish_reason="tool_call"
        )
        record.append_tool([2] * 3)
        record.append_model(
            [1] * 5, [-1.0] * 5, version=1, started_at=2.25, ended_at=3.0, finish_reason="stop"
        )
        record.finish(Status.COMPLETED, reason="answered", reward=1.0, completed_version=1, completed_at=3.0)
        return record

    workload = workload_from_trace([trajectory(0), trajectory(1)])
    assert workload.group_size == 2
    assert workload.prompt_tokens.values == (7.0, 7.0)
    assert workload.turns.values == (2.0, 2.0)
    assert sorted(set(workload.response_tokens.values)) == [5.0, 10.0]  # the interruption merged
    assert workload.tool_tokens.values == (3.0, 3.0)
    assert workload.tool_latency_s.values == (0.25, 0.25)
    assert isinstance(Segment, type)


def test_the_command_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    code = main(
        ["simulate", "--preset", "pacerl-cpu", "--steps", "24", "--filter", "pace", "--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "speed-up" in printed and "rejected groups by reason" in printed
    data = json.loads((out / "simulation.json").read_text())
    assert data["async"]["steps"] == 24 and data["preset"]["name"] == "pacerl-cpu"
    assert data["speedup"] == pytest.approx(
        data["async"]["trajectories_per_s"] / data["sync"]["trajectories_per_s"]
    )
    for name in ("throughput", "staleness", "utilization"):
        assert (out / f"{name}.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--inference-gpus", "0"], "--inference-gpus"),
        (["--trainer-gpus", "two"], "--trainer-gpus"),
        (["--filter", "fifo"], "--filter"),
        (["--preset", "nope"], "--preset"),
        (["--steps", "-3"], "--steps"),
        (["--config", "/nonexistent/sim.toml"], "--config"),
        (["workload.nope=3"], "key=value: unknown setting workload.nope"),
        (["steps"], "key=value: override 'steps' is not key=value"),
        (["--inference-gpus", "2"], "--inference-gpus (2) must be at least inference.gpus_per_engine"),
    ],
)
def test_bad_options_get_a_one_line_error(
    argv: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *argv, "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pacerl: error:") and option in error and error.count("\n") == 1


def test_the_command_keeps_its_name_lists_in_step() -> None:
    # pacerl.lab.simulate_cli lists them itself so that `pacerl --help` need not import the trainer
    assert cli_simulate.FILTERS == BUILT_IN_FILTERS
    assert tuple(PRESETS) == cli_simulate.PRESET_NAMES == EMULATION_PRESETS


def test_key_value_overrides_set_the_config_between_the_file_and_the_flags(tmp_path: Path) -> None:
    config_file = tmp_path / "sim.toml"
    config_file.write_text("steps = 40\n[workload]\ngroup_size = 4\n")
    parser = argparse.ArgumentParser(prog="pacerl")
    cli_simulate.add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    argv = ["simulate", "--config", str(config_file), "workload.group_size=6", "steps=50", "--steps", "60"]
    config, _ = cli_simulate.build_config(parser.parse_args([*argv, "--out", str(tmp_path)]))
    assert config.workload.group_size == 6  # key=value over the file
    assert config.steps == 60  # the flag over key=value


# -- the summary recorded before the simulator was made faster (issue 19) --------------------------------

_RECORDED_CASES = {
    "pace": {},
    "max_age": {
        "filter": FilterConfig(name="max_age", max_concurrent_groups=64, max_age=MaxAgeSettings(versions=2)),
        "interrupt": "continue",
        "sync_baseline": "split",
        "sync_interval": 2,
        "seed": 11,
        "inference": dataclasses.replace(InferenceConfig(), kv_capacity_tokens=32_000, max_running=48),
    },
    "none": {"filter": FilterConfig(name="none", max_concurrent_groups=64), "pool_cap_groups": 8, "seed": 3},
}
"""Changes to `recorded_case`'s base: PACE with rejections; max_age with KV retractions, `continue`
interrupts and the split sync baseline at S = 2; no filter held back by the pool cap."""

RECORDED = {
    "pace": {
        "async": {
            "simulated_s": 455.25577308017455,
            "trained_trajectories": 1920,
            "trained_tokens": 4474160,
            "steady_trajectories_per_s": 4.5071257188122145,
            "step_time_p90_s": 15.309399999999995,
            "generated_tokens": 6240116,
            "wasted_tokens": 2305294,
            "inference_utilization": 0.8088707221189665,
            "mean_running_rows": 41.77465197550421,
            "rejected_groups": {"pace_budget": 144},
            "interruptions": 5615,
            "retractions": 0,
            "model_segments_per_trajectory": 3.613020833333333,
            "max_outstanding_groups": 90,
            "pool_cap_held_s": 0.0,
            "mean_gs": 2.693962547754744,
            "mean_ws": 1.1107596918644704,
            "max_staleness": 9,
            "gs_hist": [3516, 4308, 7167, 6747, 5439, 3387, 1143, 219, 8],
            "ws_hist": [721, 26955, 4258, 0, 0, 0, 0, 0, 0],
            "step_pool_groups": 472,
        },
        "sync": {
            "simulated_s": 302.55350759624827,
            "trained_trajectories": 256,
            "trained_tokens": 657751,
            "steady_trajectories_per_s": 0.72263799695414,
            "step_time_p90_s": 95.0115743669755,
            "generated_tokens": 457329,
            "wasted_tokens": 0,
            "inference_utilization": 0.6011522214064391,
            "mean_running_rows": 4.135138108575327,
            "rejected_groups": {},
            "interruptions": 0,
            "retractions": 0,
            "model_segments_per_trajectory": 2.1796875,
            "max_outstanding_groups": 8,
            "pool_cap_held_s": 0.0,
            "mean_gs": 0.0,
            "mean_ws": 0.0,
            "max_staleness": 0,
            "gs_hist": [4671, 0, 0, 0, 0, 0, 0, 0, 0],
            "ws_hist": [4671, 0, 0, 0, 0, 0, 0, 0, 0],
            "step_pool_groups": 32,
        },
    },
    "max_age": {
        "async": {
            "simulated_s": 1622.6163896616408,
            "trained_trajectories": 584,
            "trained_tokens": 1204469,
            "steady_trajectories_per_s": 0.2717288545336681,
            "step_time_p90_s": 99.16330800963057,
            "generated_tokens": 9525921,
            "wasted_tokens": 8116970,
            "inference_utilization": 0.9737265878679585,
            "mean_running_rows": 12.798783602398894,
            "rejected_groups": {"max_age": 559},
            "interruptions": 729,
            "retractions": 153,
            "model_segments_per_trajectory": 1.9845890410958904,
            "max_outstanding_groups": 72,
            "pool_cap_held_s": 0.0,
            "mean_gs": 0.7940470475276045,
            "mean_ws": 0.558089294287086,
            "max_staleness": 2,
            "gs_hist": [5024, 0, 3308, 0, 0, 0, 0, 0, 0],
            "ws_hist": [4477, 3060, 795, 0, 0, 0, 0, 0, 0],
            "step_pool_groups": 240,
        },
        "sync": {
            "simulated_s": 201.62868334937357,
            "trained_trajectories": 256,
            "trained_tokens": 695299,
            "steady_trajectories_per_s": 1.0958699222994033,
            "step_time_p90_s": 95.66659516034123,
            "generated_tokens": 498249,
            "wasted_tokens": 0,
            "inference_utilization": 0.6329454708314981,
            "mean_running_rows": 8.283409162001071,
            "rejected_groups": {},
            "interruptions": 0,
            "retractions": 3,
            "model_segments_per_trajectory": 2.23046875,
            "max_outstanding_groups": 16,
            "pool_cap_held_s": 0.0,
            "mean_gs": 0.0,
            "mean_ws": 0.5955651491365777,
            "max_staleness": 1,
            "gs_hist": [5096, 0, 0, 0, 0, 0, 0, 0, 0],
            "ws_hist": [2061, 3035, 0, 0, 0, 0, 0, 0, 0],
            "step_pool_groups": 48,
        },
    },
    "none": {
        "async": {
            "simulated_s": 502.62366980467294,
            "trained_trajectories": 1920,
            "trained_tokens": 4863197,
            "steady_trajectories_per_s": 3.9886591849295314,
            "step_time_p90_s": 18.506780575103804,
            "generated_tokens": 3986409,
            "wasted_tokens": 0,
            "inference_utilization": 0.5888430742339107,
            "mean_running_rows": 33.88844671355551,
            "rejected_groups": {},
            "interruptions": 1624,
            "retractions": 0,
            "model_segments_per_trajectory": 3.0640625,
            "max_outstanding_groups": 71,
            "pool_cap_held_s": 364.5149098462744,
            "mean_gs": 2.236231016896031,
            "mean_ws": 3.08838362253184,
            "max_staleness": 12,
            "gs_hist": [5038, 8171, 7834, 6240, 4695, 2053, 666, 315, 85],
            "ws_hist": [856, 3956, 7342, 7822, 9318, 5803, 0, 0, 0],
            "step_pool_groups": 727,
        },
        "sync": {
            "simulated_s": 257.8881810617943,
            "trained_trajectories": 256,
            "trained_tokens": 668474,
            "steady_trajectories_per_s": 0.9710409102216737,
            "step_time_p90_s": 68.6452729803965,
            "generated_tokens": 460516,
            "wasted_tokens": 0,
            "inference_utilization": 0.6236962945095332,
            "mean_running_rows": 4.713188742369483,
            "rejected_groups": {},
            "interruptions": 0,
            "retractions": 0,
            "model_segments_per_trajectory": 2.26953125,
            "max_outstanding_groups": 8,
            "pool_cap_held_s": 0.0,
            "mean_gs": 0.0,
            "mean_ws": 0.0,
            "max_staleness": 0,
            "gs_hist": [4704, 0, 0, 0, 0, 0, 0, 0, 0],
            "ws_hist": [4704, 0, 0, 0, 0, 0, 0, 0, 0],
            "step_pool_groups": 32,
        },
    },
}
"""What the code before issue 19's speed-ups returned for each case (`recorded_summary`), to the last bit."""


def recorded_case(name: str) -> SimConfig:
    """The default workload (multi-turn, long-tailed, tool calls) on 16 + 4 GPUs, 30 steps of 8 groups."""
    base = SimConfig(
        inference_gpus=16,
        trainer_gpus=4,
        steps=30,
        sync_steps=4,
        batch_groups=8,
        filter=FilterConfig(name="pace", max_concurrent_groups=64, pace=PaceSettings(target_groups=8)),
        seed=7,
    )
    return dataclasses.replace(base, **_RECORDED_CASES[name])  # type: ignore[arg-type]


def recorded_summary(run: ModeResult) -> dict[str, object]:
    """The figures of `RECORDED`: the scalars, the GS/WS histograms and the pool occupancies summed."""
    data = run.summary()
    staleness = data.pop("staleness")
    keys = (
        "simulated_s", "trained_trajectories", "trained_tokens", "steady_trajectories_per_s",
        "step_time_p90_s", "generated_tokens", "wasted_tokens", "inference_utilization",
        "mean_running_rows", "rejected_groups", "interruptions", "retractions",
        "model_segments_per_trajectory", "max_outstanding_groups", "pool_cap_held_s",
    )  # fmt: skip
    summary = {key: data[key] for key in keys}
    summary.update({key: staleness[key] for key in ("mean_gs", "mean_ws", "max_staleness")})
    summary.update(gs_hist=list(staleness["gs_hist"]), ws_hist=list(staleness["ws_hist"]))
    summary["step_pool_groups"] = sum(run.step_pool_groups)
    return summary


@pytest.mark.parametrize("name", sorted(_RECORDED_CASES))
def test_results_equal_those_recorded_before_the_speed_ups(name: str) -> None:
    result = simulate(recorded_case(name))
    assert {"async": recorded_summary(result.async_run), "sync": recorded_summary(result.sync_run)} == (
        RECORDED[name]
    )


def test_records_equal_those_their_constructors_build() -> None:
    # pacerl.lab.records builds segments and records without their constructors' validation
    drawn: list[Trajectory] = []
    simulate_mode(
        recorded_case("max_age"), "async", lambda batch, version: drawn.extend(itertools.chain(*batch))
    )
    assert len(drawn) == 584
    for record in drawn[::7]:
        segments = tuple(Segment(**vars(segment)) for segment in record.segments)
        built = Trajectory(**{**vars(record), "segments": segments})
        assert built == record and vars(built).keys() == vars(record).keys()
        assert [vars(s) for s in built.segments] == [vars(s) for s in record.segments]
