"""The trajectory pool between rollout and training, with its staleness filters (docs/algorithms.md §2, §6).

Completed groups wait here until the trainer draws a batch. Four filters decide what is admitted and
what is thrown away (`FilterConfig.name`):

- `none`: no staleness control; FIFO draws.
- `max_age`: a hard cap on token age, v_now − v_t ≤ `max_age.versions` for every token of every member
  (prime-rl's async level, NeMo-RL's age cap); FIFO draws.
- `admission`: AReaL's staleness control (arXiv 2505.24298): the rollout side may only start as many
  groups as `admission_capacity` allows, so nothing in the pool can be older than η versions; nothing is
  rejected afterwards; FIFO draws.
- `pace`: PACE (arXiv 2609.36830): each step an EMA of the pool's excess occupancy over a target sets a
  rejection budget K_t (`pace_budget`); the K_t groups with the largest effective staleness
  S_eff = WS + pct(F)^γ·GS are rejected (`effective_staleness`, `prefix_drift`, `percentile_ranks`) and
  the batch is drawn from the rest in arrival order (FIFO). Budget, score, ranking and draw order are
  reconstructions [R] of the paper's mechanism from its abstract and a digest; see each function and
  `TrajectoryPool.select`.

Groups, not trajectories, are the unit of admission, rejection and drawing, so group-normalised
advantages (GRPO) always see every member of a group. The PACE paper does not say how it handles groups
(docs/algorithms.md §6, "Group handling"); ranking a group by the mean S_eff of its members is the option the
spec lists first, and it never needs regeneration of removed members.

Staleness terms (GS, WS) come from the trajectory record alone (`pacerl.agents.trajectory`). A finished member
without model tokens (an episode that failed before its first generation) has nothing stale: GS = 0 and
no token ages; its S_eff is its WS.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt

from pacerl.agents.trajectory import Status, Trajectory
from pacerl.trainer.plugins import chosen_settings

if TYPE_CHECKING:
    from pacerl.trainer.filters import StalenessFilter


DriftScorer: TypeAlias = Callable[[Sequence[Trajectory]], Sequence[float] | npt.NDArray[np.floating[Any]]]
"""Re-scores trajectories under the current policy: one prefix drift F ≥ 0 per trajectory, in order
(typically `prefix_drift` of a forward pass's log-probs against the recorded behaviour log-probs)."""

HIST_BINS = 9
"""Staleness histograms have integer bins 0..8; the last one counts 8 and above."""

_STATE_FORMAT = 1
_STATE_KEYS = frozenset(
    {
        "format",
        "groups",
        "drift",
        "accepted_groups",
        "budget_ema",
        "last_budget",
        "last_v_now",
        "rejections",
        "counts",
        "rejected_ids",
    }
)
# Rounding e·P must not add a group for float noise: e.g. (25 − 11)/25 · 25 = 14.000000000000002.
_ROUND_SLACK = 1e-9


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float(name: str, value: object, low: float, high: float, *, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and low <= number and (number < high if high_open else number <= high)):
        closing = ")" if high_open or math.isinf(high) else "]"
        raise ValueError(f"{name} must be finite and in [{low}, {high}{closing}, got {value!r}")
    return number


@dataclass(frozen=True)
class MaxAgeSettings:
    """max_age: a hard cap on token age (prime-rl's async level, NeMo-RL's age cap)."""

    versions: int = 4
    """A group is rejected when any member has a token with v_now − v_t > versions. >= 0."""

    def __post_init__(self) -> None:
        _check_int("max_age.versions", self.versions, 0)


@dataclass(frozen=True)
class AdmissionSettings:
    """admission: AReaL's staleness control."""

    max_offpolicyness: int = 4
    """AReaL's η (`rollout.max_head_offpolicyness`): no trained token is more than η versions older than
    the trainer; 0 is synchronous training. Counted in training steps, skipped ones included
    (`admission_capacity`), so a skipped step never closes admission. >= 0, and >= S − 1 in an async
    run publishing every S updates (the run config checks)."""

    def __post_init__(self) -> None:
        _check_int("admission.max_offpolicyness", self.max_offpolicyness, 0)


@dataclass(frozen=True)
class PaceSettings:
    """pace: PACE's adaptive rejection budget and effective-staleness ranking."""

    target_groups: int = 24
    """P*, the target pool occupancy in groups; occupancy above it builds the rejection budget. Batches
    are drawn in arrival order, so at occupancy P a group waits at most ⌈P/batch⌉ steps
    (`TrajectoryPool.select`). >= 1."""
    ema: float = 0.9
    """β, the EMA factor of the excess-occupancy rate e_t, in [0, 1) (0: no smoothing)."""
    gamma: float = 4.0
    """γ, the exponent sharpening the drift percentile into the GS weight pct^γ. > 0."""

    def __post_init__(self) -> None:
        _check_int("pace.target_groups", self.target_groups, 1)
        _check_float("pace.ema", self.ema, 0.0, 1.0, high_open=True)
        if _check_float("pace.gamma", self.gamma, 0.0, math.inf) == 0.0:
            raise ValueError(f"pace.gamma must be > 0, got {self.gamma!r}")


@dataclass(frozen=True)
class FilterConfig:
    """Which staleness filter the pool applies (group units throughout). Each built-in filter's own knobs
    sit in its section (`max_age`, `admission`, `pace`), a user's filter's in `options`; only the chosen
    filter's are read, so a sweep over `name` can keep every section set."""

    moved_keys: typing.ClassVar[dict[str, str]] = {
        "max_age": "max_age.versions",
        "max_offpolicyness": "admission.max_offpolicyness",
        "target_groups": "pace.target_groups",
        "ema": "pace.ema",
        "gamma": "pace.gamma",
    }
    """Keys of earlier versions → where they live now (the config loader names the new place)."""

    name: str = "pace"
    """`none`, `max_age`, `admission` (AReaL's η), `pace` (PACE's adaptive rejection budget), or a user's
    filter as module:name (a `StalenessFilter`, see `FILTERS`)."""
    max_concurrent_groups: int = 24
    """Groups in flight at most; every filter's `admission` honours it. >= 1."""
    max_age: MaxAgeSettings = field(default_factory=MaxAgeSettings)
    """max_age's own knobs."""
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    """admission's own knobs."""
    pace: PaceSettings = field(default_factory=PaceSettings)
    """pace's own knobs."""
    options: dict[str, Any] = field(default_factory=dict)
    """A user's filter's own knobs, given to its `StalenessFilter.settings` class (a built-in takes none)."""

    def __post_init__(self) -> None:
        self.settings  # noqa: B018 (a user's options are checked by building its settings)
        _check_int("max_concurrent_groups", self.max_concurrent_groups, 1)

    @property
    def filter(self) -> StalenessFilter:
        """The chosen filter."""
        # trainer.filters declares the built-in filters with the pool's own selection methods, so it
        # imports this module: the lookup is imported here, when a config is built, not at import time.
        from pacerl.trainer.filters import staleness_filter

        return staleness_filter(self.name)

    @property
    def settings(self) -> Any:
        """The chosen filter's own knobs: its section, or its `options` built into its settings class."""
        return chosen_settings(self, self.name, self.filter, self.options, "filter.options")


# -- pure functions ------------------------------------------------------------------------------------


def admission_capacity(
    *,
    trainer_steps: int,
    running_groups: int,
    accepted_groups: int,
    batch_groups: int,
    max_concurrent_groups: int,
    max_offpolicyness: int,
    weight_lag: int = 0,
) -> int:
    """How many new groups the rollout side may start: AReaL's `StalenessManager.get_capacity`
    (arXiv 2505.24298; inclusionAI/AReaL `staleness_manager.py`) in group units,

        max(0, min(max_concurrent − running, (η + s − L + 1)·B − (accepted + running))),

    with s = `trainer_steps`, the training steps completed, updated or skipped, and L = `weight_lag`,
    how many versions the weights the engine serves now trail the trainer's. `accepted_groups` counts
    every group ever accepted into the pool since the start of the run (drawn ones included). After s
    steps the trainer has consumed s·B groups, so capping everything ever produced at (η + s − L + 1)·B
    puts a group started now in one of the next η − L + 1 batches (when groups finish in the order they
    start): it is trained at most η − L steps later, so at trainer version at most v + η − L, where its
    tokens are of version v − L or newer. Its staleness is at most η.

    The lag term is pacerl's: AReaL publishes after every update (L = 0 when it starts a rollout). With
    weights published every S updates, L reaches S − 1 between publications, and without the term a
    group would reach η + S − 1 versions of staleness. The bound can hold only with η >= S − 1 (the
    trainer takes S batches of one published version, the last of them S − 1 versions old): the run
    config refuses a smaller η, and L > η here gives no capacity, never a negative one.

    AReaL writes the trainer version v where s stands here, because there every step moves the version.
    Here a skipped step (a batch without signal, non-finite values: `StepResult.updated` False) consumes
    its B groups but leaves the version where it was; counted in versions, each skip would shrink the
    capacity by B for the rest of the run, and with η = 0 one skip (η + 1 skips in general) would close
    it for good with nothing left to train on. Counting steps keeps AReaL's bound (the version moves at
    most once per step) and its value whenever no step is skipped. AReaL may return a negative number;
    it is floored at 0 here.
    """
    steps = _check_int("trainer_steps", trainer_steps, 0)
    running = _check_int("running_groups", running_groups, 0)
    accepted = _check_int("accepted_groups", accepted_groups, 0)
    batch = _check_int("batch_groups", batch_groups, 1)
    concurrent = _check_int("max_concurrent_groups", max_concurrent_groups, 1)
    eta = _check_int("max_offpolicyness", max_offpolicyness, 0)
    lag = _check_int("weight_lag", weight_lag, 0)
    return max(0, min(concurrent - running, (eta + steps - lag + 1) * batch - (accepted + running)))


def pace_budget(*, occupancy: int, target: int, ema: float, previous: float) -> tuple[float, int]:
    """PACE's rejection budget [R] (arXiv 2609.36830; docs/algorithms.md §6), in groups:

        e_t = β·e_{t−1} + (1 − β)·max(0, (P_t − P*)/P_t)      (the excess term is 0 when P_t = 0)
        K_t = min(round(e_t·P_t), max(0, P_t − P*))            (round half up)

    P_t = `occupancy` (groups in the pool before drawing), P* = `target`, β = `ema`, e_{t−1} =
    `previous` (0 at the start). Returns (e_t, K_t). e_t stays in [0, 1].

    Two departures from docs/algorithms.md's K_t = ⌈e_t·P_t⌉, both so that a pool at or below its target
    is never thinned: the ceiling would reject a group on every step for as long as the decaying EMA
    stays above zero (hundreds of steps after one overload), and a smoothed budget larger than the
    present excess would push the pool below P*. The EMA still smooths the budget while over target.
    """
    occupancy = _check_int("occupancy", occupancy, 0)
    target = _check_int("target", target, 0)
    beta = _check_float("ema", ema, 0.0, 1.0, high_open=True)
    previous = _check_float("previous", previous, 0.0, 1.0)
    excess = max(0.0, (occupancy - target) / occupancy) if occupancy else 0.0
    rate = beta * previous + (1.0 - beta) * excess
    rounded = math.floor(rate * occupancy + 0.5 + _ROUND_SLACK)
    return rate, max(0, min(rounded, occupancy - target))


def percentile_ranks(values: Sequence[float] | npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float64]:
    """Mid-rank percentiles in [0, 1]: (r̄ − 1)/(n − 1), r̄ the 1-based rank with ties sharing their
    mean rank. The smallest value gets 0, the largest 1 (so with PACE's pct^γ the least-drifted member's
    GS is forgiven entirely and the most-drifted member's counts in full); all-equal values get 0.5, and
    a single value 0.5 by the same convention (no ranking information: neither extreme). Shape `[n]`
    in, `[n]` out; finite values only.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or not np.isfinite(x).all():
        raise ValueError(f"values must be a 1-D array of finite floats, got shape {x.shape}")
    n = x.size
    if n <= 1:
        return np.full(n, 0.5)
    order = np.argsort(x)  # stability is not needed: tie runs get their mean rank below
    ordered = x[order]
    first = np.ones(n, dtype=np.bool_)  # position 0 always starts a run
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    ranks = np.empty(n)
    if first.all():  # no ties, the usual case for continuous drift scores
        ranks[order] = np.arange(n)
    else:
        starts = np.flatnonzero(first)
        lasts = np.append(starts[1:], n) - 1
        ranks[order] = ((starts + lasts) / 2.0)[np.cumsum(first) - 1]  # mean 0-based rank of a tie run
    return ranks / (n - 1)


def effective_staleness(
    waiting: npt.ArrayLike, generation: npt.ArrayLike, drift_percentile: npt.ArrayLike, gamma: float
) -> npt.NDArray[np.float64]:
    """PACE's effective staleness [R] (arXiv 2609.36830): S_eff = WS + pct^γ · GS, per trajectory.

    Waiting staleness counts in full; generation staleness is discounted when the current policy still
    finds the generated prefix likely (low drift percentile). All three inputs are `[n]` (WS, GS >= 0;
    pct in [0, 1]); returns `[n]`.
    """
    ws = np.asarray(waiting, dtype=np.float64)
    gs = np.asarray(generation, dtype=np.float64)
    pct = np.asarray(drift_percentile, dtype=np.float64)
    if ws.ndim != 1 or ws.shape != gs.shape or ws.shape != pct.shape:
        raise ValueError(
            f"waiting, generation and pct must share a 1-D shape: {ws.shape}, {gs.shape}, {pct.shape}"
        )
    if not (np.isfinite(ws).all() and np.isfinite(gs).all() and (ws >= 0).all() and (gs >= 0).all()):
        raise ValueError("waiting and generation staleness must be finite and >= 0")
    if not ((pct >= 0) & (pct <= 1)).all():
        raise ValueError("drift percentiles must be in [0, 1]")
    if not (math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"gamma must be finite and > 0, got {gamma!r}")
    return ws + _power(pct, gamma) * gs


def _power(base: npt.NDArray[np.float64], exponent: float) -> npt.NDArray[np.float64]:
    """base ** exponent; an integer exponent by repeated squaring, ~50× faster than numpy's pow
    (PACE's γ = 4 is two squarings), equal to it up to an ulp or two of rounding."""
    if not (exponent.is_integer() and 1 <= exponent <= 64):
        powered: npt.NDArray[np.float64] = base**exponent
        return powered
    remaining, square, result = int(exponent), base, np.ones_like(base)
    while remaining:
        if remaining & 1:
            result = result * square
        remaining >>= 1
        if remaining:
            square = square * square
    return result


def _order_ends(
    values: npt.NDArray[np.float64], head: int, tail: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """(the last `tail`, the first `head`) positions of `values` in (value, position) order, each in
    that order; head + tail <= len(values). Partitions first and sorts only the two ends (with every
    value tied at each cut), not the whole array."""
    n = values.size
    if head:
        cut = np.partition(values, head - 1)[head - 1] if head < n else np.inf
        front = np.flatnonzero(values <= cut)
        first = front[np.argsort(values[front], kind="stable")[:head]]
    else:
        first = np.zeros(0, dtype=np.intp)
    if tail:
        cut = np.partition(values, n - tail)[n - tail]
        back = np.flatnonzero(values >= cut)
        last = back[np.argsort(values[back], kind="stable")[back.size - tail :]]
    else:
        last = np.zeros(0, dtype=np.intp)
    return last, first


def prefix_drift(
    current_logprobs: npt.ArrayLike, behaviour_logprobs: npt.ArrayLike, mask: npt.ArrayLike
) -> float:
    """PACE's prefix-forgetting score F [R] for one trajectory: mean over model tokens of
    |log π_now(y_t|·) − log μ(y_t|·)|.

    All three are `[T]`, aligned with `Trajectory.tokens`: the current policy's log-prob of each token,
    the recorded behaviour log-prob (`Trajectory.behaviour_logprobs`) and the bool `Trajectory.loss_mask`
    (True on model tokens, the only positions read). The exact form of F is not public (docs/algorithms.md
    §6); the mean absolute log-ratio is the reconstruction given there.
    """
    current = np.asarray(current_logprobs, dtype=np.float64)
    behaviour = np.asarray(behaviour_logprobs, dtype=np.float64)
    model = np.asarray(mask)
    if current.ndim != 1 or current.shape != behaviour.shape or current.shape != model.shape:
        raise ValueError(
            f"logprobs and mask must share a 1-D shape: {current.shape}, {behaviour.shape}, {model.shape}"
        )
    if model.dtype != np.bool_:
        raise ValueError(f"mask must be bool, got dtype {model.dtype}")
    if not model.any():
        raise ValueError("no model tokens: the prefix drift is undefined")
    diff = current[model] - behaviour[model]
    if not np.isfinite(diff).all():
        raise ValueError("log-probs must be finite on model tokens")
    return float(np.mean(np.abs(diff)))


@dataclass(frozen=True)
class StalenessSummary:
    """Token-weighted staleness of a set of finished trajectories at trainer version v_now: every model
    token counts once (a trajectory's GS and WS weigh by its model tokens). Empty input (or no model
    tokens at all) gives zero means, zero max and empty-count histograms."""

    trajectories: int
    """How many trajectories were summarised."""
    model_tokens: int
    """Their model tokens, the weights of the means."""
    mean_gs: float
    """Token mean of v_done − v_t (generation staleness)."""
    mean_ws: float
    """Token mean of v_now − v_done (waiting staleness)."""
    mean_staleness: float
    """Token mean of v_now − v_t (= mean_gs + mean_ws)."""
    max_staleness: int
    """Largest v_now − v_t over all model tokens."""
    gs_hist: tuple[int, ...]
    """Model tokens by v_done − v_t, bins 0..8, the last bin 8 and more."""
    ws_hist: tuple[int, ...]
    """Model tokens by their trajectory's v_now − v_done, bins 0..8, the last bin 8 and more."""

    def metrics(self) -> dict[str, float]:
        """Flat scalars for a logger: the fields, with histogram bins as `gs_hist_<k>` / `ws_hist_<k>`
        (k = 0..8; `_8` holds 8 and more)."""
        flat: dict[str, float] = {
            "trajectories": float(self.trajectories),
            "model_tokens": float(self.model_tokens),
            "mean_gs": self.mean_gs,
            "mean_ws": self.mean_ws,
            "mean_staleness": self.mean_staleness,
            "max_staleness": float(self.max_staleness),
        }
        for name, hist in (("gs_hist", self.gs_hist), ("ws_hist", self.ws_hist)):
            flat.update({f"{name}_{k}": float(count) for k, count in enumerate(hist)})
        return flat


def staleness_summary(trajectories: Iterable[Trajectory], v_now: int) -> StalenessSummary:
    """The token-weighted GS/WS summary and histograms of finished `trajectories` at trainer version
    `v_now` (docs/algorithms.md §6). Raises for a running trajectory or one finished after v_now."""
    v_now = _check_int("v_now", v_now, 0)
    generation: list[npt.NDArray[np.int64]] = []
    waiting: list[npt.NDArray[np.int64]] = []
    count = 0
    for trajectory in trajectories:
        ws = trajectory.waiting_staleness(v_now)
        versions = trajectory.token_versions
        model = versions[versions >= 0]
        generation.append((v_now - ws) - model)  # v_done − v_t
        waiting.append(np.full(model.size, ws, dtype=np.int64))
        count += 1
    gs = np.concatenate(generation) if generation else np.zeros(0, dtype=np.int64)
    ws_tokens = np.concatenate(waiting) if waiting else np.zeros(0, dtype=np.int64)
    total = gs + ws_tokens

    def hist(values: npt.NDArray[np.int64]) -> tuple[int, ...]:
        return tuple(int(c) for c in np.bincount(np.minimum(values, HIST_BINS - 1), minlength=HIST_BINS))

    return StalenessSummary(
        trajectories=count,
        model_tokens=int(gs.size),
        mean_gs=float(gs.mean()) if gs.size else 0.0,
        mean_ws=float(ws_tokens.mean()) if gs.size else 0.0,
        mean_staleness=float(total.mean()) if gs.size else 0.0,
        max_staleness=int(total.max()) if gs.size else 0,
        gs_hist=hist(gs),
        ws_hist=hist(ws_tokens),
    )


# -- the pool ------------------------------------------------------------------------------------------


@dataclass
class _Columns:
    """One row per pooled trajectory, precomputed on add because `Trajectory`'s derived views rebuild
    their arrays on every access. Rows of a group are contiguous and rows follow arrival order; a
    removed group's rows are only marked dead and dropped by an occasional compaction, so removing a
    group costs O(its rows) rather than O(pool)."""

    gs: npt.NDArray[np.float64]
    """Generation staleness (0 without model tokens)."""
    scorable: npt.NDArray[np.bool_]
    """The trajectory has model tokens, so a prefix drift F (and a place in PACE's ranking)."""
    v_done: npt.NDArray[np.int64]
    """completed_version."""
    v_min: npt.NDArray[np.int64]
    """Oldest model-token version (v_done without model tokens), for the max_age cap."""
    seq: npt.NDArray[np.int64]
    """Arrival number of the row's group (increasing with the row index)."""
    alive: npt.NDArray[np.bool_]
    """False once the group was drawn or rejected."""
    drift: npt.NDArray[np.float64]
    """Cached prefix drift F."""
    drift_version: npt.NDArray[np.int64]
    """The v_now `drift` was scored at; -1 when never scored."""

    @classmethod
    def empty(cls, capacity: int) -> _Columns:
        return cls(
            gs=np.zeros(capacity),
            scorable=np.zeros(capacity, dtype=np.bool_),
            v_done=np.zeros(capacity, dtype=np.int64),
            v_min=np.zeros(capacity, dtype=np.int64),
            seq=np.zeros(capacity, dtype=np.int64),
            alive=np.zeros(capacity, dtype=np.bool_),
            drift=np.zeros(capacity),
            drift_version=np.full(capacity, -1, dtype=np.int64),
        )

    def moved(self, rows: npt.NDArray[np.intp], capacity: int) -> _Columns:
        """A fresh block of `capacity` rows holding `rows` of this one at the front."""
        block = _Columns.empty(capacity)
        for column in dataclasses.fields(self):
            getattr(block, column.name)[: rows.size] = getattr(self, column.name)[rows]
        return block


class TrajectoryPool:
    """Completed groups (lists of finished trajectories sharing a `group_id`) in arrival order, drawn
    in batches of whole groups through the configured staleness filter (see the module docstring).

    Public counters, all saved by `state_dict`:
    `accepted_groups` (groups ever added, for AReaL's admission), `rejections` (rejected groups by
    reason: `max_age`, `pace_budget`), `rejected_ids` (ids of rejected trajectories, the most recent
    `max_rejected_ids`), `budget_ema` / `last_budget` (PACE's e_t and K_t of the latest select) and
    `counts`: `drawn_groups`, `drawn_trajectories`, `rejected_trajectories`, `drift_calls`,
    `drift_scored` (trajectories re-scored), `drift_unscored` (GS > 0 members ranked with pct = 1
    because no drift scorer was given), `rejected_ids_dropped` (ids that fell off `rejected_ids`).

    Not thread-safe: the rollout side's `add_group` and the trainer's `select` must run on one event
    loop or under one lock.
    """

    def __init__(self, config: FilterConfig, *, max_rejected_ids: int = 100_000) -> None:
        if not isinstance(config, FilterConfig):
            raise ValueError(f"config must be a FilterConfig, got {type(config).__name__}")
        self.config = config
        self.max_rejected_ids = _check_int("max_rejected_ids", max_rejected_ids, 0)
        self.accepted_groups = 0
        self.rejections: Counter[str] = Counter()
        self.rejected_ids: list[str] = []
        self.counts: Counter[str] = Counter()
        self.budget_ema = 0.0
        self.last_budget = 0
        self.last_v_now: int | None = None
        """The largest trainer version seen by `select`/`refresh_drift`; versions never go back."""
        self._reset_rows()

    def _reset_rows(self) -> None:
        self._cols = _Columns.empty(64)
        self._rows = 0  # rows in use, dead ones included
        self._trajectories: list[Trajectory] = []  # by row; dead rows stay until compaction
        self._groups: dict[str, tuple[int, int]] = {}  # group id -> its rows [start, stop), arrival order
        self._ids: set[str] = set()
        self._next_seq = 0
        self._live = 0
        self._max_done = -1  # the largest completed_version added

    # -- contents ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Groups in the pool."""
        return len(self._groups)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    @property
    def num_trajectories(self) -> int:
        """Trajectories in the pool."""
        return self._live

    def group_ids(self) -> list[str]:
        """The pooled groups' ids in arrival order."""
        return list(self._groups)

    def trajectories(self) -> list[Trajectory]:
        """The pooled trajectories in arrival order (e.g. for `staleness_summary`)."""
        return [t for start, stop in self._groups.values() for t in self._trajectories[start:stop]]

    def add_group(self, group: Sequence[Trajectory]) -> None:
        """Add a completed group: every member finished, all sharing one new `group_id`, ids unique."""
        self._append(self._validated(group))
        self.accepted_groups += 1

    def _validated(self, group: Sequence[Trajectory]) -> list[Trajectory]:
        members = list(group)
        if not members or not all(isinstance(t, Trajectory) for t in members):
            raise ValueError("a group must be a non-empty sequence of Trajectory")
        group_ids = {t.group_id for t in members}
        if len(group_ids) != 1:
            raise ValueError(f"a group's members must share one group_id, got {sorted(group_ids)}")
        (group_id,) = group_ids
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} is already in the pool")
        running = [t.id for t in members if t.status is Status.RUNNING or t.completed_version is None]
        if running:
            raise ValueError(f"group {group_id!r} has unfinished trajectories: {running}")
        ids = [t.id for t in members]
        if len(set(ids)) != len(ids) or not self._ids.isdisjoint(ids):
            raise ValueError(f"group {group_id!r}: trajectory ids must be unique in the pool, got {ids}")
        return members

    def _append(self, members: list[Trajectory]) -> None:
        start, stop = self._rows, self._rows + len(members)
        if stop > self._cols.alive.size:
            self._cols = self._cols.moved(np.arange(self._rows), max(2 * self._cols.alive.size, stop))
        cols = self._cols
        for row, trajectory in enumerate(members, start):
            v_done = trajectory.completed_version
            if v_done is None:  # _validated rules this out; the check narrows the type
                raise ValueError(f"trajectory {trajectory.id!r} is not finished")
            # From the segments, not `token_versions`: one term per segment instead of per-token arrays.
            # Integer sums are exact, so GS equals `generation_staleness()` to the bit.
            lag, tokens, oldest = 0, 0, v_done
            for segment in trajectory.segments:
                if segment.version is not None:
                    lag += (v_done - segment.version) * len(segment.tokens)
                    tokens += len(segment.tokens)
                    oldest = min(oldest, segment.version)
            cols.gs[row] = lag / tokens if tokens else 0.0
            cols.scorable[row] = tokens > 0
            cols.v_done[row] = v_done
            cols.v_min[row] = oldest
        cols.seq[start:stop] = self._next_seq
        cols.alive[start:stop] = True
        cols.drift_version[start:stop] = -1
        self._trajectories.extend(members)
        self._groups[members[0].group_id] = (start, stop)
        self._ids.update(t.id for t in members)
        self._rows, self._live, self._next_seq = stop, self._live + len(members), self._next_seq + 1
        self._max_done = max(self._max_done, int(cols.v_done[start:stop].max()))

    def _remove(self, group_ids: Iterable[str]) -> None:
        spans = [self._groups.pop(group_id) for group_id in group_ids]
        for start, stop in spans:
            self._cols.alive[start:stop] = False
            self._live -= stop - start
        self._ids.difference_update([t.id for start, stop in spans for t in self._trajectories[start:stop]])
        if self._rows - self._live > max(self._live, 1024):  # amortised: compact when half is dead
            keep = np.flatnonzero(self._cols.alive[: self._rows])
            self._cols = self._cols.moved(keep, max(64, 2 * keep.size))
            self._trajectories = [self._trajectories[row] for row in keep]
            position = 0
            for group_id, (start, stop) in self._groups.items():
                self._groups[group_id] = (position, position + stop - start)
                position += stop - start
            self._rows = keep.size

    # -- admission and drawing ---------------------------------------------------------------------------

    def admission(
        self, trainer_steps: int, running_groups: int, batch_groups: int, weight_lag: int = 0
    ) -> int:
        """How many new groups the rollout side may start now, `trainer_steps` training steps into the
        run (updated or skipped; not the policy version, which a skipped step leaves where it was), with
        the engine's weights `weight_lag` versions behind the trainer's: the filter's own gate if it has one
        (AReaL's `admission_capacity` under `admission`), otherwise only the concurrency cap,
        max(0, max_concurrent − running)."""
        gate = self.config.filter.admission
        if gate is not None:
            return gate(self, trainer_steps, running_groups, batch_groups, weight_lag)
        _check_int("trainer_steps", trainer_steps, 0)
        _check_int("batch_groups", batch_groups, 1)
        _check_int("weight_lag", weight_lag, 0)
        return max(0, self.config.max_concurrent_groups - _check_int("running_groups", running_groups, 0))

    def select(
        self, batch_groups: int, v_now: int, drift: DriftScorer | None = None
    ) -> list[list[Trajectory]]:
        """Apply the filter's rejections, then draw and remove up to `batch_groups` whole groups.

        `none`, `admission`: nothing rejected; the oldest groups first (FIFO). `max_age`: groups with a
        token older than `max_age.versions` versions are rejected (reason `max_age`); FIFO. `pace`: e_t, K_t
        from the occupancy before drawing (`pace_budget`), groups scored by the mean S_eff of their
        members, the K_t highest-scored rejected (reason `pace_budget`; score ties: the earlier arrival
        stays), then the batch drawn from the rest in arrival order (FIFO), returned in that order.

        PACE's draw order [R]. docs/algorithms.md §6 says only "reject the K_t trajectories with the largest
        S_eff, then draw the training batch"; it does not say in which order. The statement followed is
        the budget's motivation, Little's law, "wait ≈ occupancy / consumption rate". Little's law
        alone holds on average under any order; it holds for each group when groups are drawn in
        arrival order, since a group then waits only for the groups ahead of it, so that keeping the
        occupancy near P* keeps every group's waiting staleness near P*/B. S_eff decides what is
        rejected, not what is drawn first. (Drawing the lowest S_eff first, as an earlier version did,
        left the oldest groups in a pool at or below its target for ever: K_t = 0 there, and fresher
        groups kept being drawn ahead of them.)

        Bound (every filter draws FIFO among the groups it keeps): a select with `batch_groups` = b
        draws min(b, P − K) groups, P the groups pooled, and under PACE P − K ≥ min(P, P*); with
        m = b for `none`, `admission` and `max_age` and m = min(b, P*) for `pace`, each select draws at
        least m groups from the front of the arrival order or empties the pool of what it keeps. A group
        that arrives with a groups ahead of it therefore leaves the pool (drawn, or rejected) by the
        ⌈(a + 1)/m⌉-th select after its arrival, whatever the rejections and arrivals in between (later
        arrivals queue behind it). With m = b (the run config keeps P* >= b), in = out = b per step and
        occupancy P before each select, that is ⌈P/b⌉ selects: a group's waiting staleness grows by at
        most ⌈P/b⌉ versions while it is pooled (the version moves at most once per step).

        `drift` (pace only; ignored by the other filters) re-scores trajectories under the current
        policy. Scores only rank rejections, so it is called only when K_t > 0 and some member has
        GS > 0, at most once per select, with the members that have model tokens and no score cached
        at this `v_now`, in arrival order. Percentiles are taken among all of them, fresh members
        (GS = 0) included, as the spec's "among pool candidates" says: a fresh member's F is measured
        the same way (its model tokens' mean |log π_now − log μ|; at WS = 0 that is the engine/trainer
        mismatch alone, later it is how far the policy moved since), so a stale member whose drift is
        large against the pool ranks high however few members are stale. Members without model tokens
        have no F and take no part in the ranking (their S_eff is their WS). Without a scorer, the
        GS > 0 members rank with pct = 1 (their full GS counts, the conservative choice) and are
        counted in `counts["drift_unscored"]`.
        """
        batch_groups = _check_int("batch_groups", batch_groups, 1)
        v_now = self._checked_version(v_now)
        # The newest completion ever added stands for the pooled ones: a group that left did so at a
        # select whose v_now (<= this one) was at least its completed_version.
        if self._max_done > v_now:
            raise ValueError(f"trainer version {v_now} is behind a pooled trajectory's completed_version")
        self.last_v_now = v_now
        rows, starts = self._live_index()
        chosen = self.config.filter
        rejected, drawn = _checked_selection(chosen.select(self, batch_groups, v_now, drift), starts.size)
        if drawn.size > batch_groups:
            raise ValueError(
                f"filter {self.config.name!r} drew {drawn.size} groups for a batch of {batch_groups}"
            )
        reason = chosen.reason
        first_rows = rows[starts]  # ids looked up only for the groups that leave: O(removed), not O(pool)
        rejected_ids = [self._trajectories[row].group_id for row in first_rows[np.sort(rejected)]]
        drawn_ids = [self._trajectories[row].group_id for row in first_rows[drawn]]
        batch = [self._trajectories[slice(*self._groups[group_id])] for group_id in drawn_ids]
        if rejected_ids:
            self._record_rejections(reason, rejected_ids)
        self.counts["drawn_groups"] += len(batch)
        self.counts["drawn_trajectories"] += sum(len(group) for group in batch)
        self._remove([*rejected_ids, *drawn_ids])
        return batch

    def pooled_groups(self) -> list[list[Trajectory]]:
        """The pooled groups in arrival order: what a filter's positions index."""
        return [self._trajectories[start:stop] for start, stop in self._groups.values()]

    def _live_index(self) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        """(the live rows in arrival order, each group's first position among them)."""
        rows = np.flatnonzero(self._cols.alive[: self._rows])
        return rows, np.flatnonzero(np.diff(self._cols.seq[rows], prepend=-1))

    def _keep_all(
        self,
        rows: npt.NDArray[np.intp],
        starts: npt.NDArray[np.intp],
        batch_groups: int,
        v_now: int,
        drift: DriftScorer | None,
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        """`none` and `admission` at selection: nothing rejected, the oldest groups drawn (FIFO)."""
        return np.zeros(0, dtype=np.intp), np.arange(min(batch_groups, starts.size))

    def _max_age(
        self,
        rows: npt.NDArray[np.intp],
        starts: npt.NDArray[np.intp],
        batch_groups: int,
        v_now: int,
        drift: DriftScorer | None,
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        """`max_age`: groups with a token older than `max_age.versions` versions rejected; FIFO draws."""
        if not rows.size:
            return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
        too_old = np.maximum.reduceat(v_now - self._cols.v_min[rows], starts) > self.config.max_age.versions
        return np.flatnonzero(too_old), np.flatnonzero(~too_old)[:batch_groups]

    def refresh_drift(self, v_now: int, drift: DriftScorer) -> int:
        """Score, in one call of `drift`, every pooled member with model tokens that has no score cached at
        `v_now` (e.g. while the trainer would otherwise wait); `select` at the same version then reuses
        the scores. Returns how many were scored. Only the latest version's score is kept per
        trajectory: v_now never decreases, so an older one can never be reused."""
        v_now = self._checked_version(v_now)
        cols = self._cols
        rows = np.flatnonzero(cols.alive[: self._rows])
        scored = self._score(rows[cols.scorable[rows] & (cols.drift_version[rows] != v_now)], v_now, drift)
        self.last_v_now = v_now
        return scored

    def _score(self, pending: npt.NDArray[np.intp], v_now: int, drift: DriftScorer) -> int:
        """Score rows `pending` with one call of `drift` and cache the scores at `v_now`."""
        if not pending.size:
            return 0
        cols = self._cols
        batch = [self._trajectories[row] for row in pending]
        scores = np.asarray(drift(batch), dtype=np.float64)
        if scores.shape != (len(batch),):
            raise ValueError(f"drift must return one score per trajectory ({len(batch)}), got {scores.shape}")
        if not (np.isfinite(scores).all() and (scores >= 0).all()):
            raise ValueError(f"drift scores must be finite and >= 0, got {scores[~(scores >= 0)][:5]!r}")
        cols.drift[pending] = scores
        cols.drift_version[pending] = v_now
        self.counts["drift_calls"] += 1
        self.counts["drift_scored"] += len(batch)
        return len(batch)

    def _checked_version(self, v_now: int) -> int:
        v_now = _check_int("v_now", v_now, 0)
        if self.last_v_now is not None and v_now < self.last_v_now:
            raise ValueError(f"trainer version went back from {self.last_v_now} to {v_now}")
        return v_now

    def _pace(
        self,
        rows: npt.NDArray[np.intp],
        starts: npt.NDArray[np.intp],
        batch_groups: int,
        v_now: int,
        drift: DriftScorer | None,
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        """(rejected, drawn) group positions (indices into `starts`) under PACE."""
        config, cols = self.config, self._cols
        occupancy = int(starts.size)
        rate, budget = pace_budget(
            occupancy=occupancy,
            target=config.pace.target_groups,
            ema=config.pace.ema,
            previous=self.budget_ema,
        )
        if not budget:  # nothing to reject: the scores would rank nothing, so nobody is scored
            self.budget_ema, self.last_budget = rate, 0
            return np.zeros(0, dtype=np.intp), np.arange(min(batch_groups, occupancy))
        gs = cols.gs[rows]
        candidate_at = np.flatnonzero(cols.scorable[rows])  # every member with a prefix, fresh ones too
        candidates = rows[candidate_at]
        stale_at = np.flatnonzero(gs > 0)  # members whose own weight pct^γ matters (positions in `rows`)
        if drift is not None and stale_at.size:  # no stale member: the ranking would weigh nothing
            # before the EMA moves: a failing scorer must leave its state as it was
            self._score(candidates[cols.drift_version[candidates] != v_now], v_now, drift)
        self.budget_ema, self.last_budget = rate, budget
        pct = np.ones(stale_at.size)  # unscored: the full GS counts
        if candidates.size and (cols.drift_version[candidates] == v_now).all():
            # Ranked among all candidates (docs/algorithms.md §6): a fresh member's F places the stale
            # ones, so the size of a drift counts even when few members are stale.
            by_position = np.zeros(rows.size)
            by_position[candidate_at] = percentile_ranks(cols.drift[candidates])
            pct = by_position[stale_at]  # GS > 0 implies model tokens: every stale member is a candidate
        elif stale_at.size:
            self.counts["drift_unscored"] += int(stale_at.size)
        # S_eff = WS where GS = 0, so only the stale members go through the weighting
        s_eff = (v_now - cols.v_done[rows]).astype(np.float64)
        s_eff[stale_at] = effective_staleness(s_eff[stale_at], gs[stale_at], pct, config.pace.gamma)
        score = np.add.reduceat(s_eff, starts) / np.diff(starts, append=rows.size)
        # groups are in arrival order, so of tied scores the later arrival is rejected
        rejected, _ = _order_ends(score, 0, self.last_budget)
        kept = np.ones(occupancy, dtype=np.bool_)
        kept[rejected] = False
        return rejected, np.flatnonzero(kept)[:batch_groups]  # FIFO draws: see `select`

    def _record_rejections(self, reason: str, group_ids: Sequence[str]) -> None:
        ids = [t.id for group_id in group_ids for t in self._trajectories[slice(*self._groups[group_id])]]
        self.rejections[reason] += len(group_ids)
        self.counts["rejected_trajectories"] += len(ids)
        self.rejected_ids.extend(ids)
        overflow = len(self.rejected_ids) - self.max_rejected_ids
        if overflow > 0:
            del self.rejected_ids[:overflow]
            self.counts["rejected_ids_dropped"] += overflow

    # -- checkpointing -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: the pooled groups (`Trajectory.to_json`, arrival order), the drift cache, PACE's
        EMA state and every counter. `load_state_dict` of it restores the pool exactly."""
        cols = self._cols
        groups = [
            [t.to_json() for t in self._trajectories[start:stop]] for start, stop in self._groups.values()
        ]
        rows = np.flatnonzero(cols.alive[: self._rows] & (cols.drift_version[: self._rows] >= 0))
        return {
            "format": _STATE_FORMAT,
            "groups": groups,
            "drift": [
                [self._trajectories[row].id, int(cols.drift_version[row]), float(cols.drift[row])]
                for row in rows
            ],
            "accepted_groups": self.accepted_groups,
            "budget_ema": self.budget_ema,
            "last_budget": self.last_budget,
            "last_v_now": self.last_v_now,
            "rejections": dict(self.rejections),
            "counts": dict(self.counts),
            "rejected_ids": list(self.rejected_ids),
        }

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Replace this pool's contents and counters with a `state_dict`; validated before anything
        changes. The filter config is this pool's own (it may differ from the saved run's)."""
        if set(data) != _STATE_KEYS:
            raise ValueError(f"pool state needs exactly {sorted(_STATE_KEYS)}; got {sorted(data)}")
        if data["format"] != _STATE_FORMAT:
            raise ValueError(f"unknown pool state format {data['format']!r}")
        groups = [[Trajectory.from_json(t) for t in group] for group in data["groups"]]
        accepted = _check_int("accepted_groups", data["accepted_groups"], len(groups))
        budget_ema = _check_float("budget_ema", data["budget_ema"], 0.0, 1.0)
        last_budget = _check_int("last_budget", data["last_budget"], 0)
        last_v_now = None if data["last_v_now"] is None else _check_int("last_v_now", data["last_v_now"], 0)
        rejections, counts = (_counter(name, data[name]) for name in ("rejections", "counts"))
        rejected_ids = list(data["rejected_ids"])
        if not all(isinstance(i, str) for i in rejected_ids):
            raise ValueError("rejected_ids must be strings")
        staged = TrajectoryPool(self.config, max_rejected_ids=self.max_rejected_ids)
        for group in groups:
            staged._append(staged._validated(group))
        row_of = {t.id: row for row, t in enumerate(staged._trajectories)}
        for entry in data["drift"]:
            trajectory_id, version, value = entry
            if trajectory_id not in row_of:
                raise ValueError(f"drift cache names {trajectory_id!r}, which is not in the pool")
            row = row_of[trajectory_id]
            staged._cols.drift_version[row] = _check_int("drift version", version, 0)
            staged._cols.drift[row] = _check_float("drift", value, 0.0, math.inf)
        staged.accepted_groups, staged.budget_ema, staged.last_budget = accepted, budget_ema, last_budget
        staged.last_v_now, staged.rejections, staged.counts = last_v_now, rejections, counts
        staged.rejected_ids = rejected_ids
        # Built aside and swapped in whole, so a bad state raises before this pool changes.
        self.__dict__.update(staged.__dict__)


def _counter(name: str, value: object) -> Counter[str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in value.items()
    ):
        raise ValueError(f"{name} must map strings to counts >= 0, got {value!r}")
    return Counter(value)


def _checked_selection(
    selection: tuple[Any, ...], groups: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """A filter's (rejected, drawn) as position arrays, ValueError unless they are valid."""
    if not (isinstance(selection, tuple) and len(selection) == 2):
        raise ValueError(f"a filter's select returns (rejected, drawn) positions, got {selection!r}")
    rejected, drawn = (np.asarray(part, dtype=np.intp).reshape(-1) for part in selection)
    every = np.concatenate([rejected, drawn])
    if every.size and (every.min() < 0 or every.max() >= groups or np.unique(every).size != every.size):
        raise ValueError(
            f"a filter's positions must be distinct and in [0, {groups}), got rejected {rejected.tolist()} "
            f"and drawn {drawn.tolist()}"
        )
    return rejected, drawn
