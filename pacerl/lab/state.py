"""The engine's moving parts, one object each: a stream of samples, an episode in flight, its group, an
engine replica, and the running tallies a mode's result is made from. Slotted plain objects: a run
makes millions of them, and the event loop (`pacerl.lab.engine`) reads and writes their fields directly."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pacerl.agents.trajectory import Origin, Trajectory
from pacerl.lab.costs import Distribution
from pacerl.trainer.pool import HIST_BINS


class SampleStream:
    """Samples of one distribution, drawn in chunks from its own generator (changing one distribution
    does not shift the samples of another); token counts come rounded, at least 1."""

    __slots__ = ("buffer", "distribution", "index", "integer", "rng")

    def __init__(self, distribution: Distribution, rng: np.random.Generator, *, integer: bool) -> None:
        self.distribution, self.rng, self.integer = distribution, rng, integer
        self.buffer: list[Any] = []
        self.index = 0

    def take(self, count: int) -> list[Any]:
        """The next `count` samples."""
        if self.index + count > len(self.buffer):
            fresh = self.distribution.sample(self.rng, max(4096, count))
            if self.integer:
                fresh = np.maximum(np.rint(fresh), 1).astype(np.int64)
            self.buffer = self.buffer[self.index :] + fresh.tolist()
            self.index = 0
        start = self.index
        self.index += count
        return self.buffer[start : self.index]


class Episode:
    """One trajectory in flight: its plan, its progress, and its segments so far."""

    __slots__ = (
        "base_context",
        "cache_version",
        "cached",
        "done",
        "engine",
        "finish_s",
        "group",
        "index",
        "parts",
        "remaining",
        "responses",
        "run",
        "seg_done",
        "seg_t0",
        "seg_version",
        "tool_latencies",
        "tool_tokens",
        "turn",
        "uid",
    )

    def __init__(self, uid: int, group: Group, index: int, engine: int) -> None:
        self.uid, self.group, self.index, self.engine = uid, group, index, engine
        self.responses: list[int] = []
        self.tool_tokens: list[int] = []
        self.tool_latencies: list[float] = []
        self.turn = 0
        self.base_context = group.prompt  # tokens before the current turn
        self.done = 0  # tokens of the current turn decoded (valid while not running)
        self.remaining = 0  # tokens of the current turn left (valid while not running)
        self.finish_s = 0.0  # engine step count at which the turn ends (valid while running)
        self.run = 0  # admissions so far; tells stale heap entries apart
        self.cached = 0  # tokens of its context in its engine's prefix cache
        self.cache_version = -1  # the engine version that computed them
        self.seg_version = -1  # the open model segment: version, start time, turn tokens before it
        self.seg_t0 = 0.0
        self.seg_done = 0
        # (origin, exact tokens, version, started_at, ended_at, finish_reason); version -1 for tools
        self.parts: list[tuple[Origin, int, int, float, float, str]] = []


class Group:
    """A group in flight: its members (until its records go to the pool) and its exact token counts."""

    __slots__ = ("generated", "id", "members", "pending", "prompt", "tokens")

    def __init__(self, group_id: str, prompt: int) -> None:
        self.id, self.prompt = group_id, prompt
        self.members: list[Episode] = []
        self.pending = 0
        self.tokens = 0  # exact tokens of all members (prompt, model, tool), for the training step
        self.generated = 0  # exact generated tokens


class EngineState:
    """One engine replica: its decode progress, its running batch and queue, and its busy time."""

    __slots__ = (
        "busy_s",
        "epoch",
        "finishing",
        "index",
        "kv",
        "paused_s",
        "queue",
        "row_s",
        "rows",
        "running",
        "s",
        "t",
        "tokens",
        "version",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.t = 0.0  # decoding proceeds from here (later than now while prefilling or paused)
        self.s = 0.0  # decode steps done (continuous)
        self.kv = 0.0  # cached tokens of the running sequences
        self.rows = 0
        self.running: dict[int, Episode] = {}  # admission order: the last is the newest
        self.finishing: list[tuple[float, int, int]] = []  # heap of (finish step, uid, run)
        self.queue: deque[Episode] = deque()
        self.epoch = 0  # invalidates scheduled events after a change
        self.version = 0
        self.busy_s = 0.0
        self.paused_s = 0.0
        self.row_s = 0.0  # ∫ rows dt while decoding
        self.tokens = 0.0


@dataclass
class RunStats:
    """One mode's running tallies (what `ModeResult` is made from); the per-step lists grow by one entry
    per training step."""

    steps: int = 0
    trained_trajectories: int = 0
    trained_tokens: int = 0
    train_s: float = 0.0
    gs_hist: list[int] = field(default_factory=lambda: [0] * HIST_BINS)
    ws_hist: list[int] = field(default_factory=lambda: [0] * HIST_BINS)
    gs_sum: int = 0
    ws_sum: int = 0
    model_tokens: int = 0
    max_staleness: int = 0
    model_segments: int = 0
    interruptions: int = 0
    retractions: int = 0
    wasted_tokens: int = 0
    rejected_trajectories: int = 0
    max_outstanding: int = 0
    pool_cap_held_s: float = 0.0
    step_end: list[float] = field(default_factory=list)
    step_trajectories: list[int] = field(default_factory=list)
    step_pool: list[int] = field(default_factory=list)
    step_gs: list[float] = field(default_factory=list)
    step_ws: list[float] = field(default_factory=list)

    def account(self, batch: Sequence[Sequence[Trajectory]], v_now: int) -> None:
        """Add a drawn batch: its staleness at the trainer's version `v_now`, token-weighted, from the
        records."""
        gs_sum = ws_sum = tokens = segments = 0
        gs_hist, ws_hist, last = self.gs_hist, self.ws_hist, HIST_BINS - 1
        oldest = v_now - self.max_staleness
        for group in batch:
            for trajectory in group:
                v_done = trajectory.completed_version
                if v_done is None:
                    raise RuntimeError(f"{trajectory.id} was drawn unfinished")
                model = 0
                for segment in trajectory.segments:
                    version = segment.version
                    if version is None:
                        continue
                    count = len(segment.tokens)
                    gs = v_done - version
                    gs_hist[gs if gs < last else last] += count
                    gs_sum += gs * count
                    model += count
                    segments += 1
                    if version < oldest:
                        oldest = version
                ws = v_now - v_done
                ws_hist[ws if ws < last else last] += model
                ws_sum += ws * model
                tokens += model
        self.max_staleness = v_now - oldest
        self.model_segments += segments
        count = sum(len(group) for group in batch)
        self.trained_trajectories += count
        self.step_trajectories.append(count)
        self.gs_sum += gs_sum
        self.ws_sum += ws_sum
        self.model_tokens += tokens
        self.step_gs.append(gs_sum / tokens if tokens else 0.0)
        self.step_ws.append(ws_sum / tokens if tokens else 0.0)
