"""Fakes of the loop's parts for tests of `pacerl.trainer.loop` (the liveness tests, the lag test): a
learner, an engine and a rollout driver small enough that a run of a few steps takes milliseconds, and
`run_bounded`, which turns a hung loop into a test failure."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pacerl.agents.trajectory import Status, Trajectory
from pacerl.envs import Task
from pacerl.trainer.learner import StepResult
from pacerl.trainer.loop import LoopConfig, Run, train_async
from pacerl.trainer.pool import FilterConfig, TrajectoryPool
from tests.scripted import ScriptedEngineBase

HANG_S = 60.0
"""Bound on a run of a few steps that finishes in milliseconds: reaching it means the loop hung."""

GROUP_SIZE = 2
BATCH_GROUPS = 2
STEPS = 6


class FakeEngine(ScriptedEngineBase):
    """Only the version: publishing moves it."""


class FakeLearner:
    """Skips the steps listed in `skips` (1-based, like `Run.step`); every other step is an update, so
    the version moves by exactly one on an updated step and not at all on a skipped one. Records the
    token ages (version at training − token version) of every batch."""

    def __init__(self, skips: Sequence[int] = ()) -> None:
        self.version = 0
        self.counts: Counter[str] = Counter()
        self.skips = set(skips)
        self.calls = 0
        self.ages: list[int] = []
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> StepResult:
        with self._lock:
            self.calls += 1
            self.batch_sizes.append(len(groups))
            members = [t for group in groups for t in group]
            self.ages += [self.version - v for t in members for v in t.versions]
            ids = tuple(t.id for t in members)
            if self.calls in self.skips:
                self.counts["equal_rewards"] += 1
                return StepResult(False, "equal_rewards", {"reward": 0.0}, ids)
            self.version += 1
            return StepResult(True, "", {"reward": 1.0}, ids)

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return [0.1 * (i % 3) for i in range(len(trajectories))]

    def weights(self) -> Mapping[str, torch.Tensor]:
        return {}

    def save(self, directory: Path) -> None:
        (directory / "learner.json").write_text(json.dumps({"version": self.version}), encoding="utf-8")

    def load(self, directory: Path) -> None:
        self.version = int(json.loads((directory / "learner.json").read_text(encoding="utf-8"))["version"])


class FakeDriver:
    """Each group takes `ticks` turns of the event loop; its tokens carry the engine's version at the
    start, so groups launched in order finish in order. Records every launch."""

    def __init__(self, engine: FakeEngine, ticks: int = 3) -> None:
        self.engine = engine
        self.ticks = ticks
        self.counts: Counter[str] = Counter()
        self.launched: list[str] = []
        self.last_failure = ""

    async def rollout_group(
        self, task: Task, group_id: str | None = None, resume: Mapping[str, Trajectory] | None = None
    ) -> list[Trajectory]:
        assert group_id is not None
        self.launched.append(group_id)
        version = self.engine.version
        for _ in range(self.ticks):
            await asyncio.sleep(0)
        members = []
        for i in range(GROUP_SIZE):
            t = Trajectory.start(f"{group_id}/{i}", group_id, task.id, [1, 2])
            t.append_model(
                [5, 6], [-0.5, -0.5], version=version, started_at=0.0, ended_at=1.0, finish_reason="stop"
            )
            t.finish(
                Status.COMPLETED,
                reason="",
                reward=float(i),
                completed_version=self.engine.version,
                completed_at=1.0,
            )
            members.append(t)
        return members

    def in_flight(self) -> dict[str, list[Trajectory]]:
        return {}


def make_run(
    tmp_path: Path,
    filter_config: FilterConfig,
    learner: FakeLearner,
    driver: type[FakeDriver] | Any = FakeDriver,
    **loop: Any,
) -> Run:
    engine = FakeEngine()
    return Run(
        learner=learner,  # type: ignore[arg-type]
        engine=engine,  # type: ignore[arg-type]
        driver=driver(engine),  # type: ignore[arg-type]
        tasks=[Task(id=f"t{i}", question=f"q{i}", answers=("1",)) for i in range(5)],
        pool=TrajectoryPool(filter_config),
        config=LoopConfig(
            steps=STEPS, batch_groups=BATCH_GROUPS, **{"sync_interval": 1, "mode": "async", **loop}
        ),
        run_dir=tmp_path,
    )


async def run_bounded(
    run: Run, loop: Callable[[Run], Awaitable[dict[str, Any]]] = train_async
) -> dict[str, Any]:
    """`loop(run)`, failing the test (with the loop's state) if it does not end within HANG_S.
    A hung loop is asked to stop (`request_stop`, which the waiting trainer honours) rather than only
    cancelled: a loop spinning on rejections can lose a cancellation in a nested `wait_for`."""
    job = asyncio.ensure_future(loop(run))
    try:
        done, _ = await asyncio.wait({job}, timeout=HANG_S)
        if not done:
            state = (
                f"the loop hung at step {run.step}: {len(run.pool)} groups pooled, "
                f"{len(run._running)} in flight, learner version {run.learner.version}"
            )
            run.request_stop()
            await asyncio.wait({job}, timeout=HANG_S)
            job.cancel()
            pytest.fail(state)
        return job.result()
    finally:
        run.close_metrics()
