"""How long `pacerl simulate` takes for 1,000 steps of 96 inference + 32 trainer GPUs (issue 19's target:
at most 20 s), and where the time goes.

    .venv/bin/python benchmarks/simulate.py [--out benchmarks/results/simulate.json] [--repeats 3]

- `wall_s`, `cpu_s`: the whole command, as a user runs it (`python -m pacerl simulate --inference-gpus
  96 --trainer-gpus 32 --filter pace --steps 1000 --out DIR`, plots included), in a fresh process each
  repetition: its wall-clock time (what benchmarks/summary.py holds against the target) and the CPU
  time it used (`resource.RUSAGE_CHILDREN`);
- `simulation_s`: the simulation alone (both modes; `wall_s` of the `simulation.json` it wrote);
- `imports`: a fresh interpreter importing what the command imports before it simulates (the CLI, the
  simulator, its presets and report), `--import-repeats` times, and which heavy modules that pulls in
  (`HEAVY`): the simulation needs none of them, the plots only matplotlib, imported when they are drawn;
- `result`: the figures of the run (async and sync trajectories/s, mean GS and WS, rejected groups),
  which the speed-ups must leave as they were (tests/lab/test_simulation.py pins small runs exactly).

Figures are medians of the repetitions. On a machine shared with other work the wall-clock times move
with its load (recorded); the CPU times move less.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ("simulate", "--inference-gpus", "96", "--trainer-gpus", "32", "--filter", "pace")
HEAVY = ("torch", "transformers", "matplotlib", "gymnasium", "httpx")
IMPORTS = f"""
import sys, time
started, cpu = time.perf_counter(), time.process_time()
import pacerl.cli, pacerl.lab.engine, pacerl.lab.presets, pacerl.lab.simulate_report
print(time.perf_counter() - started, time.process_time() - cpu, *(m for m in {HEAVY!r} if m in sys.modules))
"""


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_command(steps: int, out: Path) -> dict[str, Any]:
    """One `pacerl simulate` in a fresh process: wall and CPU seconds, and what it wrote."""
    cpu = children_cpu_s()
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pacerl", *COMMAND, "--steps", str(steps), "--out", str(out)],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    data = json.loads((out / "simulation.json").read_text())
    return {"wall_s": wall, "cpu_s": children_cpu_s() - cpu, "simulation_s": data["wall_s"], "data": data}


def time_imports(repeats: int) -> dict[str, Any]:
    walls, cpus, heavy = [], [], []
    for _ in range(repeats):
        fields = subprocess.run(
            [sys.executable, "-c", IMPORTS], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.split()
        walls.append(float(fields[0]))
        cpus.append(float(fields[1]))
        heavy = fields[2:]
    return {
        "wall_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
        "heavy_modules_imported": heavy,
    }


def result_figures(data: dict[str, Any]) -> dict[str, Any]:
    figures: dict[str, Any] = {"speedup": data["speedup"]}
    for mode in ("async", "sync"):
        run = data[mode]
        figures[mode] = {
            "trajectories_per_s": run["trajectories_per_s"],
            "mean_gs": run["staleness"]["mean_gs"],
            "mean_ws": run["staleness"]["mean_ws"],
            "rejected_groups": run["rejected_groups"],
            "interruptions": run["interruptions"],
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/simulate.json")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the whole command")
    parser.add_argument("--import-repeats", type=int, default=5)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    imports = time_imports(args.import_repeats)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.repeats):
            runs.append(run_command(args.steps, Path(scratch) / str(index)))
    figures = [result_figures(run["data"]) for run in runs]
    if any(f != figures[0] for f in figures):
        raise RuntimeError("the repetitions simulated different results; the simulator is deterministic")
    report = {
        "command": "pacerl " + " ".join(COMMAND) + f" --steps {args.steps} --out DIR",
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": round(load, 2),
        "load_average_at_end": round(os.getloadavg()[0], 2),
        "wall_s": statistics.median(run["wall_s"] for run in runs),
        "cpu_s": statistics.median(run["cpu_s"] for run in runs),
        "wall_s_each": [round(run["wall_s"], 2) for run in runs],
        "cpu_s_each": [round(run["cpu_s"], 2) for run in runs],
        "simulation_s": statistics.median(run["simulation_s"] for run in runs),
        "imports": imports,
        "target_s": 20.0,
        "result": figures[0],
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
