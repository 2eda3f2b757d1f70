"""A discrete-event simulation of the asynchronous pipeline at cluster scale (`pacerl simulate`).

It runs this project's own scheduling code against simulated time instead of real engines: the pool
(`trainer.pool.TrajectoryPool`) decides admission (`admission`, AReaL's capacity under the `admission`
filter), rejection and batch selection (`select`, with every filter: none, max_age, admission, pace),
on real `agents.trajectory.Trajectory` records whose segments carry the simulated policy versions and
times, so Generation and Waiting Staleness come from the record itself. The loop around it mirrors
`trainer/loop.py`: the producer starts as many groups as `admission` allows whenever a group finishes
or the trainer's version moves; the trainer draws a batch when at least `batch_groups` groups wait,
trains, and every `sync_interval` (S) updates publishes the weights, which pauses every engine,
interrupts its running generations and resumes them under the new version as new segments.

The models, each a documented assumption (presets say where their numbers come from):

- **Decode throughput** (per engine replica of `gpus_per_engine` GPUs, continuous batching). One decode
  step advances every running sequence by one token and takes
      τ = step_base_s + step_per_row_s · rows + step_per_kv_token_s · kv_tokens,
  the weights read once per step (memory-bound), a compute cost per row, and the attention's read of the
  KV cache (every cached token of every running sequence). Between two events `rows` is constant and
  `kv_tokens` grows by `rows` per step, so the time to decode Δ steps is closed-form,
      t(Δ) = α·Δ + β·Δ²/2   with α = τ at the start, β = step_per_kv_token_s · rows,
  and the engine is advanced analytically from event to event instead of token by token. Progress is
  continuous (a fluid approximation of step-granular decoding: a request that joins mid-step starts at
  that fraction of a step), which makes constant-length cases exact.
- **Admission into an engine**: a request waits in its engine's queue until a row is free
  (`max_running`) and the KV cache would stay under `admit_kv_fraction` of `kv_capacity_tokens`;
  admitting it costs its prefill (context not in the prefix cache, at `prefill_tokens_per_s`), during
  which the engine's decoding stalls. When the growing cache would overflow, the newest sequence is
  retracted (SGLang's behaviour): its KV is dropped and it goes back to the front of the queue.
- **Weight publication** takes `weight_sync_s`; engines pause and the trainer waits. With
  `interrupt="reprefill"` (AReaL) running sequences' caches are recomputed under the new weights (a
  prefill of every running token) and prefix caches of sequences waiting on a tool are invalid;
  with `"continue"` (PipelineRL) caches are kept.
- **Training step**: step_fixed_s + tokens · (1 + forward_share·recompute) / (gpus · tokens_per_gpu_s),
  data-parallel over packed sequences, every token (prompt, model, tool) through the forward and
  backward pass.
- **Episodes**: a group of `group_size` trajectories sharing one prompt; each plays `turns` turns of
  `response_tokens` generated tokens, with a tool call of `tool_latency_s` returning `tool_tokens`
  between turns. A later turn goes back to the same engine (prefix-cache affinity); first turns are
  spread round-robin.
- **Prefix drift for PACE** (`DriftScorer`): F(τ) = u_τ · (token-mean version gap v_now − v_t), with
  u_τ a per-trajectory sensitivity, lognormal(0, `drift_sigma`), fixed by a hash of the seed and the
  trajectory id. Drift grows with the version gap; u_τ spreads trajectories of equal gap so PACE's
  percentile ranking has something to rank. A model, not a measurement.
- **The synchronous baseline** on the same GPUs: `colocated` (every GPU generates, then every GPU trains,
  switching costs `colocated_switch_s` per round; what AReaL and verl compare against) or `split` (the
  same engines and trainer as async, used in turn). A round generates S·B groups with the current
  weights, trains S updates on them, publishes.

Not modelled: a group's members sharing their prompt's prefix cache (each prefills it), chunked
prefill mixing with decode, routing smarter than round-robin, reward and verifier time, failed or
dropped episodes, and evaluation. The defaults of the configs describe a generic tool-using agent on a
mid-size MoE; they are assumptions, while `PRESETS` carry setups checked against published figures.

Records hold synthetic token ids. With `token_block` > 1 one record token stands for that many real
tokens (segment lengths rounded, at least one), which keeps 30k-token trajectories cheap; the timing
and token accounting use exact counts, the staleness statistics the record's (block-rounded) ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import math
import statistics
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from agents.trajectory import Origin, Segment, Status, Trajectory
from trainer.pool import HIST_BINS, FilterConfig, TrajectoryPool

DistributionKind: TypeAlias = Literal["constant", "lognormal", "empirical"]
Interrupt: TypeAlias = Literal["reprefill", "continue"]
SyncBaseline: TypeAlias = Literal["colocated", "split"]
Mode: TypeAlias = Literal["async", "sync"]

_EPS = 1e-9

BatchObserver: TypeAlias = Callable[[list[list[Trajectory]], int], None]
"""Called with each drawn batch (groups of records) and the trainer version it is trained at."""


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_float(
    name: str, value: object, minimum: float, *, strict: bool = False, inf: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if (
        math.isnan(number)
        or (math.isinf(number) and not inf)
        or number < minimum
        or (strict and number <= minimum)
    ):
        bound = ">" if strict else ">="
        raise ValueError(f"{name} must be {'' if inf else 'finite and '}{bound} {minimum}, got {value!r}")
    return number


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


# -- configs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Distribution:
    """A non-negative random quantity (a token count or a latency), clipped to [minimum, maximum]."""

    kind: DistributionKind = "constant"
    """`constant` (always `median`), `lognormal` (median `median`, log-space spread `sigma`: long-tailed)
    or `empirical` (resampled uniformly from `values`, e.g. a measured trace)."""
    median: float = 1.0
    """constant: the value; lognormal: the median e^μ (> 0). Unused by empirical."""
    sigma: float = 0.0
    """lognormal: the standard deviation of log X (>= 0); 1.0 gives a mean 1.65× the median."""
    minimum: float = 0.0
    """Samples below are raised to it. >= 0."""
    maximum: float = math.inf
    """Samples above are cut to it (a generation cap such as max_new_tokens); inf: no cap."""
    values: tuple[float, ...] = ()
    """empirical: the samples to draw from (non-negative, at least one)."""

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "lognormal", "empirical"):
            raise ValueError(f"kind must be constant, lognormal or empirical, got {self.kind!r}")
        _check_float("median", self.median, 0.0, strict=self.kind == "lognormal")
        _check_float("sigma", self.sigma, 0.0)
        _check_float("minimum", self.minimum, 0.0)
        if _check_float("maximum", self.maximum, 0.0, inf=True) < self.minimum:
            raise ValueError(f"maximum ({self.maximum}) must be >= minimum ({self.minimum})")
        values = tuple(float(v) for v in self.values)
        if self.kind == "empirical" and (
            not values or min(values) < 0 or not all(map(math.isfinite, values))
        ):
            raise ValueError("an empirical distribution needs at least one finite value >= 0")
        object.__setattr__(self, "values", values)

    @classmethod
    def constant(cls, value: float) -> Distribution:
        """Always `value`."""
        return cls(kind="constant", median=value)

    @classmethod
    def lognormal(
        cls, median: float, sigma: float, maximum: float = math.inf, minimum: float = 0.0
    ) -> Distribution:
        """Lognormal with this median and log-space spread, clipped."""
        return cls(kind="lognormal", median=median, sigma=sigma, minimum=minimum, maximum=maximum)

    @classmethod
    def empirical(cls, values: Iterable[float], maximum: float = math.inf) -> Distribution:
        """Resampled from measured `values`."""
        return cls(kind="empirical", values=tuple(values), maximum=maximum)

    @property
    def upper(self) -> float:
        """The largest value a sample can take."""
        if self.kind == "constant":
            return min(max(self.median, self.minimum), self.maximum)
        if self.kind == "empirical":
            return min(max(max(self.values), self.minimum), self.maximum)
        return self.maximum

    def sample(self, rng: np.random.Generator, size: int) -> npt.NDArray[np.float64]:
        """`size` samples, shape `[size]`."""
        if self.kind == "constant":
            raw = np.full(size, self.median)
        elif self.kind == "lognormal":
            raw = rng.lognormal(math.log(self.median), self.sigma, size)
        else:
            raw = np.asarray(self.values)[rng.integers(0, len(self.values), size)]
        clipped: npt.NDArray[np.float64] = np.clip(raw, self.minimum, self.maximum)
        return clipped

    def mean(self) -> float:
        """The mean of a (clipped) sample, exact."""
        low, high = self.minimum, self.maximum
        if self.kind == "constant":
            return min(max(self.median, low), high)
        if self.kind == "empirical":
            return float(np.clip(np.asarray(self.values), low, high).mean())
        if self.sigma == 0.0:
            return min(max(self.median, low), high)
        mu, s = math.log(self.median), self.sigma

        def z(x: float, shift: float = 0.0) -> float:
            if x <= 0:
                return -math.inf
            return math.inf if math.isinf(x) else (math.log(x) - mu - shift) / s

        below = low * _normal_cdf(z(low)) if low > 0 else 0.0
        above = high * (1.0 - _normal_cdf(z(high))) if math.isfinite(high) else 0.0
        inside = math.exp(mu + s * s / 2) * (_normal_cdf(z(high, s * s)) - _normal_cdf(z(low, s * s)))
        return below + inside + above


# The defaults describe a tool-using agent on a Qwen3-30B-A3B-class MoE served 4 GPUs an engine on
# H100s: assumptions for a generic run, not measurements (the presets carry the calibrated setups).
_PROMPT_TOKENS = Distribution.lognormal(400, 0.5, maximum=2048)
_TURNS = Distribution.lognormal(2, 0.5, minimum=1, maximum=6)
_RESPONSE_TOKENS = Distribution.lognormal(500, 1.0, maximum=4096)
_TOOL_TOKENS = Distribution.lognormal(150, 1.0, maximum=1024)
_TOOL_LATENCY_S = Distribution.lognormal(0.5, 1.0, maximum=10)


@dataclass(frozen=True)
class WorkloadConfig:
    """What one episode asks of the engines and tools."""

    group_size: int = 8
    """G: trajectories per group (one prompt, G samples; group-relative advantages). >= 1."""
    prompt_tokens: Distribution = _PROMPT_TOKENS
    """Tokens of the prompt (system, tools, task), shared by a group."""
    turns: Distribution = _TURNS
    """Assistant turns per trajectory (rounded, at least 1); a tool call sits between two turns."""
    response_tokens: Distribution = _RESPONSE_TOKENS
    """Tokens generated per turn (rounded, at least 1); long-tailed, cut at max_new_tokens."""
    tool_tokens: Distribution = _TOOL_TOKENS
    """Tokens of a tool response (rounded, at least 1), prefilled before the next turn."""
    tool_latency_s: Distribution = _TOOL_LATENCY_S
    """Seconds a tool call takes (sandboxed code, a search request), long-tailed."""

    def __post_init__(self) -> None:
        _check_int("workload.group_size", self.group_size, 1)
        for name in ("prompt_tokens", "turns", "response_tokens", "tool_tokens", "tool_latency_s"):
            if not isinstance(getattr(self, name), Distribution):
                raise ValueError(f"workload.{name} must be a Distribution")
        for name in ("prompt_tokens", "turns", "response_tokens", "tool_tokens"):
            if math.isinf(getattr(self, name).upper):
                raise ValueError(f"workload.{name} needs a finite maximum (a cap the engine enforces)")

    @property
    def max_context(self) -> int:
        """The longest context an episode can reach, in tokens."""
        turns = max(1, round(self.turns.upper))
        return (
            max(1, round(self.prompt_tokens.upper))
            + turns * max(1, round(self.response_tokens.upper))
            + (turns - 1) * max(1, round(self.tool_tokens.upper))
        )


@dataclass(frozen=True)
class InferenceConfig:
    """The decode-throughput model of one engine replica (see the module docstring)."""

    gpus_per_engine: int = 4
    """GPUs serving one engine (tensor parallelism); engines = inference GPUs // this. >= 1."""
    step_base_s: float = 0.008
    """Seconds of a decode step at one row and an empty cache: reading the weights once plus launch
    overhead. > 0."""
    step_per_row_s: float = 2.0e-5
    """Seconds added per running sequence (its per-token compute). >= 0."""
    step_per_kv_token_s: float = 7.3e-9
    """Seconds added per cached token of the running sequences (attention reads the cache). >= 0."""
    prefill_tokens_per_s: float = 60_000.0
    """Prefill throughput in tokens/s; decoding stalls while admitted tokens are prefilled. inf: free."""
    kv_capacity_tokens: int = 2_000_000
    """Tokens the KV cache holds; must fit the longest possible context. >= 1."""
    max_running: int = 256
    """Sequences decoding at once (SGLang's max_running_requests). >= 1."""
    admit_kv_fraction: float = 0.9
    """A queued request is admitted only while the cache (with its context) stays under this share
    of capacity; the rest is headroom for growth before a retraction. In (0, 1]."""

    def __post_init__(self) -> None:
        _check_int("inference.gpus_per_engine", self.gpus_per_engine, 1)
        _check_float("inference.step_base_s", self.step_base_s, 0.0, strict=True)
        _check_float("inference.step_per_row_s", self.step_per_row_s, 0.0)
        _check_float("inference.step_per_kv_token_s", self.step_per_kv_token_s, 0.0)
        _check_float("inference.prefill_tokens_per_s", self.prefill_tokens_per_s, 0.0, strict=True, inf=True)
        _check_int("inference.kv_capacity_tokens", self.kv_capacity_tokens, 1)
        _check_int("inference.max_running", self.max_running, 1)
        if not 0.0 < _check_float("inference.admit_kv_fraction", self.admit_kv_fraction, 0.0) <= 1.0:
            raise ValueError(f"inference.admit_kv_fraction must be in (0, 1], got {self.admit_kv_fraction}")

    def step_time(self, rows: float, kv_tokens: float) -> float:
        """τ: seconds of one decode step with `rows` running sequences holding `kv_tokens`."""
        return self.step_base_s + self.step_per_row_s * rows + self.step_per_kv_token_s * kv_tokens


