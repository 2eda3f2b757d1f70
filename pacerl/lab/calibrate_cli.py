"""`pacerl calibrate`: choose the publication interval S and the learning rate η of async GRPO together,
from a coarse sweep (docs/algorithms.md §8; `pacerl.lab.calibration` holds the detector and the fits,
`pacerl.lab.calibration_report` the analysis of a sweep and the files it writes).

    pacerl calibrate --config run.toml --sync-intervals 1,2,4,8 --lrs 1e-4,3e-4,1e-3,3e-3 --steps 30 \
        --out runs/calibrate [--seeds 0,1] [--parallel 2] [--horizon 500] [--safety 0.5] [key=value ...]

Each grid point (S, η, seed) is one `pacerl train` subprocess of vanilla async GRPO (`learner.loss.name=
grpo`, no SAT, `filter.name=none`, `loop.mode=async`, `loop.sync_interval=S`, `learner.lr=η`) in
OUT/runs/S<S>-lr<η>-seed<seed>/, `--parallel` at a time with the machine's CPUs divided among them (the
`threads` setting). A point whose run finished holds `point.json` and is skipped when the command runs
again; an interrupted one starts over; a finished point run with other settings is an error (choose
another --out). Evaluation is off and so is R3 (vanilla GRPO; on an MoE, `learner.routing_replay=true`
calibrates the stabilised variant instead), whatever the config file says, unless the key=value
overrides turn them on. A config that warm-starts (a fresh tiny model) is warm-started once, in
OUT/warm-start/, so that every point starts from the same policy.

Writes OUT/calibration.md (the grid table, η_max per S, Ĉ = S·η_max and B̂ = T_c·η with their ranges, the
fitted exponents, the recommended η per S), calibration.json, and stability.png (the S × η map with
the fitted boundary Ĉ/S, beside T_c against η). Bad input is one line naming the option, exit code 2.
The library (torch, the trainer) and matplotlib are imported only when a sweep runs: `pacerl` builds
this parser for every subcommand.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pacerl.lab.calibration import collapse_step

if TYPE_CHECKING:
    from pacerl.config import RunConfig

POINT_FILE = "point.json"
REPORT_FILE = "calibration.md"
RESULT_FILE = "calibration.json"
PLOT_FILE = "stability.png"
WARM_START_DIR = "warm-start"

DEFAULT_SETTINGS: dict[str, Any] = {
    "evaluation.every": 0,
    "evaluation.at_start": False,
    "evaluation.at_end": False,
    "learner.routing_replay": False,
}
"""Applied before the overrides (which may change them): the detector reads the training reward, so
held-out evaluations only cost time; R3 is a stabiliser the paper's vanilla GRPO does not have."""

FIXED_SETTINGS: dict[str, str] = {
    "learner.loss.name": "vanilla GRPO",
    "learner.loss.sat": "vanilla GRPO",
    "filter.name": "vanilla GRPO",
    "loop.mode": "vanilla GRPO",
    "loop.sync_interval": "--sync-intervals",
    "learner.lr": "--lrs",
    "loop.steps": "--steps",
    "loop.max_wall_s": "--steps",
    "seed": "--seeds",
    "run_dir": "--out",
    "threads": "--parallel",
    "loop.require_update": "the sweep (a point that trains nothing is a result, not an error)",
}
"""Keys `pacerl calibrate` sets on every point, with what sets them (an override of one is an error)."""


@dataclass(frozen=True)
class Options:
    """The command line, checked."""

    config: Path | None
    """The run config every point starts from (None: the built-in one)."""
    sync_intervals: tuple[int, ...]
    """S values of the grid."""
    lrs: tuple[float, ...]
    """η values of the grid."""
    steps: int
    """Steps of each run: T_max, where a run that never collapsed is censored."""
    seeds: tuple[int, ...]
    """Seeds: each grid point runs once per seed."""
    parallel: int
    """Runs at a time."""
    horizon: int
    """T of the recommendation (default: `steps`)."""
    safety: float
    """κ of the recommendation."""
    out: Path
    """The sweep's directory."""
    overrides: tuple[str, ...]
    """key=value settings for every point."""


