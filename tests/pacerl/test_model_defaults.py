"""Defaults that follow the model: a real checkpoint's token budgets and prompt come from it where the
user set none, the tiny model keeps its own, and a setting that looks wrong for the model is warned of."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pacerl.agents.models import build_tiny_moe, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.config import (
    REAL_MODEL_NEW_TOKENS,
    REAL_MODEL_TOTAL_TOKENS,
    RunConfig,
    load_config,
    model_warnings,
)
from pacerl.evaluate import eval_config
from pacerl.settings import config_to_dict


def _checkpoint(root: Path, context: int, name: str = "real") -> Path:
    """A checkpoint's config and tokenizer files (no weights: the defaults read no more than these)."""
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "max_position_embeddings": context})
    )
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return directory


def _budgets(config: RunConfig) -> tuple[int, int, bool, int, int, bool]:
    rollout, settings = config.rollout, config.evaluation.settings
    return (
        rollout.sampling.max_new_tokens,
        rollout.max_total_tokens,
        rollout.tool_schemas_in_prompt,
        settings.max_new_tokens,
        settings.max_total_tokens,
        settings.tool_schemas_in_prompt,
    )


def test_a_real_checkpoint_gets_budgets_from_its_context_and_sees_its_tools(tmp_path: Path) -> None:
    long = _checkpoint(tmp_path, 32768, "long")
    config = load_config(None, [f"model.path={long}"])
    new, total = REAL_MODEL_NEW_TOKENS, REAL_MODEL_TOTAL_TOKENS
    assert _budgets(config) == (new, total, True, new, total, True)
    assert config.env.system_prompt is None  # the env's own prompt, which says how to answer
    assert _budgets(eval_config(flags={"model": str(long)})) == (new, total, True, new, total, True)
    short = _checkpoint(tmp_path, 1024, "short")  # the episode gets the whole context, a turn half of it
    assert _budgets(load_config(None, [f"model.path={short}"])) == (512, 1024, True, 512, 1024, True)


def test_a_shipped_models_context_is_known_without_its_files() -> None:
    config = load_config(None, ["model.path=smollm2-135m"])
    assert _budgets(config)[:2] == (REAL_MODEL_NEW_TOKENS, 8192)


def test_what_the_user_set_is_kept(tmp_path: Path) -> None:
    real = _checkpoint(tmp_path, 32768)
    file = tmp_path / "run.toml"
    file.write_text(
        f'env.system_prompt = ""\n[model]\npath = "{real}"\n[rollout.sampling]\nmax_new_tokens = 300\n'
        "[evaluation.settings]\ntool_schemas_in_prompt = false\n"
    )
    config = load_config(file, ["rollout.max_total_tokens=2000"])
    assert _budgets(config) == (300, 2000, True, REAL_MODEL_NEW_TOKENS, REAL_MODEL_TOTAL_TOKENS, False)
    assert config.env.system_prompt == ""
    evaluated = eval_config(str(file), ["evaluation.settings.max_new_tokens=700"])
    assert _budgets(evaluated)[3:] == (700, REAL_MODEL_TOTAL_TOKENS, False)


def test_the_tiny_model_keeps_its_defaults(tmp_path: Path) -> None:
    assert config_to_dict(load_config()) == config_to_dict(RunConfig())  # `make demo`'s run is unchanged
    tokenizer = tiny_tokenizer()
    # Saved as a run saves its model: the tiny tokenizer carries pacerl's own chat template.
    saved = save_model(build_tiny_moe(tokenizer=tokenizer), tokenizer, tmp_path / "model")
    config = load_config(None, [f"model.path={saved}"])
    assert _budgets(config) == (40, 256, False, 40, 256, False) and config.env.system_prompt == ""
    assert _budgets(eval_config(flags={"model": str(saved)}))[3:] == (40, 256, False)


def test_settings_that_look_wrong_for_the_model_are_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    real = _checkpoint(tmp_path, 2048)
    assert model_warnings(load_config(None, [f"model.path={real}"])) == []  # its defaults look right
    wrong = [
        f"model.path={real}",
        "rollout.max_total_tokens=4096",
        "rollout.sampling.max_new_tokens=40",
        "env.system_prompt=",
        "rollout.tool_schemas_in_prompt=false",
        "env.max_tool_calls=0",
    ]
    with caplog.at_level(logging.WARNING, logger="pacerl.config"):
        config = load_config(None, wrong)
    warned = [record.getMessage() for record in caplog.records]
    assert warned == model_warnings(config) and len(warned) == 4, warned
    above, short, untold, off = warned
    assert above.startswith("rollout.max_total_tokens=4096 is above the 2048-token context of")
    assert short.startswith("rollout.sampling.max_new_tokens=40 cannot hold one tool call plus an answer")
    assert untold.startswith('rollout.tool_schemas_in_prompt=false with env.system_prompt="":')
    assert off == "env.max_tool_calls=0 turns off pacerl/CodeMath-v0's tools (python)"
    tiny = [item for item in wrong if not item.startswith("model.path")]
    assert model_warnings(load_config(None, tiny)) == []  # the tiny model learns its tools by SFT


def test_a_tool_free_env_is_not_warned_of_short_turns(tmp_path: Path) -> None:
    real = _checkpoint(tmp_path, 32768)
    overrides = [f"model.path={real}", "env.id=pacerl/Math-v0", "rollout.sampling.max_new_tokens=40"]
    assert model_warnings(load_config(None, overrides)) == []
