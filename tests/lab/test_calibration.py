"""`pacerl.lab.calibration` against hand-computed numbers (the collapse detector, the cross-check, η_max per
S, Ĉ, B̂, the log-log fits, the recommendation), and `pacerl calibrate` end to end on a 2 × 2 grid of
3-step runs on the Math-v0 sums from one shared warm start: its files, and a second call that skips the
finished points and restarts the interrupted one."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from pacerl.cli import main
from pacerl.lab.calibrate_cli import POINT_FILE, Options, available_cpus
from pacerl.lab.calibration import (
    Spread,
    SweepPoint,
    censored_budget_floor,
    collapse_budget,
    collapse_step,
    collapse_time_fit,
    cross_check,
    held_out_collapse_step,
    lr_max_fit,
    per_seed_constants,
    power_law_fit,
    recommend_lr,
    smoothed,
    stability_boundaries,
    stability_constant,
)
from pacerl.lab.calibration_report import analyse, markdown_report
from tests.helpers import SUMS

ROOT = Path(__file__).resolve().parents[2]


def test_collapse_step_by_hand() -> None:
    # window 1: no smoothing. Peak 1; step 2 (0.4) falls below 0.5, step 3 (0.9) recovers past 0.8,
    # step 4 (0.2) falls again and stays down.
    assert collapse_step([1.0, 0.4, 0.9, 0.2, 0.3], window=1) == 4
    assert collapse_step([1.0, 0.4, 0.9, 0.45, 0.85], window=1) is None  # recovered at the end
    # window 3: α = 0.5. Smoothed 0.8, 0.8, 0.4, 0.2: 0.4 is not below half of 0.8, 0.2 is.
    assert collapse_step([0.8, 0.8, 0.0, 0.0, 0.0], window=3) == 4
    assert collapse_step([0.0, 0.0, 0.0]) is None  # never rose: nothing to collapse from
    assert collapse_step([]) is None
    # The default span 10 (α = 2/11): from 1.0, zeros halve the EMA after 4 steps ((9/11)^4 = 0.448).
    assert collapse_step([1.0] + [0.0] * 10) == 5
    with pytest.raises(ValueError, match="fall"):
        collapse_step([1.0], fall=0.9, recover=0.8)
    assert smoothed([0.8, 0.8, 0.0, 0.0], window=3) == pytest.approx([0.8, 0.8, 0.4, 0.2])


def test_the_experiments_use_the_library_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / "benchmarks" / "experiments" / "common.py"
    spec = importlib.util.spec_from_file_location("experiments_common", path)
    assert spec is not None and spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "experiments_common", common)  # its dataclasses look themselves up
    spec.loader.exec_module(common)
    assert common.collapse_step is collapse_step


def test_cross_check_by_hand() -> None:
    # Entropy 1.0, 1.0 | 0.4, 0.4 over windows of 2: drop 0.6, at least halved -> collapse.
    # Grad norms: median 1.0, max 12 -> spike ratio 12 >= 10.
    check = cross_check([1.0, 1.0, 0.7, 0.4, 0.4], [1.0, 0.5, 12.0, 1.0, 2.0], window=2)
    assert check.entropy_drop == pytest.approx(0.6)
    assert check.max_grad_norm == 12.0 and check.grad_norm_spike == pytest.approx(12.0)
    assert check.signals == ("entropy collapse", "grad-norm spike")
    # Window 5 shrinks to half of 4 updates: first 2 mean 0.5, last 2 mean 1.5 -> drop -2, a blow-up.
    spread_out = cross_check([0.5, 0.5, 1.5, 1.5], [1.0, 1.0, 1.0, 1.0])
    assert spread_out.entropy_drop == pytest.approx(-2.0) and spread_out.signals == ("entropy blow-up",)
    quiet = cross_check([1.0], [])
    assert math.isnan(quiet.entropy_drop) and math.isnan(quiet.max_grad_norm) and quiet.signals == ()
    with pytest.raises(ValueError, match="finite"):
        cross_check([1.0, math.nan], [1.0])


def sweep() -> list[SweepPoint]:
    """A 4 × 3 grid with T_max = 100: S = 1 never collapses; S = 2 collapses at η = 1e-3 (step 20);
    S = 4 from 3e-4 (steps 50 and 10); S = 8 already at 1e-4 (step 100, the last)."""
    collapses = {(2, 1e-3): 20, (4, 3e-4): 50, (4, 1e-3): 10, (8, 1e-4): 100, (8, 3e-4): 40, (8, 1e-3): 12}
    return [
        SweepPoint(s, lr, 0, 100, collapses.get((s, lr))) for s in (1, 2, 4, 8) for lr in (1e-4, 3e-4, 1e-3)
    ]


def test_boundaries_constants_and_fits_by_hand() -> None:
    points = sweep()
    boundaries = stability_boundaries(points)
    assert [(b.sync_interval, b.lr_max, b.lr_collapse) for b in boundaries] == [
        (1, 1e-3, None),  # censored: η_max >= 1e-3
        (2, 3e-4, 1e-3),
        (4, 1e-4, 3e-4),
        (8, None, 1e-4),
    ]
    assert [b.bracketed for b in boundaries] == [False, True, True, False]
    # Ĉ over the bracketed S only: 2·3e-4 = 6e-4 and 4·1e-4 = 4e-4.
    c_hat = stability_constant(boundaries)
    assert c_hat is not None
    assert (c_hat.median, c_hat.low, c_hat.high, c_hat.count) == pytest.approx((5e-4, 4e-4, 6e-4, 2))
    assert c_hat.ratio == pytest.approx(1.5)
    # η_max: 3e-4 at S = 2, 1e-4 at S = 4 -> slope log(1/3)/log 2 = -1.585; two points, no error.
    fit = lr_max_fit(boundaries)
    assert fit.exponent == pytest.approx(math.log(1 / 3) / math.log(2))
    assert fit.stderr is None and fit.points == 2 and "two points" in fit.note
    # B̂: T_c·η = 0.02, 0.015, 0.01, 0.01, 0.012, 0.012 -> median 0.012, range 0.01 - 0.02.
    b_hat = collapse_budget(points)
    assert b_hat is not None
    assert (b_hat.median, b_hat.low, b_hat.high, b_hat.count) == pytest.approx((0.012, 0.01, 0.02, 6))
    # Stable runs: T_max·η up to 100·1e-3 = 0.1 (S = 1), far above B̂.
    assert censored_budget_floor(points) == pytest.approx(0.1)
    assert collapse_time_fit(points).points == 6


def test_held_out_collapse_step_by_hand() -> None:
    # Best 0.4 at step 5; 0.1 at step 10 is below half of it, 0.35 at 15 climbs back past 0.8·0.4 = 0.32,
    # 0.15 at 20 falls again and stays down.
    curve = [(0, 0.3), (5, 0.4), (10, 0.1), (15, 0.35), (20, 0.15), (25, 0.3)]
    assert held_out_collapse_step(curve) == 20
    assert held_out_collapse_step(curve[:4]) is None  # recovered by its last evaluation
    # The warm start's accuracy counts as a best: a run that only falls from it collapses.
    assert held_out_collapse_step([(0, 0.26), (5, 0.2), (10, 0.0), (15, 0.02)]) == 10
    assert held_out_collapse_step([(0, 0.26), (5, 0.2), (10, 0.22)]) is None  # a dip is not a collapse
    assert held_out_collapse_step([(0, 0.0), (5, 0.0)]) is None and held_out_collapse_step([]) is None
    with pytest.raises(ValueError, match="in order"):
        held_out_collapse_step([(5, 0.1), (0, 0.2)])


def test_per_seed_constants_by_hand() -> None:
    # Seed 0 brackets S = 2 at 3e-4 and S = 4 at 1e-4 (Ĉ median 5e-4); seed 1 only S = 2, at 1e-4
    # (Ĉ 2e-4); seed 2 collapses everywhere (nothing bracketed, left out).
    points = [
        SweepPoint(2, 1e-4, 0, 30, None), SweepPoint(2, 3e-4, 0, 30, None), SweepPoint(2, 1e-3, 0, 30, 9),
        SweepPoint(4, 1e-4, 0, 30, None), SweepPoint(4, 3e-4, 0, 30, 12),
        SweepPoint(2, 1e-4, 1, 30, None), SweepPoint(2, 3e-4, 1, 30, None, unstable=True),
        SweepPoint(2, 1e-4, 2, 30, 20),
    ]  # fmt: skip
    assert per_seed_constants(points) == pytest.approx({0: 5e-4, 1: 2e-4})
    assert points[6].collapsed and points[6].collapse_step is None  # unstable: collapsed without a step
    assert collapse_budget(points) is not None and collapse_budget(points).count == 3  # type: ignore[union-attr]


def test_the_report_counts_held_out_and_entropy_collapses_and_shows_the_staleness(tmp_path: Path) -> None:
    """A steady training reward is not stability: a run whose held-out accuracy falls for good collapsed
    (dated by that evaluation), and so did one whose entropy blew up (no date)."""
    steady, flat_entropy, norms = [0.5] * 20, [1.0] * 20, [1.0] * 20
    base = {"steps": 20, "wall_s": 1.0, "reward": steady, "grad_norm": norms}
    records = [
        {**base, "sync_interval": 1, "lr": 1e-3, "seed": 0, "entropy": flat_entropy,
         "staleness_mean": 0.95, "staleness_max": 1.0, "held_out": [[0, 0.3], [10, 0.28], [20, 0.3]]},
        {**base, "sync_interval": 1, "lr": 2e-3, "seed": 0, "entropy": flat_entropy,
         "staleness_mean": 0.95, "staleness_max": 1.0, "held_out": [[0, 0.3], [10, 0.1], [20, 0.05]]},
        {**base, "sync_interval": 2, "lr": 1e-3, "seed": 0, "entropy": flat_entropy,
         "staleness_mean": 1.85, "staleness_max": 2.0, "held_out": [[0, 0.3], [20, 0.3]]},
        {**base, "sync_interval": 2, "lr": 2e-3, "seed": 0, "entropy": [1.0] * 10 + [3.0] * 10,
         "staleness_mean": 1.85, "staleness_max": 2.0, "held_out": [[0, 0.3], [20, 0.3]]},
    ]  # fmt: skip
    options = Options(None, (1, 2), (1e-3, 2e-3), 20, (0,), 1, 20, 0.5, tmp_path, (), exact_lag=True)
    result = analyse(records, options)
    assert [row.collapsed_by for row in result.points] == [(), ("held-out",), (), ("entropy blow-up",)]
    assert [row.point.collapse_step for row in result.points] == [None, 10, None, None]
    assert [row.point.collapsed for row in result.points] == [False, True, False, True]
    # η_max 1e-3 at both S: Ĉ values 1e-3 and 2e-3; the bracket's upper end is S times 2e-3.
    assert result.c_hat is not None and result.c_hat.median == pytest.approx(1.5e-3)
    assert result.c_hat_bracket == pytest.approx((1.5e-3, 3e-3))
    assert result.c_hat_seeds is not None and result.c_hat_seeds.mean == pytest.approx(1.5e-3)
    assert result.b_hat_interval is not None and result.b_hat_interval.mean == pytest.approx(0.02)
    report = markdown_report(result, options)
    assert "exactly S updates old" in report and "| 0.95 / 1 | 0.300 → 0.050 |" in report
    assert "| yes | held-out | 10 | 0.02 |" in report and "| yes | entropy blow-up | – | – |" in report
    assert "lies between 0.0015 and 0.003" in report


def test_a_collapse_both_judges_see_is_dated_by_the_reward_detector(tmp_path: Path) -> None:
    rewards = [0.5] * 5 + [0.0] * 15
    record = {
        "sync_interval": 2, "lr": 1e-3, "seed": 0, "steps": 20, "wall_s": 1.0, "reward": rewards,
        "entropy": [1.0] * 5, "grad_norm": [1.0] * 5, "held_out": [[0, 0.3], [5, 0.3], [15, 0.0], [20, 0.0]],
    }  # fmt: skip
    options = Options(None, (2,), (1e-3,), 20, (0,), 1, 20, 0.5, tmp_path, (), exact_lag=True)
    (row,) = analyse([record], options).points
    assert row.collapsed_by == ("reward", "held-out")
    assert row.point.collapse_step == collapse_step(rewards) != 15


def test_a_noisy_interval_is_flagged_and_counted_conservatively() -> None:
    points = [
        SweepPoint(2, 1e-4, 0, 30, None),
        SweepPoint(2, 3e-4, 0, 30, 12),
        SweepPoint(2, 1e-3, 0, 30, None),
    ]
    (boundary,) = stability_boundaries(points)
    assert (boundary.lr_max, boundary.lr_collapse, boundary.non_monotone) == (1e-4, 3e-4, True)
    # A collapse in any seed makes the η collapsing.
    seeds = [SweepPoint(1, 1e-3, 0, 30, None), SweepPoint(1, 1e-3, 1, 30, 9)]
    assert stability_boundaries(seeds)[0].lr_collapse == 1e-3
    assert stability_constant(stability_boundaries(seeds)) is None  # nothing stable below: unbracketed


def test_power_law_fit_by_hand() -> None:
    exact = power_law_fit([1.0, 2.0, 4.0], [1.0, 0.5, 0.25])
    assert exact.exponent == pytest.approx(-1.0) and exact.prefactor == pytest.approx(1.0)
    assert exact.stderr == pytest.approx(0.0, abs=1e-12) and exact.note == ""
    # In log2 units x = 0, 1, 2 and y = 2, 1, 1: slope -1/2, intercept 11/6, residuals 1/6, -1/3, 1/6,
    # RSS 1/6, Sxx 2 -> standard error sqrt((1/6)/1/2) = sqrt(1/12) (the ratio is the same in any base).
    fit = power_law_fit([1.0, 2.0, 4.0], [4.0, 2.0, 2.0])
    assert fit.exponent == pytest.approx(-0.5)
    assert fit.stderr == pytest.approx(math.sqrt(1 / 12))
    assert fit.prefactor == pytest.approx(2 ** (11 / 6))
    lonely = power_law_fit([2.0, 2.0], [1.0, 3.0])
    assert lonely.exponent is None and lonely.stderr is None and "too few points" in lonely.note
    assert power_law_fit([], []).exponent is None
    with pytest.raises(ValueError, match="positive"):
        power_law_fit([1.0, 0.0], [1.0, 1.0])


def test_recommendation_by_hand() -> None:
    c_hat, b_hat = Spread(5e-4, 4e-4, 6e-4, 2), Spread(0.0125, 0.01, 0.02, 4)
    # S = 2, T = 100: min(5e-4/2, 0.0125/100) = min(2.5e-4, 1.25e-4) -> the budget binds; κ = 0.5.
    advice = recommend_lr(c_hat, b_hat, sync_interval=2, horizon=100, safety=0.5)
    assert advice.staleness_limit == pytest.approx(2.5e-4) and advice.budget_limit == pytest.approx(1.25e-4)
    assert advice.lr == pytest.approx(6.25e-5) and advice.binding == "budget"
    # S = 8, T = 10: min(6.25e-5, 1.25e-3) -> staleness binds.
    short = recommend_lr(c_hat, b_hat, sync_interval=8, horizon=10, safety=0.5)
    assert short.lr == pytest.approx(3.125e-5) and short.binding == "staleness"
    only_budget = recommend_lr(None, b_hat, sync_interval=8, horizon=10, safety=1.0)
    assert only_budget.lr == pytest.approx(1.25e-3) and only_budget.staleness_limit is None
    assert recommend_lr(None, None, sync_interval=1, horizon=10).lr is None
    # Measured at S = 2: η_max 1e-4 (collapsed from 3e-4) caps the law's 2.5e-4 and the budget's 1.25e-4.
    measured = stability_boundaries(sweep())[1]
    capped = recommend_lr(c_hat, b_hat, sync_interval=2, horizon=100, safety=0.5, boundary=measured)
    assert capped.measured_limit == 3e-4 and capped.lr == pytest.approx(6.25e-5)  # the budget still binds
    tight = recommend_lr(c_hat, b_hat, sync_interval=4, horizon=10, boundary=stability_boundaries(sweep())[2])
    assert tight.measured_limit == 1e-4 and tight.lr == pytest.approx(5e-5) and tight.binding == "measured"
    censored = recommend_lr(
        c_hat, b_hat, sync_interval=1, horizon=10, boundary=stability_boundaries(sweep())[0]
    )
    assert censored.measured_limit is None  # only a lower bound: no cap
    with pytest.raises(ValueError, match="safety"):
        recommend_lr(c_hat, b_hat, sync_interval=1, horizon=10, safety=1.5)


@pytest.mark.parametrize(
    ("changes", "overrides", "named"),
    [
        ({"--lrs": "1e-3,abc"}, [], "--lrs"),
        ({"--lrs": "0"}, [], "--lrs"),
        ({"--sync-intervals": "0,2"}, [], "--sync-intervals"),
        ({"--sync-intervals": "2,2"}, [], "--sync-intervals"),
        ({"--steps": "many"}, [], "--steps"),
        ({"--safety": "2"}, [], "--safety"),
        ({"--parallel": "999"}, [], "--parallel"),
        ({}, ["learner.lr=1e-3"], "learner.lr"),
        ({}, ["loop.sync_interval=4"], "loop.sync_interval"),
        ({}, ["notapair"], "key=value"),
    ],
)
def test_bad_input_is_one_line_naming_the_option(
    changes: dict[str, str],
    overrides: list[str],
    named: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = {"--sync-intervals": "1,2", "--lrs": "1e-3", "--steps": "3", "--out": str(tmp_path / "out")}
    options.update(changes)
    assert main(["calibrate", *[item for pair in options.items() for item in pair], *overrides]) == 2
    error = capsys.readouterr().err.strip()
    assert named in error and len(error.splitlines()) == 1, error
    assert not (tmp_path / "out").exists()  # nothing was written


def test_a_required_option_missing_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--sync-intervals", "1", "--steps", "3", "--out", str(tmp_path)]) == 2
    assert "--lrs is required" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)  # six subprocesses: about a minute on an idle 2-core machine, five on a busy one
def test_calibrate_runs_a_grid_writes_its_report_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh tiny MoE on the eight Math-v0 sums (tests/helpers.py's `SUMS`): calibrate warm-starts it
    once (a few SFT steps: the point here is the machinery, not learning) and runs four 3-step points."""
    tasks = tmp_path / "eight.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": f"add-{a}-{b}", "question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
            for a, b in SUMS
        )
    )
    settings = {
        "env": {"id": "pacerl/Math-v0", "tasks": str(tasks)},
        "sft": {"steps": 4, "batch_size": 8},
        "rollout": {"group_size": 4, "sampling": {"max_new_tokens": 8}},
        "loop": {"batch_groups": 2},
        "filter": {"pace": {"target_groups": 2}, "max_concurrent_groups": 2},
    }
    config = tmp_path / "run.json"
    config.write_text(json.dumps(settings))
    out = tmp_path / "sweep"
    parallel = min(2, available_cpus())
    command = ["calibrate", "--config", str(config), "--sync-intervals", "1,2", "--lrs", "1e-4,1e-2",
               "--steps", "3", "--parallel", str(parallel), "--horizon", "50", "--out", str(out),
               "rollout.max_total_tokens=96"]  # fmt: skip
    assert main(command) == 0
    printed = capsys.readouterr().out
    names = ["S1-lr0.0001-seed0", "S1-lr0.01-seed0", "S2-lr0.0001-seed0", "S2-lr0.01-seed0"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == names
    report = (out / "calibration.md").read_text()
    assert "Recommended η for a 50-step run" in report and "Ĉ = S·η_max" in report
    assert (out / "stability.png").stat().st_size > 10_000
    result = json.loads((out / "calibration.json").read_text())
    assert [(p["point"]["sync_interval"], p["point"]["lr"]) for p in result["points"]] == [
        (1, 1e-4), (1, 1e-2), (2, 1e-4), (2, 1e-2)
    ]  # fmt: skip
    assert all(p["point"]["steps"] == 3 for p in result["points"])
    assert [r["sync_interval"] for r in result["recommendations"]] == [1, 2]
    assert "S=1 lr=0.0001 seed 0" in printed and printed.count("warm start") == 1
    # Every point ran vanilla async GRPO at its own S and η from the one warm start, the CPUs divided
    # among the parallel runs, the overrides applied.
    run = json.loads((out / "runs" / "S2-lr0.01-seed0" / "config.json").read_text())
    assert run["learner"]["loss"]["name"] == "grpo" and run["learner"]["loss"]["sat"] is False
    assert run["filter"]["name"] == "none" and run["loop"]["mode"] == "async"
    assert (run["loop"]["sync_interval"], run["learner"]["lr"], run["loop"]["steps"]) == (2, 1e-2, 3)
    assert run["threads"] == max(1, available_cpus() // parallel)
    assert run["model"]["path"] == str((out / "warm-start").resolve()) and run["sft"]["when"] == "never"
    assert run["rollout"]["max_total_tokens"] == 96 and run["evaluation"]["every"] == 0

    # Resume: three finished points are skipped; the fourth, interrupted (no point.json), starts over.
    finished = {name: (out / "runs" / name / POINT_FILE).stat().st_mtime_ns for name in names[:3]}
    (out / "runs" / names[3] / POINT_FILE).unlink()
    (out / "runs" / names[3] / "leftover").write_text("from the interrupted run")
    assert main(command) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished before, skipped") == 3 and "warm start" not in printed
    assert {name: (out / "runs" / name / POINT_FILE).stat().st_mtime_ns for name in names[:3]} == finished
    assert (out / "runs" / names[3] / POINT_FILE).is_file()
    assert not (out / "runs" / names[3] / "leftover").exists()

    # The same directory with other settings is refused before anything runs.
    assert main([*command[:-1], "rollout.max_total_tokens=128"]) == 2
    assert "finished with other settings" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)  # two subprocesses (warm start, one point): under a minute idle
def test_exact_lag_trains_every_batch_at_the_lag_it_names(tmp_path: Path) -> None:
    """`--exact-lag`: the point runs in sync mode with `loop.lag=S`, each step's tokens are exactly
    min(S, version) updates old (a skipped step does not move the version), and the record keeps the
    staleness and the held-out evaluations."""

    def sums(path: Path, pairs: list[tuple[int, int]]) -> Path:
        rows = [
            {"id": f"add-{a}-{b}", "question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs
        ]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    # A warm start on all 100 sums leaves the eight half learnt, so groups differ and steps update.
    tasks = sums(tmp_path / "eight.jsonl", list(SUMS))
    every = sums(tmp_path / "all.jsonl", [(a, b) for a in range(10) for b in range(10)])
    out = tmp_path / "sweep"
    command = ["calibrate", "--exact-lag", "--sync-intervals", "2", "--lrs", "1e-3", "--steps", "5",
               "--out", str(out), "env.id=pacerl/Math-v0", f"env.tasks={tasks}", f"evaluation.tasks={tasks}",
               f"sft.tasks={every}", "sft.steps=60", "sft.batch_size=32", "loop.batch_groups=4",
               "evaluation.every=5", "evaluation.at_start=true", "evaluation.at_end=true"]  # fmt: skip
    assert main(command) == 0
    run_dir = out / "runs" / "S2-lr0.001-seed0"
    run = json.loads((run_dir / "config.json").read_text())
    assert (run["loop"]["mode"], run["loop"]["lag"], run["loop"]["sync_interval"]) == ("sync", 2, 1)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward" in row]
    before = [int(row["version"] - row["updated"]) for row in steps]
    assert [row["staleness/max_staleness"] for row in steps] == [min(2, v) for v in before]
    record = json.loads((run_dir / POINT_FILE).read_text())
    assert record["staleness_max"] == max(min(2, v) for v in before) == 2, before  # it did train
    assert [step for step, _ in record["held_out"]] == [0, 5]
    assert "| staleness |" in (out / "calibration.md").read_text()