@dataclass(frozen=True)
class TrainerConfig:
    """The step-time model of the trainer (see the module docstring)."""

    tokens_per_gpu_s: float = 6_000.0
    """Training throughput of one GPU in tokens/s (forward + backward of packed sequences). > 0."""
    step_fixed_s: float = 3.0
    """Seconds per step that do not scale with tokens (optimizer step, all-reduce, bookkeeping). >= 0."""
    forward_share: float = 1.0 / 3.0
    """A forward pass's cost as a share of forward + backward (≈ 1/3 by FLOPs). In [0, 1]."""
    recompute_async: bool = True
    """Async steps run an extra forward (AReaL's proximal log-probs, PACE's drift re-scoring)."""
    recompute_sync: bool = False
    """Sync steps run an extra forward (e.g. verl's old_log_prob pass)."""
    colocated_efficiency: float = 1.0
    """Colocated sync only: per-GPU training throughput relative to a dedicated trainer (offloading,
    resharding and a wider data-parallel group cost throughput). In (0, 1]."""

    def __post_init__(self) -> None:
        _check_float("trainer.tokens_per_gpu_s", self.tokens_per_gpu_s, 0.0, strict=True)
        _check_float("trainer.step_fixed_s", self.step_fixed_s, 0.0)
        if not 0.0 <= _check_float("trainer.forward_share", self.forward_share, 0.0) <= 1.0:
            raise ValueError(f"trainer.forward_share must be in [0, 1], got {self.forward_share}")
        if not 0.0 < _check_float("trainer.colocated_efficiency", self.colocated_efficiency, 0.0) <= 1.0:
            raise ValueError(
                f"trainer.colocated_efficiency must be in (0, 1], got {self.colocated_efficiency}"
            )
        for name in ("recompute_async", "recompute_sync"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"trainer.{name} must be true or false")

    def step_time(self, tokens: int, gpus: int, *, recompute: bool, efficiency: float = 1.0) -> float:
        """Seconds of one step over `tokens` on `gpus` GPUs."""
        factor = 1.0 + (self.forward_share if recompute else 0.0)
        return self.step_fixed_s + tokens * factor / (gpus * self.tokens_per_gpu_s * efficiency)


