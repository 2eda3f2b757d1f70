"""The mutation score of `make mutate` (docs/mutation.md), read from mutmut's results in mutants/.

Counts mutmut's mutants in scope per file: every function of losses.py, advantages.py and replay.py of
pacerl/trainer/, and the budget, ranking and draw/reject functions of its pool.py (`POOL_SCOPE`;
mutmut mutates the whole file, the rest of it is out of scope and not run). Killed = a test failed, or
the mutant ran past mutmut's time limit (an infinite loop); the score is killed over all in-scope
mutants, so a mutant that no selected test reaches counts as a survivor. Prints each survivor with its
source line and the mutation. Then applies `NAMED_MUTANTS`, the wrong edits issues 14 and 27 name
(mutmut's operators do not make all of them), one at a time to a copy of the tree, and runs each one's
tests on it. Exits 1 when a mutant in scope was not run, the score is below `--min-score`, or a named
mutant survives.

Run from the repository root after `mutmut run` (the Makefile's `mutate` target does both).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

FILES = (
    "pacerl/trainer/losses.py",
    "pacerl/trainer/advantages.py",
    "pacerl/trainer/pool.py",
    "pacerl/trainer/replay.py",
)
POOL_SCOPE = (
    "admission_capacity",
    "pace_budget",
    "percentile_ranks",
    "effective_staleness",
    "_power",
    "_order_ends",
    "prefix_drift",
    "TrajectoryPool.select",
    "TrajectoryPool._pace",
    "TrajectoryPool._keep_all",
    "TrajectoryPool._max_age",
)
"""The pool's functions in scope, as `function` or `Class.method`."""
MUTANT_GLOBS = (
    "pacerl.trainer.losses.*",
    "pacerl.trainer.advantages.*",
    "pacerl.trainer.replay.*",
    *(
        f"pacerl.trainer.pool.{'xǁ' + name.replace('.', 'ǁ') if '.' in name else 'x_' + name}__mutmut_*"
        for name in POOL_SCOPE
    ),
)
"""mutmut's names of the mutants in scope (what `mutmut run` is given)."""

TESTS = ("tests/trainer/test_losses.py", "tests/trainer/test_pool.py", "tests/trainer/test_replay.py")
"""The tests mutmut runs (`pytest_add_cli_args_test_selection` in pyproject.toml)."""


class Named(NamedTuple):
    """A hand-written mutant: the file it edits, its edits (original text, replacement; each original
    found exactly once) and the tests that must kill it."""

    path: str
    edits: list[tuple[str, str]]
    tests: tuple[str, ...] = TESTS
    """`TESTS`, or for an edit outside mutmut's files (the learner's), the tests written to kill it:
    learner tests are too slow for every mutmut mutant, not for one named edit."""


