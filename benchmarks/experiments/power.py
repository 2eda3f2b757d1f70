"""How much each seed experiment can tell (docs/experiments.md): for every comparison a paper makes, the
per-seed differences of this project's runs, their mean with its 95% t-interval, the minimum detectable
effect (MDE) at the seeds run, the paper's effect on the same scale, the seeds that effect would need, and
a verdict: reproduced in miniature (the interval excludes zero on the paper's side), not reproduced (the
experiment could have seen the paper's effect and the interval excludes it), or inconclusive. Collapse
counts are compared with a one-sided Fisher exact test.

    .venv/bin/python benchmarks/experiments/power.py

Reads the results JSON the experiment scripts wrote (each names its commit) and writes
benchmarks/experiments/results/power.{md,json}.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, collapsed, markdown_table, paired_comparison, provenance, provenance_line

from pacerl.lab.power import fisher_exact_greater, mean_interval, minimum_detectable_effect, seeds_needed

RESULTS = ROOT / "benchmarks" / "experiments" / "results"

PACE = "cluster_pace-codemath-v0"
SAT_EDGE, SAT_LOW = "sat_r3_exact-math-v0", "sat_r3_exact-lr1e-4-math-v0"
LAG1, LAG8 = 35.83 / 32.25 - 1, 34.79 / 31.46 - 1
PAPER_GAINS: list[tuple[str, str, str, str, str, float, str]] = [
    # (experiment, results stem, arm, baseline, metric, the paper's relative gain, where it comes from)
    ("(a) PACE", PACE, "async+pace", "async", "eval_end", 0.187,
     "PACE abstract: +18.7% over unfiltered async at equal wall-clock"),
    ("(b) SAT-GSPO + R3, lag 1, lr 1e-4", SAT_LOW, "sat-gspo+r3-lag1", "gspo-lag1", "eval_end", LAG1,
     "SAT Table 1: AIME24 35.83 vs 32.25 at lag 1"),
    ("(b) SAT-GSPO + R3, lag 8, lr 1e-4", SAT_LOW, "sat-gspo+r3-lag8", "gspo-lag8", "eval_end", LAG8,
     "SAT Table 1: AIME24 34.79 vs 31.46 at lag 8"),
    ("(b) SAT-GSPO + R3, lag 1, lr 5e-4", SAT_EDGE, "sat-gspo+r3-lag1", "gspo-lag1", "eval_end", LAG1,
     "SAT Table 1: AIME24 35.83 vs 32.25 at lag 1"),
    ("(b) SAT-GSPO + R3, lag 8, lr 5e-4", SAT_EDGE, "sat-gspo+r3-lag8", "gspo-lag8", "eval_end", LAG8,
     "SAT Table 1: AIME24 34.79 vs 31.46 at lag 8"),
    ("(b) GSPO + R3, lag 1, lr 5e-4", SAT_EDGE, "gspo+r3-lag1", "gspo-lag1", "eval_end", 34.00 / 32.25 - 1,
     "SAT Table 1: 34.00 vs 32.25 at lag 1"),
    ("(b) SAT-GSPO, lag 8, lr 5e-4", SAT_EDGE, "sat-gspo-lag8", "gspo-lag8", "eval_end", 32.71 / 31.46 - 1,
     "SAT Table 1: 32.71 vs 31.46 at lag 8"),
    ("Search RL after 150 SFT steps", "search_rl-search-v0", "sync RL", "", "gain", 0.0,
     "no paper: this project's own one-seed claim of a gain"),
    ("Search RL after 300 SFT steps", "search_rl-sft300-search-v0", "sync RL", "", "gain", 0.0,
     "no paper: the warm start the env's recipe asks for"),
]  # fmt: skip
"""The comparisons the papers report as gains, in this project's arms."""


def load(stem: str) -> tuple[list[dict[str, Any]], Mapping[str, Any]] | None:
    """(runs, provenance) of a results file, None when it was not written."""
    path = RESULTS / f"{stem}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if isinstance(data, list):  # written before results named their commit
        return data, {"commit": "unknown (before results named their commit)"}
    return data["runs"], data["provenance"]


def verdict(mean: float, half: float, mde: float, effect: float) -> str:
    if mean - half > 0:
        return "reproduced in miniature"
    if mde <= effect and mean + half < effect:
        return "not reproduced (the effect was detectable and is not there)"
    return "inconclusive (the seeds cannot detect the paper's effect)" if mde > effect else "inconclusive"


def within_run_gain(
    experiment: str, loaded: tuple[list[dict[str, Any]], Mapping[str, Any]], arm: str, key: str, source: str
) -> dict[str, Any]:
    """A gain each run measures against its own start (`key`, e.g. after − before), over the seeds."""
    values = [float(r[key]) for r in loaded[0] if r.get("arm") == arm and isinstance(r.get(key), int | float)]
    interval = mean_interval(values)
    mde = minimum_detectable_effect(interval.sd, len(values), paired=True) if len(values) >= 2 else math.nan
    shown = interval.mean - interval.half_width > 0
    return {
        "experiment": experiment,
        "comparison": f"{arm}: {key}",
        "seeds": len(values),
        "difference": interval.text(3),
        "sd": interval.sd,
        "mde": mde,
        "paper": "–",
        "needed": "–",
        "verdict": "a gain (interval above zero)" if shown else "no gain shown",
        "source": source,
        "commit": loaded[1]["commit"][:12],
        "differences": values,
    }