def _default_filter() -> FilterConfig:
    # PACE's target: one batch waiting; in flight: eight batches, enough rows to keep the engines busy
    return FilterConfig(name="pace", target_groups=32, max_concurrent_groups=256)


@dataclass(frozen=True)
class SimConfig:
    """One simulation: the cluster, the workload, the models and the loop's knobs."""

    inference_gpus: int = 96
    """GPUs running inference engines (async and split sync). >= gpus_per_engine."""
    trainer_gpus: int = 32
    """GPUs training (async and split sync). >= 1."""
    steps: int = 1000
    """Trainer steps (updates) to simulate in async mode. >= 1."""
    sync_steps: int | None = None
    """Steps of the synchronous baseline; None: min(steps, 100). Every sync round starts from idle
    engines with fresh samples, so rounds are independent and fewer steps estimate the same mean."""
    batch_groups: int = 32
    """B: groups per training batch. >= 1."""
    sync_interval: int = 1
    """S: weights are published every S updates (sync: a round generates S·B groups). >= 1."""
    filter: FilterConfig = field(default_factory=_default_filter)
    """The pool's staleness filter and its knobs (`trainer.pool.FilterConfig`), including
    `max_concurrent_groups`, the producer's in-flight cap."""
    seed: int = 0
    """Seed of every sample (lengths, latencies, drift sensitivities). >= 0."""
    weight_sync_s: float = 3.0
    """Seconds to publish weights from the trainer to the engines (async and split sync). >= 0."""
    colocated_switch_s: float = 10.0
    """Colocated sync: seconds per round to switch the GPUs between generating and training (offload,
    reload, reshard, load the weights into the engine). >= 0."""
    interrupt: Interrupt = "reprefill"
    """What an engine does with running sequences on a weight update: `reprefill` (AReaL: recompute
    their caches) or `continue` (PipelineRL: keep the stale caches)."""
    sync_baseline: SyncBaseline = "colocated"
    """The synchronous baseline's hardware use: `colocated` or `split` (see the module docstring)."""
    token_block: int | None = None
    """Real tokens per record token (see the module docstring). >= 1; None: a mean turn of about 8
    record tokens (1 for turns that short), which keeps building records cheap."""
    pool_cap_groups: int | None = None
    """The simulator stops starting groups while this many wait in the pool (None: 16·B). The real loop
    has no such cap; it only keeps an unfiltered run whose generation outpaces training bounded in
    memory, and the time it holds the producer back is reported (`pool_cap_held_s`)."""
    drift_sigma: float = 1.0
    """Spread (log-space std) of the per-trajectory drift sensitivity of the PACE drift model. >= 0."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """Episode shape: group size, lengths, turns, tools."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """Decode-throughput model of one engine."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Step-time model of the trainer."""

    def __post_init__(self) -> None:
        _check_int("inference_gpus", self.inference_gpus, 1)
        _check_int("trainer_gpus", self.trainer_gpus, 1)
        _check_int("steps", self.steps, 1)
        if self.sync_steps is not None:
            _check_int("sync_steps", self.sync_steps, 1)
        _check_int("batch_groups", self.batch_groups, 1)
        _check_int("sync_interval", self.sync_interval, 1)
        _check_int("seed", self.seed, 0)
        if self.token_block is not None:
            _check_int("token_block", self.token_block, 1)
        if self.pool_cap_groups is not None:
            _check_int("pool_cap_groups", self.pool_cap_groups, self.batch_groups)
        _check_float("weight_sync_s", self.weight_sync_s, 0.0)
        _check_float("colocated_switch_s", self.colocated_switch_s, 0.0)
        _check_float("drift_sigma", self.drift_sigma, 0.0)
        if self.interrupt not in ("reprefill", "continue"):
            raise ValueError(f"interrupt must be reprefill or continue, got {self.interrupt!r}")
        if self.sync_baseline not in ("colocated", "split"):
            raise ValueError(f"sync_baseline must be colocated or split, got {self.sync_baseline!r}")
        for name, kind in (
            ("filter", FilterConfig),
            ("workload", WorkloadConfig),
            ("inference", InferenceConfig),
            ("trainer", TrainerConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}")
        if self.inference_gpus < self.inference.gpus_per_engine:
            raise ValueError(
                f"inference_gpus ({self.inference_gpus}) must be at least inference.gpus_per_engine "
                f"({self.inference.gpus_per_engine})"
            )
        if self.workload.max_context > self.inference.kv_capacity_tokens:
            raise ValueError(
                f"inference.kv_capacity_tokens ({self.inference.kv_capacity_tokens}) must hold the longest "
                f"possible context ({self.workload.max_context} tokens of prompt, turns and tool responses)"
            )

    @property
    def engines(self) -> int:
        """Engine replicas of the async (and split sync) setup."""
        return self.inference_gpus // self.inference.gpus_per_engine

    @property
    def baseline_steps(self) -> int:
        """The effective `sync_steps`."""
        return min(self.steps, 100) if self.sync_steps is None else self.sync_steps

    @property
    def block(self) -> int:
        """The effective `token_block`."""
        if self.token_block is not None:
            return self.token_block
        return max(1, math.floor(self.workload.response_tokens.mean() / 8))

    @property
    def pool_cap(self) -> int:
        """The effective `pool_cap_groups`."""
        return 16 * self.batch_groups if self.pool_cap_groups is None else self.pool_cap_groups


def config_to_dict(config: Any) -> Any:
    """A config tree as plain JSON types (inf becomes the string "inf")."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: config_to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, tuple | list):
        return [config_to_dict(v) for v in config]
    if isinstance(config, float) and math.isinf(config):
        return "inf"
    return config


def config_from_dict(base: Any, data: Mapping[str, Any], prefix: str = "") -> Any:
    """`base` (a config dataclass) with the settings of `data` applied: nested sections by their field
    name, a section given in part keeps the rest of `base`; lists become tuples and the string "inf" a
    float. Unknown keys and invalid values raise ValueError naming the key."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a table of settings")
    known = {f.name: f for f in dataclasses.fields(base)}
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"unknown setting {prefix}{key} (known here: {', '.join(sorted(known))})")
        current = getattr(base, key)
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            changes[key] = config_from_dict(current, value, f"{prefix}{key}.")
        elif isinstance(value, list):
            changes[key] = tuple(value)
        elif value == "inf":
            changes[key] = math.inf
        else:
            changes[key] = value
    try:
        return dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{prefix}{error}" if prefix and not str(error).startswith(prefix) else str(error)
        ) from None