_GATE = (
    "c_high = torch.where(gated & (d > 0), k, torch.ones_like(k))",
    "c_low = torch.where(gated & (d < 0), k, ",
)
_BOUNDS = "return 1 - clip.eps_low * c_low, 1 + clip.eps_high * c_high, gated, k"
_CAUCHY = "k = 1.0 / (1.0 + ((magnitude - q) / q.clamp_min(1e-12)) ** 2)"
_STALENESS = "staleness = sequence_staleness(logprobs, behaviour, mask)"
_GSPO_BOUNDS = "lo, hi, gated, k = sat_bounds(staleness, present, clip, sat, sat_threshold)"
_DENOMINATOR = 'denominator = float(tokens if unit == "token" else len(trajectories))'
_UPDATES = "tests/trainer/test_learner_updates.py"
_SCORE = "score = np.add.reduceat(s_eff, starts) / np.diff(starts, append=rows.size)"
NAMED_MUTANTS: dict[str, Named] = {
    "SAT endpoint selection swapped": Named(
        "pacerl/trainer/losses.py",
        [(_GATE[0], _GATE[0].replace("d > 0", "d < 0")), (_GATE[1], _GATE[1].replace("d < 0", "d > 0"))],
    ),
    "contraction radius: cauchy exponent 3": Named(
        "pacerl/trainer/losses.py",
        [(_CAUCHY, _CAUCHY.replace("** 2", "** 3"))],
    ),
    "contraction radius: cauchy scale 2q": Named(
        "pacerl/trainer/losses.py",
        [(_CAUCHY, _CAUCHY.replace("/ q.clamp_min", "/ (2 * q).clamp_min"))],
    ),
    "contraction radius: rational q² instead of 2q²": Named(
        "pacerl/trainer/losses.py",
        [("k = 2 * q**2 / (q**2 + magnitude**2)", "k = q**2 / (q**2 + magnitude**2)")],
    ),
    "contraction radius: c² instead of c": Named(
        "pacerl/trainer/losses.py",
        [(_BOUNDS, _BOUNDS.replace("c_low,", "c_low**2,").replace("c_high,", "c_high**2,"))],
    ),
    "sequence-level gate: mean |d| instead of |mean d|": Named(
        "pacerl/trainer/losses.py",
        [(_STALENESS, "staleness = ((logprobs - behaviour).abs() * weights).sum(-1) / lengths")],
    ),
    "sequence-level gate: largest token |d|": Named(
        "pacerl/trainer/losses.py",
        [(_STALENESS, "staleness = torch.where(mask, (logprobs - behaviour).abs(), 0.0).amax(-1)")],
    ),
    "sequence-level gate: rows without tokens in the quantile": Named(
        "pacerl/trainer/losses.py",
        [(_GSPO_BOUNDS, _GSPO_BOUNDS.replace("present,", "torch.ones_like(present),"))],
    ),
    "asymmetric epsilons swapped (SAT)": Named(
        "pacerl/trainer/losses.py",
        [
            (
                _BOUNDS,
                _BOUNDS.replace("eps_low", "EPS").replace("eps_high", "eps_low").replace("EPS", "eps_high"),
            )
        ],
    ),
    "asymmetric epsilons swapped (token losses)": Named(
        "pacerl/trainer/losses.py",
        [
            (
                "lo = torch.full_like(logprobs, 1 - clip.eps_low)",
                "lo = torch.full_like(logprobs, 1 - clip.eps_high)",
            ),
            (
                "hi = torch.full_like(logprobs, 1 + clip.eps_high)",
                "hi = torch.full_like(logprobs, 1 + clip.eps_low)",
            ),
        ],
    ),
    "asymmetric epsilons swapped (GSPO)": Named(
        "pacerl/trainer/losses.py",
        [
            ("sequence_log_ratio, 1 - clip.eps_low)", "sequence_log_ratio, 1 - clip.eps_high)"),
            ("sequence_log_ratio, 1 + clip.eps_high)", "sequence_log_ratio, 1 + clip.eps_low)"),
        ],
    ),
    "padding counted in the quantile": Named(
        "pacerl/trainer/losses.py",
        [
            (
                "values = staleness_log_ratio.detach().abs()[active]",
                "values = staleness_log_ratio.detach().abs().flatten()",
            )
        ],
    ),
    "GSPO's mean counting empty rows": Named(
        "pacerl/trainer/losses.py",
        [
            (
                "loss = _batch_mean(per_sequence[present], denominator)",
                "loss = _batch_mean(per_sequence, denominator)",
            )
        ],
    ),
    "PACE's group score the max instead of the mean": Named(
        "pacerl/trainer/pool.py",
        [(_SCORE, "score = np.maximum.reduceat(s_eff, starts)")],
    ),
    "PACE's group score the sum instead of the mean": Named(
        "pacerl/trainer/pool.py",
        [(_SCORE, "score = np.add.reduceat(s_eff, starts)")],
    ),
    "PACE draws the lowest S_eff first instead of in arrival order": Named(
        "pacerl/trainer/pool.py",
        [
            (
                "return rejected, np.flatnonzero(kept)[:batch_groups]",
                "order = np.argsort(score, kind='stable')\n"
                "        return rejected, order[kept[order]][:batch_groups]",
            )
        ],
    ),
    "replayed routes given the live gate weights": Named(
        "pacerl/trainer/replay.py",
        [("scores = weights(module, logits, chosen)", "scores = weights(module, logits, live)")],
    ),
    "SAT's threshold for later updates taken at the proximal weights": Named(
        "pacerl/trainer/update_step.py",
        [("if proximal is not None and not moved:", "if proximal is not None:")],
        (f"{_UPDATES}::test_each_later_update_takes_sats_quantile_at_its_own_weights",),
    ),
    "sequence-mean losses divided by the token count": Named(
        "pacerl/trainer/update_step.py",
        [(_DENOMINATOR, "denominator = float(tokens)")],
        (f"{_UPDATES}::test_the_accumulated_gradient_divides_by_the_batchs_sequences_or_tokens_by_hand",),
    ),
}
"""Hand-written mutants by name (`Named`): the wrong edits issues 14 and 27 name."""

KILLED = {1, 3, 37}  # a test failed (3: pytest's internal error), or the type check caught it
TIMEOUT = {36, 24, -24, 152, 255}  # ran past the CPU-time limit (SIGXCPU)
SURVIVED = 0
NO_TESTS = {5, 33}


def function_of(mutant: str) -> str:
    """`Class.method` or `function` of a mutant (`pacerl.trainer.pool.xǁTrajectoryPoolǁselect__mutmut_3`)."""
    mangled = mutant.rpartition(".")[2].rpartition("__mutmut_")[0]
    if mangled.startswith("xǁ"):
        return mangled[2:].replace("ǁ", ".")
    return mangled.removeprefix("x_")


def in_scope(path: str, mutant: str) -> bool:
    return path != "pacerl/trainer/pool.py" or function_of(mutant) in POOL_SCOPE


