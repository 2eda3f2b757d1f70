"""`pacerl train --print-config` and `pacerl eval --print-config`: the resolved config, nothing run; and
every shipped example config in configs/ loads through them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from pacerl import assembly, evaluate
from pacerl.cli import main
from pacerl.config import config_from_dict, load_config
from pacerl.evaluate import eval_config
from pacerl.settings import config_to_dict

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model or building a run fails the test: --print-config must touch neither."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("--print-config loaded a model or started a run")

    for module, name in [(assembly, "load_model"), (assembly, "build_run"), (evaluate, "load_model")]:
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr("pacerl.train.load_policy", refuse)
    monkeypatch.setattr("pacerl.train.train", refuse)


def _printed(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    printed: dict[str, Any] = json.loads(capsys.readouterr().out)
    return printed


def test_train_prints_the_resolved_config_as_the_run_saves_it(
    capsys: pytest.CaptureFixture[str], nothing_loads: None, tmp_path: Path
) -> None:
    printed = _printed(capsys, ["train", "--print-config", "loop.steps=3", f"run_dir={tmp_path / 'run'}"])
    assert printed == config_to_dict(load_config(None, ["loop.steps=3", f"run_dir={tmp_path / 'run'}"]))
    assert printed["loop"]["steps"] == 3 and printed["rollout"]["sampling"]["max_new_tokens"] == 40
    assert config_to_dict(config_from_dict(printed)) == printed  # it reads back as a config
    assert not (tmp_path / "run").exists()  # nothing was written


def test_eval_prints_its_resolved_config_without_the_model(
    capsys: pytest.CaptureFixture[str], nothing_loads: None
) -> None:
    argv = ["eval", "--print-config", "--model", "no/such-model", "--n", "2", "env.max_turns=5"]
    printed = _printed(capsys, argv)
    expected = eval_config(None, ["env.max_turns=5"], {"model": "no/such-model", "n": 2})
    assert printed == config_to_dict(expected)
    assert printed["evaluation"]["settings"]["samples"] == 2 and printed["model"]["path"] == "no/such-model"


def test_print_config_still_refuses_a_bad_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config", "loop.stepz=1"]) == 2
    assert "loop.stepz" in capsys.readouterr().err


def test_the_shipped_configs_include_a_real_model_on_sglang_search_r1_and_smollm2() -> None:
    names = {path.name for path in CONFIGS}
    assert {"retool-qwen2.5-7b-sglang.toml", "search-r1-qwen2.5-3b.toml", "smollm2-codemath.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_every_shipped_config_loads_through_print_config(
    path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    nothing_loads: None,
) -> None:
    with caplog.at_level(logging.WARNING):
        trained = _printed(capsys, ["train", "--config", str(path), "--print-config"])
        evaluated = _printed(capsys, ["eval", "--config", str(path), "--print-config"])
    # A shipped example must not look wrong to pacerl's own checks of a setting against its model.
    assert not [r for r in caplog.records if r.name.startswith("pacerl.")], caplog.text
    assert trained["model"]["path"] == evaluated["model"]["path"] is not None
    if path.name.startswith("retool"):
        assert trained["engine_backend"] == "sglang" and trained["env"]["id"] == "pacerl/CodeMath-v0"
        assert trained["env"]["sandbox"]["backend"] == "docker"
        assert trained["rollout"]["tool_schemas_in_prompt"] and trained["env"]["system_prompt"] is None
    if path.name.startswith("search-r1"):
        assert trained["env"]["id"] == "pacerl/SearchR1-v0"
        assert trained["env"]["retriever_url"].endswith("/retrieve")
