"""What a simulation returns: each mode's run (`ModeResult`, with the trained tokens' staleness), the
async-vs-sync pair (`SimResult`), and the steady-state capacities from the means (`bounds`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from pacerl.lab.config import SimConfig
from pacerl.settings import config_to_dict

Mode: TypeAlias = Literal["async", "sync"]


@dataclass(frozen=True)
class StalenessStats:
    """Token-weighted staleness of the trained trajectories (docs/algorithms.md §6), from their records."""

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
            in_flight,
            (config.filter.admission.max_offpolicyness + 1) * config.batch_groups * workload.group_size,
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
