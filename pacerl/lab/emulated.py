"""Emulated-cluster training: the real model, env and learner under the simulator's clock.

`pacerl train` with `emulation.clock = "emulated"` trains for real, but every decision that depends on
time is taken by the discrete-event engine of `pacerl simulate` (`pacerl.lab.engine`), run on the real
workload (docs/simulation.md, "Emulated-cluster training"):

- **What the clock decides**, in simulated seconds, with the cost models of `emulation.preset`
  (`pacerl.lab.costs`) on `inference_gpus` + `trainer_gpus`: when a group starts (the pool's admission
  under the run's filter and `max_concurrent_groups`), when each turn joins an engine's batch and when
  it ends (the decode model at the batch's rows and KV), how long a tool call takes (the tool-latency
  model), when a batch is drawn and how long its step takes (the trainer model on the batch's real token
  count), and when weights are published (every `loop.sync_interval` updates, after the weight-sync
  time). So it decides which version is live for each decoded token and how long each group waits.
- **What is real**: every token (the run's engine, holding the live version's weights), every tool call
  and reward (the run's env and sandbox, through the run's `RolloutDriver`: token-exact records), every
  update (the run's learner, on the batches the pool's filter draws, PACE scored by the learner's own
  prefix drift).

How a turn is realised: when the clock admits a turn into an engine's batch, the real engine generates
the whole turn at once under the live version (`Turn.hold`), and the turn's real length is what the
clock decodes. When a publication interrupts it after d of its tokens (the clock's fluid progress,
rounded, as the simulator cuts its segments), the first d generated tokens are kept as the old version's
(`Turn.commit`) and the rest is thrown away and generated again from there under the new weights
(AReaL's interruption: the continuation sees the new weights from the first token on). The driver gets
one answer per turn whose per-token versions say which version made each token, so its record has one
model segment per version, exactly as the real engine's in-place updates produce. Weights trained but not
yet published are kept on the CPU, version → state dict, until the clock publishes them; the real engine
holds only the live version's.

Token counts feed back: a turn's real length, its real context (prompt, earlier turns, tool responses)
and the batch's real tokens are what the cost models see, each times `emulation.token_scale` (one real
token costs as much as that many simulated ones: a tiny model's short turns stretched to a preset's
lengths; the records and the staleness statistics keep the real tokens).

The clock runs on a worker thread and waits for each real thing it needs (an episode's next action
after a turn, the generations of the turns it admits together, a weight load, an update), which runs on
the event loop meanwhile: everything real happens in the clock's order, one event at a time, whatever
this machine's speed.

A group counts as completed when its last member finishes (the simulator's convention: the records'
`completed_version` is the version live then, for every member), so GS and WS split as in `pacerl
simulate`; the real asynchronous loop stamps each member at its own finish. Not supported: checkpoints
and `--resume` (the clock's state is not saved), the Ray runtime, SGLang, and `engine.interrupt =
"continue"`.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import queue
import time
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from pacerl.agents.engine.protocol import ContextOverflowError, Generation, SamplingParams
from pacerl.agents.rollout import RolloutDriver
from pacerl.agents.trajectory import Status, Trajectory
from pacerl.envs import Task
from pacerl.lab.config import SimConfig
from pacerl.lab.engine import _TOOL, _Simulation
from pacerl.lab.presets import PRESETS
from pacerl.lab.results import Mode, ModeResult
from pacerl.lab.state import EngineState, Episode, Group
from pacerl.settings import config_to_dict
from pacerl.trainer.learner import StepResult
from pacerl.trainer.loop import Run
from pacerl.trainer.pool import FilterConfig, StalenessSummary, TrajectoryPool, staleness_summary

_T = TypeVar("_T")


def clock_config(
    preset: str,
    *,
    inference_gpus: int | None,
    trainer_gpus: int | None,
    token_scale: int,
    mode: Mode,
    steps: int,
    batch_groups: int,
    sync_interval: int,
    group_size: int,
    max_total_tokens: int,
    filter_config: FilterConfig,
    seed: int,
) -> SimConfig:
    """The `SimConfig` of an emulated run: the cost models and cluster of `preset` (GPU counts overridden
    unless None), the run's loop, filter, group size and seed, records of real tokens (`token_block` 1).
    The sync arm publishes after every update, as `train_sync` does. ValueError for what cannot work."""
    if preset not in PRESETS:
        raise ValueError(f"emulation.preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    base = PRESETS[preset]().config
    if base.interrupt != "reprefill":
        raise ValueError(f"emulation needs a preset whose interrupt is reprefill, not {base.interrupt!r}")
    context = max_total_tokens * token_scale
    if context > base.inference.kv_capacity_tokens:
        raise ValueError(
            f"rollout.max_total_tokens × emulation.token_scale ({context}) exceeds the KV capacity of one "
            f"{preset} engine ({base.inference.kv_capacity_tokens} tokens)"
        )
    return replace(
        base,
        inference_gpus=inference_gpus or base.inference_gpus,
        trainer_gpus=trainer_gpus or base.trainer_gpus,
        steps=steps,
        sync_steps=steps,
        batch_groups=batch_groups,
        sync_interval=sync_interval if mode == "async" else 1,
        filter=filter_config,
        seed=seed,
        token_block=1,
        workload=replace(base.workload, group_size=group_size),
    )


# -- a turn as the clock realises it ------------------------------------------------------------------


class Turn:
    """One assistant turn the driver asked for: the tokens kept so far (each with its version) and the
    generation held for the rest under one version, of which the clock decodes a prefix."""

    def __init__(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        session: str | None = None,
        routes_start: int | None = None,
        future: asyncio.Future[Generation] | None = None,
    ) -> None:
        self.input_ids = list(input_ids)
        self.sampling, self.session, self.routes_start, self.future = sampling, session, routes_start, future
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.rows: list[np.ndarray] = []
        """Route rows kept: input positions [routes_start, rows_end)."""
        self.rows_end = routes_start or 0
        self.held: Generation | None = None
        self.held_version = -1
        self.held_input = 0
        """Input length of the call that made `held`."""
        self.turn_base = 0
        """Simulated tokens of this turn decoded before `held` started (`Turn.hold`)."""

    def request(self) -> tuple[list[int], SamplingParams, int]:
        """Input, sampling and routes start of the call that generates the rest of the turn."""
        sampling = replace(self.sampling, max_new_tokens=self.sampling.max_new_tokens - len(self.tokens))
        return self.input_ids + self.tokens, sampling, self.rows_end

    def hold(self, generation: Generation, version: int, turn_base: int) -> None:
        """Hold `generation` (from `request()`) as the rest of the turn under `version`."""
        if not generation.tokens:
            raise RuntimeError("the engine generated no token for a turn")
        self.held, self.held_version = generation, version
        self.held_input, self.turn_base = len(self.input_ids) + len(self.tokens), turn_base

    def commit(self, count: int) -> None:
        """Keep the first `count` held tokens (decoded under `held_version`) and drop the rest."""
        held = self.held
        if held is None or not 0 <= count < len(held.tokens):
            raise RuntimeError(f"cannot keep {count} tokens of a held generation of {self.held_length}")
        self.tokens += held.tokens[:count]
        self.logprobs += held.logprobs[:count]
        self.versions += [self.held_version] * count
        if count and self.routes_start is not None and held.routed_experts is not None:
            end = self.held_input + count - 1  # rows of the inputs whose next token is kept
            self.rows += list(held.routed_experts[: end - held.routed_experts_start])
            self.rows_end = end
        self.held = None

    @property
    def held_length(self) -> int:
        return 0 if self.held is None else len(self.held.tokens)

    def result(self) -> Generation:
        """The whole turn: the kept tokens and the held generation, each token with its version."""
        held = self.held
        if held is None:
            raise RuntimeError("a turn ended with no generation held")
        routes = None
        if self.routes_start is not None and held.routed_experts is not None:
            rows = [*self.rows, *held.routed_experts]
            routes = np.stack(rows).astype(np.int32) if rows else held.routed_experts[:0]
        return Generation(
            (*self.tokens, *held.tokens),
            (*self.logprobs, *held.logprobs),
            (*self.versions, *[self.held_version] * len(held.tokens)),
            held.finish_reason,
            routes,
            self.routes_start or 0,
        )


Action = Turn | Trajectory
"""What an episode does next: ask for a turn, or finish with its record."""


class Workload(Protocol):
    """The side of an emulated run that is not the clock: the episodes, their generations and the
    learner (`RealWorkload`; a test stand-in replays the simulator's own plan)."""

    drop_failed_groups: bool
    """A group with a failed member is dropped (`RolloutConfig.on_failure`), not pooled."""

    def launch(self, group: Group) -> list[Action]:
        """Start the episodes of a planned group; each member's first action, by member index."""
        ...

    def generate(self, turns: Sequence[Turn], version: int) -> None:
        """Hold a generation of the rest of each turn under `version` (`Turn.hold`)."""
        ...

    def complete(self, group_id: str, index: int, turn: Turn) -> Action:
        """Hand the finished turn to its episode; its next action."""
        ...

    def publish(self, version: int) -> None:
        """Make `version` the weights of generations from now on."""
        ...

    def dropped(self, group_id: str) -> None:
        """A finished group was dropped for a failed member (`drop_failed_groups`)."""
        ...

    def train(self, groups: list[list[Trajectory]], version: int) -> StepResult:
        """One update on a drawn batch at trainer version `version`."""
        ...

    def step_ended(self, result: StepResult, staleness: StalenessSummary, scalars: dict[str, float]) -> bool:
        """Record a finished step with the clock's `scalars`; False to stop the run."""
        ...

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float] | None:
        """PACE's drift scores under the current weights, or None for the simulator's drift model."""
        ...


