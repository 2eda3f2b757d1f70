"""The trajectory pool and its staleness filters (none, max_age, AReaL admission, PACE), against numbers
worked out by hand on small pools."""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence

import numpy as np
import pytest

from pacerl.agents.trajectory import Status, Trajectory
from pacerl.trainer.pool import (
    AdmissionSettings,
    FilterConfig,
    MaxAgeSettings,
    PaceSettings,
    TrajectoryPool,
    _order_ends,
    admission_capacity,
    effective_staleness,
    pace_budget,
    percentile_ranks,
    prefix_drift,
    staleness_summary,
)


def traj(tid: str, group: str, runs: Sequence[tuple[int, int]], v_done: int) -> Trajectory:
    """A finished trajectory: prompt, then one model segment per (version, tokens) run, a one-token tool
    segment between consecutive runs."""
    t = Trajectory.start(tid, group, "task", [1, 2, 3])
    for i, (version, count) in enumerate(runs):
        if i:
            t.append_tool([7])
        t.append_model(
            [5] * count, [-0.5] * count, version=version, started_at=0.0, ended_at=1.0, finish_reason="stop"
        )
    t.finish(Status.COMPLETED, reason="", reward=1.0, completed_version=v_done, completed_at=2.0)
    return t


def hand_groups() -> list[list[Trajectory]]:
    """Four groups of two, for v_now = 10 (GS, WS per member):
    A: GS 0, WS 2 (both);  B: b0 GS mean(1,1,0,0) = 0.5, b1 GS 0, WS 0;
    C: GS 4, WS 1 (both; tokens of version 5, so 5 versions old);  D: GS 0, WS 0 (both)."""
    return [
        [traj("A/0", "A", [(8, 3)], 8), traj("A/1", "A", [(8, 3)], 8)],
        [traj("B/0", "B", [(9, 2), (10, 2)], 10), traj("B/1", "B", [(10, 3)], 10)],
        [traj("C/0", "C", [(5, 4)], 9), traj("C/1", "C", [(5, 4)], 9)],
        [traj("D/0", "D", [(10, 2)], 10), traj("D/1", "D", [(10, 2)], 10)],
    ]


DRIFT = {
    "A/0": 0.2,
    "A/1": 0.25,
    "B/0": 0.5,
    "B/1": 0.05,
    "C/0": 0.01,
    "C/1": 0.02,
    "D/0": 0.03,
    "D/1": 0.04,
    "F/0": 0.015,
}
"""Prefix drift F of every member with model tokens (PACE ranks F among all of them, fresh ones too)."""


def pool_of(config: FilterConfig, groups: Sequence[Sequence[Trajectory]] | None = None) -> TrajectoryPool:
    pool = TrajectoryPool(config)
    for group in hand_groups() if groups is None else groups:
        pool.add_group(group)
    return pool


def ids(batch: list[list[Trajectory]]) -> list[str]:
    return [group[0].group_id for group in batch]


class RecordingDrift:
    """A drift scorer that looks scores up and records every call's trajectory ids."""

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores
        self.calls: list[list[str]] = []

    def __call__(self, batch: Sequence[Trajectory]) -> list[float]:
        self.calls.append([t.id for t in batch])
        return [self.scores[t.id] for t in batch]


def no_drift_call(batch: Sequence[Trajectory]) -> list[float]:
    raise AssertionError(f"drift was called for {[t.id for t in batch]}")


# -- config and pure functions -----------------------------------------------------------------------------


