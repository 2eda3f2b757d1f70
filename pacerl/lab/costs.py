"""The simulator's cost models: what a decode step, a prefill, a weight publication and a training step
cost, and what an episode asks of the engines and tools. Each is a documented assumption (the presets in
`pacerl.lab.presets` say where their numbers come from):

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

The defaults describe a generic tool-using agent on a mid-size MoE; they are assumptions, while the
presets carry setups checked against published figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

DistributionKind: TypeAlias = Literal["constant", "lognormal", "empirical"]


def check_int(name: str, value: object, minimum: int) -> int:
    """`value` if it is an integer (not a bool) >= `minimum`, else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_float(
    name: str, value: object, minimum: float, *, strict: bool = False, inf: bool = False
) -> float:
    """`value` as a float if it is a number >= `minimum` (> with `strict`), finite unless `inf`, not
    NaN; else ValueError naming `name`."""
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
        check_float("median", self.median, 0.0, strict=self.kind == "lognormal")
        check_float("sigma", self.sigma, 0.0)
        check_float("minimum", self.minimum, 0.0)
        if check_float("maximum", self.maximum, 0.0, inf=True) < self.minimum:
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
        check_int("workload.group_size", self.group_size, 1)
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
        check_int("inference.gpus_per_engine", self.gpus_per_engine, 1)
        check_float("inference.step_base_s", self.step_base_s, 0.0, strict=True)
        check_float("inference.step_per_row_s", self.step_per_row_s, 0.0)
        check_float("inference.step_per_kv_token_s", self.step_per_kv_token_s, 0.0)
        check_float("inference.prefill_tokens_per_s", self.prefill_tokens_per_s, 0.0, strict=True, inf=True)
        check_int("inference.kv_capacity_tokens", self.kv_capacity_tokens, 1)
        check_int("inference.max_running", self.max_running, 1)
        if not 0.0 < check_float("inference.admit_kv_fraction", self.admit_kv_fraction, 0.0) <= 1.0:
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
        check_float("trainer.tokens_per_gpu_s", self.tokens_per_gpu_s, 0.0, strict=True)
        check_float("trainer.step_fixed_s", self.step_fixed_s, 0.0)
        if not 0.0 <= check_float("trainer.forward_share", self.forward_share, 0.0) <= 1.0:
            raise ValueError(f"trainer.forward_share must be in [0, 1], got {self.forward_share}")
        if not 0.0 < check_float("trainer.colocated_efficiency", self.colocated_efficiency, 0.0) <= 1.0:
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
