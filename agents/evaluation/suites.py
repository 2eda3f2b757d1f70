"""Benchmark suites: evaluate every benchmark of a suite (`pacerl.agents.evaluation.benchmarks`) and report
avg@k, pass@k and maj@k per benchmark and their average, as the tables of papers do.

    result = run_suite("math", evaluate_benchmark, label="Qwen3-1.7B")
    print(result.table())        # benchmarks as columns, then Avg.; rows avg@k, pass@k (and maj@k)
    print(result.markdown())     # the same table in Markdown
    json.dumps(result.to_json())

`evaluate_benchmark(benchmark)` is the caller's: it plays the benchmark's tasks (`load_benchmark`) in its
env (`benchmark.env_id`) with a config from `benchmark_eval_config` and returns the `EvalReport`.

The layout: one column per benchmark, its header naming k (`AIME24 (k=32)`), then `Avg.`; two rows per
model, `avg@k` (the mean correctness of the k samples, the expected pass@1) and `pass@k` (the unbiased
estimator at that benchmark's k), and a third, `maj@k` (the share of tasks whose k samples' most frequent
final answer is correct: `scores.majority_correct`) when the envs extract answers, `-` for one that does
not; in percent with one decimal, since the k differ across columns (AIME
avg@32, GSM8K greedy) and one cell holding both would not sort or copy. `Avg.` is the unweighted mean over
the benchmarks, as Search-R1 and the math papers average their columns; for a greedy benchmark pass@1 is
its avg@1.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rich.console import Console
from rich.table import Table

from pacerl.agents.evaluation.benchmarks import Benchmark, suite_benchmarks
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.report import EvalReport


@dataclass(frozen=True)
class BenchmarkResult:
    """One benchmark's headline numbers and its full report."""

    benchmark: Benchmark
    """What was evaluated."""
    report: EvalReport
    """Its evaluation."""

    @property
    def k(self) -> int:
        """Samples per task."""
        return self.report.samples

    @property
    def avg_at_k(self) -> float:
        return self.report.avg_at_k

    @property
    def pass_at_k(self) -> float:
        """pass@k at k = the samples per task."""
        return self.report.pass_at_k[self.report.samples]

    @property
    def maj_at_k(self) -> float | None:
        """maj@k at k = the samples per task; None when the env extracts no answers."""
        return self.report.maj_at_k

    def to_json(self) -> dict[str, Any]:
        bench = self.benchmark
        return {
            "name": bench.name,
            "title": bench.title,
            "dataset": bench.dataset,
            "configs": list(bench.configs),
            "split": bench.split,
            "env_id": bench.env_id,
            "tasks": self.report.tasks,
            "k": self.k,
            "avg_at_k": self.avg_at_k,
            "pass_at_k": self.pass_at_k,
            "maj_at_k": self.maj_at_k,
            "report": self.report.to_json(),
        }


@dataclass(frozen=True)
class SuiteResult:
    """A suite's results for one model."""

    suite: str
    """The suite (or single benchmark) name."""
    label: str
    """The model, in the caller's words: the row header of the table."""
    results: tuple[BenchmarkResult, ...]
    """One per benchmark, in the suite's order."""

    @property
    def average_avg_at_k(self) -> float:
        """The unweighted mean of the benchmarks' avg@k."""
        return sum(r.avg_at_k for r in self.results) / len(self.results)

    @property
    def average_pass_at_k(self) -> float:
        """The unweighted mean of the benchmarks' pass@k (each at its own k)."""
        return sum(r.pass_at_k for r in self.results) / len(self.results)

    @property
    def average_maj_at_k(self) -> float | None:
        """The unweighted mean of the benchmarks' maj@k; None unless every benchmark reports one."""
        values = [r.maj_at_k for r in self.results]
        if any(value is None for value in values):
            return None
        return sum(value or 0.0 for value in values) / len(values)

    def to_json(self) -> dict[str, Any]:
        average = {
            "avg_at_k": self.average_avg_at_k,
            "pass_at_k": self.average_pass_at_k,
            "maj_at_k": self.average_maj_at_k,
        }
        return {
            "suite": self.suite,
            "label": self.label,
            "benchmarks": [result.to_json() for result in self.results],
            "average": average,
        }

    def table(self) -> str:
        """The paper layout as aligned text (`suite_table` of this one model)."""
        return suite_table([self])

    def markdown(self) -> str:
        """The paper layout as a Markdown table (`suite_markdown` of this one model)."""
        return suite_markdown([self])


