"""The Python steps of the GPU check (`benchmarks/gpu/check.sh` runs them; see README.md beside this file).

    python benchmarks/gpu/check.py build-model --out DIR [--layers 2 --experts 32]
    python benchmarks/gpu/check.py train --memory-out FILE -- key=value ...   # `pacerl train`, then memory
    python benchmarks/gpu/check.py summarize --r3 RUN --live RUN ... --out FILE

Each step exits non-zero with a one-line message on stderr when something is missing or wrong.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "num_heads": 32,
    "num_kv_heads": 4,
    "head_dim": 128,
    "top_k": 8,
    "moe_intermediate_size": 768,
}
"""Qwen3-30B-A3B's widths (its config.json); the check keeps them and cuts layers (48) and experts (128)."""


class CheckError(RuntimeError):
    """A step of the check found something missing or wrong; its message is the one line printed."""


def build_model(out: Path, layers: int, experts: int, max_position: int) -> dict[str, Any]:
    """Save a random-weight Qwen3-MoE of Qwen3-30B-A3B's width with `layers` layers and `experts`
    experts, and pacerl's offline tokenizer, as a Hugging Face checkpoint in `out` (nothing downloaded)."""
    from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, parameter_count, save_model
    from pacerl.agents.tokenizer import tiny_tokenizer

    if experts < QWEN3_30B_A3B["top_k"]:
        raise CheckError(f"--experts must be at least top_k = {QWEN3_30B_A3B['top_k']}, got {experts}")
    tokenizer = tiny_tokenizer()
    width = QWEN3_30B_A3B
    shape = TinyMoEConfig(
        family="qwen3_moe",
        hidden_size=width["hidden_size"],
        num_layers=layers,
        num_heads=width["num_heads"],
        num_kv_heads=width["num_kv_heads"],
        head_dim=width["head_dim"],
        num_experts=experts,
        top_k=width["top_k"],
        moe_intermediate_size=width["moe_intermediate_size"],
        max_position=max_position,
    )
    model = build_tiny_moe(shape, tokenizer)
    save_model(model, tokenizer, out)
    return {"path": str(out), "parameters": parameter_count(model), "layers": layers, "experts": experts}


def train(memory_out: Path, overrides: Sequence[str]) -> int:
    """`pacerl train OVERRIDES` in this process (rank 0), then this process's peak CUDA memory per
    device (torch's allocator: `max_memory_allocated`, `max_memory_reserved`) written to `memory_out`."""
    import torch

    from pacerl.cli import main

    print("pacerl train " + " ".join(overrides), file=sys.stderr, flush=True)
    try:
        return main(["train", *overrides])
    finally:
        devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)
        memory = {
            str(device): {
                "max_memory_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
                "max_memory_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
            }
            for device in devices
        }
        memory_out.write_text(json.dumps(memory, indent=2))