def gain_rows() -> list[dict[str, Any]]:
    rows = []
    for experiment, stem, arm, baseline, key, relative, source in PAPER_GAINS:
        loaded = load(stem)
        if loaded and not baseline:  # a gain within each run (after − before)
            rows.append(within_run_gain(experiment, loaded, arm, key, source))
            continue
        comparison = paired_comparison(loaded[0], arm, baseline, key) if loaded else None
        if comparison is None:
            rows.append({"experiment": experiment, "comparison": f"{arm} − {baseline}", "verdict": "not run"})
            continue
        effect = relative * comparison["baseline_mean"]
        needed = seeds_needed(effect, comparison["sd"], paired=True) if effect > 0 else None
        rows.append(
            {
                "experiment": experiment,
                "comparison": f"{arm} − {baseline} ({key})",
                "seeds": len(comparison["seeds"]),
                "difference": f"{comparison['mean']:+.3f} ± {comparison['half_width']:.3f}",
                "sd": comparison["sd"],
                "mde": comparison["mde"],
                "paper": f"{effect:+.3f} ({100 * relative:+.1f}%)",
                "needed": "–" if needed is None else needed,
                "verdict": verdict(comparison["mean"], comparison["half_width"], comparison["mde"], effect),
                "source": source,
                "commit": loaded[1]["commit"][:12] if loaded else "",
                "differences": comparison["differences"],
            }
        )
    return rows


def collapse_rows(pairs: Sequence[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
    """(label, results stem, arm, baseline): collapses of `arm` against `baseline` over the same seeds."""
    rows = []
    for label, stem, arm, baseline in pairs:
        loaded = load(stem)
        if loaded is None:
            rows.append({"comparison": label, "test": "not run"})
            continue
        runs = [r for r in loaded[0] if "error" not in r]
        ours = [collapsed(r) for r in runs if r["arm"] == arm]
        theirs = [collapsed(r) for r in runs if r["arm"] == baseline]
        if not ours or not theirs:
            rows.append({"comparison": label, "test": "not run"})
            continue
        p = fisher_exact_greater(sum(ours), len(ours), sum(theirs), len(theirs))
        rows.append(
            {
                "comparison": label,
                "arm": f"{arm}: {sum(ours)}/{len(ours)}",
                "baseline": f"{baseline}: {sum(theirs)}/{len(theirs)}",
                "p": p,
                "test": "the arm collapses more (p < 0.05)" if p < 0.05 else "no difference shown",
                "commit": loaded[1]["commit"][:12],
            }
        )
    return rows


def main() -> None:
    gains = gain_rows()
    collapses = collapse_rows(
        [
            (
                "R3 at lag 1, lr 1e-3, router noise 0.1",
                "r3_lag1-noise0.1-math-v0",
                "gspo+r3-lag1",
                "gspo-lag1",
            ),
            ("R3 at lag 1, lr 1e-3, router noise 0", "r3_lag1-noise0-math-v0", "gspo+r3-lag1", "gspo-lag1"),
            (
                "R3 on the eight sums, on-policy, lr 1e-3, router noise 0.1",
                "r3_eight-lag0-noise0.1-math-v0",
                "gspo+r3-lag0",
                "gspo-lag0",
            ),
            (
                "R3 on the eight sums, on-policy, lr 1e-3, router noise 0",
                "r3_eight-lag0-noise0-math-v0",
                "gspo+r3-lag0",
                "gspo-lag0",
            ),
            ("R3 at lag 8 (lr 5e-4)", SAT_EDGE, "gspo+r3-lag8", "gspo-lag8"),
            (
                "SAT-GSPO + R3 against SAT-GSPO at lag 8 (lr 5e-4)",
                SAT_EDGE,
                "sat-gspo+r3-lag8",
                "sat-gspo-lag8",
            ),
            ("GSPO at lag 1 against lag 8 (lr 5e-4)", SAT_EDGE, "gspo-lag1", "gspo-lag8"),
        ]
    )
    made = provenance()
    text = "# What the seed experiments can detect\n\n" + provenance_line(made) + "\n\n"
    text += "## Gains the papers report\n\n" + markdown_table(
        gains,
        [
            ("experiment", "experiment"),
            ("comparison", "comparison"),
            ("seeds", "seeds"),
            ("difference", "difference (95% CI)"),
            ("sd", "sd of the differences"),
            ("mde", "MDE at these seeds"),
            ("paper", "the paper's effect here"),
            ("needed", "seeds it needs"),
            ("verdict", "verdict"),
            ("commit", "results' commit"),
        ],
    )
    text += "\nMDE: the smallest true paired difference a two-sided test at α 0.05 detects with power 0.8, "
    text += "from the seeds' spread. The paper's effect is its relative gain applied to this baseline. "
    text += (
        f"With {len(gains)} comparisons, each interval at 95%, about {0.05 * len(gains):.1f} would exclude "
    )
    text += "zero by chance alone: a single one that does is weak evidence.\n\n"
    text += "## Collapses\n\n" + markdown_table(
        collapses,
        [
            ("comparison", "comparison"),
            ("arm", "arm collapsed"),
            ("baseline", "baseline collapsed"),
            ("p", "one-sided Fisher p"),
            ("test", "result"),
            ("commit", "results' commit"),
        ],
    )
    (RESULTS / "power.md").write_text(text)
    data = {"provenance": made, "gains": gains, "collapses": collapses}
    (RESULTS / "power.json").write_text(json.dumps(data, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