def _layout(results: Sequence[SuiteResult]) -> tuple[list[str], list[list[str]]]:
    if not results:
        raise ValueError("no suite results to tabulate")
    columns = [(r.benchmark.name, r.benchmark.title, r.k) for r in results[0].results]
    for result in results[1:]:
        if [(r.benchmark.name, r.benchmark.title, r.k) for r in result.results] != columns:
            raise ValueError("suite results tabulated together must have the same benchmarks and k")
    header = ["model", "metric", *(f"{title} (k={k})" for _, title, k in columns), "Avg."]
    rows = []
    for result in results:
        metrics: list[tuple[str, list[float | None], float | None]] = [
            ("avg@k", [r.avg_at_k for r in result.results], result.average_avg_at_k),
            ("pass@k", [r.pass_at_k for r in result.results], result.average_pass_at_k),
        ]
        if any(r.maj_at_k is not None for r in result.results):
            metrics.append(("maj@k", [r.maj_at_k for r in result.results], result.average_maj_at_k))
        for metric, values, average in metrics:
            cells = ("-" if v is None else f"{100 * v:.1f}" for v in [*values, average])
            rows.append([result.label or "model", metric, *cells])
    return header, rows


def suite_table(results: Sequence[SuiteResult]) -> str:
    """Several models' results on one suite as aligned text: benchmarks as columns, then Avg.; rows
    avg@k, pass@k and (when the envs extract answers) maj@k per model, in percent."""
    header, rows = _layout(results)
    table = Table(title=f"suite {results[0].suite}")
    for index, name in enumerate(header):
        table.add_column(name, justify="left" if index < 2 else "right")
    for row in rows:
        table.add_row(*row)
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue()


def suite_markdown(results: Sequence[SuiteResult]) -> str:
    """`suite_table` as a Markdown table, for a paper draft or a README."""
    header, rows = _layout(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def benchmark_eval_config(
    benchmark: Benchmark, base: EvalConfig | None = None, given: Mapping[str, Any] | None = None
) -> EvalConfig:
    """The `EvalConfig` for `benchmark`: `base` (default `EvalConfig()`), then the benchmark's own
    settings (`eval_settings`: samples, temperature, Search-R1's stop strings and budgets), then what
    the user set explicitly (`given`, e.g. `{"samples": 8}`), which wins. `ks` keeps only the k a
    benchmark's samples allow."""
    settings = {**benchmark.eval_settings, **(given or {})}
    config = replace(base or EvalConfig(), **{k: v for k, v in settings.items() if k != "ks"}, ks=(1,))
    ks = settings.get("ks", (base.ks if base is not None else (1,)))
    return replace(config, ks=tuple(k for k in ks if k <= config.samples) or (1,))


def run_suite(
    name: str,
    evaluate_benchmark: Callable[[Benchmark], EvalReport],
    *,
    label: str = "",
    benchmarks: Sequence[str] | None = None,
) -> SuiteResult:
    """Evaluate every benchmark of suite `name` (a benchmark's own name is a suite of one) with
    `evaluate_benchmark`, in the suite's order; `benchmarks` keeps only those named. A failure in one
    benchmark propagates: a table with a silently missing column would mislead."""
    members = suite_benchmarks(name)
    if benchmarks is not None:
        unknown = set(benchmarks) - {b.name for b in members}
        if unknown:
            raise ValueError(f"suite {name!r} has no benchmark {sorted(unknown)}")
        members = tuple(b for b in members if b.name in benchmarks)
    results = tuple(BenchmarkResult(benchmark, evaluate_benchmark(benchmark)) for benchmark in members)
    return SuiteResult(name, label, results)