def add_calibrate_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pacerl calibrate` to the CLI's subcommands. Values are parsed by `parse_options`, so a bad
    one is a one-line error naming its option rather than argparse's usage block."""
    parser = commands.add_parser(
        "calibrate",
        help="sweep S × η of async GRPO, fit the staleness and learning-rate laws, recommend η",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add = parser.add_argument
    add("--config", metavar="FILE", help="a TOML or JSON run config (default: the built-in one)")
    add("--sync-intervals", metavar="S,...", help="publication intervals, e.g. 1,2,4,8")
    add("--lrs", metavar="ETA,...", help="learning rates, e.g. 1e-4,3e-4,1e-3")
    add("--steps", metavar="N", help="steps of each run (the horizon a run is censored at)")
    add("--seeds", metavar="N,...", default="0", help="seeds; every grid point runs once per seed")
    add("--parallel", metavar="K", default="1", help="runs at a time (the CPUs are divided among them)")
    add("--horizon", metavar="T", help="steps of the run to recommend η for (default: --steps)")
    add("--safety", metavar="KAPPA", default="0.5", help="safety factor κ of the recommendation")
    add("--out", metavar="DIR", help="the sweep's directory (a second call resumes it)")
    add("overrides", nargs="*", help="key=value settings for every run, e.g. loop.batch_groups=4")
    parser.set_defaults(handler=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`pacerl calibrate ...`."""
    return main_calibrate(parse_options(args))


# --- options -------------------------------------------------------------------------------------------

_T = TypeVar("_T", int, float)


def _number(option: str, raw: str, kind: type[_T], minimum: _T, *, strict: bool = False) -> _T:
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{option}: {raw!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{option} must be {'>' if strict else '>='} {minimum}, got {raw}")
    return value


def _numbers(
    option: str, raw: str | None, kind: type[_T], minimum: _T, *, strict: bool = False
) -> tuple[_T, ...]:
    if raw is None:
        raise ValueError(f"{option} is required (comma-separated, e.g. {option} {_EXAMPLES[option]})")
    values = tuple(_number(option, item.strip(), kind, minimum, strict=strict) for item in raw.split(","))
    if len(set(values)) != len(values):
        raise ValueError(f"{option} lists a value twice: {raw}")
    return tuple(sorted(values))


_EXAMPLES = {"--sync-intervals": "1,2,4,8", "--lrs": "1e-4,3e-4,1e-3", "--seeds": "0,1"}


def parse_options(args: argparse.Namespace) -> Options:
    """The checked options (ValueError naming the option on bad input)."""
    if args.steps is None:
        raise ValueError("--steps is required (steps of each run, e.g. --steps 30)")
    if args.out is None:
        raise ValueError("--out is required (the sweep's directory)")
    steps = _number("--steps", args.steps, int, 1)
    safety = _number("--safety", args.safety, float, 0.0, strict=True)
    if safety > 1:
        raise ValueError(f"--safety must be in (0, 1], got {args.safety}")
    parallel = _number("--parallel", args.parallel, int, 1)
    if parallel > available_cpus():
        raise ValueError(f"--parallel {parallel} exceeds this machine's {available_cpus()} CPUs")
    overrides = tuple(args.overrides)
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not key=value (e.g. loop.batch_groups=4)")
        if key.strip() in FIXED_SETTINGS:
            raise ValueError(f"override {key.strip()} is set by calibrate ({FIXED_SETTINGS[key.strip()]})")
    return Options(
        config=None if args.config is None else Path(args.config).resolve(),
        sync_intervals=_numbers("--sync-intervals", args.sync_intervals, int, 1),
        lrs=_numbers("--lrs", args.lrs, float, 0.0, strict=True),
        steps=steps,
        seeds=_numbers("--seeds", args.seeds, int, 0),
        parallel=parallel,
        horizon=steps if args.horizon is None else _number("--horizon", args.horizon, int, 1),
        safety=safety,
        out=Path(args.out),
        overrides=overrides,
    )


def available_cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# --- the sweep -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridPoint:
    """One run of the sweep."""

    sync_interval: int
    """S."""
    lr: float
    """η."""
    seed: int
    """The run's seed."""

    @property
    def name(self) -> str:
        """Its run directory's name."""
        return f"S{self.sync_interval}-lr{self.lr:g}-seed{self.seed}"

    def label(self) -> str:
        return f"S={self.sync_interval} lr={self.lr:g} seed {self.seed}"


def point_settings(point: GridPoint, options: Options, run_dir: Path, extra: Mapping[str, Any]) -> list[str]:
    """The key=value overrides of one point's `pacerl train`, in the order they apply: calibrate's
    defaults, the user's overrides, the shared warm start (`extra`), then what calibrate fixes."""
    fixed: dict[str, Any] = {
        "learner.loss.name": "grpo",
        "learner.loss.sat": False,
        "filter.name": "none",
        "loop.mode": "async",
        "loop.sync_interval": point.sync_interval,
        "learner.lr": point.lr,
        "loop.steps": options.steps,
        "loop.max_wall_s": None,
        "seed": point.seed,
        "run_dir": str(run_dir),
        "threads": max(1, available_cpus() // options.parallel),
        "loop.require_update": False,
    }
    pairs = [f"{key}={json.dumps(value)}" for key, value in DEFAULT_SETTINGS.items()]
    pairs += options.overrides
    pairs += [f"{key}={json.dumps(value)}" for key, value in {**extra, **fixed}.items()]
    return pairs


def main_calibrate(options: Options) -> int:
    """Run (or resume) the sweep, then fit, report and plot. Every point's config is checked, and so
    are the finished points' settings, before anything is written."""
    # The run config (torch) and the report (matplotlib) are imported when a calibration runs, not for
    # `pacerl --help`.
    from pacerl.config import load_config
    from pacerl.lab.calibration_report import analyse, jsonable, markdown_report, plot_stability

    base = load_config(options.config, [*_pairs(DEFAULT_SETTINGS), *options.overrides])
    warm = options.out / WARM_START_DIR
    extra = {"model.path": str(warm.resolve()), "sft.when": "never"} if _warm_starts(base) else {}
    runs = options.out / "runs"
    grid = [
        GridPoint(s, lr, seed) for seed in options.seeds for s in options.sync_intervals for lr in options.lrs
    ]
    plans = {point: point_settings(point, options, runs / point.name, extra) for point in grid}
    expected = {point: _comparable(load_config(options.config, pairs)) for point, pairs in plans.items()}
    for point in grid:
        done = runs / point.name / POINT_FILE
        if done.is_file() and json.loads(done.read_text())["config"] != expected[point]:
            raise ValueError(
                f"--out {options.out}: {point.label()} finished with other settings; choose another --out"
            )
    runs.mkdir(parents=True, exist_ok=True)
    try:
        if extra:
            _warm_start_once(base, options, warm)
            # Resolved again now that the warm start exists: a model's defaults follow the checkpoint
            # (`pacerl.config.model_defaults`), and a path not yet written resolves as some other model.
            expected = {
                point: _comparable(load_config(options.config, pairs)) for point, pairs in plans.items()
            }
        records = _run_grid(grid, plans, expected, options, runs)
    except KeyboardInterrupt:
        print(f"interrupted: the same command resumes the sweep in {options.out}", file=sys.stderr)
        return 130
    result = analyse(records, options)
    report = markdown_report(result, options)
    (options.out / REPORT_FILE).write_text(report, encoding="utf-8")
    settings = {key: value for key, value in vars(options).items() if key not in ("config", "out")}
    data = {"settings": jsonable(settings), **jsonable(result)}
    (options.out / RESULT_FILE).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    plot_stability(result, options.out / PLOT_FILE)
    print(report)
    print(f"wrote {options.out / REPORT_FILE}, {options.out / RESULT_FILE}, {options.out / PLOT_FILE}")
    return 0


def _pairs(settings: Mapping[str, Any]) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in settings.items()]


def _comparable(config: RunConfig) -> dict[str, Any]:
    """The resolved config a finished point is checked against, less what does not change the run's
    meaning (where it ran, how many threads)."""
    from pacerl.settings import config_to_dict

    data: dict[str, Any] = config_to_dict(config)
    data.pop("run_dir"), data.pop("threads")
    return data


def _warm_starts(config: RunConfig) -> bool:
    """Whether `pacerl train` would warm-start a run of `config` (as `pacerl.train.warm_start` decides)."""
    _, steps = config.sft.resolved(config.env.id)
    fresh = config.model.path is None
    return steps > 0 and (config.sft.when == "always" or (config.sft.when == "fresh" and fresh))


def _warm_start_once(base: RunConfig, options: Options, directory: Path) -> None:
    """The warm start every run of `base` would do, done once with `pacerl sft` into `directory` (kept
    across calls: a directory holding a saved model is reused)."""
    if (directory / "config.json").is_file():
        return
    shutil.rmtree(directory, ignore_errors=True)  # an interrupted warm start starts over
    command = [sys.executable, "-m", "pacerl", "sft", "--out", str(directory)]
    command += ["--config", str(options.config)] if options.config is not None else []
    log = options.out / "warm-start.log"
    print(f"warm start ({base.sft.resolved(base.env.id)[1]} SFT steps) into {directory}", flush=True)
    with log.open("w", encoding="utf-8") as output:
        code = subprocess.run(
            [*command, *_pairs(DEFAULT_SETTINGS), *options.overrides], stdout=output, stderr=output
        ).returncode
    if code != 0:
        raise RuntimeError(f"the shared warm start failed ({_last_line(log)}); see {log}")


def _run_grid(
    grid: Sequence[GridPoint],
    plans: Mapping[GridPoint, list[str]],
    expected: Mapping[GridPoint, dict[str, Any]],
    options: Options,
    runs: Path,
) -> list[dict[str, Any]]:
    """Each point's record, running the points that have none, `options.parallel` at a time; the
    first failure stops the sweep (the points already finished stay finished)."""
    records: dict[GridPoint, dict[str, Any]] = {}
    todo = []
    for point in grid:
        done = runs / point.name / POINT_FILE
        if done.is_file():
            records[point] = json.loads(done.read_text())
            print(f"{point.label()}: finished before, skipped", flush=True)
        else:
            todo.append(point)

    def run(point: GridPoint) -> dict[str, Any]:
        record = run_point(point, plans[point], expected[point], options, runs / point.name)
        records[point] = record
        print(f"{point.label()}: {_outcome(record)} [{len(records)}/{len(grid)}]", flush=True)
        return record

    pool = ThreadPoolExecutor(max_workers=options.parallel)
    futures = [pool.submit(run, point) for point in todo]
    try:
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        # After a failure or Ctrl-C nothing new starts; the running ones end on their own (a Ctrl-C
        # reaches them too, and they stop after their current step).
        pool.shutdown(wait=True, cancel_futures=True)
    for future in finished:
        future.result()
    return [records[point] for point in grid]


def run_point(
    point: GridPoint, pairs: Sequence[str], config: Mapping[str, Any], options: Options, run_dir: Path
) -> dict[str, Any]:
    """Train one point from scratch (`pacerl train`, its output in RUN_DIR/train.log) and write its
    record, RUN_DIR/point.json: the settings and the per-step series the report is computed from."""
    from pacerl.trainer.metrics import read_metrics

    shutil.rmtree(run_dir, ignore_errors=True)  # a point interrupted mid-way starts over
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "pacerl", "train"]
    command += ["--config", str(options.config)] if options.config is not None else []
    log = run_dir / "train.log"
    with log.open("w", encoding="utf-8") as output:
        code = subprocess.run([*command, *pairs], stdout=output, stderr=output).returncode
    if code != 0:
        raise RuntimeError(f"{point.label()}: pacerl train exited with {code} ({_last_line(log)}); see {log}")
    steps = [row for row in read_metrics(run_dir) if "reward" in row]
    if len(steps) != options.steps:  # Ctrl-C ends a run early, with a checkpoint and exit code 0
        raise RuntimeError(f"{point.label()}: stopped after {len(steps)} of {options.steps} steps")
    updates = [row for row in steps if row.get("updated")]
    record = {
        "sync_interval": point.sync_interval,
        "lr": point.lr,
        "seed": point.seed,
        "steps": options.steps,
        "wall_s": float(steps[-1]["elapsed_s"]),
        "reward": [float(row["reward"]) for row in steps],
        "entropy": _finite(updates, "entropy"),
        "grad_norm": _finite(updates, "grad_norm"),
        "config": dict(config),
    }
    (run_dir / POINT_FILE).write_text(json.dumps(record) + "\n", encoding="utf-8")
    return record


def _finite(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    values = (row.get(key) for row in rows)
    return [float(value) for value in values if isinstance(value, int | float) and math.isfinite(value)]


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _outcome(record: Mapping[str, Any]) -> str:
    step = collapse_step(record["reward"])
    return "stable" if step is None else f"collapsed at step {step}"
