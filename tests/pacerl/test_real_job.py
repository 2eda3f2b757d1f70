"""The named real-model job's config (`make demo-real`): it loads, asks for what its docs say, and reads
the env's own prompt (the tool's format) word for word."""

from __future__ import annotations

from pathlib import Path

from pacerl.config import load_config
from pacerl.envs.code_math import SYSTEM_PROMPT

ROOT = Path(__file__).resolve().parents[2]


def test_the_smollm2_job_config_loads_with_the_envs_prompt_and_a_warm_start() -> None:
    config = load_config(ROOT / "configs" / "smollm2-codemath.toml")
    assert config.model.path == "smollm2-135m" and config.env.id == "pacerl/CodeMath-v0"
    assert config.env.system_prompt == SYSTEM_PROMPT  # the TOML copy must not drift from the env's
    # A loaded checkpoint skips the warm start unless told (sft.when=fresh): this job needs it.
    assert config.sft.when == "always" and config.sft.resolved(config.env.id) == ("teacher", 30)
    assert config.loop.mode == "async" and config.filter.name == "pace"
    assert config.learner.loss.name == "gspo" and config.learner.loss.sat


def test_the_makefile_runs_the_job_from_its_config() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "demo-real: $(STAMP)\n\t$(BIN)/pacerl train --config configs/smollm2-codemath.toml" in makefile
