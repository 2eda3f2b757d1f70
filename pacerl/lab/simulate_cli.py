"""`pacerl simulate`: the async pipeline at cluster scale in simulated time (`pacerl.lab.engine`), next to
its synchronous baseline on the same GPUs; prints a table and writes `simulation.json` and PNG plots.

    pacerl simulate --inference-gpus 96 --trainer-gpus 32 --filter pace --steps 1000 --out runs/sim
    pacerl simulate --preset areal --out runs/sim-areal      # AReaL's published setup, vs its 2.77×

Settings come from, in order: the built-in defaults or `--preset`, then `--config FILE` (TOML or JSON with
the fields of `SimConfig`; nested sections `workload`, `inference`, `trainer`, `filter`), then dotted
`key=value` overrides of those fields (as `pacerl train` takes them), then the flags.
Bad input is one line naming the option, exit code 2. The trainer package (and torch with it) and
matplotlib are imported only when a simulation runs: `pacerl` builds this parser for every subcommand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pacerl.lab.config import SimConfig, cluster_filter, config_from_dict
from pacerl.settings import ConfigError, apply_overrides, read_settings

if TYPE_CHECKING:
    from pacerl.lab.presets import Preset

FILTERS = ("none", "max_age", "admission", "pace")
"""pacerl.trainer.filters.BUILT_IN_FILTERS (a test keeps them equal): listed here so the parser imports no
torch."""
PRESET_NAMES = ("areal", "verl", "pacerl-cpu")
"""pacerl.lab.presets.PRESETS' names (a test keeps them equal)."""
SIMULATION_FILE = "simulation.json"


