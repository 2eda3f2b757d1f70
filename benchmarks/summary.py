"""One table of every speed ratio `make bench` measures against its target, read from the benchmarks'
JSON results; writes it as JSON and, with `--readme`, into the README between its markers.

    .venv/bin/python benchmarks/summary.py [--results benchmarks/results] [--readme README.md]

A measure whose result file or field is missing is listed as not measured (run its benchmark first);
nothing is carried over from an earlier table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
"""The README lines between which the table is regenerated."""


@dataclass(frozen=True)
class Measure:
    """One row: a figure computed from a benchmark's results and the target it must meet."""

    name: str
    """What is measured, as the table shows it."""
    source: str
    """The result file (under the results directory) the figure comes from."""
    figure: Callable[[dict[str, Any]], float]
    """The figure from that file's JSON (KeyError: not measured)."""
    target: float
    """The bound it must meet."""
    higher_is_better: bool
    """Whether the target is a floor (True) or a ceiling (False)."""
    unit: str
    """How the figure and the target are printed: "x" for a ratio, "ms", "s"."""

    def met(self, value: float) -> bool:
        return value >= self.target if self.higher_is_better else value <= self.target


def _ratio(numerator: float, denominator: float) -> float:
    if denominator <= 0:
        raise KeyError("a zero or negative denominator: not measured")
    return numerator / denominator


def _sandbox_plain(result: dict[str, Any]) -> float:
    return float(result["plain_python3_-I_-c"]["p50_ms"])


MEASURES = (
    Measure(
        "embedded engine vs transformers generate (tok/s)",
        "engine.json",
        lambda r: float(r["engine_vs_hf"]),
        3.0,
        True,
        "x",
    ),
    Measure(
        "local one-shot, warm sandbox waiting, vs python3 -I -c (p50)",
        "sandbox.json",
        lambda r: _ratio(r["local_bwrap"]["oneshot_idle_arrivals"]["p50_ms"], _sandbox_plain(r)),
        0.5,
        False,
        "x",
    ),
    Measure(
        "local one-shot back to back vs python3 -I -c (p50)",
        "sandbox.json",
        lambda r: _ratio(r["local_bwrap"]["oneshot_back_to_back"]["p50_ms"], _sandbox_plain(r)),
        1.0,
        False,
        "x",
    ),
    Measure(
        "docker vs local throughput (runs/s, 8 callers)",
        "sandbox.json",
        lambda r: _ratio(
            r["docker"]["throughput_runs_per_s"]["8"], r["local_bwrap"]["throughput_runs_per_s"]["8"]
        ),
        0.5,
        True,
        "x",
    ),
    Measure(
        "docker one-shot back to back (p50)",
        "sandbox.json",
        lambda r: float(r["docker"]["oneshot_back_to_back"]["p50_ms"]),
        30.0,
        False,
        "ms",
    ),
    Measure(
        "Learner.train_step vs plain fwd+bwd+AdamW (tok/s)",
        "trainer.json",
        lambda r: float(r["learner_vs_plain"]),
        1.0,
        True,
        "x",
    ),
    Measure(
        "pacerl simulate, 1,000 steps of 96 + 32 GPUs (wall)",
        "simulate.json",
        lambda r: float(r["wall_s"]),
        20.0,
        False,
        "s",
    ),
    Measure(
        "SmolLM2-135M: embedded engine vs transformers generate (tok/s, long-tail batches of 16)",
        "engine_smollm2.json",
        lambda r: float(r["engine_vs_hf"]),
        3.0,
        True,
        "x",
    ),
    Measure(
        "SmolLM2-135M: Learner.train_step vs plain fwd+bwd+AdamW (tok/s)",
        "trainer_smollm2.json",
        lambda r: float(r["learner_vs_plain"]),
        1.0,
        True,
        "x",
    ),
    Measure(
        "SmolLM2-135M: CPU time of a learner step with the heap handed back after it vs without",
        "host_memory.json",
        lambda r: float(next(m["cpu_vs_glibc"] for m in r["modes"] if m["mode"] == "trim")),
        1.10,
        False,
        "x",
    ),
)
"""Issue 19's targets, in its order, then issue 28's on a real model (`make bench-real`)."""


def _shown(value: float, unit: str) -> str:
    return f"{value:.2f}×" if unit == "x" else f"{value:.1f} {unit}"


def summarise(results: Path) -> list[dict[str, Any]]:
    """Each measure's figure (None when not measured), its target and whether it is met."""
    rows = []
    for measure in MEASURES:
        path = results / measure.source
        value: float | None = None
        if path.is_file():
            try:
                value = measure.figure(json.loads(path.read_text(encoding="utf-8")))
            except (KeyError, TypeError, ValueError):
                value = None
        bound = "≥" if measure.higher_is_better else "≤"
        rows.append(
            {
                "measure": measure.name,
                "source": measure.source,
                "value": value,
                "shown": "not measured" if value is None else _shown(value, measure.unit),
                "target": f"{bound} {_shown(measure.target, measure.unit)}",
                "met": None if value is None else measure.met(value),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as the README shows it."""
    lines = ["| measure | now | target | met |", "|---|--:|--:|:-:|"]
    for row in rows:
        met = "–" if row["met"] is None else ("yes" if row["met"] else "no")
        lines.append(f"| {row['measure']} | {row['shown']} | {row['target']} | {met} |")
    return "\n".join(lines)


def replace_block(text: str, table: str) -> str:
    """`text` with the lines between the markers replaced by `table`; ValueError without markers."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"the README needs one {START} line before one {END} line")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--readme", type=Path, help="rewrite the table between the README's markers")
    args = parser.parse_args(argv)
    rows = summarise(args.results)
    table = markdown(rows)
    print(table)
    (args.results / "summary.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.readme is not None:
        args.readme.write_text(
            replace_block(args.readme.read_text(encoding="utf-8"), table), encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
