"""The CLI trains and evaluates a skyrl-gym env through its adapter (`env.id=skyrl-gym/gsm8k`) on SkyRL-schema
rows, with no validation set: a seeded tenth of the rows is held out of training and evaluated on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pacerl.agents.models import build_tiny_moe, save_model
from pacerl.agents.tokenizer import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = str(ROOT / "tests" / "fixtures" / "skyrl" / "gsm8k.parquet")


def cli(*arguments: str, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (ROOT, path) if p)}
    return subprocess.run(
        [sys.executable, "-m", "pacerl", *arguments],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_the_cli_trains_and_evaluates_a_skyrl_gym_env(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    model = save_model(build_tiny_moe(tokenizer=tokenizer), tokenizer, tmp_path / "model")
    report = tmp_path / "eval.json"
    evaluated = cli(
        "eval", "--model", str(model), "--env", "skyrl-gym/gsm8k", f"env.tasks={FIXTURE}", "--n", "2",
        "--out", str(report),
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert "ships no validation set: evaluating on 1 of its 10 tasks held out of training, seed 0" in (
        evaluated.stderr
    )
    result = json.loads(report.read_text())
    assert result["tasks"] == 1 and result["episodes"] == 2 and result["failures"].get("failed", 0) == 0
    run_dir = tmp_path / "run"
    settings = [
        "env.id=skyrl-gym/gsm8k", f"env.tasks={FIXTURE}", f"run_dir={run_dir}", "loop.steps=1",
        "loop.batch_groups=2", "rollout.group_size=2", "filter.pace.target_groups=2",
        "filter.max_concurrent_groups=2", "evaluation.every=0", "evaluation.at_start=false",
    ]  # fmt: skip
    trained = cli("train", *settings)
    assert "evaluating on 1 of its 10 training tasks, held out of training (seed 0" in trained.stderr
    # A random-init model never writes `#### N`: reward 0 everywhere, the step is skipped, and the run
    # exits 2 naming it (tests/pacerl/test_user_env.py) after a step played through the skyrl env.
    assert trained.returncode == 2, trained.stderr
    assert trained.stderr.strip().splitlines()[-1].startswith("pacerl: error: trained nothing: all 1 steps")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 1 and summary["evaluations"][-1]["step"] == 1
    assert summary["evaluations"][-1]["eval/accuracy"] == 0.0


PARITY_MODULE = """
from skyrl_gym import register
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class ParityEnv(BaseTextEnv):
    \"\"\"One turn, reward 1 for an answer of even length: a random model's samples differ in it.\"\"\"

    def __init__(self, env_config=None, extras=None):
        super().__init__()

    def step(self, action):
        even = float(len(action) % 2 == 0)
        return BaseTextEnvStepOutput(observations=[], reward=even, done=True, metadata={})


register(id="pacerl_parity", entry_point=ParityEnv)
"""


@pytest.mark.slow
def test_the_cli_updates_the_policy_on_a_users_skyrl_gym_env(tmp_path: Path) -> None:
    """A skyrl-gym env from a user's module (`module:skyrl-gym/NAME`), untouched, whose rewards differ
    within a group even for a random model: the run's steps update the weights."""
    (tmp_path / "user_parity.py").write_text(PARITY_MODULE)
    run_dir = tmp_path / "run"
    settings = [
        "env.id=user_parity:skyrl-gym/pacerl_parity", f"env.tasks={FIXTURE}", f"run_dir={run_dir}",
        "loop.steps=2", "loop.batch_groups=2", "rollout.group_size=8", "filter.pace.target_groups=2",
        "filter.max_concurrent_groups=2", "evaluation.every=0", "evaluation.at_start=false",
        "sft.when=never",
    ]  # fmt: skip
    trained = cli("train", *settings, path=tmp_path)
    assert trained.returncode == 0, trained.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 2 and summary["updated_steps"] >= 1, summary
