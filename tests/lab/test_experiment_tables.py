"""The experiments' shared table machinery (`benchmarks/experiments/common.py`) against hand-computed
numbers: the mean ± 95% t-interval over seeds, its text, the first point of a curve at a target on
either axis, and a resumed sweep that refuses a finished arm run with other settings."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    path = ROOT / "benchmarks" / "experiments" / "common.py"
    spec = importlib.util.spec_from_file_location("experiments_common", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "experiments_common", module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def test_mean_and_95_percent_t_interval_by_hand(common: ModuleType) -> None:
    # 1, 2, 3: mean 2, sample sd 1, t(0.975, 2 df) = 4.303: half-width 4.303 / sqrt(3) = 2.4843.
    mean, half, n = common.mean_ci([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and half == pytest.approx(4.303 / math.sqrt(3))
    # 0.2, 0.4, 0.4, 0.6: mean 0.4, sd sqrt(0.08 / 3) = 0.16330, t(3 df) = 3.182: 0.25981.
    assert common.mean_ci([0.2, 0.4, 0.4, 0.6])[1] == pytest.approx(3.182 * math.sqrt(0.08 / 3) / 2)
    # Non-finite values are left out; one value has no interval; none has no mean.
    mean, half, n = common.mean_ci([0.5, math.nan])
    assert (mean, n) == (0.5, 1) and math.isnan(half)
    assert math.isnan(common.mean_ci([])[0]) and common.mean_ci([])[2] == 0
    # Beyond the table (30 values, 29 df) the normal quantile stands in.
    values = [float(i % 2) for i in range(30)]
    sd = math.sqrt(sum((v - 0.5) ** 2 for v in values) / 29)
    assert common.mean_ci(values)[1] == pytest.approx(1.96 * sd / math.sqrt(30))


def test_format_ci_says_how_many_runs_it_covers(common: ModuleType) -> None:
    assert common.format_ci([1.0, 2.0, 3.0]) == "2.000 ± 2.484"
    assert common.format_ci([1.0, 2.0, 3.0], 1) == "2.0 ± 2.5"
    assert common.format_ci([0.25]) == "0.250"
    assert common.format_ci([1.0, None, 3.0], 2, of=3) == "2.00 ± 12.71 (2/3)"
    assert common.format_ci([None, None], of=2) == "– (0/2)"
    assert common.format_ci([]) == "–"


def test_time_to_reach_reads_either_axis(common: ModuleType) -> None:
    curve = [(10.0, 0, 0.1, 0.0), (20.0, 5, 0.3, 1.5), (30.0, 10, 0.5, 3.0), (40.0, 15, 0.4, 4.5)]
    assert common.time_to_reach(curve, 0.3) == 20.0
    assert common.time_to_reach(curve, 0.45, axis=3) == 3.0
    assert common.time_to_reach(curve, 0.6, axis=3) is None


def test_a_finished_arm_with_other_settings_is_refused_and_a_failed_one_runs_again(
    common: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arm = common.Arm("sync", {"loop.mode": "sync"}, seed=1)
    base = {"loop.steps": 3}
    run_dir = tmp_path / "sync-seed1"
    settings = {**base, **arm.overrides, "run_dir": str(run_dir), "seed": 1}
    run_dir.mkdir()
    finished = {"arm": "sync", "seed": 1, "eval_end": 0.5, "settings": settings}
    (run_dir / common.SUMMARY).write_text(json.dumps(finished))
    assert common.run_arm(arm, base, tmp_path) == finished  # resumed: not run again
    with pytest.raises(SystemExit, match="finished with other settings"):
        common.run_arm(arm, {"loop.steps": 4}, tmp_path)
    # A failed arm is run again (here: its command is recorded instead of training).
    (run_dir / common.SUMMARY).write_text(json.dumps({"arm": "sync", "seed": 1, "error": "boom"}))
    commands: list[list[str]] = []

    class Done:
        returncode = 1
        stderr = "still failing"

    def record(command: list[str], **_: object) -> Done:
        commands.append(command)
        return Done()

    monkeypatch.setattr(common.subprocess, "run", record)
    again = common.run_arm(arm, base, tmp_path, threads=1)
    assert again["error"] == "still failing" and len(commands) == 1
    assert "threads=1" in commands[0] and 'loop.mode="sync"' in commands[0]
