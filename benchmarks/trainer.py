"""The learner's train step against a plain transformers forward+backward of the same batch, and the cost
of R3 routing replay (trainer/learner.py, trainer/replay.py).

    .venv/bin/python benchmarks/trainer.py [--out benchmarks/results/trainer.json]
    .venv/bin/python benchmarks/trainer.py --model smollm2-135m --batch 8 --repeats 5 \
        --out benchmarks/results/trainer_smollm2.json

The batch: 16 trajectories (`--batch`) of the tiny MoE (1.9M parameters) or of `--model` (anything
`load_model` takes, such as the shipped SmolLM2-135M), each a 32-token prompt and a 224-token model
segment (256 tokens, 3,584 trained at 16), in groups of 8, with (an MoE) the routes the model itself
picks recorded for every position (prompt and model tokens, as the rollout driver records them), as an
engine running the same weights would.

- `plain`: `model(input_ids, attention_mask)`, a masked token-mean log-likelihood loss on the same
  tokens, backward, grad-norm clip, AdamW step: the least any RL step on this batch must do.
- `learner`: `Learner.train_step` with SAT-GSPO (collation, log-probs at the sampling temperature,
  the loss and its diagnostics, entropy, the step); `learner_r3` the same with routing replay on (an
  MoE only).

Arms alternate within each repetition so machine noise hits them alike; figures are medians of
`--repeats`, of wall-clock time and (`cpu_step_s`, `learner_vs_plain_cpu`) of process CPU time, which
moves less on a machine shared with other work (with one thread; with more, it also counts the time
threads spin waiting for each other). Targets: learner ≥ 1.0× plain tokens/s (issue 19; 0.9× before); R3
overhead ≤ 10%. `mismatch`: the training–inference mismatch (mean and max |log π_θ − log μ| over
generated tokens) with the trainer's live routing and with R3 (the engine's routes replayed at every
position: prompt and generated tokens), and the share of routes where the trainer's live router
disagrees with the engine's, for engines whose routers are perturbed by increasing noise
(`--mismatch-only` runs this part alone; the tiny MoE only). The PACE selection time at pool sizes
1k and 10k comes from benchmarks/pool.py and is folded in here.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pacerl.agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, declares_moe, load_model, moe_info
from pacerl.agents.rollout import append_generation
from pacerl.agents.routing import RoutedExperts
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Status, Trajectory
from pacerl.trainer.learner import Learner, LearnerConfig

PROMPT, RESPONSE, GROUP = 32, 224, 8


def make_batch(model: torch.nn.Module, size: int = 16, seed: int = 0) -> list[list[Trajectory]]:
    """`size` trajectories of random tokens, in groups of 8, with (an MoE) the routes `model` itself
    chooses for them (what an engine running the same weights records), so replay and live routing
    load the experts alike."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 500, (size, PROMPT + RESPONSE))
    routes = None
    if declares_moe(model.config):
        chosen: list[torch.Tensor] = []
        hooks = [
            gate.register_forward_hook(lambda module, inputs, output: chosen.append(output[2]))
            for gate in moe_info(model).gates
        ]
        with torch.no_grad():
            model(input_ids=torch.from_numpy(ids))
        for hook in hooks:
            hook.remove()
        # [B*T, layers, k]; the row of token p is the routing of input p - 1.
        routes = torch.stack(chosen, 1).reshape(size, PROMPT + RESPONSE, len(chosen), -1).numpy()
    groups = []
    for g in range(size // GROUP):
        group = []
        for i in range(GROUP):
            row = g * GROUP + i
            trajectory = Trajectory.start(f"{g}/{i}", str(g), "task", ids[row, :PROMPT])
            if routes is not None:
                trajectory.attach_routes(
                    RoutedExperts.from_array(routes[row, : PROMPT - 1], num_experts=8), 0
                )
            trajectory.append_model(
                ids[row, PROMPT:],
                rng.uniform(-7.0, -5.0, RESPONSE),
                version=0,
                started_at=0.0,
                ended_at=0.0,
                finish_reason="length",
                routed_experts=None
                if routes is None
                else RoutedExperts.from_array(routes[row, PROMPT - 1 : -1], num_experts=8),
            )
            trajectory.finish(
                Status.COMPLETED, reason="", reward=float(i % 2), completed_version=0, completed_at=0.0
            )
            group.append(trajectory)
        groups.append(group)
    return groups


def plain_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, learner: Learner, groups: Any
) -> None:
    batch = learner.collate([t for group in groups for t in group])  # untimed below: same tensors
    started, cpu = time.perf_counter(), time.process_time()
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.targets[..., None])[..., 0]
    loss = -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
    torch.autograd.backward(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    plain_step.elapsed = time.perf_counter() - started  # type: ignore[attr-defined]
    plain_step.cpu = time.process_time() - cpu  # type: ignore[attr-defined]


async def engine_rollouts(engine_model: torch.nn.Module, prompts: list[list[int]]) -> list[Trajectory]:
    """One sampled generation per prompt with the routes of every position (the prompt's from the
    prefill, then the generated tokens'), recorded as the rollout driver does."""
    engine = EmbeddedEngine(engine_model, config=EmbeddedEngineConfig(seed=1))
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0)
    outputs = await asyncio.gather(
        *(engine.generate(p, sampling, return_routed_experts=True) for p in prompts)
    )
    await engine.aclose()
    trajectories = []
    for index, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        trajectory = Trajectory.start(f"m{index}", "m", "task", prompt)
        append_generation(trajectory, out, num_experts=8, started_at=0.0, ended_at=0.0)
        trajectory.finish(Status.COMPLETED, reason="", reward=0.0, completed_version=0, completed_at=0.0)
        trajectories.append(trajectory)
    return trajectories