def function_spans(path: str) -> dict[str, tuple[int, int]]:
    """`function` / `Class.method` -> (first line, last line) in the source file."""
    spans: dict[str, tuple[int, int]] = {}
    tree = ast.parse(Path(path).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            spans[node.name] = (node.lineno, node.end_lineno or node.lineno)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    spans[f"{node.name}.{item.name}"] = (item.lineno, item.end_lineno or item.lineno)
    return spans


def describe(path: str, mutant: str, spans: dict[str, tuple[int, int]]) -> str:
    """`line: - old / + new` for a mutant, from mutmut's diff of the function."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(mutant, path=path).splitlines()
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    start, stop = spans.get(function_of(mutant), (1, 0))
    source = Path(path).read_text().splitlines()
    first = removed[0].strip() if removed else None
    line = next((n for n in range(start, stop + 1) if source[n - 1].strip() == first), start)
    old = " / ".join(text.strip() for text in removed)
    new = " / ".join(text.strip() for text in added)
    return f"{path}:{line} {mutant.rpartition('.')[2]}\n    - {old}\n    + {new}"


def check_named() -> list[str]:
    """Run each of `NAMED_MUTANTS` against its tests in a copy of the tree; the names of the survivors.
    The unmutated copy runs first, with every named mutant's tests, and must pass, so that a broken
    copy cannot pass for a kill."""
    everything = tuple(dict.fromkeys(test for mutant in NAMED_MUTANTS.values() for test in mutant.tests))
    survivors = []
    for name, (path, edits, tests) in {
        "(control: no mutation)": Named("pacerl/trainer/losses.py", [], everything),
        **NAMED_MUTANTS,
    }.items():
        with tempfile.TemporaryDirectory(prefix="named-mutant-") as scratch:
            tree = Path(scratch)
            shutil.copytree("pacerl", tree / "pacerl")  # the links followed: a copy of every part
            shutil.copytree("tests", tree / "tests")
            shutil.copy("pyproject.toml", tree)
            text = (tree / path).read_text()
            for old, new in edits:
                if text.count(old) != 1:
                    raise SystemExit(f"named mutant {name!r}: {old!r} is not in {path} exactly once")
                text = text.replace(old, new)
            (tree / path).write_text(text)
            # The copy of pacerl comes first on the path, so the tests import its (mutated) trainer.
            env = os.environ | {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
            run = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
            failed = [line.split("::", 1)[1] for line in run.stdout.splitlines() if line.startswith("FAILED")]
            if not edits:
                if run.returncode:
                    raise SystemExit(f"the tests fail on an unmutated copy:\n{run.stdout[-2000:]}")
                continue
            if run.returncode == 1 and failed:
                print(f"killed   {name}: {failed[0].split(' ')[0]}")
            else:
                print(f"SURVIVED {name} (pytest exit {run.returncode})")
                survivors.append(name)
    return survivors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-score", type=float, default=90.0, help="fail below this score (percent)")
    parser.add_argument("--globs", action="store_true", help="print the names in scope for `mutmut run`")
    args = parser.parse_args()
    if args.globs:
        print("\n".join(MUTANT_GLOBS))
        return 0
    rows, survivors, unrun = [], [], []
    total_killed = total_all = 0
    for path in FILES:
        meta = Path("mutants") / f"{path}.meta"
        if not meta.exists():
            print(f"{meta} is missing: run `make mutate`", file=sys.stderr)
            return 1
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        scoped = {name: code for name, code in codes.items() if in_scope(path, name)}
        killed = sum(code in KILLED for code in scoped.values())
        timeout = sum(code in TIMEOUT for code in scoped.values())
        no_tests = sum(code in NO_TESTS for code in scoped.values())
        unrun += [name for name, code in scoped.items() if code is None]
        spans = function_spans(path)
        lost = sorted(
            (name for name, code in scoped.items() if code is not None and code not in KILLED | TIMEOUT),
            key=lambda name: (function_of(name), int(name.rpartition("_")[2])),
        )
        survivors += [describe(path, name, spans) for name in lost]
        total = len(scoped)
        rows.append((path, killed + timeout, timeout, len(lost) - no_tests, no_tests, total))
        total_killed, total_all = total_killed + killed + timeout, total_all + total
    header = ("killed", "(timeout)", "survived", "no tests", "total", "score")
    print(f"{'file':31} " + " ".join(f"{name:>9}" for name in header))
    for path, killed, timeout, survived, no_tests, total in rows:
        score = 100.0 * killed / total if total else 100.0
        print(f"{path:31} {killed:9} {timeout:9} {survived:9} {no_tests:9} {total:9} {score:8.1f}%")
    score = 100.0 * total_killed / total_all if total_all else 100.0
    print(f"{'all in scope':31} {total_killed:9} {'':9} {'':9} {'':9} {total_all:9} {score:8.1f}%")
    if survivors:
        print("\nsurvivors (docs/mutation.md says why each is equivalent or left):")
        print("\n".join(survivors))
    print("\nnamed mutants:")
    named_survivors = check_named()
    if unrun:
        print(f"\n{len(unrun)} mutants in scope were not run, e.g. {unrun[0]}", file=sys.stderr)
        return 1
    if score < args.min_score:
        print(f"\nmutation score {score:.1f}% is below {args.min_score}%", file=sys.stderr)
        return 1
    if named_survivors:
        print(f"\nnamed mutants survived: {named_survivors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