def add_simulate_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pacerl simulate` to the CLI's subcommands. Every value is parsed by `main_simulate`, so a bad
    one is a one-line error naming its option rather than argparse's usage block."""
    parser = commands.add_parser(
        "simulate",
        help="simulate the async pipeline at cluster scale vs its synchronous baseline",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add = parser.add_argument
    add("--preset", metavar="NAME", help=f"a calibrated setup: {', '.join(PRESET_NAMES)}")
    add("--config", metavar="FILE", help="TOML or JSON with SimConfig's fields (applied after --preset)")
    add("settings", nargs="*", metavar="KEY=VALUE", help="SimConfig's fields as dotted key=value, e.g. "
        "workload.group_size=8 (applied after --config, before the flags)")  # fmt: skip
    add("--inference-gpus", metavar="N", help="GPUs running inference engines")
    add("--trainer-gpus", metavar="M", help="GPUs training")
    add("--filter", metavar="NAME", help=f"the pool's staleness filter: {', '.join(FILTERS)}")
    add("--sync-interval", metavar="S", help="publish weights every S updates")
    add("--steps", metavar="N", help="trainer steps to simulate (async)")
    add("--sync-steps", metavar="N", help="steps of the sync baseline (default: min(steps, 100))")
    add("--batch-groups", metavar="B", help="groups per batch (also sets the in-flight cap to 8B and "
        "PACE's target to B unless given)")  # fmt: skip
    add("--group-size", metavar="G", help="trajectories per group")
    add("--max-concurrent-groups", metavar="N", help="groups in flight at most")
    add("--max-offpolicyness", metavar="ETA", help="admission: AReaL's η")
    add("--max-age", metavar="K", help="max_age: the oldest token version gap allowed")
    add("--target-groups", metavar="P", help="pace: the target pool occupancy in groups")
    add("--sync-baseline", metavar="KIND", help="colocated (every GPU generates, then trains) or split")
    add("--interrupt", metavar="KIND", help="reprefill (AReaL) or continue (PipelineRL)")
    add(
        "--trace", metavar="FILE", help="trajectory JSONL whose lengths, turns and tool latencies to resample"
    )
    add("--seed", metavar="N", help="seed of every sample")
    add("--out", metavar="DIR", default="runs/simulate", help="where simulation.json and the plots go")
    add("--plots", action=argparse.BooleanOptionalAction, default=True, help="write the PNG plots")
    parser.set_defaults(handler=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    """`pacerl simulate ...`."""
    return main_simulate(args)


def _integer(option: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{option} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{option} must be >= {minimum}, got {value}")
    return value


def _choice(option: str, raw: str, choices: Sequence[str]) -> str:
    if raw not in choices:
        raise ValueError(f"{option} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as a nested settings mapping, each value checked with its option's name."""
    data: dict[str, Any] = {}
    filter_: dict[str, Any] = {}
    integers = (
        ("inference_gpus", "--inference-gpus", 1),
        ("trainer_gpus", "--trainer-gpus", 1),
        ("sync_interval", "--sync-interval", 1),
        ("steps", "--steps", 1),
        ("sync_steps", "--sync-steps", 1),
        ("batch_groups", "--batch-groups", 1),
        ("seed", "--seed", 0),
    )
    for key, option, minimum in integers:
        raw = getattr(args, key)
        if raw is not None:
            data[key] = _integer(option, raw, minimum)
    # flag -> (the filter's section, or "" for the filter itself; key)
    for attribute, option, minimum, (section, key) in (
        ("max_concurrent_groups", "--max-concurrent-groups", 1, ("", "max_concurrent_groups")),
        ("max_offpolicyness", "--max-offpolicyness", 0, ("admission", "max_offpolicyness")),
        ("max_age", "--max-age", 0, ("max_age", "versions")),
        ("target_groups", "--target-groups", 1, ("pace", "target_groups")),
    ):
        raw = getattr(args, attribute)
        if raw is not None:
            place = filter_.setdefault(section, {}) if section else filter_
            place[key] = _integer(option, raw, minimum)
    if args.filter is not None:
        # a user's filter (module:name) is checked by the config, which imports its module
        filter_["name"] = args.filter if ":" in args.filter else _choice("--filter", args.filter, FILTERS)
    if "batch_groups" in data:  # the filter's defaults follow the batch (`cluster_filter`)
        derived = cluster_filter(data["batch_groups"])
        filter_.setdefault("max_concurrent_groups", derived.max_concurrent_groups)
        filter_.setdefault("pace", {}).setdefault("target_groups", derived.pace.target_groups)
    if filter_:
        data["filter"] = filter_
    if args.group_size is not None:
        data["workload"] = {"group_size": _integer("--group-size", args.group_size, 1)}
    if args.sync_baseline is not None:
        data["sync_baseline"] = _choice("--sync-baseline", args.sync_baseline, ("colocated", "split"))
    if args.interrupt is not None:
        data["interrupt"] = _choice("--interrupt", args.interrupt, ("reprefill", "continue"))
    return data


def _read_config(path: str) -> dict[str, Any]:
    try:
        return read_settings(Path(path))
    except ConfigError as error:
        raise ValueError(f"--config: {error}") from None


def build_config(args: argparse.Namespace) -> tuple[SimConfig, Preset | None]:
    """The simulation config from the preset, the config file and the flags (ValueError naming the
    option on bad input)."""
    preset_name = None if args.preset is None else _choice("--preset", args.preset, PRESET_NAMES)
    overrides = _overrides(args)  # checked before the heavy import below
    file_data = _read_config(args.config) if args.config is not None else None
    if args.settings:
        try:
            file_data = apply_overrides(dict(file_data or {}), args.settings)
        except ConfigError as error:
            raise ValueError(f"key=value: {error}") from None

    from pacerl.lab.presets import PRESETS
    from pacerl.lab.traces import workload_from_trace

    preset = PRESETS[preset_name]() if preset_name is not None else None
    config = preset.config if preset is not None else SimConfig()
    if file_data is not None:
        try:
            config = config_from_dict(config, file_data)
        except ValueError as error:
            source = f"--config {args.config}" if args.config is not None else "key=value"
            raise ValueError(f"{source}: {error}") from None
    if args.trace is not None:
        from pacerl.agents.trajectory_io import load_jsonl

        try:
            workload = workload_from_trace(
                load_jsonl(args.trace), overrides.get("workload", {}).get("group_size")
            )
        except (OSError, ValueError) as error:
            raise ValueError(f"--trace {args.trace}: {error}") from None
        # the trace's own lengths pick the record-token block, not the preset's
        config = dataclasses.replace(config, workload=workload, token_block=None)
    try:
        config = config_from_dict(config, overrides)
    except ValueError as error:
        raise ValueError(
            f"the options do not make a valid setup: {_name_options(str(error), args)}"
        ) from None
    return config, preset


def _name_options(message: str, args: argparse.Namespace) -> str:
    """`message` with each setting the user gave as a flag called by its option (`--inference-gpus`
    for `inference_gpus`), so the error names what to change."""
    for key, value in sorted(vars(args).items(), key=lambda item: -len(item[0])):
        if value is not None and key not in (
            "out",
            "plots",
            "handler",
            "command",
            "preset",
            "config",
            "trace",
            "settings",
        ):
            message = re.sub(rf"(?<![\w.-]){key}\b", "--" + key.replace("_", "-"), message)
    return message


def main_simulate(args: argparse.Namespace) -> int:
    """Build the config, simulate both modes, print the table, write the JSON and the plots."""
    config, preset = build_config(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before the run: a bad --out fails in a second, not minutes
    from pacerl.lab.engine import simulate
    from pacerl.lab.simulate_report import print_report, write_plots

    result = simulate(config)
    data = result.to_json()
    data["preset"] = None
    if preset is not None:
        data["preset"] = {
            "name": args.preset,
            "description": preset.description,
            "published": None if preset.published is None else vars(preset.published),
            "sources": list(preset.sources),
        }
    _write_json(out / SIMULATION_FILE, data)
    written = [out / SIMULATION_FILE]
    if args.plots:
        written += write_plots(result, out)
    print_report(result, preset, args.preset)
    for path in written:
        print(f"wrote {path}")
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(partial, path)