# -- presets -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishedFigure:
    """An async-vs-sync measurement a preset is checked against."""

    speedup: float
    """The published speed-up of async over sync on the same GPUs (wall time for the same steps)."""
    sync_step_s: float
    """Published seconds per trainer step of the synchronous run (a preset step: B groups)."""
    async_step_s: float
    """Published seconds per trainer step of the asynchronous run."""
    source: str
    """Where the figures are published."""


@dataclass(frozen=True)
class Preset:
    """A named setup: the config, what it reproduces, and which numbers are published vs assumed."""

    config: SimConfig
    """The simulation config."""
    description: str
    """One line."""
    published: PublishedFigure | None
    """The figure it is checked against (None: a calibration of this project's own measurements)."""
    sources: tuple[str, ...]
    """Each parameter's provenance: `from the paper/docs`, `derived`, `assumed` or `fitted`."""


def _areal() -> Preset:
    # AReaL v0.3 (blog/AReaL_v0_3.md, Table 2; arXiv 2505.24298): R1-Distill-Qwen-1.5B on math, 16 nodes
    # of 8 H800, 1000 PPO steps: sync 41.0 h, async 14.8 h (2.77×). 3/4 of the GPUs infer.
    workload = WorkloadConfig(
        group_size=16,
        prompt_tokens=Distribution.lognormal(200, 0.5, maximum=1024),
        turns=Distribution.constant(1),
        response_tokens=Distribution.lognormal(4000, 1.0, maximum=27648),
        tool_tokens=Distribution.constant(1),
        tool_latency_s=Distribution.constant(0.0),
    )
    inference = InferenceConfig(
        gpus_per_engine=1,
        step_base_s=0.003,
        step_per_row_s=8e-6,
        step_per_kv_token_s=8.6e-9,
        prefill_tokens_per_s=100_000.0,
        kv_capacity_tokens=1_900_000,
        max_running=256,
    )
    trainer = TrainerConfig(tokens_per_gpu_s=40_000.0, step_fixed_s=3.0, recompute_async=True)
    config = SimConfig(
        inference_gpus=96,
        trainer_gpus=32,
        steps=100,
        sync_steps=20,
        batch_groups=512,
        sync_interval=1,
        filter=FilterConfig(name="admission", max_offpolicyness=4, max_concurrent_groups=2560),
        weight_sync_s=3.0,
        colocated_switch_s=10.0,
        interrupt="reprefill",
        sync_baseline="colocated",
        token_block=256,
        workload=workload,
        inference=inference,
        trainer=trainer,
    )
    return Preset(
        config=config,
        description="AReaL v0.3: R1-Distill-Qwen-1.5B math RL, 128 H800 (96 inference + 32 trainer), η = 4",
        published=PublishedFigure(
            speedup=2.77,
            sync_step_s=41.0 * 3600 / 1000,
            async_step_s=14.8 * 3600 / 1000,
            source="AReaL v0.3 blog, Table 2 (arXiv 2505.24298): 1000 PPO steps, 41.0 h sync, 14.8 h async",
        ),
        sources=(
            "paper/docs: 128 H800 GPUs (16 nodes), 1.5B model, 512 prompts × 16 samples per step, η = 4 "
            "(max_head_offpolicyness of the async math configs), interruptible generation (reprefill), a "
            "publication every step, max_new_tokens 27,648, 3/4 of the GPUs for inference, a sync "
            "baseline that generates and trains on all GPUs in turn",
            "derived from H800 specs (3.35 TB/s, 989 TFLOP/s bf16) and Qwen2-1.5B's shape (28 layers, 2 KV "
            "heads × 128, 28.7 KB of KV per token): per-row and per-KV-token decode costs, KV capacity",
            "assumed: 3 ms decode-step floor, prefill 100k tok/s, weight sync 3 s, colocated switch 10 s, "
            "trainer 40k tok/s/GPU (≈ 55% of peak with the recompute forward: optimistic, AReaL packs "
            "sequences)",
            "fitted: response lengths lognormal (median 4,000, σ 1.0, cut at 27,648: mean ≈ 6,100), the "
            "median chosen so the simulated sync step lands on the published 147.6 s; the async step and "
            "the speed-up are predictions",
        ),
    )


def _verl() -> Preset:
    # verl fully_async_policy (docs/advance/fully_async.md): Qwen2.5-Math-7B, DAPO, H20 GPUs, 128 GPUs:
    # colocate sync 356.30 s/step (gen 177.85, old_log_prob 53.92, update_actor 113.81) vs fully async
    # 64:64 150.63 s/step; 2.35× over 400 steps (2.67× over the first 100).
    workload = WorkloadConfig(
        group_size=16,
        prompt_tokens=Distribution.lognormal(150, 0.4, maximum=1024),
        turns=Distribution.constant(1),
        response_tokens=Distribution.lognormal(700, 1.2, maximum=28672),
        tool_tokens=Distribution.constant(1),
        tool_latency_s=Distribution.constant(0.0),
    )
    inference = InferenceConfig(
        gpus_per_engine=1,
        step_base_s=0.005,
        step_per_row_s=2.0e-4,
        step_per_kv_token_s=1.43e-8,
        prefill_tokens_per_s=6_000.0,
        kv_capacity_tokens=1_060_000,
        max_running=256,
    )
    trainer = TrainerConfig(
        tokens_per_gpu_s=1_450.0,
        step_fixed_s=2.0,
        recompute_async=False,
        recompute_sync=True,
        colocated_efficiency=0.55,
    )
    config = SimConfig(
        inference_gpus=64,
        trainer_gpus=64,
        steps=160,
        sync_steps=40,
        batch_groups=128,
        sync_interval=4,
        filter=FilterConfig(name="admission", max_offpolicyness=2, max_concurrent_groups=1024),
        weight_sync_s=5.0,
        colocated_switch_s=10.7,
        interrupt="reprefill",
        sync_baseline="colocated",
        token_block=128,
        workload=workload,
        inference=inference,
        trainer=trainer,
    )
    return Preset(
        config=config,
        description="verl fully_async: Qwen2.5-Math-7B DAPO, 128 H20 (64 rollout + 64 trainer), partial "
        "rollout",
        published=PublishedFigure(
            speedup=2.35,
            sync_step_s=356.30 / 4,
            async_step_s=150.63 / 4,
            source="verl docs/advance/fully_async.md, 128-GPU 7B table: 356.30 s vs 150.63 s per "
            "512-prompt step (4 updates here), 2.35× over 400 steps (2.67× over the first 100)",
        ),
        sources=(
            "paper/docs: 128 H20 GPUs split 64:64 vs 128 colocated, 512 prompts × 16 per verl step = 4 "
            "updates of 128 prompts (require_batches 4 × ppo_mini_batch_size 32, "
            "trigger_parameter_sync_step 4), staleness_threshold 0.5, partial rollout, max response 28k, "
            "rollout log-probs in async (no old_log_prob pass) and an old_log_prob pass in sync, ≈ 10.7 s "
            "of other per-step time in sync",
            "derived: staleness_threshold 0.5 × 512 prompts = 256 extra groups = η 2 batches of 128 in "
            "AReaL's capacity; decode costs and KV capacity from H20 specs (4.0 TB/s, 148 TFLOP/s) and "
            "Qwen2.5-7B's shape (57 KB of KV per token); prefill ≈ 6k tok/s at 60% of peak",
            "assumed: response lengths lognormal (median 700, σ 1.2, cut at 28,672: mean ≈ 1,400), weight "
            "sync 5 s, trainer 1,450 tok/s/GPU (≈ 45% of peak)",
            "fitted to verl's sync row: the decode-step floor (5 ms: 3.8 ms of weight reads plus launch "
            "overhead) to its 178 s generation phase, colocated_efficiency 0.55 to its 168 s of log-prob "
            "and update passes (its 128 colocated GPUs train at about half the per-GPU rate of the 64 "
            "dedicated ones); the async step and the speed-up are predictions",
        ),
    )


