"""The learner's batch preparation by hand: which trajectories carry signal, their advantages under each
estimator, the update plan's whole groups, and micro-batches that never split a group."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from pacerl.agents.trajectory import Status, Trajectory
from pacerl.trainer.batch_prep import AdvantageName, AdvantageStd, micro_batches, prepare_batch, update_plan
from tests.trainer.helpers import make_trajectory


def mixed_groups() -> list[list[Trajectory]]:
    """a: rewards 1, 0. c: all 1 (no signal). b: an empty response (reward 1), a response with reward
    0, and a failed member (no reward)."""
    empty = Trajectory.start("b/0", "b", "task", [5, 6])
    empty.append_tool([7, 8])
    empty.finish(Status.COMPLETED, reason="", reward=1.0, completed_version=0, completed_at=0.0)
    failed = Trajectory.start("b/2", "b", "task", [5, 6])
    failed.finish(Status.FAILED, reason="engine failed", reward=None, completed_version=0, completed_at=0.0)
    return [
        [make_trajectory("a/0", "a", 1.0, [20, 21]), make_trajectory("a/1", "a", 0.0, [22])],
        [make_trajectory("c/0", "c", 1.0, [23]), make_trajectory("c/1", "c", 1.0, [24])],
        [empty, make_trajectory("b/1", "b", 0.0, [25, 26, 27]), failed],
    ]


@pytest.mark.parametrize(
    ("advantage", "std", "expected"),
    [
        ("grpo", "population", [1.0, -1.0, -1.0]),  # groups of two: ±0.5 / 0.5
        ("grpo", "unbiased", [1 / math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]),  # ±0.5 / sqrt(0.5)
        ("dr_grpo", "population", [0.5, -0.5, -0.5]),
        # Centred per group (0.5, -0.5, -0.5; the empty member is left out before the batch's
        # normalisation), then over the batch: mean -1/6, population std sqrt(2)/3.
        ("reinforce_pp", "population", [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]),
    ],
)
def test_prepare_batch_keeps_the_signal_and_counts_the_rest(
    advantage: AdvantageName, std: AdvantageStd, expected: list[float]
) -> None:
    counts: Counter[str] = Counter()
    prepared = prepare_batch(
        mixed_groups(), advantage=advantage, advantage_std=std, drop_zero_advantage=True, counts=counts
    )
    assert [t.id for t in prepared.trajectories] == ["a/0", "a/1", "b/1"]
    assert prepared.group_index == [0, 0, 1]  # c is dropped, so b is the second kept group
    assert prepared.advantages == pytest.approx(expected, abs=1e-12)
    assert counts == Counter(failed_member=1, zero_advantage=1, empty_response=1)


def test_prepare_batch_keeps_groups_without_signal_when_asked() -> None:
    counts: Counter[str] = Counter()
    prepared = prepare_batch(
        mixed_groups(), advantage="grpo", advantage_std="population", drop_zero_advantage=False, counts=counts
    )
    assert [t.id for t in prepared.trajectories] == ["a/0", "a/1", "c/0", "c/1", "b/1"]
    assert prepared.group_index == [0, 0, 1, 1, 2]
    assert prepared.advantages == [1.0, -1.0, 0.0, 0.0, -1.0]
    assert "zero_advantage" not in counts


def test_update_plan_splits_whole_groups_and_is_seeded() -> None:
    group_index = [0, 0, 1, 1, 1, 2]
    single = update_plan(group_index, minibatches=1, epochs=1, shuffle_seed=0, version=0)
    assert single == [(0, [0, 1, 2, 3, 4, 5])]  # one update: no shuffle
    plan = update_plan(group_index, minibatches=5, epochs=2, shuffle_seed=3, version=7)
    assert [epoch for epoch, _ in plan] == [0, 0, 0, 1, 1, 1]  # no more updates than groups
    for epoch in (0, 1):
        parts = sorted(members for e, members in plan if e == epoch)
        assert parts == [[0, 1], [2, 3, 4], [5]]
    assert plan == update_plan(group_index, minibatches=5, epochs=2, shuffle_seed=3, version=7)


def test_micro_batches_close_before_a_group_that_would_overflow() -> None:
    group_index = [0, 0, 1, 1, 1, 2]
    members = [0, 1, 2, 3, 4, 5]
    assert micro_batches(group_index, members, 4) == [[0, 1], [2, 3, 4, 5]]
    assert micro_batches(group_index, members, 2) == [[0, 1], [2, 3, 4], [5]]  # a larger group alone
    assert micro_batches(group_index, [5, 2, 3, 4], 64) == [[5, 2, 3, 4]]
