"""The async loop (`pacerl.trainer.loop.train_async`) under skipped steps, with every staleness filter: it
never waits for a batch that cannot come. A skipped step (equal rewards, non-finite values) consumes its batch
without moving the policy version; admission must count it as consumed all the same. Where no batch can
ever form, the run ends with a one-line error naming the cause instead of waiting in silence.

The learner, engine and rollout driver are small fakes, so each run takes milliseconds. A hang is turned
into a test failure by a generous bound on the wait (`loop_fakes.HANG_S`); no assertion depends on elapsed
time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from pacerl.agents.trajectory import Status, Trajectory
from pacerl.envs import Task
from pacerl.trainer.checkpoint import latest_checkpoint
from pacerl.trainer.filters import BUILT_IN_FILTERS
from pacerl.trainer.loop import RunFailedError, train_async, train_sync
from pacerl.trainer.pool import AdmissionSettings, FilterConfig, MaxAgeSettings, PaceSettings
from tests.trainer.loop_fakes import (
    BATCH_GROUPS,
    STEPS,
    FakeDriver,
    FakeEngine,
    FakeLearner,
    make_run,
    run_bounded,
)


class FailingDriver(FakeDriver):
    """Groups fail (dropped, like `on_failure=drop_group`) except those whose launch number (1-based)
    passes `finishes`; or, with `untrainable`, every episode ends truncated before its first token."""

    def __init__(
        self,
        engine: FakeEngine,
        finishes: Callable[[int], bool] = lambda number: False,
        untrainable: bool = False,
    ) -> None:
        super().__init__(engine)
        self.finishes, self.untrainable = finishes, untrainable
        self.ended: dict[int, asyncio.Event] = {}

    async def rollout_group(
        self, task: Task, group_id: str | None = None, resume: Mapping[str, Trajectory] | None = None
    ) -> list[Trajectory]:
        number = len(self.launched) + 1  # this group's launch number
        self.ended[number] = asyncio.Event()
        try:
            group = await super().rollout_group(task, group_id, resume)
            # Groups end in launch order, as the counts in the tests assume: on a loaded machine a later
            # group could otherwise end first, and "fails in a row" would depend on the scheduler.
            if number > 1:
                await self.ended[number - 1].wait()
        finally:  # a cancelled group holds up none after it
            self.ended[number].set()
        if self.untrainable:
            members = []
            for t in group:
                bare = Trajectory.start(t.id, t.group_id, t.task_id, [1, 2])
                bare.finish(
                    Status.TRUNCATED,
                    reason="context budget exhausted",
                    reward=0.0,
                    completed_version=t.completed_version,
                    completed_at=1.0,
                )
                members.append(bare)
            return members
        if self.finishes(number):
            return group
        self.last_failure = "engine failed: cannot connect to the server\n(gave up after 3 attempts)"
        return []


def filter_config(name: str, eta: int) -> FilterConfig:
    return FilterConfig(
        name=name,
        max_concurrent_groups=4,
        admission=AdmissionSettings(max_offpolicyness=eta),
        pace=PaceSettings(target_groups=BATCH_GROUPS),
        max_age=MaxAgeSettings(versions=4),
    )


CASES = [(name, eta) for name in BUILT_IN_FILTERS for eta in ((0, 1) if name == "admission" else (0,))]
SKIPS = [(1,), (1, 2), (2, 3, 4), (1, 2, 3, 4, 5, 6)]


@pytest.mark.parametrize("skips", SKIPS, ids=lambda s: "skip" + "-".join(map(str, s)))
@pytest.mark.parametrize(
    ("name", "eta"), CASES, ids=[f"{n}-eta{e}" if n == "admission" else n for n, e in CASES]
)
async def test_every_filter_finishes_a_run_with_skipped_steps(
    tmp_path: Path, name: str, eta: int, skips: tuple[int, ...]
) -> None:
    learner = FakeLearner(skips)
    run = make_run(tmp_path, filter_config(name, eta), learner)
    summary = await run_bounded(run)
    assert summary["step"] == STEPS and learner.calls == STEPS
    assert summary["version"] == learner.version == STEPS - len(set(skips) & set(range(1, STEPS + 1)))
    assert learner.batch_sizes == [BATCH_GROUPS] * STEPS
    if name == "admission":
        # AReaL's bound still holds with steps counted (a version moves at most once per step)
        assert max(learner.ages) <= eta, learner.ages


@pytest.mark.parametrize("skips", [(), (2,), (1, 4)], ids=["no-skip", "skip2", "skip1-4"])
@pytest.mark.parametrize(("sync_interval", "eta"), [(2, 1), (2, 2), (3, 2), (3, 4)])
async def test_admission_bounds_staleness_by_eta_when_weights_are_published_every_s_updates(
    tmp_path: Path, sync_interval: int, eta: int, skips: tuple[int, ...]
) -> None:
    """η bounds every trained token's age (trainer version − token version) also when the engine gets
    weights only every S updates: admission counts the engine's lag behind the trainer. Without the lag
    term, ages reach η + S − 1 (e.g. 2 with S = 2, η = 1)."""
    learner = FakeLearner(skips)
    run = make_run(tmp_path, filter_config("admission", eta), learner, sync_interval=sync_interval)
    summary = await run_bounded(run)
    assert summary["step"] == STEPS and learner.batch_sizes == [BATCH_GROUPS] * STEPS
    assert max(learner.ages) <= eta, learner.ages
    assert max(learner.ages) >= sync_interval - 1  # the lag itself shows: the bound is not vacuous


async def test_a_blocked_producer_ends_the_run_with_one_line(tmp_path: Path) -> None:
    """The producer blocked for good: an `admission` pool that counted 12 accepted groups in 3 steps of
    4 groups, resumed into a run of 2-group batches (η = 0 allows (0 + 3 + 1)·2 = 8), with nothing
    pooled or in flight. The run ends with an error naming the cause instead of waiting."""
    learner = FakeLearner()
    run = make_run(tmp_path, filter_config("admission", 0), learner)
    run.step, run.pool.accepted_groups = 3, 12  # what `Run.restore` would set
    with pytest.raises(RuntimeError) as raised:
        await run_bounded(run)
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("no batch can ever form at step 4: the pool holds 0 of the 2 groups")
    assert "admission filter admits none" in message
    assert "= 8 groups after 3 steps with the engine 0 versions behind, and 12 were accepted" in message
    assert run.driver.launched == [] and learner.calls == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("skips", [(), (1,)], ids=["no-skip", "skip1"])
async def test_max_age_below_the_publication_lag_ends_the_run_with_one_line(
    tmp_path: Path, skips: tuple[int, ...]
) -> None:
    """max_age 0 with weights published every 2 updates: after the first update the engine serves
    version 0 to a trainer at version 1, so every group is rejected for good."""
    learner = FakeLearner(skips)
    run = make_run(
        tmp_path, FilterConfig(name="max_age", max_age=MaxAgeSettings(versions=0)), learner, sync_interval=2
    )
    with pytest.raises(RuntimeError) as raised:
        await run_bounded(run)
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert "max_age.versions=0 rejects every group" in message and "sync_interval=2" in message
    updated_at = len(skips) + 1  # the first step that updates
    assert message.startswith(f"no batch can ever form at step {updated_at + 1}:")
    assert run.step == learner.calls == updated_at and learner.version == 1


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_rollouts_that_keep_failing_end_the_run_with_one_line(tmp_path: Path, mode: str) -> None:
    """A dead engine: every group fails. The run stops once `max_failed_groups` (5) failed in a row,
    with one line naming the last failure, and keeps what it had (a checkpoint) instead of relaunching
    groups for ever."""
    learner = FakeLearner()
    run = make_run(tmp_path, filter_config("pace", 0), learner, FailingDriver, mode=mode, max_failed_groups=5)
    with pytest.raises(RunFailedError) as raised:
        await run_bounded(run, train_sync if mode == "sync" else train_async)
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("rollouts keep failing: 5 groups in a row failed and none finished")
    assert message.endswith("engine failed: cannot connect to the server (gave up after 3 attempts)")
    # bounded: the groups that failed in a row, plus at most what was in flight when the 5th came back
    launched = len(run.driver.launched)  # type: ignore[attr-defined]
    assert 5 <= launched <= 5 + (4 if mode == "async" else BATCH_GROUPS)
    assert learner.calls == (2 if mode == "sync" else 0)  # sync trained its two empty batches
    assert latest_checkpoint(tmp_path / "checkpoints") is not None


async def test_failures_that_are_not_in_a_row_do_not_stop_the_run(tmp_path: Path) -> None:
    """The first four groups fail, then three of every four: a finishing group resets the count, so
    never 5 fail in a row."""
    learner = FakeLearner()

    # A rule, not a list of numbers: a loaded machine launches more groups per step (the producer
    # keeps going while the learner's thread waits for a core), and a list ends at some launch.
    def finishes(number: int) -> bool:
        return number >= 5 and number % 4 == 1

    def driver(engine: FakeEngine) -> FailingDriver:
        return FailingDriver(engine, finishes=finishes)

    run = make_run(tmp_path, filter_config("none", 0), learner, driver, max_failed_groups=5)
    summary = await run_bounded(run)
    assert summary["step"] == STEPS and summary["dropped_groups"] >= 3 * STEPS * BATCH_GROUPS
    assert run.trained_nothing() is None


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_batches_with_nothing_to_train_on_end_the_run_with_one_line(tmp_path: Path, mode: str) -> None:
    """Every episode ends before its first token (a context budget below the prompt): after
    `max_untrainable_batches` (3) such batches the run stops, naming how the episodes ended."""
    learner = FakeLearner(skips=range(1, STEPS + 1))

    def driver(engine: FakeEngine) -> FailingDriver:
        return FailingDriver(engine, untrainable=True)

    run = make_run(tmp_path, filter_config("pace", 0), learner, driver, mode=mode)
    with pytest.raises(RunFailedError) as raised:
        await run_bounded(run, train_sync if mode == "sync" else train_async)
    message = str(raised.value)
    assert len(message.splitlines()) == 1 and learner.calls == 3 and run.step == 3
    assert message.startswith("nothing to train on: 3 batches in a row held no episode that ended with a")
    assert message.endswith("truncated: context budget exhausted, no model token ×4")


async def test_a_run_whose_every_step_was_skipped_says_it_trained_nothing(tmp_path: Path) -> None:
    learner = FakeLearner(skips=range(1, STEPS + 1))
    learner.counts.update(zero_advantage=7, failed_member=0)  # what the learner counted; 0s are not named
    run = make_run(tmp_path, filter_config("none", 0), learner)
    summary = await run_bounded(run)
    assert (summary["steps_run"], summary["updated_steps"]) == (STEPS, 0)
    assert run.trained_nothing() == (
        f"trained nothing: all {STEPS} steps were skipped (zero_advantage ×7, equal_rewards ×{STEPS}), "
        "the policy is still version 0"
    )
    once = make_run(tmp_path / "once", filter_config("none", 0), FakeLearner(skips=range(2, STEPS + 1)))
    await run_bounded(once)
    assert once.trained_nothing() is None and once.updated_steps == 1
    smoke = make_run(
        tmp_path / "smoke",
        filter_config("none", 0),
        FakeLearner(skips=range(1, STEPS + 1)),
        require_update=False,
    )
    await run_bounded(smoke)
    assert smoke.trained_nothing() is None and smoke.updated_steps == 0