def _pacerl_cpu() -> Preset:
    # This project's own measurements on a 2-core machine (README benchmarks): CodeMath episodes at
    # 20-23 episodes/s with the local sandbox, the tiny MoE engine at ~700 tok/s with 32 rows, about 25
    # generated tokens per episode over 2 turns, a train step of ~0.3 s per 128 episodes, tool call ~15 ms.
    workload = WorkloadConfig(
        group_size=8,
        prompt_tokens=Distribution.lognormal(60, 0.3, maximum=256),
        turns=Distribution.constant(2),
        response_tokens=Distribution.lognormal(11, 0.6, maximum=48),
        tool_tokens=Distribution.lognormal(12, 0.5, maximum=64),
        tool_latency_s=Distribution.lognormal(0.015, 0.5, maximum=2.0),
    )
    inference = InferenceConfig(
        gpus_per_engine=1,
        step_base_s=0.005,
        step_per_row_s=0.0013,
        step_per_kv_token_s=0.0,
        prefill_tokens_per_s=18_000.0,
        kv_capacity_tokens=65_536,
        max_running=32,
    )
    trainer = TrainerConfig(tokens_per_gpu_s=45_000.0, step_fixed_s=0.05, recompute_async=False)
    config = SimConfig(
        inference_gpus=1,
        trainer_gpus=1,
        steps=200,
        batch_groups=16,
        sync_interval=1,
        filter=FilterConfig(name="pace", target_groups=16, max_concurrent_groups=8),
        weight_sync_s=0.004,
        colocated_switch_s=0.0,
        interrupt="reprefill",
        sync_baseline="split",
        token_block=1,
        workload=workload,
        inference=inference,
        trainer=trainer,
    )
    return Preset(
        config=config,
        description="pacerl on a 2-core CPU: the tiny MoE engine on one core, the learner on the other",
        published=None,
        sources=(
            "measured (README benchmarks): engine 695 tok/s with 32 rows → 46 ms per 32-row step (5 ms "
            "floor + 1.3 ms per row); reprefill of 32 in-flight requests 177 ms (≈ 18k tok/s prefill); "
            "in-place weight update 3.7 ms; ~25 generated tokens per episode over 2 turns; tool call ~15 ms; "
            "a train step ≈ 0.3 s per 128 episodes; 20-25 episodes/s end to end with the sandbox",
            "assumed: prompt ≈ 60 tokens, tool responses ≈ 12 tokens, one core each for engine and learner "
            "(split: the sync baseline alternates them)",
        ),
    )


PRESETS: dict[str, Callable[[], Preset]] = {"areal": _areal, "verl": _verl, "pacerl-cpu": _pacerl_cpu}
"""The named setups of `pacerl simulate --preset`."""


# -- results -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StalenessStats:
    """Token-weighted staleness of the trained trajectories (ALGORITHMS.md §6), from their records."""

    model_tokens: int
    """Model tokens (record tokens) counted."""
    mean_gs: float
    """Mean Generation Staleness v_done − v_t."""
    mean_ws: float
    """Mean Waiting Staleness v_now − v_done."""
    max_staleness: int
    """The oldest token trained: max v_now − v_t."""
    gs_hist: tuple[int, ...]
    """Tokens per GS of 0..8 (the last bin 8 and above)."""
    ws_hist: tuple[int, ...]
    """Tokens per WS of 0..8 (the last bin 8 and above)."""


@dataclass(frozen=True)
class ModeResult:
    """One simulated run (async, or the synchronous baseline)."""

    mode: Mode
    """`async` or `sync`."""
    steps: int
    """Trainer steps simulated."""
    simulated_s: float
    """Simulated seconds until the last step ended."""
    trained_trajectories: int
    """Trajectories trained on."""
    trained_tokens: int
    """Real tokens (prompt, model, tool) of the trained trajectories."""
    trajectories_per_s: float
    """Trained trajectories per simulated second, whole run."""
    steady_trajectories_per_s: float
    """The same over the second half of the steps (without the start-up transient)."""
    step_time_s: float
    """Mean seconds per trainer step, whole run."""
    step_time_p90_s: float
    """90th percentile of the seconds between two step ends."""
    generated_tokens: int
    """Real tokens the engines decoded (trained, rejected, or still in flight at the end)."""
    wasted_tokens: int
    """Generated tokens of rejected groups."""
    inference_utilization: float
    """Share of engine time spent decoding or prefilling (not idle, not paused for weight syncs)."""
    trainer_utilization: float
    """Share of the trainer's time spent in training steps."""
    gpu_utilization: float
    """Busy GPU-seconds over all GPU-seconds."""
    mean_running_rows: float
    """Mean sequences in an engine's batch while it is decoding."""
    staleness: StalenessStats
    """Staleness of the trained tokens."""
    rejected_groups: dict[str, int]
    """Groups the filter rejected, by reason (`max_age`, `pace_budget`)."""
    rejected_trajectories: int
    """Trajectories in those groups."""
    interruptions: int
    """Generations cut by a weight update (each resumes as a new segment)."""
    retractions: int
    """Sequences retracted from a full KV cache."""
    model_segments_per_trajectory: float
    """Mean model segments per trained trajectory."""
    max_outstanding_groups: int
    """Most groups in flight plus pooled at any time."""
    pool_cap_held_s: float
    """Simulated seconds `pool_cap_groups` held the producer back (0: the cap never mattered)."""
    step_end_s: tuple[float, ...]
    """When each step ended (simulated seconds)."""
    step_trajectories: tuple[int, ...]
    """Trajectories each step trained on."""
    step_pool_groups: tuple[int, ...]
    """Groups waiting in the pool when each step drew its batch (PACE's occupancy P_t)."""
    step_mean_gs: tuple[float, ...]
    """Token-mean GS of each step's batch."""
    step_mean_ws: tuple[float, ...]
    """Token-mean WS of each step's batch."""

    def summary(self) -> dict[str, Any]:
        """The scalars and histograms, without the per-step series."""
        data = config_to_dict(self)
        for key in ("step_end_s", "step_trajectories", "step_pool_groups", "step_mean_gs", "step_mean_ws"):
            data.pop(key)
        return dict(data)


@dataclass(frozen=True)
class Bounds:
    """Steady-state capacities from the means: upper bounds (no length tails, no waiting for a group's
    last member, no interrupts), exact for constant lengths on saturated engines without KV limits."""

    generation_trajectories_per_s: float
    """What the async engines can produce, saturated."""
    training_trajectories_per_s: float
    """What the async trainer can consume, weight syncs included."""

    @property
    def pipeline_trajectories_per_s(self) -> float:
        """min(generation, training): the async pipeline's capacity."""
        return min(self.generation_trajectories_per_s, self.training_trajectories_per_s)


