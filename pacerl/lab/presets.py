"""The named setups of `pacerl simulate --preset`: each a `SimConfig` with what it reproduces, the
published figure it is checked against, and where every parameter comes from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pacerl.lab.config import SimConfig
from pacerl.lab.costs import Distribution, InferenceConfig, TrainerConfig, WorkloadConfig
from pacerl.trainer.pool import AdmissionSettings, FilterConfig, PaceSettings


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
        filter=FilterConfig(
            name="admission", max_concurrent_groups=2560, admission=AdmissionSettings(max_offpolicyness=4)
        ),
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
        filter=FilterConfig(
            name="admission", max_concurrent_groups=1024, admission=AdmissionSettings(max_offpolicyness=5)
        ),
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
            "derived: the rollouter may run (1 + staleness_threshold 0.5) × 4 batches of 128 ahead of "
            "the last weight sync = η 5 in pacerl's lag-aware capacity ((η + steps − lag + 1)·B); "
            "decode costs and KV capacity from H20 specs (4.0 TB/s, 148 TFLOP/s) and "
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
    # This project's own measurements on a 2-core machine (docs/benchmarks.md): CodeMath episodes at
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
        filter=FilterConfig(name="pace", max_concurrent_groups=8, pace=PaceSettings(target_groups=16)),
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
            "measured (docs/benchmarks.md): engine 695 tok/s with 32 rows → 46 ms per 32-row step (5 ms "
            "floor + 1.3 ms per row); reprefill of 32 in-flight requests 177 ms (≈ 18k tok/s prefill); "
            "in-place weight update 3.7 ms; ~25 generated tokens per episode over 2 turns; tool call ~15 ms; "
            "a train step ≈ 0.3 s per 128 episodes; 20-25 episodes/s end to end with the sandbox",
            "assumed: prompt ≈ 60 tokens, tool responses ≈ 12 tokens, one core each for engine and learner "
            "(split: the sync baseline alternates them)",
        ),
    )


PRESETS: dict[str, Callable[[], Preset]] = {"areal": _areal, "verl": _verl, "pacerl-cpu": _pacerl_cpu}
"""The named setups of `pacerl simulate --preset`."""
