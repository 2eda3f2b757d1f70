"""A discrete-event simulation of the asynchronous pipeline at cluster scale (`pacerl simulate`).

It runs this project's own scheduling code against simulated time instead of real engines: the pool
(`pacerl.trainer.pool.TrajectoryPool`) decides admission (`admission`, AReaL's capacity under the `admission`
filter), rejection and batch selection (`select`, with every filter: none, max_age, admission, pace),
on real `pacerl.agents.trajectory.Trajectory` records whose segments carry the simulated policy versions and
times, so Generation and Waiting Staleness come from the record itself. The loop around it mirrors
`trainer/loop.py`: the producer starts as many groups as `admission` allows whenever a group finishes
or the trainer's version moves; the trainer draws a batch when at least `batch_groups` groups wait,
trains, and every `sync_interval` (S) updates publishes the weights, which pauses every engine,
interrupts its running generations and resumes them under the new version as new segments.

The cost models are in `pacerl.lab.costs`, the config and the synchronous baseline in
`pacerl.lab.config`, the records the pool sees and the PACE drift model in `pacerl.lab.records`, the
engine's moving parts in `pacerl.lab.state`, what a run returns in `pacerl.lab.results`.

Not modelled: a group's members sharing their prompt's prefix cache (each prefills it), chunked
prefill mixing with decode, routing smarter than round-robin, reward and verifier time, failed or
dropped episodes, and evaluation.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from heapq import heappop, heappush
from math import sqrt
from typing import Any, TypeAlias

import numpy as np

from pacerl.agents.trajectory import Origin, Trajectory
from pacerl.lab.config import SimConfig
from pacerl.lab.records import DriftScorer, RecordMaker
from pacerl.lab.results import Mode, ModeResult, SimResult, StalenessStats, bounds
from pacerl.lab.state import EngineState, Episode, Group, RunStats, SampleStream
from pacerl.trainer.pool import FilterConfig, TrajectoryPool

_EPS = 1e-9

BatchObserver: TypeAlias = Callable[[list[list[Trajectory]], int], None]
"""Called with each drawn batch (groups of records) and the trainer version it is trained at."""

# -- the simulator -----------------------------------------------------------------------------------

_ENGINE, _TOOL, _TRAINED, _PUBLISHED = 0, 1, 2, 3


class _Simulation:
    """One mode's event loop. The async loop follows `trainer/loop.py`'s `train_async`; the sync loop
    its `train_sync`, generating S·B groups a round (`pacerl.lab.config`)."""

    def __init__(self, config: SimConfig, mode: Mode, on_batch: BatchObserver | None = None) -> None:
        self.config, self.mode, self.on_batch = config, mode, on_batch
        self.workload, self.inference = config.workload, config.inference
        colocated = mode == "sync" and config.sync_baseline == "colocated"
        gpus = config.inference_gpus + config.trainer_gpus if colocated else config.inference_gpus
        self.train_gpus = config.inference_gpus + config.trainer_gpus if colocated else config.trainer_gpus
        self.colocated = colocated
        self.engines = [EngineState(i) for i in range(gpus // self.inference.gpus_per_engine)]
        self.filter = config.filter if mode == "async" else FilterConfig(name="none")
        self.pool = TrajectoryPool(self.filter, max_rejected_ids=0)
        self.steps = config.steps if mode == "async" else config.baseline_steps
        streams = np.random.SeedSequence([config.seed, 0 if mode == "async" else 1]).spawn(5)
        w = self.workload
        self.prompts, self.turns, self.responses, self.tool_tokens, self.tool_latency = (
            SampleStream(d, np.random.default_rng(s), integer=integer)
            for d, s, integer in zip(
                (w.prompt_tokens, w.turns, w.response_tokens, w.tool_tokens, w.tool_latency_s),
                streams,
                (True, True, True, True, False),
                strict=True,
            )
        )
        # the decode model's and the loop's constants, read on every event
        self.base_s, self.row_s, self.kv_s = (
            self.inference.step_base_s,
            self.inference.step_per_row_s,
            self.inference.step_per_kv_token_s,
        )
        self.kv_capacity = self.inference.kv_capacity_tokens
        self.admit_limit = self.inference.admit_kv_fraction * self.inference.kv_capacity_tokens
        self.max_running = self.inference.max_running
        self.keep_caches = config.interrupt == "continue"
        self.pool_cap = config.pool_cap
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any]] = []
        self.sequence = 0
        self.version = 0
        self.served_version = 0  # the version the engines' weights are of (the last published)
        self.trainer_busy = False
        self.running_groups: dict[str, Group] = {}
        self.pooled: dict[str, Group] = {}
        self.next_group = 0
        self.next_uid = 0
        self.round_robin = 0
        self.round_open = False  # sync: a round's groups are being generated or trained on
        self.held_since: float | None = None  # when the pool cap began holding the producer back
        self.finished = False
        self.stats = RunStats()
        self.records = RecordMaker(config.block)
        self.drift_scorer = DriftScorer(config.seed, config.drift_sigma)

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> ModeResult:
        self.try_launch()
        events, pop = self.events, heapq.heappop
        engine_event, tool_returned = self.engine_event, self.tool_returned
        while not self.finished:
            if not events:
                raise RuntimeError(
                    f"{self.mode} simulation stalled at step {self.stats.steps} of {self.steps}: nothing in "
                    f"flight and no batch to draw (pool {len(self.pool)} groups)"
                )
            when, _, kind, payload = pop(events)
            if kind == _ENGINE:
                if payload[1] != payload[0].epoch:
                    continue  # the engine was rescheduled since: about half of all events
                self.now = when
                engine_event(*payload)
            elif kind == _TOOL:
                self.now = when
                tool_returned(payload)
            elif kind == _TRAINED:
                self.now = when
                self.trained()
            else:
                self.now = when
                self.published()
        return self.result()

    def push(self, when: float, kind: int, payload: Any) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, kind, payload))

    # -- producer ------------------------------------------------------------------------------------

    def try_launch(self) -> None:
        """Start as many groups as the pool's admission allows (async) or a round of S·B (sync)."""
        config = self.config
        if self.mode == "sync":
            if self.round_open or self.trainer_busy:
                return
            self.round_open = True
            room = config.sync_interval * config.batch_groups
        else:
            lag = self.version - self.served_version
            room = self.pool.admission(self.stats.steps, len(self.running_groups), config.batch_groups, lag)
            if room and len(self.pool) >= self.pool_cap:
                if self.held_since is None:
                    self.held_since = self.now
                return
            if self.held_since is not None:
                self.stats.pool_cap_held_s += self.now - self.held_since
                self.held_since = None
        touched: set[int] = set()
        for _ in range(room):
            self.launch_group(touched)
        for index in sorted(touched):  # one admission pass per engine, not per group
            engine = self.engines[index]
            self.advance(engine, self.now)
            self.admit(engine)
            self.schedule(engine)
        outstanding = len(self.running_groups) + len(self.pool)
        self.stats.max_outstanding = max(self.stats.max_outstanding, outstanding)

    def launch_group(self, touched: set[int]) -> None:
        """Plan a group's episodes and queue their first turns, round-robin over the engines."""
        size = self.workload.group_size
        group = Group(f"g{self.next_group:07d}", self.prompts.take(1)[0])
        self.next_group += 1
        engines = self.engines
        for index, turns in enumerate(self.turns.take(size)):
            engine = self.round_robin
            self.round_robin = (engine + 1) % len(engines)
            episode = Episode(self.next_uid, group, index, engine)
            self.next_uid += 1
            episode.responses = responses = self.responses.take(turns)
            episode.tool_tokens = tools = self.tool_tokens.take(turns - 1)
            episode.tool_latencies = self.tool_latency.take(turns - 1)
            episode.remaining = responses[0]
            generated = sum(responses)
            group.tokens += group.prompt + generated + sum(tools)
            group.generated += generated
            group.members.append(episode)
            engines[engine].queue.append(episode)
            touched.add(engine)
        group.pending = size
        self.running_groups[group.id] = group
        self.launched(group)

    def launched(self, group: Group) -> None:
        """A hook after a group's episodes are planned and queued (emulated training starts the real
        episodes here, `pacerl.lab.emulated`); nothing in a simulation."""

    # -- engines -------------------------------------------------------------------------------------

    def advance(self, engine: EngineState, until: float) -> None:
        """Decode from engine.t to `until` (nothing while it is stalled past `until`)."""
        dt = until - engine.t
        if dt <= 0:
            return
        rows = engine.rows
        if rows:
            kv_s = self.kv_s
            alpha = self.base_s + self.row_s * rows + kv_s * engine.kv
            beta = kv_s * rows
            steps = dt / alpha if beta == 0 else 2 * dt / (alpha + sqrt(alpha * alpha + 2 * beta * dt))
            decoded = rows * steps
            engine.s += steps
            engine.kv += decoded
            engine.tokens += decoded
            engine.busy_s += dt
            engine.row_s += rows * dt
        engine.t = until

    def admit(self, engine: EngineState) -> None:
        """Move queued requests into the running batch while rows and KV allow; their prefill stalls
        decoding. Called with the engine advanced to now."""
        queue = engine.queue
        if not queue or engine.rows >= self.max_running:
            return
        limit, max_running, keep_caches = self.admit_limit, self.max_running, self.keep_caches
        version, running = engine.version, engine.running
        prefill = 0
        opened: list[Episode] = []
        while queue and engine.rows < max_running:
            episode = queue[0]
            context = episode.base_context + episode.done
            if engine.rows and engine.kv + context > limit:
                break
            queue.popleft()
            valid = episode.cache_version == version or keep_caches
            prefill += context - (episode.cached if valid else 0)
            running[episode.uid] = episode
            engine.rows += 1
            engine.kv += context
            opened.append(episode)
        if not opened:
            return
        self.realise(engine, opened)
        stall = prefill / self.inference.prefill_tokens_per_s
        now = self.now
        t = engine.t
        engine.t = t = (t if t >= now else now) + stall
        engine.busy_s += stall
        s_now, finishing = engine.s, engine.finishing
        for episode in opened:
            episode.run = run = episode.run + 1
            episode.finish_s = finish = s_now + episode.remaining
            heappush(finishing, (finish, episode.uid, run))
            done = episode.done
            episode.cached, episode.cache_version = episode.base_context + done, version
            episode.seg_version, episode.seg_t0, episode.seg_done = version, t, done

    def realise(self, engine: EngineState, opened: list[Episode]) -> None:
        """A hook when `opened` episodes join `engine`'s batch, before their turn's end is scheduled from
        `remaining` (emulated training generates their turns here under `engine.version`); nothing in a
        simulation, whose lengths are planned at launch."""

    def schedule(self, engine: EngineState) -> None:
        """Schedule the engine's next own event: a turn ending, or the cache overflowing."""
        engine.epoch += 1
        rows = engine.rows
        if not rows:
            return
        finishing, running = engine.finishing, engine.running
        while finishing:
            _, uid, run = finishing[0]
            episode = running.get(uid)
            if episode is not None and episode.run == run:
                break
            heappop(finishing)
        if not finishing:
            raise RuntimeError(f"engine {engine.index} lost track of its {engine.rows} running sequences")
        s_now, kv = engine.s, engine.kv
        first = finishing[0][0]
        target = s_now if s_now > first else first  # max(first, s_now)
        overflow = False
        if rows > 1:
            room = (self.kv_capacity - kv) / rows
            if s_now + room < target:
                target, overflow = s_now + max(room, 0.0), True
        steps = target - s_now
        kv_s = self.kv_s
        alpha = self.base_s + self.row_s * rows + kv_s * kv
        when = engine.t + alpha * steps + kv_s * rows * steps * steps / 2
        self.sequence += 1
        heappush(self.events, (when, self.sequence, _ENGINE, (engine, engine.epoch, target, overflow)))

    def engine_event(self, engine: EngineState, epoch: int, target: float, overflow: bool) -> None:
        """The engine reached the step it was scheduled for (`run` drops events of an older `epoch`):
        retract on overflow, end the turns due, admit, reschedule."""
        self.advance(engine, self.now)
        engine.kv += engine.rows * (target - engine.s)  # snap to the exact step (float rounding)
        engine.s = target
        if overflow:
            self.retract(engine, engine.running[next(reversed(engine.running))])
        finishing, running = engine.finishing, engine.running
        limit = target + _EPS
        ended: list[Episode] = []
        while finishing and finishing[0][0] <= limit:
            _, uid, run = heappop(finishing)
            episode = running.get(uid)
            if episode is not None and episode.run == run:
                ended.append(episode)
        if ended:
            now, version = self.now, engine.version
            for episode in ended:  # end_turn, inlined: the hot loop
                responses, turn_index = episode.responses, episode.turn
                turn = responses[turn_index]
                tokens = turn - episode.seg_done
                if tokens > 0:
                    reason = "stop" if turn_index == len(responses) - 1 else "tool_call"
                    episode.parts.append(
                        (Origin.MODEL, tokens, episode.seg_version, episode.seg_t0, now, reason)
                    )
                episode.seg_done = turn
                # remove, inlined: out of the batch with its exact (fractional) cache
                decoded = turn - (episode.finish_s - target)
                del running[episode.uid]
                engine.rows -= 1
                engine.kv = engine.kv - (episode.base_context + decoded) if engine.rows else 0.0
                episode.cached, episode.cache_version = episode.base_context + turn, version
            after_turn = self.after_turn
            for episode in ended:
                after_turn(episode, version)
        if not overflow:  # a retracted request must not walk straight back into the full cache
            self.admit(engine)
        self.schedule(engine)

    def remove(self, engine: EngineState, episode: Episode) -> None:
        """Take a running episode out of the batch, with its exact (fractional) cache."""
        decoded = episode.responses[episode.turn] - (episode.finish_s - engine.s)
        del engine.running[episode.uid]
        engine.rows -= 1
        engine.kv = engine.kv - (episode.base_context + decoded) if engine.rows else 0.0

    def done_now(self, engine: EngineState, episode: Episode) -> int:
        """Tokens of the running episode's turn decoded so far (whole tokens, the last one left out)."""
        turn = episode.responses[episode.turn]
        return min(max(round(turn - (episode.finish_s - engine.s)), episode.seg_done), turn - 1)

    def close_segment(self, episode: Episode, done: int, ended_at: float, reason: str) -> None:
        tokens = done - episode.seg_done
        if tokens > 0:
            episode.parts.append(
                (Origin.MODEL, tokens, episode.seg_version, episode.seg_t0, ended_at, reason)
            )
        episode.seg_done = done

    def retract(self, engine: EngineState, episode: Episode) -> None:
        done = self.done_now(engine, episode)
        self.close_segment(episode, done, self.now, "retracted")
        self.remove(engine, episode)
        episode.done, episode.remaining = done, episode.responses[episode.turn] - done
        episode.cached = 0
        engine.queue.appendleft(episode)
        self.stats.retractions += 1

    def after_turn(self, episode: Episode, version: int) -> None:
        """Call the tool, or finish the episode (and its group: the records go to the pool). Runs after
        every turn ending at this instant has left its engine, because a finished group may start new
        groups on that same engine."""
        if episode.turn < len(episode.responses) - 1:
            self.sequence += 1
            heappush(
                self.events, (self.now + episode.tool_latencies[episode.turn], self.sequence, _TOOL, episode)
            )
            return
        group = episode.group
        group.pending -= 1
        if not group.pending:
            self.group_done(group, version)

    def tool_returned(self, episode: Episode) -> None:
        tool = episode.tool_tokens[episode.turn]
        episode.parts.append((Origin.TOOL, tool, -1, 0.0, 0.0, ""))
        episode.base_context += episode.responses[episode.turn] + tool
        episode.turn += 1
        episode.done, episode.remaining, episode.seg_done = 0, episode.responses[episode.turn], 0
        engine = self.engines[episode.engine]
        engine.queue.append(episode)
        self.advance(engine, self.now)
        self.admit(engine)
        self.schedule(engine)

    # -- records and the pool ------------------------------------------------------------------------

    def group_done(self, group: Group, version: int) -> None:
        del self.running_groups[group.id]
        records = self.make_records(group, version)
        group.members = []  # breaks the group ↔ episode cycles, so refcounting frees them (gc is paused)
        self.pool.add_group(records)
        self.pooled[group.id] = group
        self.try_launch()
        self.try_train()

    def make_records(self, group: Group, version: int) -> list[Trajectory]:
        """The finished group's records, completed at trainer version `version` and time now."""
        records, now = self.records, self.now
        prompt = records.prompt(group.prompt)
        record = records.record
        return [record(episode, prompt, version, now) for episode in group.members]

    def drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """PACE's drift scores of `trajectories` at the trainer's version (`DriftScorer`)."""
        return self.drift_scorer(trajectories, self.version)

    # -- trainer -------------------------------------------------------------------------------------

    def try_train(self) -> None:
        """Draw and train when the trainer is free and a batch waits (`Run.next_batch`)."""
        config = self.config
        if self.trainer_busy or self.finished or not self.batch_ready():
            return
        if self.mode == "sync" and self.running_groups:
            return  # a sync round trains only once all of it is generated
        before = set(self.pooled)
        occupancy = len(self.pool)
        batch = self.pool.select(config.batch_groups, self.version, self.drift)
        drawn = {group[0].group_id for group in batch}
        for group_id in before - drawn:
            if group_id not in self.pool:  # rejected
                group = self.pooled.pop(group_id)
                self.stats.wasted_tokens += group.generated
                self.stats.rejected_trajectories += self.workload.group_size
        if not batch:
            self.try_launch()
            return
        self.stats.step_pool.append(occupancy)
        tokens = sum(self.pooled.pop(group_id).tokens for group_id in drawn)
        self.stats.account(batch, self.version)
        if self.on_batch is not None:
            self.on_batch(batch, self.version)
        self.stats.trained_tokens += tokens
        recompute = config.trainer.recompute_async if self.mode == "async" else config.trainer.recompute_sync
        efficiency = config.trainer.colocated_efficiency if self.colocated else 1.0
        duration = config.trainer.step_time(
            tokens, self.train_gpus, recompute=recompute, efficiency=efficiency
        )
        self.stats.train_s += duration
        self.trainer_busy = True
        self.push(self.now + duration, _TRAINED, None)
        self.try_launch()

    def batch_ready(self) -> bool:
        """Whether a batch can be drawn: a whole one waits in the pool."""
        return len(self.pool) >= self.config.batch_groups

    def trained(self) -> None:
        """A step ended: the version moves (unless the step was skipped); every S updates the weights
        are published."""
        updated = self.step_updated()
        if updated:
            self.version += 1
        stats = self.stats
        stats.steps += 1
        stats.step_end.append(self.now)
        if stats.steps >= self.steps:
            self.finished = True
            return
        sync_round_over = self.mode == "sync" and (
            self.version % self.config.sync_interval == 0 or not len(self.pool)
        )
        async_due = self.mode == "async" and updated and self.version % self.config.sync_interval == 0
        if async_due or sync_round_over:
            self.publish()
            return
        self.trainer_busy = False
        self.try_launch()
        self.try_train()

    def step_updated(self) -> bool:
        """Whether the step that just ended changed the weights (a real learner skips a batch without
        signal, `pacerl.trainer.learner.StepResult.updated`); every simulated step does."""
        return True

    def publish(self) -> None:
        """Pause every engine for the weight sync, cut running generations into a segment of the old
        version, and resume them as a new segment of the new version (`Run.publish`)."""
        duration = self.config.colocated_switch_s if self.colocated else self.config.weight_sync_s
        reprefill = self.config.interrupt == "reprefill"
        now, version = self.now, self.version
        self.served_version = version
        prefill_rate, model = self.inference.prefill_tokens_per_s, Origin.MODEL
        for engine in self.engines:
            self.advance(engine, now)
            rows = engine.rows
            stall = engine.kv / prefill_rate if reprefill and rows else 0.0
            resume = max(engine.t, now) + duration + stall
            engine.paused_s += duration
            engine.busy_s += stall
            engine.t, engine.version = resume, version
            s_now = engine.s
            for episode in engine.running.values():  # close_segment at done_now, inlined: the hot loop
                turn = episode.responses[episode.turn]
                seg_done = episode.seg_done
                done = round(turn - (episode.finish_s - s_now))
                if done < seg_done:
                    done = seg_done
                if done > turn - 1:
                    done = turn - 1
                if done > seg_done:
                    episode.parts.append(
                        (model, done - seg_done, episode.seg_version, episode.seg_t0, now, "abort")
                    )
                episode.seg_done, episode.seg_version, episode.seg_t0 = done, version, resume
                episode.cache_version = version
            self.stats.interruptions += rows
            if rows:
                self.schedule(engine)
        self.push(now + duration, _PUBLISHED, None)

    def published(self) -> None:
        self.trainer_busy = False
        if self.mode == "sync":
            self.round_open = False
        self.try_launch()
        self.try_train()

    # -- the result ----------------------------------------------------------------------------------

    def result(self) -> ModeResult:
        stats, end = self.stats, self.now
        engines = self.engines
        busy = sum(min(e.busy_s, end) for e in engines)
        engine_time = len(engines) * end
        rows = sum(e.row_s for e in engines) / max(sum(e.busy_s for e in engines), _EPS)
        gpus_total = (
            self.train_gpus if self.colocated else self.config.inference_gpus + self.config.trainer_gpus
        )
        busy_gpu_s = busy * self.inference.gpus_per_engine + stats.train_s * self.train_gpus
        ends = np.asarray(stats.step_end)
        gaps = np.diff(np.concatenate([[0.0], ends]))
        half = stats.steps // 2
        if stats.steps >= 4:
            window = ends[-1] - ends[half - 1]
            steady = sum(stats.step_trajectories[half:]) / window
        else:
            steady = stats.trained_trajectories / end
        tokens = stats.model_tokens
        return ModeResult(
            mode=self.mode,
            steps=stats.steps,
            simulated_s=end,
            trained_trajectories=stats.trained_trajectories,
            trained_tokens=stats.trained_tokens,
            trajectories_per_s=stats.trained_trajectories / end,
            steady_trajectories_per_s=steady,
            step_time_s=end / stats.steps,
            step_time_p90_s=float(np.percentile(gaps, 90)),
            generated_tokens=round(sum(e.tokens for e in engines)),
            wasted_tokens=stats.wasted_tokens,
            inference_utilization=min(1.0, busy / engine_time),
            trainer_utilization=min(1.0, stats.train_s / end),
            gpu_utilization=min(1.0, busy_gpu_s / (gpus_total * end)),
            mean_running_rows=rows,
            staleness=StalenessStats(
                model_tokens=tokens,
                mean_gs=stats.gs_sum / tokens if tokens else 0.0,
                mean_ws=stats.ws_sum / tokens if tokens else 0.0,
                max_staleness=stats.max_staleness,
                gs_hist=tuple(stats.gs_hist),
                ws_hist=tuple(stats.ws_hist),
            ),
            rejected_groups=dict(sorted(Counter(self.pool.rejections).items())),
            rejected_trajectories=stats.rejected_trajectories,
            interruptions=stats.interruptions,
            retractions=stats.retractions,
            model_segments_per_trajectory=stats.model_segments / max(stats.trained_trajectories, 1),
            max_outstanding_groups=stats.max_outstanding,
            pool_cap_held_s=stats.pool_cap_held_s
            + (end - self.held_since if self.held_since is not None else 0.0),
            step_end_s=tuple(stats.step_end),
            step_trajectories=tuple(stats.step_trajectories),
            step_pool_groups=tuple(stats.step_pool),
            step_mean_gs=tuple(stats.step_gs),
            step_mean_ws=tuple(stats.step_ws),
        )


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: a run allocates millions of small objects, and the collector's
    passes over the live ones cost a third of the run. The simulation frees its own cycles (a finished
    group drops its members), so refcounting reclaims memory meanwhile."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate_mode(config: SimConfig, mode: Mode, on_batch: BatchObserver | None = None) -> ModeResult:
    """Simulate one mode: `async` (the pool and its filter between engines and trainer) or `sync` (the
    synchronous baseline of `config.sync_baseline`). Deterministic given `config.seed`. `on_batch` sees
    every drawn batch with the trainer version it trains at (to inspect the records)."""
    if mode not in ("async", "sync"):
        raise ValueError(f"mode must be async or sync, got {mode!r}")
    with _gc_paused():
        return _Simulation(config, mode, on_batch).run()


def simulate(config: SimConfig) -> SimResult:
    """The async pipeline and its synchronous baseline on the same GPUs, one seed."""
    started = time.perf_counter()
    async_run = simulate_mode(config, "async")
    sync_run = simulate_mode(config, "sync")
    return SimResult(
        config=config,
        async_run=async_run,
        sync_run=sync_run,
        bounds=bounds(config),
        wall_s=time.perf_counter() - started,
    )
