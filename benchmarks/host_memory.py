"""What handing freed heap memory back costs and saves (`pacerl.trainer.host_memory`): SmolLM2-135M learner
steps (forward, backward, AdamW) in three fresh processes side by side: glibc as it is, `return_free_heap`
after each step (what `pacerl train` does), and the mmap threshold fixed at 1 MiB plus the same (the
alternative that was tried).

    .venv/bin/python benchmarks/host_memory.py [--steps 4] [--out benchmarks/results/host_memory.json]

Reports each mode's CPU seconds per step (user and system: wall time depends on the machine's load),
resident memory after the steps and the peak. One torch thread, so that the modes do not share cores.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import subprocess
import sys
from pathlib import Path

# The repository root before this folder: benchmarks/trainer.py would shadow the `trainer` package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("glibc", "trim", "mmap-1MiB+trim")


def measure(mode: str, steps: int) -> dict[str, object]:
    """In this process: `steps` learner steps of SmolLM2 on random tokens under `mode`."""
    import torch
    from transformers import AutoModelForCausalLM

    from pacerl.agents.gguf import checkpoint_source
    from pacerl.trainer.host_memory import peak_rss_gb, return_free_heap, rss_gb

    if mode == "mmap-1MiB+trim":
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint_source("smollm2-135m"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    generator = torch.Generator().manual_seed(0)
    user, system = [], []
    for step in range(steps):
        length = (160, 224, 192, 256)[step % 4]  # ragged, as padded micro-batches are
        ids = torch.randint(0, 49_000, (4, length), generator=generator)
        before = resource.getrusage(resource.RUSAGE_SELF)
        logprobs = model(input_ids=ids).logits.log_softmax(-1).gather(-1, ids[..., None])
        logprobs.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if mode != "glibc":
            return_free_heap()
        after = resource.getrusage(resource.RUSAGE_SELF)
        user.append(after.ru_utime - before.ru_utime)
        system.append(after.ru_stime - before.ru_stime)
    return {
        "mode": mode,
        "cpu_s_per_step": (sum(user) + sum(system)) / steps,
        "system_s_per_step": sum(system) / steps,
        "rss_gb_after": rss_gb(),
        "peak_rss_gb": peak_rss_gb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/host_memory.json")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in a child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.steps)))
        return
    rows = []
    for mode in MODES:
        child = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps)]
        done = subprocess.run(child, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[0]
    for row in rows:
        row["cpu_vs_glibc"] = row["cpu_s_per_step"] / base["cpu_s_per_step"]  # type: ignore[operator]
    report = {"model": "smollm2-135m", "steps": args.steps, "batch": "4 x 160-256 tokens", "modes": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