def mismatch(tokenizer: Any) -> list[dict[str, float]]:
    """Training–inference mismatch with and without R3 when the rollout engine's routers differ from the
    trainer's by Gaussian noise of `noise` × the router weights' std (standing in for kernels or
    precision that flip top-k choices): 64 sampled generations of 48 tokens each."""
    trainer_model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, 16).tolist() for _ in range(64)]
    rows = []
    for noise in (0.0, 0.05, 0.2, 0.5):
        engine_model = copy.deepcopy(trainer_model)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for gate in moe_info(engine_model).gates:
                gate.weight.add_(
                    torch.randn(gate.weight.shape, generator=generator) * noise * gate.weight.std()
                )
        trajectories = asyncio.run(engine_rollouts(engine_model, prompts))
        learner = Learner(trainer_model, LearnerConfig(temperature=1.0))
        rows.append({"router_noise": noise, **learner.mismatch(trajectories)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/trainer.json")
    parser.add_argument(
        "--model",
        help="a checkpoint directory, .gguf file or shipped name (load_model); default the tiny MoE",
    )
    parser.add_argument("--batch", type=int, default=16, help="trajectories a step, a multiple of 8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--mismatch-only", action="store_true", help="only the mismatch table (printed, not written)"
    )
    args = parser.parse_args()
    if args.batch < GROUP or args.batch % GROUP:
        parser.error(f"--batch must be a positive multiple of {GROUP}")
    torch.set_num_threads(args.threads)
    tokenizer = tiny_tokenizer()
    if args.mismatch_only:
        print(json.dumps(mismatch(tokenizer), indent=2))
        return

    def fresh_model() -> torch.nn.Module:
        if args.model is None:
            return build_tiny_moe(TinyMoEConfig(), tokenizer)
        model, _ = load_model(args.model)
        return model

    model = fresh_model()
    moe = declares_moe(model.config)
    groups = make_batch(model, args.batch)
    tokens = sum(t.num_model_tokens for group in groups for t in group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    # Each arm trains its own copy of the weights (with lr 1e-6 they stay alike).
    learners = {
        "learner": Learner(fresh_model(), LearnerConfig(lr=1e-6, temperature=0.7, routing_replay=False))
    }
    if moe:
        learners["learner_r3"] = Learner(fresh_model(), LearnerConfig(lr=1e-6, temperature=0.7))
    arms: dict[str, list[float]] = {name: [] for name in ("plain", *learners)}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(2 if args.model is None else 1):  # warm-up
        plain_step(model, optimizer, learners["learner"], groups)
        for learner in learners.values():
            learner.train_step(groups)
    for _ in range(args.repeats):
        plain_step(model, optimizer, learners["learner"], groups)
        arms["plain"].append(plain_step.elapsed)  # type: ignore[attr-defined]
        cpu["plain"].append(plain_step.cpu)  # type: ignore[attr-defined]
        for name, learner in learners.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            result = learner.train_step(groups)
            arms[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
            assert result.updated, result.skipped
    median = {name: statistics.median(times) for name, times in arms.items()}
    median_cpu = {name: statistics.median(times) for name, times in cpu.items()}
    report: dict[str, Any] = {
        "model": args.model or "tiny-moe",
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "batch": {
            "trajectories": args.batch,
            "tokens_per_trajectory": PROMPT + RESPONSE,
            "trained_tokens": tokens,
        },
        "repeats": args.repeats,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "step_s": median,
        "tokens_per_s": {name: tokens / value for name, value in median.items()},
        "learner_vs_plain": median["plain"] / median["learner"],
        "learner_vs_plain_runs": [p / q for p, q in zip(arms["plain"], arms["learner"], strict=True)],
        "cpu_step_s": median_cpu,
        "learner_vs_plain_cpu": median_cpu["plain"] / median_cpu["learner"],
    }
    if moe:
        report["learner_r3_vs_plain"] = median["plain"] / median["learner_r3"]
        report["r3_overhead"] = median["learner_r3"] / median["learner"] - 1
        report["mismatch"] = mismatch(tokenizer)
    pool_results = Path(args.out).with_name("pool.json")
    if args.model is None and pool_results.exists():
        report["pace_selection"] = json.loads(pool_results.read_text())
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "pace_selection"}, indent=2))


if __name__ == "__main__":
    main()