def run_figures(run_dir: Path) -> dict[str, Any]:
    """Throughput, step times and mismatch of one run, from its metrics.jsonl: means over the steps that
    updated the weights, leaving out the first (it pays for warm-up) when there are more."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise CheckError(f"{path} is missing: the training run wrote no metrics")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    updated = [row for row in rows if row.get("updated") and "tokens_per_s" in row]
    if not updated:
        raise CheckError(f"{path} has no step that updated the weights: nothing to measure")
    measured = updated[1:] if len(updated) > 1 else updated
    times = sorted(row["time"] for row in rows if "tokens_per_s" in row)
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]

    def mean(key: str) -> float | None:
        values = [float(row[key]) for row in measured if key in row]
        return statistics.fmean(values) if values else None

    return {
        "steps_updated": len(updated),
        "steps_measured": len(measured),
        "tokens_per_s": mean("tokens_per_s"),
        "learner_step_s": mean("step_s"),
        "loop_step_s": statistics.median(gaps) if gaps else None,
        "mismatch": mean("mismatch"),
        "routing_disagreement": mean("routing_disagreement"),
        "r3_coverage": mean("r3_coverage"),
        "reward": mean("reward"),
    }


def gpu_log_peaks(path: Path) -> dict[str, Any]:
    """Peak memory per GPU and per process group from check.sh's nvidia-smi samples: lines
    `gpu <index> <used MiB>` and `app <pid> <pgid> <used MiB>`."""
    per_gpu: dict[str, float] = {}
    per_group: dict[str, float] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) == 3 and fields[0] == "gpu":
                per_gpu[fields[1]] = max(per_gpu.get(fields[1], 0.0), float(fields[2]))
            elif len(fields) == 4 and fields[0] == "app":
                # Summed over a group's processes at one sample would be exact; the max of each is a floor.
                per_group[fields[2]] = max(per_group.get(fields[2], 0.0), float(fields[3]))
    return {"peak_used_mib_per_gpu": per_gpu, "peak_used_mib_per_process_group": per_group}


def summarize(args: argparse.Namespace) -> dict[str, Any]:
    """The check's JSON: both runs' figures, mismatch with and without R3, peak memory."""
    r3, live = run_figures(args.r3), run_figures(args.live)
    memory = {
        "trainer_rank0_r3": json.loads(args.r3_memory.read_text()) if args.r3_memory.is_file() else None,
        "trainer_rank0_live": json.loads(args.live_memory.read_text())
        if args.live_memory.is_file()
        else None,
        **gpu_log_peaks(args.gpu_log),
        "sglang_process_group": args.sglang_pgid,
        "trainer_process_groups": {"r3": args.r3_pgid, "live": args.live_pgid},
    }
    return {
        "check": "benchmarks/gpu/check.sh",
        "gpus": args.gpus,
        "model": json.loads(args.model_info.read_text()) if args.model_info.is_file() else None,
        "weight_transport": args.weight_transport,
        "tokens_per_s": r3["tokens_per_s"],
        "learner_step_s": r3["learner_step_s"],
        "loop_step_s": r3["loop_step_s"],
        "mismatch_with_r3": r3["mismatch"],
        "mismatch_without_r3": live["mismatch"],
        "routing_disagreement_without_r3": live["routing_disagreement"],
        "memory": memory,
        "runs": {"r3": r3, "live": live},
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="check.py", description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    model = steps.add_parser("build-model", help="save the random-weight Qwen3-MoE checkpoint")
    model.add_argument("--out", type=Path, required=True)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--experts", type=int, default=32)
    model.add_argument("--max-position", type=int, default=4096)
    model.add_argument("--info-out", type=Path, help="also write what was built as JSON here")
    run = steps.add_parser("train", help="`pacerl train` in this process, then its peak CUDA memory")
    run.add_argument("--memory-out", type=Path, required=True)
    run.add_argument("overrides", nargs="*", help="key=value settings of `pacerl train` (after --)")
    summary = steps.add_parser("summarize", help="write the check's JSON")
    summary.add_argument("--r3", type=Path, required=True, help="run directory of the R3 run")
    summary.add_argument("--live", type=Path, required=True, help="run directory of the run without R3")
    summary.add_argument("--r3-memory", type=Path, required=True)
    summary.add_argument("--live-memory", type=Path, required=True)
    summary.add_argument("--gpu-log", type=Path, required=True)
    summary.add_argument("--model-info", type=Path, required=True)
    summary.add_argument("--gpus", type=int, required=True)
    summary.add_argument("--weight-transport", default="disk")
    summary.add_argument("--sglang-pgid", default=None)
    summary.add_argument("--r3-pgid", default=None)
    summary.add_argument("--live-pgid", default=None)
    summary.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.step == "build-model":
            info = build_model(args.out, args.layers, args.experts, args.max_position)
            if args.info_out is not None:
                args.info_out.write_text(json.dumps(info, indent=2))
            print(json.dumps(info))
            return 0
        if args.step == "train":
            return train(args.memory_out, args.overrides)
        result = summarize(args)
    except CheckError as error:
        print(f"check.py {args.step}: {error}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