@dataclass(frozen=True)
class SimResult:
    """The async run, the synchronous baseline on the same GPUs, and their ratio."""

    config: SimConfig
    """What was simulated."""
    async_run: ModeResult
    """The asynchronous pipeline."""
    sync_run: ModeResult
    """The synchronous baseline."""
    bounds: Bounds
    """Rough capacities of the async setup."""
    wall_s: float
    """Seconds the simulation took on this machine (the one figure that is not simulated)."""

    @property
    def speedup(self) -> float:
        """Async over sync trained trajectories per second, whole runs."""
        return self.async_run.trajectories_per_s / self.sync_run.trajectories_per_s

    @property
    def steady_speedup(self) -> float:
        """The same over the second half of each run."""
        return self.async_run.steady_trajectories_per_s / self.sync_run.steady_trajectories_per_s

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: the config, both runs with their per-step series, bounds, speed-ups, wall time."""
        return {
            "config": config_to_dict(self.config),
            "async": config_to_dict(self.async_run),
            "sync": config_to_dict(self.sync_run),
            "bounds": {
                **config_to_dict(self.bounds),
                "pipeline_trajectories_per_s": self.bounds.pipeline_trajectories_per_s,
            },
            "speedup": self.speedup,
            "steady_speedup": self.steady_speedup,
            "wall_s": self.wall_s,
        }


def bounds(config: SimConfig) -> Bounds:
    """`Bounds` of the async setup. Generation: the lesser of saturated engines (rows as many as
    `max_running`, the KV cache and the in-flight cap allow; each token costs a step's per-row share,
    each trajectory its prefill) and Little's law (trajectories in flight over one trajectory's latency:
    its turns decoded at that step time plus its tool calls). Training: the mean tokens of a batch, with
    one weight sync every S steps."""
    workload, inference = config.workload, config.inference
    turns = max(1.0, workload.turns.mean())
    generated = turns * max(1.0, workload.response_tokens.mean())
    tool = (turns - 1.0) * max(1.0, workload.tool_tokens.mean())
    prompt = max(1.0, workload.prompt_tokens.mean())
    mean_context = prompt + tool / 2 + generated / 2  # time-average over a decode
    in_flight = config.filter.max_concurrent_groups * workload.group_size
    if config.filter.name == "admission":
        in_flight = min(
            in_flight, (config.filter.max_offpolicyness + 1) * config.batch_groups * workload.group_size
        )
    kv_rows = inference.admit_kv_fraction * inference.kv_capacity_tokens / mean_context
    rows = max(1.0, min(float(inference.max_running), kv_rows, in_flight / config.engines))
    step = inference.step_time(rows, rows * mean_context)
    prefill = (prompt + tool) / inference.prefill_tokens_per_s
    saturated = config.engines / (generated * step / rows + prefill)
    latency = generated * step + prefill * rows + (turns - 1.0) * workload.tool_latency_s.mean()
    trajectories = config.batch_groups * workload.group_size
    tokens = round(trajectories * (prompt + tool + generated))
    train = config.trainer.step_time(tokens, config.trainer_gpus, recompute=config.trainer.recompute_async)
    return Bounds(
        generation_trajectories_per_s=min(saturated, in_flight / latency),
        training_trajectories_per_s=trajectories / (train + config.weight_sync_s / config.sync_interval),
    )


# -- the simulator -----------------------------------------------------------------------------------

_ENGINE, _TOOL, _TRAINED, _PUBLISHED = 0, 1, 2, 3


class _Stream:
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


class _Episode:
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

    def __init__(self, uid: int, group: _Group, index: int, engine: int) -> None:
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


class _Group:
    __slots__ = ("generated", "id", "members", "pending", "prompt", "tokens")

    def __init__(self, group_id: str, prompt: int) -> None:
        self.id, self.prompt = group_id, prompt
        self.members: list[_Episode] = []
        self.pending = 0
        self.tokens = 0  # exact tokens of all members (prompt, model, tool), for the training step
        self.generated = 0  # exact generated tokens


class _Engine:
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
        self.running: dict[int, _Episode] = {}  # admission order: the last is the newest
        self.finishing: list[tuple[float, int, int]] = []  # heap of (finish step, uid, run)
        self.queue: deque[_Episode] = deque()
        self.epoch = 0  # invalidates scheduled events after a change
        self.version = 0
        self.busy_s = 0.0
        self.paused_s = 0.0
        self.row_s = 0.0  # ∫ rows dt while decoding
        self.tokens = 0.0


@dataclass
class _Stats:
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


class _Simulation:
    """One mode's event loop. The async loop follows `trainer/loop.py`'s `train_async`; the sync loop
    its `train_sync`, generating S·B groups a round (see the module docstring)."""

    def __init__(self, config: SimConfig, mode: Mode, on_batch: BatchObserver | None = None) -> None:
        self.config, self.mode, self.on_batch = config, mode, on_batch
        self.workload, self.inference = config.workload, config.inference
        colocated = mode == "sync" and config.sync_baseline == "colocated"
        gpus = config.inference_gpus + config.trainer_gpus if colocated else config.inference_gpus
        self.train_gpus = config.inference_gpus + config.trainer_gpus if colocated else config.trainer_gpus
        self.colocated = colocated
        self.engines = [_Engine(i) for i in range(gpus // self.inference.gpus_per_engine)]
        self.filter = config.filter if mode == "async" else FilterConfig(name="none")
        self.pool = TrajectoryPool(self.filter, max_rejected_ids=0)
        self.steps = config.steps if mode == "async" else config.baseline_steps
        streams = np.random.SeedSequence([config.seed, 0 if mode == "async" else 1]).spawn(5)
        w = self.workload
        self.prompts, self.turns, self.responses, self.tool_tokens, self.tool_latency = (
            _Stream(d, np.random.default_rng(s), integer=integer)
            for d, s, integer in zip(
                (w.prompt_tokens, w.turns, w.response_tokens, w.tool_tokens, w.tool_latency_s),
                streams,
                (True, True, True, True, False),
                strict=True,
            )
        )
        # the decode model's constants, read on every event
        self.base_s, self.row_s, self.kv_s = (
            self.inference.step_base_s,
            self.inference.step_per_row_s,
            self.inference.step_per_kv_token_s,
        )
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any]] = []
        self.sequence = 0
        self.version = 0
        self.trainer_busy = False
        self.running_groups: dict[str, _Group] = {}
        self.pooled: dict[str, _Group] = {}
        self.next_group = 0
        self.next_uid = 0
        self.round_robin = 0
        self.round_open = False  # sync: a round's groups are being generated or trained on
        self.held_since: float | None = None  # when the pool cap began holding the producer back
        self.finished = False
        self.stats = _Stats()
        self.block = config.block
        self._templates: dict[int, Segment] = {}
        self._tool_segments: dict[int, Segment] = {}
        self._normal = statistics.NormalDist()

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> ModeResult:
        self.try_launch()
        while not self.finished:
            if not self.events:
                raise RuntimeError(
                    f"{self.mode} simulation stalled at step {self.stats.steps} of {self.steps}: nothing in "
                    f"flight and no batch to draw (pool {len(self.pool)} groups)"
                )
            when, _, kind, payload = heapq.heappop(self.events)
            self.now = when
            if kind == _ENGINE:
                self.engine_event(*payload)
            elif kind == _TOOL:
                self.tool_returned(payload)
            elif kind == _TRAINED:
                self.trained()
            else:
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
            room = self.pool.admission(self.stats.steps, len(self.running_groups), config.batch_groups)
            if room and len(self.pool) >= config.pool_cap:
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
        group = _Group(f"g{self.next_group:07d}", self.prompts.take(1)[0])
        self.next_group += 1
        engines = self.engines
        for index, turns in enumerate(self.turns.take(size)):
            engine = self.round_robin
            self.round_robin = (engine + 1) % len(engines)
            episode = _Episode(self.next_uid, group, index, engine)
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

    # -- engines -------------------------------------------------------------------------------------

    def advance(self, engine: _Engine, until: float) -> None:
        """Decode from engine.t to `until` (nothing while it is stalled past `until`)."""
        dt = until - engine.t
        if dt <= 0:
            return
        rows = engine.rows
        if rows:
            alpha = self.base_s + self.row_s * rows + self.kv_s * engine.kv
            beta = self.kv_s * rows
            steps = dt / alpha if beta == 0 else 2 * dt / (alpha + math.sqrt(alpha * alpha + 2 * beta * dt))
            engine.s += steps
            engine.kv += rows * steps
            engine.tokens += rows * steps
            engine.busy_s += dt
            engine.row_s += rows * dt
        engine.t = until

    def admit(self, engine: _Engine) -> None:
        """Move queued requests into the running batch while rows and KV allow; their prefill stalls
        decoding. Called with the engine advanced to now."""
        inference = self.inference
        limit = inference.admit_kv_fraction * inference.kv_capacity_tokens
        prefill = 0
        opened: list[_Episode] = []
        while engine.queue and engine.rows < inference.max_running:
            episode = engine.queue[0]
            context = episode.base_context + episode.done
            if engine.rows and engine.kv + context > limit:
                break
            engine.queue.popleft()
            valid = episode.cache_version == engine.version or self.config.interrupt == "continue"
            prefill += context - (episode.cached if valid else 0)
            episode.run += 1
            episode.finish_s = engine.s + episode.remaining
            engine.running[episode.uid] = episode
            heapq.heappush(engine.finishing, (episode.finish_s, episode.uid, episode.run))
            engine.rows += 1
            engine.kv += context
            opened.append(episode)
        if not opened:
            return
        stall = prefill / inference.prefill_tokens_per_s
        engine.t = max(engine.t, self.now) + stall
        engine.busy_s += stall
        for episode in opened:
            episode.cached, episode.cache_version = episode.base_context + episode.done, engine.version
            episode.seg_version, episode.seg_t0, episode.seg_done = engine.version, engine.t, episode.done

    def schedule(self, engine: _Engine) -> None:
        """Schedule the engine's next own event: a turn ending, or the cache overflowing."""
        engine.epoch += 1
        if not engine.rows:
            return
        finishing = engine.finishing
        while finishing:
            _, uid, run = finishing[0]
            episode = engine.running.get(uid)
            if episode is not None and episode.run == run:
                break
            heapq.heappop(finishing)
        if not finishing:
            raise RuntimeError(f"engine {engine.index} lost track of its {engine.rows} running sequences")
        rows, s_now, kv = engine.rows, engine.s, engine.kv
        target = max(finishing[0][0], s_now)
        overflow = False
        if rows > 1:
            room = (self.inference.kv_capacity_tokens - kv) / rows
            if s_now + room < target:
                target, overflow = s_now + max(room, 0.0), True
        steps = target - s_now
        alpha = self.base_s + self.row_s * rows + self.kv_s * kv
        when = engine.t + alpha * steps + self.kv_s * rows * steps * steps / 2
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, _ENGINE, (engine, engine.epoch, target, overflow)))

    def engine_event(self, engine: _Engine, epoch: int, target: float, overflow: bool) -> None:
        if epoch != engine.epoch:
            return
        self.advance(engine, self.now)
        engine.kv += engine.rows * (target - engine.s)  # snap to the exact step (float rounding)
        engine.s = target
        if overflow:
            self.retract(engine, engine.running[next(reversed(engine.running))])
        finishing = engine.finishing
        ended: list[_Episode] = []
        while finishing and finishing[0][0] <= engine.s + _EPS:
            _, uid, run = heapq.heappop(finishing)
            episode = engine.running.get(uid)
            if episode is not None and episode.run == run:
                ended.append(episode)
        for episode in ended:
            self.end_turn(engine, episode)
        for episode in ended:
            self.after_turn(episode, engine.version)
        if not overflow:  # a retracted request must not walk straight back into the full cache
            self.admit(engine)
        self.schedule(engine)

    def remove(self, engine: _Engine, episode: _Episode) -> None:
        """Take a running episode out of the batch, with its exact (fractional) cache."""
        decoded = episode.responses[episode.turn] - (episode.finish_s - engine.s)
        del engine.running[episode.uid]
        engine.rows -= 1
        engine.kv = engine.kv - (episode.base_context + decoded) if engine.rows else 0.0

    def done_now(self, engine: _Engine, episode: _Episode) -> int:
        """Tokens of the running episode's turn decoded so far (whole tokens, the last one left out)."""
        turn = episode.responses[episode.turn]
        return min(max(round(turn - (episode.finish_s - engine.s)), episode.seg_done), turn - 1)

    def close_segment(self, episode: _Episode, done: int, ended_at: float, reason: str) -> None:
        tokens = done - episode.seg_done
        if tokens > 0:
            episode.parts.append(
                (Origin.MODEL, tokens, episode.seg_version, episode.seg_t0, ended_at, reason)
            )
        episode.seg_done = done

    def retract(self, engine: _Engine, episode: _Episode) -> None:
        done = self.done_now(engine, episode)
        self.close_segment(episode, done, self.now, "retracted")
        self.remove(engine, episode)
        episode.done, episode.remaining = done, episode.responses[episode.turn] - done
        episode.cached = 0
        engine.queue.appendleft(episode)
        self.stats.retractions += 1

    def end_turn(self, engine: _Engine, episode: _Episode) -> None:
        """Take a finished turn out of the batch (its follow-up comes from `after_turn`)."""
        turn = episode.responses[episode.turn]
        last = episode.turn == len(episode.responses) - 1
        self.close_segment(episode, turn, self.now, "stop" if last else "tool_call")
        self.remove(engine, episode)
        episode.cached, episode.cache_version = episode.base_context + turn, engine.version

    def after_turn(self, episode: _Episode, version: int) -> None:
        """Call the tool, or finish the episode (and its group: the records go to the pool). Runs after
        every turn ending at this instant has left its engine, because a finished group may start new
        groups on that same engine."""
        if episode.turn < len(episode.responses) - 1:
            self.push(self.now + episode.tool_latencies[episode.turn], _TOOL, episode)
            return
        group = episode.group
        group.pending -= 1
        if not group.pending:
            self.group_done(group, version)

    def tool_returned(self, episode: _Episode) -> None:
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

    def group_done(self, group: _Group, version: int) -> None:
        del self.running_groups[group.id]
        prompt = Segment(Origin.PROMPT, (0,) * self.blocks(group.prompt))
        records = [self.record(episode, prompt, version) for episode in group.members]
        group.members = []  # breaks the group ↔ episode cycles, so refcounting frees them (gc is paused)
        self.pool.add_group(records)
        self.pooled[group.id] = group
        self.try_launch()
        self.try_train()

    def blocks(self, tokens: int) -> int:
        return max(1, round(tokens / self.block)) if self.block > 1 else tokens

    def record(self, episode: _Episode, prompt: Segment, version: int) -> Trajectory:
        """The finished episode as a real Trajectory (synthetic token ids; see `token_block`); the
        group's members share one prompt segment and tool segments of one length are shared too
        (segments are immutable)."""
        group, block = episode.group, self.block
        segments = [prompt]
        tools = self._tool_segments
        for origin, tokens, seg_version, started, ended, reason in episode.parts:
            count = max(1, round(tokens / block)) if block > 1 else tokens
            if origin is Origin.TOOL:
                tool = tools.get(count)
                if tool is None:
                    tool = tools[count] = Segment(Origin.TOOL, (2,) * count)
                segments.append(tool)
            else:
                segments.append(self.model_segment(count, seg_version, started, ended, reason))
        return Trajectory(
            id=f"{group.id}-{episode.index}",
            group_id=group.id,
            task_id=group.id,
            segments=tuple(segments),
            status=Status.COMPLETED,
            status_reason="answered",
            reward=0.0,
            completed_version=version,
            completed_at=self.now,
        )

    def model_segment(self, count: int, version: int, started: float, ended: float, reason: str) -> Segment:
        """A model segment of `count` tokens: a copy of a validated template of that length with its own
        version, times and finish reason. Segment's constructor re-validates every token and log-prob,
        which made it the largest cost of a run; the copy keeps the validated tokens and checks the
        four fields it sets (the Trajectory built from it validates the whole record again)."""
        template = self._templates.get(count)
        if template is None:
            template = self._templates[count] = Segment(
                Origin.MODEL, (1,) * count, (-1.0,) * count, 0, 0.0, 0.0, "stop"
            )
        if not (version >= 0 and 0.0 <= started <= ended and reason):
            raise RuntimeError(f"invalid simulated segment: v{version} [{started}, {ended}] {reason!r}")
        segment = Segment.__new__(Segment)
        # frozen: the fields go straight into the instance dict, as the dataclass's __init__ puts them
        segment.__dict__.update(
            template.__dict__, version=version, started_at=started, ended_at=ended, finish_reason=reason
        )
        return segment

    def drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """The PACE drift model (module docstring): sensitivity × token-mean version gap at v_now."""
        scores = []
        for trajectory in trajectories:
            lag = tokens = 0
            for segment in trajectory.segments:
                if segment.version is not None:
                    lag += (self.version - segment.version) * len(segment.tokens)
                    tokens += len(segment.tokens)
            digest = zlib.crc32(f"{self.config.seed}:{trajectory.id}".encode())
            z = self._normal.inv_cdf((digest + 0.5) / 2**32)
            scores.append(math.exp(self.config.drift_sigma * z) * lag / tokens if tokens else 0.0)
        return scores

    # -- trainer -------------------------------------------------------------------------------------

    def try_train(self) -> None:
        """Draw and train when the trainer is free and a batch waits (`Run.next_batch`)."""
        config = self.config
        if self.trainer_busy or self.finished or len(self.pool) < config.batch_groups:
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
        self.account(batch)
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

    def account(self, batch: list[list[Trajectory]]) -> None:
        """Staleness of the batch at the trainer's version, token-weighted, from the records."""
        stats, v_now = self.stats, self.version
        gs_sum = ws_sum = tokens = 0
        for group in batch:
            for trajectory in group:
                v_done = trajectory.completed_version
                if v_done is None:
                    raise RuntimeError(f"{trajectory.id} was drawn unfinished")
                ws = v_now - v_done
                for segment in trajectory.segments:
                    version = segment.version
                    if version is None:
                        continue
                    count = len(segment.tokens)
                    gs = v_done - version
                    stats.gs_hist[min(gs, HIST_BINS - 1)] += count
                    gs_sum += gs * count
                    tokens += count
                    stats.max_staleness = max(stats.max_staleness, v_now - version)
                    stats.model_segments += 1
                model = sum(len(s.tokens) for s in trajectory.segments if s.version is not None)
                stats.ws_hist[min(ws, HIST_BINS - 1)] += model
                ws_sum += ws * model
        count = sum(len(group) for group in batch)
        stats.trained_trajectories += count
        stats.step_trajectories.append(count)
        stats.gs_sum += gs_sum
        stats.ws_sum += ws_sum
        stats.model_tokens += tokens
        stats.step_gs.append(gs_sum / tokens if tokens else 0.0)
        stats.step_ws.append(ws_sum / tokens if tokens else 0.0)

    def trained(self) -> None:
        """A step ended: the version moves; every S updates the weights are published."""
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
        if (self.mode == "async" and self.version % self.config.sync_interval == 0) or sync_round_over:
            self.publish()
            return
        self.trainer_busy = False
        self.try_launch()
        self.try_train()

    def publish(self) -> None:
        """Pause every engine for the weight sync, cut running generations into a segment of the old
        version, and resume them as a new segment of the new version (`Run.publish`)."""
        duration = self.config.colocated_switch_s if self.colocated else self.config.weight_sync_s
        reprefill = self.config.interrupt == "reprefill"
        now, version = self.now, self.version
        for engine in self.engines:
            self.advance(engine, now)
            stall = engine.kv / self.inference.prefill_tokens_per_s if reprefill and engine.rows else 0.0
            resume = max(engine.t, now) + duration + stall
            engine.paused_s += duration
            engine.busy_s += stall
            engine.t, engine.version = resume, version
            s_now = engine.s
            for episode in engine.running.values():  # close_segment at done_now, inlined: the hot loop
                turn = episode.responses[episode.turn]
                done = min(max(round(turn - (episode.finish_s - s_now)), episode.seg_done), turn - 1)
                if done > episode.seg_done:
                    episode.parts.append(
                        (
                            Origin.MODEL,
                            done - episode.seg_done,
                            episode.seg_version,
                            episode.seg_t0,
                            now,
                            "abort",
                        )
                    )
                episode.seg_done, episode.seg_version, episode.seg_t0 = done, version, resume
                episode.cache_version = version
            self.stats.interruptions += engine.rows
            if engine.rows:
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