def test_filter_config_validates_ranges() -> None:
    assert FilterConfig().name == "pace"
    for make, bad in (
        (FilterConfig, {"name": "fifo"}),
        (FilterConfig, {"max_concurrent_groups": 0}),
        (MaxAgeSettings, {"versions": -1}),
        (MaxAgeSettings, {"versions": True}),
        (AdmissionSettings, {"max_offpolicyness": -1}),
        (PaceSettings, {"target_groups": 0}),
        (PaceSettings, {"target_groups": 2.5}),
        (PaceSettings, {"ema": 1.0}),
        (PaceSettings, {"ema": -0.1}),
        (PaceSettings, {"gamma": 0.0}),
        (PaceSettings, {"gamma": math.inf}),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make(**bad)


def test_admission_capacity_by_hand() -> None:
    common = {"max_concurrent_groups": 16, "max_offpolicyness": 4, "batch_groups": 4, "trainer_steps": 2}
    # concurrency 16 - 3 = 13; staleness (4 + 2 + 1)·4 - (20 + 3) = 28 - 23 = 5 -> 5
    assert admission_capacity(running_groups=3, accepted_groups=20, **common) == 5
    # concurrency 16 - 14 = 2 binds: staleness 28 - (10 + 14) = 4
    assert admission_capacity(running_groups=14, accepted_groups=10, **common) == 2
    # staleness 28 - (30 + 3) = -5: floored at 0 (AReaL would return -5)
    assert admission_capacity(running_groups=3, accepted_groups=30, **common) == 0
    # synchronous (η = 0) at the start: (0 + 0 + 1)·2 - 0 = 2 groups may run
    sync = admission_capacity(
        trainer_steps=0,
        running_groups=0,
        accepted_groups=0,
        batch_groups=2,
        max_concurrent_groups=16,
        max_offpolicyness=0,
    )
    assert sync == 2
    # η = 0 after one skipped step (version still 0): the step consumed its 2 groups, so
    # (0 + 1 + 1)·2 - 2 = 2 may start; counted in versions it would be (0 + 0 + 1)·2 - 2 = 0 for good
    after_skip = admission_capacity(
        trainer_steps=1,
        running_groups=0,
        accepted_groups=2,
        batch_groups=2,
        max_concurrent_groups=16,
        max_offpolicyness=0,
    )
    assert after_skip == 2
    # the engine 1 version behind the trainer (weights published every 2 updates): one batch less,
    # (4 + 2 - 1 + 1)·4 - (20 + 3) = 1; a lag of 3: (4 + 2 - 3 + 1)·4 - 23 = -7, floored at 0
    assert admission_capacity(running_groups=3, accepted_groups=20, weight_lag=1, **common) == 1
    assert admission_capacity(running_groups=3, accepted_groups=20, weight_lag=3, **common) == 0
    assert admission_capacity(running_groups=3, accepted_groups=10, weight_lag=2, **common) == 7  # 20 - 13
    with pytest.raises(ValueError, match=r"^weight_lag must be >= 0, got -1$"):
        admission_capacity(running_groups=3, accepted_groups=20, weight_lag=-1, **common)
    with pytest.raises(ValueError, match="trainer_steps"):
        admission_capacity(running_groups=0, accepted_groups=0, **{**common, "trainer_steps": -1})
    with pytest.raises(ValueError, match="batch_groups"):
        admission_capacity(running_groups=0, accepted_groups=0, **{**common, "batch_groups": 0})
    with pytest.raises(ValueError, match="running_groups"):
        admission_capacity(running_groups=-1, accepted_groups=0, **common)


def test_pace_budget_by_hand() -> None:
    # P = 12, P* = 8: excess (12 - 8)/12 = 1/3; e = 0.9·0.1 + 0.1·(1/3) = 0.09 + 0.0333… = 0.12333…
    # K = round(0.12333…·12) = round(1.48) = 1 (at most the excess 12 - 8 = 4)
    rate, budget = pace_budget(occupancy=12, target=8, ema=0.9, previous=0.1)
    assert rate == pytest.approx(0.09 + 0.1 / 3)
    assert budget == 1
    # a large smoothed rate is capped by the present excess: e = 0.5·1 + 0.5·(2/10) = 0.6, 0.6·10 = 6 -> 2
    assert pace_budget(occupancy=10, target=8, ema=0.5, previous=1.0) == pytest.approx((0.6, 2))
    # round half up: e = 0.5·0 + 0.5·(1/4)... P = 4, P* = 3: e = 0.125, 0.125·4 = 0.5 -> 1
    assert pace_budget(occupancy=4, target=3, ema=0.5, previous=0.0) == pytest.approx((0.125, 1))
    # under target the excess is 0 and e only decays: e = 0.9·0.5 = 0.45, and nothing is rejected
    assert pace_budget(occupancy=5, target=8, ema=0.9, previous=0.5) == pytest.approx((0.45, 0))
    # an empty pool: excess 0 by definition, K = 0
    assert pace_budget(occupancy=0, target=8, ema=0.9, previous=0.5) == pytest.approx((0.45, 0))
    # β = 0: e is the current excess; (25 - 11)/25 = 0.56 and 0.56·25 is 14.000000000000002 in floats,
    # which must stay 14 groups, not 15
    assert pace_budget(occupancy=25, target=11, ema=0.0, previous=0.0) == (0.56, 14)
    # no history and no excess: nothing rejected
    assert pace_budget(occupancy=8, target=8, ema=0.9, previous=0.0) == (0.0, 0)
    for bad in ({"ema": 1.0}, {"previous": 1.5}, {"occupancy": -1}, {"target": -1}):
        with pytest.raises(ValueError):
            pace_budget(**{"occupancy": 4, "target": 2, "ema": 0.9, "previous": 0.0, **bad})  # type: ignore[arg-type]


def test_percentile_ranks_by_hand() -> None:
    # sorted 1, 2, 2, 3: 0-based ranks 0, 1.5 (tie of ranks 1 and 2), 3 -> divided by n - 1 = 3
    assert percentile_ranks([3.0, 1.0, 2.0, 2.0]).tolist() == [1.0, 0.0, 0.5, 0.5]
    assert percentile_ranks([0.2, 0.1]).tolist() == [1.0, 0.0]
    assert percentile_ranks([7.0]).tolist() == [0.5]
    assert percentile_ranks([4.0, 4.0, 4.0]).tolist() == [0.5, 0.5, 0.5]
    assert percentile_ranks([]).shape == (0,)
    with pytest.raises(ValueError, match="finite"):
        percentile_ranks([1.0, float("nan")])
    with pytest.raises(ValueError, match="1-D"):
        percentile_ranks(np.zeros((2, 2)))


def test_percentile_ranks_match_a_brute_force_count_with_ties() -> None:
    rng = np.random.default_rng(0)
    for n in (2, 3, 10, 257):
        values = rng.integers(0, 5, size=n).astype(float)  # many ties
        below = (values[None, :] < values[:, None]).sum(1)
        equal = (values[None, :] == values[:, None]).sum(1)
        mean_rank = below + (equal - 1) / 2  # 0-based mean rank of each tie run
        assert percentile_ranks(values) == pytest.approx(mean_rank / (n - 1))


def test_order_ends_match_a_full_stable_sort() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 100, 1000):
        values = rng.integers(0, 6, size=n) / 4  # many ties, broken by position
        order = np.argsort(values, kind="stable")
        for head, tail in ((0, 0), (1, 0), (0, 1), (min(3, n), 0), (n // 2, n - n // 2), (1, n - 1)):
            last, first = _order_ends(values, head, tail)
            assert first.tolist() == order[:head].tolist()
            assert last.tolist() == order[n - tail :].tolist()


def test_effective_staleness_by_hand() -> None:
    # S_eff = WS + pct^4·GS: 2 + 1·1.5 = 3.5; 0 + 0.5^4·2 = 0.0625·2 = 0.125; 1 + 0.3^4·0 = 1
    result = effective_staleness([2, 0, 1], [1.5, 2.0, 0.0], [1.0, 0.5, 0.3], 4.0)
    assert result.tolist() == pytest.approx([3.5, 0.125, 1.0])
    # γ = 1: the percentile weighs GS linearly: 0 + 0.5·2 = 1
    assert effective_staleness([0], [2.0], [0.5], 1.0).tolist() == [1.0]
    # integer γ goes by repeated squaring; it agrees with pow, as does a fractional γ
    pct = np.random.default_rng(2).random(100)
    for gamma in (1.0, 2.0, 3.0, 4.0, 7.0, 2.5):
        expected = pct**gamma
        np.testing.assert_allclose(effective_staleness(np.zeros(100), np.ones(100), pct, gamma), expected)
    with pytest.raises(ValueError, match="shape"):
        effective_staleness([0, 1], [0.0], [0.5], 4.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        effective_staleness([0], [1.0], [1.5], 4.0)
    with pytest.raises(ValueError, match=">= 0"):
        effective_staleness([-1], [1.0], [0.5], 4.0)
    with pytest.raises(ValueError, match="gamma"):
        effective_staleness([0], [1.0], [0.5], 0.0)


def test_prefix_drift_by_hand() -> None:
    current = np.array([-1.0, -0.5, -2.0, -0.1])
    behaviour = np.array([-1.2, 0.0, -1.0, -0.1])
    mask = np.array([True, False, True, True])
    # model tokens 0, 2, 3: |0.2| + |-1.0| + |0| = 1.2 over 3 tokens = 0.4 (token 1 is ignored)
    assert prefix_drift(current, behaviour, mask) == pytest.approx(0.4)
    t = traj("x", "g", [(3, 2)], 3)  # prompt of 3, two model tokens with log-prob -0.5
    scored = np.array([0.0, 0.0, 0.0, -0.7, -0.5])
    assert prefix_drift(scored, t.behaviour_logprobs, t.loss_mask) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no model tokens"):
        prefix_drift(current, behaviour, np.zeros(4, dtype=bool))
    with pytest.raises(ValueError, match="bool"):
        prefix_drift(current, behaviour, np.ones(4))
    with pytest.raises(ValueError, match="shape"):
        prefix_drift(current[:3], behaviour, mask)


def test_staleness_summary_by_hand() -> None:
    first = traj("t1", "g", [(8, 2), (9, 1), (10, 1)], 10)  # v_done - v_t = 2, 2, 1, 0; WS at 12 = 2
    second = traj("t2", "g", [(7, 2)], 7)  # v_done - v_t = 0, 0; WS = 5
    summary = staleness_summary([first, second], 12)
    assert (summary.trajectories, summary.model_tokens) == (2, 6)
    assert summary.mean_gs == pytest.approx(5 / 6)  # (2 + 2 + 1 + 0 + 0 + 0)/6
    assert summary.mean_ws == pytest.approx(3.0)  # (4·2 + 2·5)/6
    assert summary.mean_staleness == pytest.approx(5 / 6 + 3)
    assert summary.max_staleness == 5  # v_now - v_t: 4, 4, 3, 2, 5, 5
    assert summary.gs_hist == (3, 1, 2, 0, 0, 0, 0, 0, 0)
    assert summary.ws_hist == (0, 0, 4, 0, 0, 2, 0, 0, 0)
    # token-weighted: the per-trajectory GS weighed by model tokens gives the same mean
    weighted = (first.generation_staleness() * 4 + second.generation_staleness() * 2) / 6
    assert summary.mean_gs == pytest.approx(weighted)
    old = traj("t3", "g", [(0, 1), (12, 1)], 12)  # a token 12 versions old lands in the 8+ bin
    assert staleness_summary([old], 12).gs_hist == (1, 0, 0, 0, 0, 0, 0, 0, 1)
    metrics = summary.metrics()
    assert metrics["gs_hist_2"] == 2.0 and metrics["ws_hist_5"] == 2.0 and metrics["max_staleness"] == 5.0
    assert staleness_summary([], 3).model_tokens == 0
    with pytest.raises(ValueError, match="behind"):
        staleness_summary([first], 9)
    with pytest.raises(RuntimeError, match="running"):
        staleness_summary([Trajectory.start("r", "g", "task", [1])], 3)


# -- the filters on the hand-built pool ------------------------------------------------------------------


def test_pace_rejects_the_largest_effective_staleness_and_draws_in_arrival_order() -> None:
    pool = pool_of(FilterConfig(name="pace", pace=PaceSettings(target_groups=2, ema=0.5, gamma=4.0)))
    drift = RecordingDrift(DRIFT)
    batch = pool.select(2, 10, drift)
    # every member with model tokens is re-scored, once, in arrival order (the fresh ones place the
    # stale ones in the ranking)
    assert drift.calls == [["A/0", "A/1", "B/0", "B/1", "C/0", "C/1", "D/0", "D/1"]]
    # P = 4, P* = 2: e = 0.5·0 + 0.5·(2/4) = 0.25, K = round(0.25·4) = 1
    assert (pool.budget_ema, pool.last_budget) == (0.25, 1)
    # drift ranks among all 8: C/0 .01, C/1 .02, D/0, D/1, B/1, A/0, A/1, B/0 .5 -> pct = rank/7:
    # B/0 1, C/0 0, C/1 1/7. Group scores: A (2 + 2)/2 = 2; B (0 + 1·0.5 + 0)/2 = 0.25;
    # C ((1 + 0·4) + (1 + (1/7)^4·4))/2 = 1 + 2/2401; D 0.
    # A (waited 2 versions) goes; C spans 5 versions but its prefix drifted least of all, so it stays.
    assert pool.rejections == {"pace_budget": 1}
    assert pool.rejected_ids == ["A/0", "A/1"]
    assert ids(batch) == ["B", "C"]  # the rest in arrival order, not by score
    assert pool.group_ids() == ["D"]
    assert (pool.counts["drawn_groups"], pool.counts["rejected_trajectories"]) == (2, 2)
    assert pool.counts["drift_scored"] == 8 and pool.counts["drift_unscored"] == 0


def test_pace_ranks_a_large_drift_against_the_fresh_members_too() -> None:
    """The issue's pool: v_now 8, P* 2, β 0, groups of two. A: tokens of versions 0 and 8 (GS 4, WS 0,
    F 5.0); B0-B2 fresh (GS 0, WS 1, F 0.01). P = 4: e = 2/4, K = 2. Ranked among all eight members, A's
    tie at the top has mid-rank 6.5 of 7: pct 13/14, S_eff = (13/14)^4·4 = 2.97 > 1, so A goes first,
    then the latest of the tied fresh groups. Ranked among the stale members alone, A would get pct 0.5
    (S_eff 0.25) whatever its drift, and B1, B2 would go instead."""
    pool = TrajectoryPool(FilterConfig(name="pace", pace=PaceSettings(target_groups=2, ema=0.0)))
    scores = {}
    pool.add_group([traj(f"A/{i}", "A", [(0, 2), (8, 2)], 8) for i in range(2)])
    scores.update({"A/0": 5.0, "A/1": 5.0})
    for b in range(3):
        pool.add_group([traj(f"B{b}/{i}", f"B{b}", [(7, 2)], 7) for i in range(2)])
        scores.update({f"B{b}/0": 0.01, f"B{b}/1": 0.01})
    assert ids(pool.select(2, 8, RecordingDrift(scores))) == ["B0", "B1"]
    assert pool.rejected_ids == ["A/0", "A/1", "B2/0", "B2/1"]


@pytest.mark.parametrize(("drift_a", "drawn"), [(0.0, "A"), (0.01, "A"), (100.0, "B")])
def test_pace_decision_follows_the_size_of_the_drift(drift_a: float, drawn: str) -> None:
    """One interrupted trajectory A (versions 4 and 8: GS 2, WS 0) against one fresh B (GS 0, WS 1,
    F 0.01), P* 1, β 0: P = 2, K = 1. F_A below B's: pct 0, S_eff 0 < 1, B goes; equal: pct 0.5,
    S_eff 0.5^4·2 = 0.125 < 1, B goes; far above: pct 1, S_eff 2 > 1, A goes."""
    pool = TrajectoryPool(FilterConfig(name="pace", pace=PaceSettings(target_groups=1, ema=0.0)))
    pool.add_group([traj("A/0", "A", [(4, 1), (8, 1)], 8)])
    pool.add_group([traj("B/0", "B", [(7, 2)], 7)])
    assert ids(pool.select(1, 8, RecordingDrift({"A/0": drift_a, "B/0": 0.01}))) == [drawn]


def test_pace_leaves_members_without_model_tokens_out_of_the_ranking() -> None:
    """A member that failed before its first token has no prefix: it is not scored and takes no rank.
    Ranked among S/0 (F 1.0) and T/0 (F 0.5) alone, S/0 gets pct 1: S_eff = 0 + 1·2 = 2 > T's WS 1."""
    failed = Trajectory.start("T/1", "T", "task", [1, 2])
    failed.finish(Status.FAILED, reason="engine failed", reward=None, completed_version=7, completed_at=1.0)
    pool = TrajectoryPool(FilterConfig(name="pace", pace=PaceSettings(target_groups=1, ema=0.0)))
    pool.add_group([traj("S/0", "S", [(4, 1), (8, 1)], 8)])
    pool.add_group([traj("T/0", "T", [(7, 2)], 7), failed])
    drift = RecordingDrift({"S/0": 1.0, "T/0": 0.5})
    # T's score is the mean of its members' WS: (1 + 1)/2 = 1 < 2, so S goes
    assert ids(pool.select(1, 8, drift)) == ["T"] and drift.calls == [["S/0", "T/0"]]


def test_pace_without_drift_counts_full_generation_staleness() -> None:
    pool = pool_of(FilterConfig(name="pace", pace=PaceSettings(target_groups=2, ema=0.5)))
    batch = pool.select(2, 10)
    # unscored GS > 0 members take pct = 1: C = ((1 + 4) + (1 + 4))/2 = 5 is now the largest score
    assert pool.rejected_ids == ["C/0", "C/1"]
    assert ids(batch) == ["A", "B"]
    assert pool.group_ids() == ["D"]
    assert pool.counts["drift_unscored"] == 3


def test_pace_budget_stops_once_the_pool_is_back_at_target() -> None:
    pool = pool_of(FilterConfig(name="pace", pace=PaceSettings(target_groups=2, ema=0.5)))
    pool.select(2, 10, RecordingDrift(DRIFT))
    assert ids(pool.select(2, 10, no_drift_call)) == ["D"]  # K = 0: nothing to rank, no call
    # P = 1 < P*: e = 0.5·0.25 = 0.125 decays, but K = 0: a pool under target is never thinned
    assert (pool.budget_ema, pool.last_budget) == (0.125, 0)
    assert pool.rejections == {"pace_budget": 1}


def test_pace_drift_is_cached_per_version_and_asked_only_for_a_budget() -> None:
    drift = RecordingDrift({**DRIFT, "E/0": 0.6, "E/1": 0.07, "G/0": 0.001, "H/0": 0.002})
    pool = pool_of(FilterConfig(name="pace", pace=PaceSettings(target_groups=8)))  # P = 4 <= P*: K = 0
    assert ids(pool.select(1, 10, drift)) == ["A"] and drift.calls == []  # nothing to rank: no call
    pool = pool_of(FilterConfig(name="pace", pace=PaceSettings(target_groups=3, ema=0.0)))
    # P = 4: e = 1/4, K = 1 rejects A (score 2, as in the first PACE test); B is drawn; every member
    # with model tokens is scored once
    assert ids(pool.select(1, 10, drift)) == ["B"] and pool.rejected_ids == ["A/0", "A/1"]
    assert drift.calls == [["A/0", "A/1", "B/0", "B/1", "C/0", "C/1", "D/0", "D/1"]]
    pool.add_group([traj("E/0", "E", [(9, 1), (10, 1)], 10), traj("E/1", "E", [(10, 1)], 10)])
    pool.add_group([traj("F/0", "F", [(10, 1)], 10)])
    # P = 4 (C, D, E, F), K = 1. Same version: C's and D's scores are reused, E's and F's scored.
    # Ranks among C/0 .01, F/0 .015, C/1 .02, D/0 .03, D/1 .04, E/1 .07, E/0 .6 -> pct = rank/6:
    # C ((1 + 0) + (1 + (2/6)^4·4))/2 = 1 + 2/81; E (1·0.5 + 0)/2 = 0.25; D and F 0. C goes, D is drawn.
    assert ids(pool.select(1, 10, drift)) == ["D"] and pool.rejected_ids[2:] == ["C/0", "C/1"]
    assert drift.calls[1:] == [["E/0", "E/1", "F/0"]]
    pool.add_group([traj("G/0", "G", [(11, 1)], 11)])
    pool.add_group([traj("H/0", "H", [(11, 1)], 11)])
    # v 11, P = 4 (E, F, G, H), K = 1: a new version re-scores every member still pooled.
    # Ranks G .001, H .002, F .015, E/1 .07, E/0 .6: E/0 pct 1, E ((1 + 1·0.5) + 1)/2 = 1.25 > F 1 > G, H 0.
    assert ids(pool.select(1, 11, drift)) == ["F"] and pool.rejected_ids[4:] == ["E/0", "E/1"]
    assert drift.calls[2:] == [["E/0", "E/1", "F/0", "G/0", "H/0"]]
    assert pool.counts["drift_calls"] == 3 and pool.counts["drift_scored"] == 16


def test_pace_ties_are_rejected_latest_first_and_the_rest_drawn_in_arrival_order() -> None:
    pool = pool_of(FilterConfig(name="pace", pace=PaceSettings(target_groups=3, ema=0.0)))
    pool.add_group([traj("F/0", "F", [(10, 1)], 10)])  # score 0, like D but later
    # P = 5: e = 2/5, K = 2 rejects A (2) and C (1 + (2/8)^4·4/2 = 1.0078: C/1 ranks 2 of 8);
    # B (0.25), D and F (0) drawn in arrival order
    assert ids(pool.select(3, 10, RecordingDrift(DRIFT))) == ["B", "D", "F"]
    assert pool.rejected_ids == ["A/0", "A/1", "C/0", "C/1"]
    tied = pool_of(FilterConfig(name="pace", pace=PaceSettings(target_groups=1, ema=0.0)), [hand_groups()[3]])
    tied.add_group([traj("F/0", "F", [(10, 1)], 10)])  # P = 2, K = 1: D and F tie at 0
    assert ids(tied.select(1, 10)) == ["D"] and tied.rejected_ids == ["F/0"]


def test_pace_at_or_below_target_leaves_no_group_behind() -> None:
    """Four groups pooled, then two in and two out per step at occupancy 6 <= P* = 8 (K = 0 throughout):
    every group leaves within ⌈P/b⌉ = ⌈6/2⌉ = 3 selects of its arrival, so none waits more than 3
    versions, the first four included."""
    pool = TrajectoryPool(FilterConfig(name="pace", pace=PaceSettings(target_groups=8)))
    arrived: dict[str, int] = {}
    for n in range(4):
        pool.add_group([traj(f"g{n}/0", f"g{n}", [(0, 2)], 0)])
        arrived[f"g{n}"] = 0
    waits = []
    for v_now in range(1, 41):
        for n in range(4 + 2 * (v_now - 1), 4 + 2 * v_now):
            pool.add_group([traj(f"g{n}/0", f"g{n}", [(v_now - 1, 2)], v_now - 1)])
            arrived[f"g{n}"] = v_now - 1
        assert len(pool) == 6
        for group in pool.select(2, v_now, random_scores):
            waits.append(v_now - group[0].completed_version)  # type: ignore[operator]
            assert v_now - arrived[group[0].group_id] <= 3, (group[0].group_id, v_now)
    assert pool.last_budget == 0 and not pool.rejections
    assert set(pool.group_ids()) == {"g80", "g81", "g82", "g83"}  # the last arrivals, nothing older
    assert max(waits) == 3 and len(waits) == 80


@pytest.mark.parametrize(
    ("name", "target"),
    [("none", 8), ("max_age", 8), ("admission", 8), ("pace", 8), ("pace", 3), ("pace", 1)],
)
def test_every_group_leaves_the_pool_within_the_bound(name: str, target: int) -> None:
    """`select`'s bound: a group that arrives with a groups ahead of it leaves (drawn or rejected) by the
    ⌈(a + 1)/m⌉-th select after its arrival, m = min(b, P*) under PACE and b otherwise; driven through
    400 steps whose arrivals (0 to 2b a step, b on average) match the b drawn a step."""
    rng = random.Random(7)
    batch = 4
    pool = TrajectoryPool(
        FilterConfig(
            name=name, max_age=MaxAgeSettings(versions=3), pace=PaceSettings(target_groups=target, ema=0.5)
        )
    )
    m = min(batch, target) if name == "pace" else batch
    deadline: dict[str, int] = {}  # group -> the last select it may still be pooled before
    number = 0
    for select in range(400):
        v_now = 3 + select
        for _ in range(rng.randint(0, 2 * batch)):
            group = random_group(rng, number, v_now)
            number += 1
            deadline[group[0].group_id] = select + math.ceil((len(pool) + 1) / m)
            pool.add_group(group)
        before = set(pool.group_ids())
        pool.select(batch, v_now, random_scores)
        for group_id in before - set(pool.group_ids()):  # drawn or rejected by this select
            assert select < deadline.pop(group_id), (group_id, select)
    assert all(deadline[group_id] >= 400 for group_id in pool.group_ids())  # none overdue
    assert number > 1000 and (name in ("none", "admission") or pool.rejections)


def test_max_age_rejects_groups_with_an_old_token_then_fifo() -> None:
    pool = pool_of(FilterConfig(name="max_age", max_age=MaxAgeSettings(versions=4)))
    batch = pool.select(2, 10, no_drift_call)  # drift is pace's only
    assert pool.rejections == {"max_age": 1}  # C has tokens of version 5: 10 - 5 = 5 > 4
    assert pool.rejected_ids == ["C/0", "C/1"]
    assert ids(batch) == ["A", "B"]
    assert pool.group_ids() == ["D"]
    # at the cap exactly (10 - 5 = 5 = max_age) the group stays
    pool = pool_of(FilterConfig(name="max_age", max_age=MaxAgeSettings(versions=5)))
    assert ids(pool.select(4, 10)) == ["A", "B", "C", "D"]
    assert pool.rejections == {}


@pytest.mark.parametrize("name", ["none", "admission"])
def test_unfiltered_draws_are_fifo(name: str) -> None:
    pool = pool_of(FilterConfig(name=name))  # type: ignore[arg-type]
    assert ids(pool.select(2, 10, no_drift_call)) == ["A", "B"]
    assert ids(pool.select(5, 12)) == ["C", "D"]  # fewer than asked: what there is
    assert pool.select(1, 12) == [] and pool.rejections == {}


def test_admission_capacity_only_under_the_admission_filter() -> None:
    areal = pool_of(
        FilterConfig(
            name="admission", max_concurrent_groups=16, admission=AdmissionSettings(max_offpolicyness=1)
        )
    )
    assert areal.accepted_groups == 4
    # v 0, B 2, running 1: min(16 - 1, (1 + 0 + 1)·2 - (4 + 1)) = min(15, -1) -> 0
    assert areal.admission(0, running_groups=1, batch_groups=2) == 0
    # v 2: (1 + 2 + 1)·2 - 5 = 3
    assert areal.admission(2, running_groups=1, batch_groups=2) == 3
    areal.select(2, 10)
    assert areal.accepted_groups == 4  # drawing does not un-accept: AReaL counts since the start
    names: tuple[str, ...] = ("none", "max_age", "pace")
    for name in names:
        pool = pool_of(FilterConfig(name=name, max_concurrent_groups=16))
        assert pool.admission(0, running_groups=1, batch_groups=2) == 15
        assert pool.admission(0, running_groups=20, batch_groups=2) == 0
    with pytest.raises(ValueError, match="batch_groups"):
        areal.admission(0, running_groups=0, batch_groups=0)


def test_a_member_without_model_tokens_is_pooled_with_no_generation_staleness() -> None:
    failed = Trajectory.start("G/1", "G", "task", [1, 2])
    failed.finish(Status.FAILED, reason="engine failed", reward=None, completed_version=3, completed_at=1.0)
    pool = TrajectoryPool(FilterConfig(name="max_age", max_age=MaxAgeSettings(versions=0)))
    pool.add_group([traj("G/0", "G", [(3, 2)], 3), failed])
    assert pool.num_trajectories == 2
    assert [len(group) for group in pool.select(1, 3)] == [2]  # no token is older than 0 versions


# -- integrity, counting, checkpoints --------------------------------------------------------------------


def random_group(rng: random.Random, number: int, v_now: int) -> list[Trajectory]:
    group = f"g{number}"
    members = []
    for i in range(rng.randint(1, 5)):
        v_done = v_now - rng.randint(0, 3)
        start = v_done - rng.randint(0, 6)
        runs = [(rng.randint(max(start, 0), v_done), rng.randint(1, 4)) for _ in range(rng.randint(1, 3))]
        members.append(traj(f"{group}/{i}", group, sorted(runs), v_done))
    return members


def random_scores(batch: Sequence[Trajectory]) -> list[float]:
    return [random.Random(t.id).random() for t in batch]


@pytest.mark.parametrize("name", ["none", "max_age", "admission", "pace"])
def test_groups_stay_whole_and_no_trajectory_is_lost(name: str) -> None:
    rng = random.Random(0)
    config = FilterConfig(name=name, max_age=MaxAgeSettings(versions=5), pace=PaceSettings(target_groups=15))  # type: ignore[arg-type]
    pool = TrajectoryPool(config)
    added: dict[str, list[str]] = {}
    drawn: list[str] = []
    for v_now in range(3, 30):
        for _ in range(rng.randint(0, 20)):
            group = random_group(rng, len(added), v_now)
            pool.add_group(group)
            added[group[0].group_id] = [t.id for t in group]
        for group in pool.select(rng.randint(1, 20), v_now, random_scores):
            assert [t.id for t in group] == added[group[0].group_id]  # whole, in order
            drawn += [t.id for t in group]
    pooled = [t.id for t in pool.trajectories()]
    everything = drawn + pool.rejected_ids + pooled
    assert len(everything) == len(set(everything)) == sum(len(members) for members in added.values())
    assert pool.counts["drawn_trajectories"] == len(drawn)
    assert pool.counts["rejected_trajectories"] == len(pool.rejected_ids)
    assert sum(pool.rejections.values()) == len({i.split("/")[0] for i in pool.rejected_ids})
    assert pool.num_trajectories == len(pooled) and len(pool) == len({i.split("/")[0] for i in pooled})
    if name in ("none", "admission"):
        assert not pool.rejected_ids
    else:
        assert pool.rejected_ids


def test_precomputed_staleness_matches_the_record_across_compaction() -> None:
    rng = random.Random(1)
    groups = [random_group(rng, number, 20) for number in range(150)]
    pool = TrajectoryPool(FilterConfig(name="none"))
    for cycle in range(4):  # the same records again once drawn: each cycle leaves ~450 dead rows
        for group in groups:
            pool.add_group(group)
        out = [g for _ in range(15) for g in pool.select(10, 20 + cycle)]
        assert [g[0].group_id for g in out] == [g[0].group_id for g in groups]
        assert [[t.id for t in g] for g in out] == [[t.id for t in g] for g in groups]
    for group in groups[:5]:
        pool.add_group(group)
    rows = sum(len(group) for group in groups[:5])
    assert pool._rows < 4 * sum(len(g) for g in groups)  # compacted at least once
    live = np.flatnonzero(pool._cols.alive[: pool._rows])
    assert live.size == rows == pool.num_trajectories
    # GS precomputed on add equals the record's own (bit for bit), and so does the oldest version
    for row, trajectory in zip(live, pool.trajectories(), strict=True):
        assert pool._cols.gs[row] == trajectory.generation_staleness()
        assert pool._cols.v_min[row] == trajectory.token_versions[trajectory.loss_mask].min()


def test_rejected_ids_are_bounded() -> None:
    pool = TrajectoryPool(
        FilterConfig(name="max_age", max_age=MaxAgeSettings(versions=0)), max_rejected_ids=3
    )
    for group in hand_groups():
        pool.add_group(group)
    pool.select(1, 10)  # A, B and C hold tokens older than v 10: 6 trajectories rejected
    assert pool.rejections == {"max_age": 3}
    assert pool.rejected_ids == ["B/1", "C/0", "C/1"]  # the latest 3
    assert pool.counts["rejected_ids_dropped"] == 3 and pool.counts["rejected_trajectories"] == 6


def test_state_dict_round_trip_is_exact() -> None:
    config = FilterConfig(name="pace", pace=PaceSettings(target_groups=2, ema=0.5))
    pool = pool_of(config, [*hand_groups(), [traj("E/0", "E", [(6, 2), (9, 1)], 9)]])
    pool.select(1, 10, RecordingDrift(DRIFT | {"E/0": 0.2}))
    state = json.loads(json.dumps(pool.state_dict(), allow_nan=False))
    # P = 5: e = 0.5·(3/5) = 0.3, K = round(1.5) = 2. E/0 (GS 2, WS 1) ties A/0 at 0.2: mid-rank 5.5 of
    # 8, E = 1 + (5.5/8)^4·2 = 1.45; A 2, C 1 + (1/8)^4·2, B 0.25, D 0: A and E go, B is drawn; C and D
    # stay pooled with their scores at v 10
    assert [entry[0] for entry in state["drift"]] == ["C/0", "C/1", "D/0", "D/1"]
    restored = TrajectoryPool(config)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert len(restored) == len(pool) and restored.num_trajectories == pool.num_trajectories
    assert (restored.budget_ema, restored.accepted_groups) == (pool.budget_ema, pool.accepted_groups)
    # the cache came back: the same select on both, at the same version and over target, asks only for
    # the new member's score. P = 3: e = 0.5·0.3 + 0.5·(1/3), K = round(0.95) = 1. Ranks G/0 .005, C/0,
    # C/1, D/0, D/1 -> pct = rank/4: C ((1 + (1/4)^4·4) + (1 + (2/4)^4·4))/2 = 1.13 goes; D, G drawn.
    drifts = [RecordingDrift({"G/0": 0.005}), RecordingDrift({"G/0": 0.005})]
    for either in (pool, restored):
        either.add_group([traj("G/0", "G", [(10, 1)], 10)])
    assert ids(restored.select(2, 10, drifts[0])) == ids(pool.select(2, 10, drifts[1])) == ["D", "G"]
    assert drifts[0].calls == drifts[1].calls == [["G/0"]]
    assert restored.rejected_ids[-2:] == pool.rejected_ids[-2:] == ["C/0", "C/1"]
    assert restored.state_dict() == pool.state_dict()
    restored.add_group([traj("H/0", "H", [(10, 1)], 10)])
    assert restored.accepted_groups == pool.accepted_groups + 1


def test_load_state_dict_rejects_a_bad_state_and_keeps_the_pool() -> None:
    pool = pool_of(FilterConfig())
    state = pool.state_dict()
    with pytest.raises(ValueError, match="exactly"):
        pool.load_state_dict({**state, "extra": 1})
    with pytest.raises(ValueError, match="not in the pool"):
        pool.load_state_dict({**state, "drift": [["nobody", 3, 0.1]]})
    with pytest.raises(ValueError, match="counts"):
        pool.load_state_dict({**state, "counts": {"drawn_groups": -1}})
    assert pool.state_dict() == state


def test_bad_input_raises() -> None:
    pool = pool_of(
        FilterConfig(pace=PaceSettings(target_groups=2, ema=0.0))
    )  # K = 2: the drift scorer is asked
    running = Trajectory.start("R/0", "R", "task", [1])
    with pytest.raises(ValueError, match="unfinished"):
        pool.add_group([running])
    with pytest.raises(ValueError, match="share one group_id"):
        pool.add_group([traj("X/0", "X", [(1, 1)], 1), traj("Y/0", "Y", [(1, 1)], 1)])
    with pytest.raises(ValueError, match="already in the pool"):
        pool.add_group([traj("A/9", "A", [(1, 1)], 1)])
    with pytest.raises(ValueError, match="unique"):
        pool.add_group([traj("Z/0", "Z", [(1, 1)], 1), traj("Z/0", "Z", [(1, 1)], 1)])
    with pytest.raises(ValueError, match="non-empty"):
        pool.add_group([])
    with pytest.raises(ValueError, match="batch_groups"):
        pool.select(0, 10)
    with pytest.raises(ValueError, match="behind"):
        pool.select(1, 9)  # B and D finished at version 10
    assert len(pool) == 4 and pool.accepted_groups == 4  # nothing changed
    with pytest.raises(ValueError, match="one score per trajectory"):
        pool.select(1, 10, lambda batch: [0.1])  # eight members need scores
    with pytest.raises(ValueError, match="finite"):
        pool.select(1, 10, lambda batch: [0.1, float("nan"), -1.0] + [0.1] * (len(batch) - 3))
    assert pool.budget_ema == 0.0 and pool.counts["drift_calls"] == 0
    pool.select(1, 11)
    with pytest.raises(ValueError, match="went back"):
        pool.select(1, 10)
    with pytest.raises(ValueError, match="FilterConfig"):
        TrajectoryPool("pace")  # type: ignore[arg-type]


# -- Mutation-testing kills (docs/mutation.md): each test pins a behaviour a plausible wrong edit would
# change, with numbers worked out by hand.


def test_pace_scores_a_group_by_its_members_mean() -> None:
    # GS = 0 everywhere, so S_eff = WS = 10 - v_done. X (one member): 3; Y (two): 5 and 0, mean 2.5;
    # Z (three): 2, 2, 2, mean 2. P = 3, P* = 2, β = 0: e = 1/3, K = round(1) = 1 rejects X, the largest
    # mean. The max (Y: 5), the sum (Z: 6) or the sum times the size (Z: 18) would reject another group.
    pool = TrajectoryPool(FilterConfig(name="pace", pace=PaceSettings(target_groups=2, ema=0.0)))
    pool.add_group([traj("X/0", "X", [(7, 1)], 7)])
    pool.add_group([traj("Y/0", "Y", [(5, 1)], 5), traj("Y/1", "Y", [(10, 1)], 10)])
    pool.add_group([traj(f"Z/{i}", "Z", [(8, 1)], 8) for i in range(3)])
    assert ids(pool.select(3, 10, no_drift_call)) == ["Y", "Z"]
    assert pool.rejected_ids == ["X/0"] and pool.last_budget == 1


def test_pool_counters_add_up_over_selects() -> None:
    pool = pool_of(FilterConfig(name="pace", pace=PaceSettings(target_groups=2, ema=0.5)))
    assert ids(pool.select(2, 10)) == ["A", "B"]  # as in the test without drift: C rejected, D stays
    assert (pool.counts["drawn_groups"], pool.counts["drift_unscored"]) == (2, 3)
    pool.add_group([traj("E/0", "E", [(9, 1), (10, 1)], 10)])  # GS (1 + 0)/2 = 0.5, unscored: pct 1
    pool.add_group([traj("F/0", "F", [(10, 1)], 10)])
    pool.add_group([traj("G/0", "G", [(10, 1)], 10)])
    # P = 4 (D, E, F, G): e = 0.5·0.25 + 0.5·(2/4) = 0.375, K = round(1.5) = 2 rejects E (0.5) and the
    # latest of the tied zeros (G); D and F are drawn
    assert ids(pool.select(2, 10)) == ["D", "F"] and pool.rejected_ids[2:] == ["E/0", "G/0"]
    assert (pool.counts["drawn_groups"], pool.counts["drift_unscored"]) == (4, 4)


def test_fifo_continues_from_any_group_left_at_the_front() -> None:
    pool = TrajectoryPool(FilterConfig(name="none"))
    for name in "ABC":
        pool.add_group([traj(f"{name}/0", name, [(0, 1)], 0)])
    assert ids(pool.select(1, 0)) == ["A"]
    assert ids(pool.select(1, 0)) == ["B"]  # the front group now has arrival number 1
    with pytest.raises(ValueError, match=r"^batch_groups must be >= 1, got 0$"):
        pool.select(0, 0)


def test_order_ends_return_positions_even_when_empty() -> None:
    values = np.array([0.5, 0.25, 0.75])
    for head, tail in ((0, 0), (1, 0), (0, 1), (1, 2)):
        last, first = _order_ends(values, head, tail)
        assert last.dtype == np.intp and first.dtype == np.intp
        assert first.tolist() == [1][:head] and last.tolist() == [0, 2][2 - tail :]


def test_budget_and_admission_refusals_name_the_argument() -> None:
    admission = {
        "trainer_steps": 0,
        "running_groups": 0,
        "accepted_groups": 0,
        "batch_groups": 1,
        "max_concurrent_groups": 1,
        "max_offpolicyness": 0,
    }
    # the smallest legal values: one group may run, min(1 - 0, (0 + 0 + 1)·1 - 0) = 1
    assert admission_capacity(**admission) == 1
    for name, minimum in (
        ("trainer_steps", 0),
        ("running_groups", 0),
        ("accepted_groups", 0),
        ("batch_groups", 1),
        ("max_concurrent_groups", 1),
        ("max_offpolicyness", 0),
    ):
        with pytest.raises(ValueError, match=rf"^{name} must be >= {minimum}, got {minimum - 1}$"):
            admission_capacity(**{**admission, name: minimum - 1})
    # P* = 0 is legal: everything is excess, e = 0.5·0 + 0.5·1 = 0.5, K = min(round(1), 2) = 1
    assert pace_budget(occupancy=2, target=0, ema=0.5, previous=0.0) == (0.5, 1)
    budget = {"occupancy": 2, "target": 0, "ema": 0.5, "previous": 0.0}
    for name, bad, message in (
        ("occupancy", -1, "occupancy must be >= 0, got -1"),
        ("target", -1, "target must be >= 0, got -1"),
        ("ema", 1.0, "ema must be finite and in [0.0, 1.0), got 1.0"),
        ("previous", 1.5, "previous must be finite and in [0.0, 1.0], got 1.5"),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            pace_budget(**{**budget, name: bad})  # type: ignore[arg-type]


def test_effective_staleness_and_prefix_drift_refusals_and_precision() -> None:
    with pytest.raises(ValueError, match="must share a 1-D shape"):
        effective_staleness([0.0, 1.0], [0.0], [0.5, 0.5], 4.0)  # GS alone has the wrong shape
    with pytest.raises(ValueError, match="must share a 1-D shape"):
        effective_staleness(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)), 4.0)
    with pytest.raises(ValueError, match=r"^waiting and generation staleness must be finite and >= 0$"):
        effective_staleness([0.0], [-1.0], [0.5], 4.0)
    with pytest.raises(ValueError, match=r"^drift percentiles must be in \[0, 1\]$"):
        effective_staleness([0.0], [1.0], [-0.5], 4.0)
    # computed in float64 whatever comes in: pct 0.7 (as float32) squared twice, times GS 1
    pct = np.float32([0.7])
    assert effective_staleness([0.0], [1.0], pct, 4.0).tolist() == [float(pct[0]) ** 2 * float(pct[0]) ** 2]
    current, behaviour, mask = np.array([-1.0, -0.5, -2.0]), np.array([-1.2, 0.0, -1.0]), np.ones(3, bool)
    with pytest.raises(ValueError, match="must share a 1-D shape"):
        prefix_drift(current, behaviour[:2], mask)  # behaviour alone has the wrong shape
    with pytest.raises(ValueError, match="must share a 1-D shape"):
        prefix_drift(current[None], behaviour[None], mask[None])
    with pytest.raises(ValueError, match=r"^no model tokens: the prefix drift is undefined$"):
        prefix_drift(current, behaviour, np.zeros(3, bool))
    with pytest.raises(ValueError, match=r"^log-probs must be finite on model tokens$"):
        prefix_drift(current, np.array([-1.2, math.nan, -1.0]), mask)


def test_every_built_in_filter_is_registered_with_its_traits() -> None:
    from pacerl.trainer.filters import BUILT_IN_FILTERS, FILTERS

    assert BUILT_IN_FILTERS == tuple(FILTERS)[:4] == ("none", "max_age", "admission", "pace")
    traits = {
        name: (f.reason, f.section, f.admission is not None, f.check is not None, f.stall is not None)
        for name, f in FILTERS.items()
        if name in BUILT_IN_FILTERS
    }
    assert traits == {
        "none": ("", "", False, False, False),
        "admission": ("", "admission", True, True, False),
        "max_age": ("max_age", "max_age", False, True, True),
        "pace": ("pace_budget", "pace", False, True, False),
    }