# -- the clock ----------------------------------------------------------------------------------------


class EmulatedClock(_Simulation):
    """The simulator's event loop (`pacerl.lab.engine`) with its plan replaced by a `Workload`: turns are
    as long as the workload generates them, episodes have as many turns as their env plays, records are
    the workload's, steps are the learner's. Tool latencies, and the schedule, are the simulator's."""

    def __init__(
        self,
        config: SimConfig,
        mode: Mode,
        workload: Workload,
        *,
        pool: TrajectoryPool | None = None,
        token_scale: int = 1,
    ) -> None:
        """`pool`: the run's own (async: its rejections reach the run's metrics); None: a fresh one of
        the mode's filter. `token_scale`: simulated tokens per real token. >= 1."""
        if token_scale < 1:
            raise ValueError(f"token_scale must be >= 1, got {token_scale}")
        super().__init__(config, mode, on_batch=self._train)
        if pool is not None:
            self.pool = pool
        self.side, self.scale = workload, token_scale
        self.playing: dict[int, Turn] = {}
        """Episode uid → the turn it is playing or waiting to play."""
        self.finished_records: dict[int, Trajectory] = {}
        self._step: tuple[StepResult, StalenessSummary, float] | None = None
        """The step being trained: its result, the batch's staleness and when it was drawn."""
        self._ending: tuple[StepResult, StalenessSummary, float] | None = None
        self._live = 0
        self._first_turns: list[Episode] = []

    # -- episodes ------------------------------------------------------------------------------------

    def launched(self, group: Group) -> None:
        for episode, action in zip(group.members, self.side.launch(group), strict=True):
            if isinstance(action, Trajectory):  # ended before its first turn (e.g. the prompt is too long)
                self.engines[episode.engine].queue.remove(episode)
                self.finished_records[episode.uid] = action
                episode.responses = [0]
                self.push(self.now, _TOOL, episode)  # `tool_returned` finishes it
                continue
            self.playing[episode.uid] = action
            episode.base_context = self.scale * len(action.input_ids)
            self._first_turns.append(episode)

    def realise(self, engine: EngineState, opened: list[Episode]) -> None:
        if self._first_turns:
            # The first turns of every group launched since the last admission, generated together (one
            # wide batch instead of one per engine); one that waits in a queue past a publication is
            # generated again when it joins a batch, like any turn held under an older version.
            first = [e for e in self._first_turns if self.playing[e.uid].held is None]
            self._first_turns = []
            self.side.generate([self.playing[e.uid] for e in first], engine.version)
            for episode in first:
                episode.responses[0] = self.scale * self.playing[episode.uid].held_length
        fresh = [e for e in opened if self.playing[e.uid].held_version != engine.version]
        for episode in fresh:
            turn = self.playing[episode.uid]
            if turn.held is not None:  # retracted, then a publication came before it got back in
                turn.commit((episode.done - turn.turn_base) // self.scale)
            turn.turn_base = episode.done
        self.side.generate([self.playing[e.uid] for e in fresh], engine.version)
        for episode in fresh:
            held = self.playing[episode.uid].held_length
            episode.responses[episode.turn] = episode.done + self.scale * held
        for episode in opened:
            episode.remaining = episode.responses[episode.turn] - episode.done

    def after_turn(self, episode: Episode, version: int) -> None:
        group, turn = episode.group, self.playing.pop(episode.uid)
        action = self.side.complete(group.id, episode.index, turn)
        del episode.responses[episode.turn + 1 :]
        if isinstance(action, Trajectory):
            self.finished_records[episode.uid] = action
        else:
            context = self.scale * len(action.input_ids)
            tool = context - episode.base_context - episode.responses[episode.turn]
            if tool < 0:
                raise RuntimeError(f"episode {group.id}/{episode.index}: its next turn's context shrank")
            index = episode.turn
            del episode.tool_tokens[index:]
            episode.tool_tokens.append(tool)
            if index >= len(episode.tool_latencies):  # more tool calls than planned: the model's samples
                episode.tool_latencies.append(float(self.tool_latency.take(1)[0]))
            episode.responses.append(0)  # set when the turn is admitted (`realise`)
            self.playing[episode.uid] = action
        super().after_turn(episode, version)

    def tool_returned(self, episode: Episode) -> None:
        if episode.uid in self.finished_records and episode.uid not in self.playing:
            episode.group.pending -= 1  # an episode that ended before its first turn
            if not episode.group.pending:
                self.group_done(episode.group, self.version)
            return
        super().tool_returned(episode)

    def group_done(self, group: Group, version: int) -> None:
        records = [self.finished_records[e.uid] for e in group.members]
        if any(r.status is Status.FAILED for r in records) and self.side.drop_failed_groups:
            for episode in group.members:
                del self.finished_records[episode.uid]
            del self.running_groups[group.id]
            group.members = []
            self.side.dropped(group.id)
            self.try_launch()
            self.try_train()
            return
        super().group_done(group, version)

    def make_records(self, group: Group, version: int) -> list[Trajectory]:
        records = [self.finished_records.pop(e.uid) for e in group.members]
        for record in records:
            record.completed_version, record.completed_at = version, self.now  # the group's completion
        group.tokens = self.scale * sum(len(r.tokens) for r in records)
        group.generated = self.scale * sum(r.num_model_tokens for r in records)
        return records

    # -- publication ---------------------------------------------------------------------------------

    def publish(self) -> None:
        super().publish()
        if self.version == self._live:
            return  # a sync round that ended on a skipped step: nothing new to load
        self._live = self.version
        self.side.publish(self.version)
        for engine in self.engines:
            running = list(engine.running.values())
            for episode in running:  # the clock cut their segments at seg_done (`_Simulation.publish`)
                turn = self.playing[episode.uid]
                turn.commit((episode.seg_done - turn.turn_base) // self.scale)
            for episode in engine.queue:  # retracted ones hold tokens decoded under the old weights
                waiting = self.playing.get(episode.uid)
                if waiting is not None and waiting.held is not None:
                    waiting.commit((episode.done - waiting.turn_base) // self.scale)
            if not running:
                continue
            self.side.generate([self.playing[e.uid] for e in running], self.version)
            changed = False
            for episode in running:
                turn = self.playing[episode.uid]
                turn.turn_base = episode.seg_done
                total = episode.seg_done + self.scale * turn.held_length
                shift = total - episode.responses[episode.turn]
                if shift:  # the rest is as long as the new weights make it; the decoded fraction stays
                    episode.responses[episode.turn] = total
                    episode.finish_s += shift
                    episode.run += 1
                    heapq.heappush(engine.finishing, (episode.finish_s, episode.uid, episode.run))
                    changed = True
            if changed:
                self.schedule(engine)

    # -- the trainer ---------------------------------------------------------------------------------

    def batch_ready(self) -> bool:
        """As in a simulation; and in the sync arm, a round whose every group has finished, short of a
        whole batch by the groups dropped for a failed member, trains on the rest (as `train_sync`)."""
        if super().batch_ready():
            return True
        return self.mode == "sync" and self.round_open and not self.running_groups and len(self.pool) > 0

    def _train(self, batch: list[list[Trajectory]], version: int) -> None:
        staleness = staleness_summary([t for group in batch for t in group], version)
        groups = sorted(batch, key=lambda group: group[0].group_id) if self.mode == "sync" else batch
        self._step = (self.side.train(groups, version), staleness, self.now)

    def step_updated(self) -> bool:
        if self._ending is None:
            raise RuntimeError("a training step ended that never started")
        return self._ending[0].updated

    def trained(self) -> None:
        """Record the step that ended (before `trained` may draw and train the next batch), then move
        the clock on."""
        self._ending, self._step = self._step, None
        if self._ending is None:
            raise RuntimeError("a training step ended that never started")
        result, staleness, drawn_at = self._ending
        gpus = self.config.inference_gpus + self.config.trainer_gpus
        last = self.stats.step_end[-1] if self.stats.step_end else 0.0
        scalars = {
            "sim/time_s": self.now,
            "sim/gpu_hours": gpus * self.now / 3600.0,
            "sim/step_s": self.now - last,
            "sim/train_s": self.now - drawn_at,
            "sim/pool_groups": float(len(self.pool)),
            "in_flight_groups": float(len(self.running_groups)),
            "sim/interruptions": float(self.stats.interruptions),
        }
        if not self.side.step_ended(result, staleness, scalars):
            self.finished = True  # a stop request, or the run's wall-clock budget
        super().trained()
        self._ending = None

    def drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        scores = self.side.prefix_drift(trajectories)
        return super().drift(trajectories) if scores is None else scores


# -- the real side ------------------------------------------------------------------------------------


class _Bridge:
    """Runs coroutines on the event loop from the clock's thread and waits for them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class _ClockedEngine:
    """What the driver talks to: each `generate` call is a `Turn` handed to the clock, answered when the
    clock ends the turn; `version` is the clock's live version."""

    def __init__(self, workload: RealWorkload) -> None:
        self._workload = workload

    @property
    def version(self) -> int:
        return self._workload.live

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        session: str | None = None,
    ) -> Generation:
        if session is None or session not in self._workload.channels:
            raise RuntimeError(f"the emulated engine serves the run's episodes only, not {session!r}")
        context = self._workload.max_context
        if len(input_ids) >= context:
            raise ContextOverflowError(f"the prompt has {len(input_ids)} tokens; the context holds {context}")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        turn = Turn(
            input_ids,
            sampling,
            session=session,
            routes_start=routed_experts_start_len if return_routed_experts else None,
            future=future,
        )
        self._workload.channels[session].put(turn)
        return await future

    async def abort(self, request_id: str) -> None:
        return None

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        raise RuntimeError("the emulated clock publishes the weights")

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


class RealWorkload:
    """The run's real parts behind the clock: its driver plays the episodes (env, sandbox, tokens) through
    a `_ClockedEngine`, its engine generates the turns, its learner trains, its metrics record."""

    def __init__(
        self, run: Run, loop: asyncio.AbstractEventLoop, *, max_gpu_hours: float | None = None
    ) -> None:
        self.run, self.bridge, self.engine = run, _Bridge(loop), run.engine
        self.max_gpu_hours = max_gpu_hours
        """The run ends after the step whose `sim/gpu_hours` reaches this (None: no such budget)."""
        self.live = run.engine.version
        self.max_context = int(getattr(run.engine, "max_context", 1 << 62))
        driver = run.driver
        self.driver = RolloutDriver(
            _ClockedEngine(self),
            driver.tokenizer,
            driver.make_env,
            driver.config,
            num_experts=driver.num_experts,
        )
        self.drop_failed_groups = driver.config.on_failure == "drop_group"
        self.channels: dict[str, queue.SimpleQueue[Action | BaseException]] = {}
        self.episodes: dict[str, asyncio.Task[None]] = {}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        """Version → weights trained but not yet published (CPU copies)."""

    def launch(self, group: Group) -> list[Action]:
        group_id, task = self.run.cursor.next()
        if group_id != group.id:
            raise RuntimeError(f"the clock launched {group.id} where the task cursor is at {group_id}")
        ids = [f"{group_id}/{index}" for index in range(len(group.members))]
        for trajectory_id in ids:
            self.channels[trajectory_id] = queue.SimpleQueue()
        self.bridge.call(self._start(task, group_id, ids))
        return [self._next(trajectory_id) for trajectory_id in ids]

    async def _start(self, task: Task, group_id: str, ids: list[str]) -> None:
        for trajectory_id in ids:
            self.episodes[trajectory_id] = asyncio.ensure_future(self._play(task, group_id, trajectory_id))

    async def _play(self, task: Task, group_id: str, trajectory_id: str) -> None:
        channel = self.channels[trajectory_id]
        try:
            channel.put(await self.driver.rollout(task, group_id, trajectory_id))
        except BaseException as error:  # the clock waiting on this episode must hear of it
            channel.put(error)
            raise

    def _next(self, trajectory_id: str) -> Action:
        action = self.channels[trajectory_id].get()
        if isinstance(action, BaseException):
            raise RuntimeError(f"episode {trajectory_id} failed: {action!r}") from action
        if isinstance(action, Trajectory):
            del self.channels[trajectory_id], self.episodes[trajectory_id]
        return action

    def generate(self, turns: Sequence[Turn], version: int) -> None:
        if not turns:
            return
        if self.engine.version != version:
            raise RuntimeError(f"the engine holds version {self.engine.version}, the clock says {version}")
        generations = self.bridge.call(self._generate_all(turns))
        for turn, generation in zip(turns, generations, strict=True):
            turn.hold(generation, version, turn.turn_base)

    async def _generate_all(self, turns: Sequence[Turn]) -> list[Generation]:
        calls: list[Awaitable[Generation]] = []
        for turn in turns:
            tokens, sampling, start = turn.request()
            if turn.routes_start is None:
                calls.append(self.engine.generate(tokens, sampling, session=turn.session))
            else:
                engine: Any = self.engine  # an EngineWithRoutesStart (the embedded engine)
                calls.append(
                    engine.generate(
                        tokens,
                        sampling,
                        return_routed_experts=True,
                        routed_experts_start_len=start,
                        session=turn.session,
                    )
                )
        return list(await asyncio.gather(*calls))

    def complete(self, group_id: str, index: int, turn: Turn) -> Action:
        future = turn.future
        if future is None:
            raise RuntimeError("a real turn has no caller to answer")
        generation = turn.result()
        self.bridge.loop.call_soon_threadsafe(_answer, future, generation)
        return self._next(f"{group_id}/{index}")

    def publish(self, version: int) -> None:
        weights = self.pending.pop(version)
        for old in [v for v in self.pending if v < version]:
            del self.pending[old]
        self.bridge.call(self.engine.update_weights(weights, version))
        self.live = version

    def dropped(self, group_id: str) -> None:
        self.run.dropped_groups.append(group_id)

    def train(self, groups: list[list[Trajectory]], version: int) -> StepResult:
        learner = self.run.learner
        if learner.version != version:
            raise RuntimeError(f"the learner is at version {learner.version}, the clock at {version}")
        result = learner.train_step(groups)
        if result.updated:
            self.pending[learner.version] = {
                k: v.detach().to("cpu", copy=True) for k, v in learner.weights().items()
            }
        return result

    def step_ended(self, result: StepResult, staleness: StalenessSummary, scalars: dict[str, float]) -> bool:
        run = self.run
        run.step += 1
        run.extra_scalars = scalars
        run.record(result, staleness)
        self.bridge.call(run.evaluate())
        budget = self.max_gpu_hours
        return run.should_continue() and (budget is None or scalars["sim/gpu_hours"] < budget)

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float] | None:
        return self.run.learner.prefix_drift(trajectories)

    async def aclose(self) -> None:
        """Cancel the episodes the clock left running when it stopped."""
        jobs = list(self.episodes.values())
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        self.episodes.clear()


def _answer(future: asyncio.Future[Generation], generation: Generation) -> None:
    if not future.done():
        future.set_result(generation)


# -- the entry point ----------------------------------------------------------------------------------


async def train_emulated(
    run: Run, config: SimConfig, mode: Mode, *, token_scale: int = 1, max_gpu_hours: float | None = None
) -> dict[str, Any]:
    """Train `run` (built as for `train_sync`/`train_async`, embedded engine) under the clock of
    `config` (`clock_config`): `mode` is the loop's; the run ends at `config`'s steps or after the step
    that reaches `max_gpu_hours` simulated GPU-hours, whichever comes first. Writes `clock.json` (the
    clock's config, which `pacerl simulate --config` reads) and `emulation.json` (its figures) into the
    run directory; returns the run's summary with the clock's figures under `emulation`."""
    workload = RealWorkload(run, asyncio.get_running_loop(), max_gpu_hours=max_gpu_hours)
    pool = run.pool if mode == "async" else None
    clock = EmulatedClock(config, mode, workload, pool=pool, token_scale=token_scale)
    started = time.monotonic()
    try:
        result = await asyncio.to_thread(clock.run)
    finally:
        await workload.aclose()
        await run.aclose()
    summary = run.summary()
    summary["driver"] = dict(workload.driver.counts)
    summary["emulation"] = emulation_summary(result, config, token_scale, time.monotonic() - started)
    write_emulation(run.run_dir, config, token_scale, summary["emulation"])
    return summary


def emulation_summary(
    result: ModeResult, config: SimConfig, token_scale: int, wall_s: float
) -> dict[str, Any]:
    """The clock's figures of a run: simulated time and GPU-hours, staleness, rejections, utilization."""
    gpus = config.inference_gpus + config.trainer_gpus
    return {
        "mode": result.mode,
        "steps": result.steps,
        "simulated_s": result.simulated_s,
        "gpu_hours": gpus * result.simulated_s / 3600.0,
        "step_time_s": result.step_time_s,
        "inference_utilization": result.inference_utilization,
        "trainer_utilization": result.trainer_utilization,
        "mean_gs": result.staleness.mean_gs,
        "mean_ws": result.staleness.mean_ws,
        "gs_hist": list(result.staleness.gs_hist),
        "ws_hist": list(result.staleness.ws_hist),
        "rejected_groups": dict(result.rejected_groups),
        "interruptions": result.interruptions,
        "retractions": result.retractions,
        "token_scale": token_scale,
        "wall_s": wall_s,
    }


def write_emulation(run_dir: Path, config: SimConfig, token_scale: int, figures: Mapping[str, Any]) -> Path:
    """`clock.json`, the clock's `SimConfig` as `pacerl simulate --config` reads it, and `emulation.json`,
    the clock's `token_scale` and figures; the path of the latter."""
    (run_dir / "clock.json").write_text(json.dumps(config_to_dict(config), indent=1) + "\n", encoding="utf-8")
    path = run_dir / "emulation.json"
    data = {"token_scale": token_scale, "result": dict(figures)}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path