# -- traces ------------------------------------------------------------------------------------------


def workload_from_trace(trajectories: Sequence[Trajectory], group_size: int | None = None) -> WorkloadConfig:
    """A workload resampled from measured trajectory records (`agents.trajectory.load_jsonl`): empirical
    prompt lengths, turns, tokens per turn (a turn is a run of model segments, interruptions merged),
    tool-response tokens, and tool latency (from a turn's last model segment ending to the next turn's
    first one starting: the tool plus the env step). `group_size` defaults to the most common group
    size in the trace."""
    finished = [t for t in trajectories if t.status is not Status.RUNNING]
    if not finished:
        raise ValueError("the trace holds no finished trajectory")
    prompts: list[float] = []
    turns: list[float] = []
    responses: list[float] = []
    tools: list[float] = []
    latencies: list[float] = []
    for trajectory in finished:
        prompts.append(trajectory.prompt_length)
        turn_tokens, in_turn, last_end, pending_tool = 0, False, None, 0
        count = 0
        for segment in trajectory.segments[1:]:
            if segment.origin is Origin.MODEL:
                if not in_turn:
                    if last_end is not None and segment.started_at is not None:
                        latencies.append(max(0.0, segment.started_at - last_end))
                    if pending_tool:
                        tools.append(pending_tool)
                    pending_tool, in_turn, count = 0, True, count + 1
                turn_tokens += len(segment.tokens)
                last_end = segment.ended_at
            else:
                if in_turn:
                    responses.append(turn_tokens)
                    turn_tokens, in_turn = 0, False
                pending_tool += len(segment.tokens)
        if in_turn:
            responses.append(turn_tokens)
        if count:
            turns.append(count)
    if not responses:
        raise ValueError("the trace holds no model tokens")
    sizes = Counter(t.group_id for t in finished)
    size = group_size or Counter(sizes.values()).most_common(1)[0][0]

    def empirical(values: list[float], default: float) -> Distribution:
        return Distribution.empirical(values) if values else Distribution.constant(default)

    return WorkloadConfig(
        group_size=size,
        prompt_tokens=empirical(prompts, 1),
        turns=empirical(turns, 1),
        response_tokens=empirical(responses, 1),
        tool_tokens=empirical(tools, 1),
        tool_latency_s=empirical(latencies, 0.0),
    )
