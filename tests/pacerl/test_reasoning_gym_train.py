"""`pacerl train` on reasoning-gym's tasks: a fresh tiny model is warm-started on pacerl/ReasoningGym-v0's
answer demonstrations (the answer tags), then trained, and the run evaluates on its datasets'
evaluation sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pacerl.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pacerl_train_on_a_reasoning_gym_dataset(tmp_path: Path) -> None:
    run_dir = tmp_path / "rg"
    command = [
        sys.executable, "-m", "pacerl", "train", f"run_dir={run_dir}",
        "env.id=pacerl/ReasoningGym-v0", "env.tasks=reasoning_gym:leg_counting?size=200&seed=1",
        "loop.steps=2", "loop.batch_groups=2", "rollout.group_size=4",
        "filter.pace.target_groups=2", "filter.max_concurrent_groups=2",
        "evaluation.every=1", "evaluation.settings.max_tasks=4", "sft.steps=3",
        "loop.require_update=false",  # a fresh model's groups may all score 0: nothing to learn from yet
    ]  # fmt: skip
    trained = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert trained.returncode == 0, trained.stderr
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["env"] == {**saved["env"], "id": "pacerl/ReasoningGym-v0"}
    assert "SFT warm start (answer, 3 steps)" in trained.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows if "eval/accuracy" in row] == [0, 1, 2]
    assert sum(row.get("trajectories", 0) for row in rows if "reward" in row) >= 16
    assert all(0.0 <= row["reward"] <= 1.0 for row in rows if "reward" in row)
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 2
