"""`pacerl eval` reads the same typed config as `pacerl train` (a file, the flags as shorthands, then
`key=value` overrides), honours what it says (prompt, tools in the prompt, budgets, samples, turns),
saves it resolved with the report, and evaluates a served model through `engine_backend=openai`
against `pacerl serve openai`."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.models import build_tiny_moe, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.config import ConfigError, load_config
from pacerl.envs.code_math import SYSTEM_PROMPT as CODE_MATH_PROMPT
from pacerl.evaluate import eval_config, main_eval
from pacerl.openai_app import create_app
from pacerl.train import train
from tests.helpers import ThreadServer, free_port

KEY_VARIABLE = "PACERL_TEST_SERVED_KEY"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny_tokenizer()
    return save_model(build_tiny_moe(tokenizer=tokenizer), tokenizer, tmp_path_factory.mktemp("m") / "model")


def test_file_then_flags_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "eval.toml"
    path.write_text(
        '[env]\nid = "pacerl/Math-v0"\nmax_turns = 2\n'
        "[evaluation.settings]\nsamples = 2\nmax_new_tokens = 8\n",
        encoding="utf-8",
    )
    config = eval_config(str(path), ["evaluation.settings.max_new_tokens=9"], {"n": 3, "seed": 5})
    settings = config.evaluation.settings
    assert (config.env.id, config.env.max_turns) == ("pacerl/Math-v0", 2)  # the file
    assert (settings.samples, settings.seed, config.seed) == (3, 5, 5)  # the flags beat the file
    assert settings.max_new_tokens == 9  # key=value beats the file
    assert settings.temperature == 0.7 and settings.max_tasks is None  # eval's defaults, not train's greedy
    assert eval_config(None, ["evaluation.settings.samples=2"], {"n": 4}).evaluation.settings.samples == 2
    with pytest.raises(ConfigError, match=r"unknown key evaluation\.settings\.top_q"):
        eval_config(None, ["evaluation.settings.top_q=0.9"])
    with pytest.raises(ConfigError, match="top_p must be in"):
        eval_config(None, ["evaluation.settings.top_p=0"])


def test_the_report_holds_the_resolved_config_and_the_prompt_what_it_says(
    model_dir: Path, tmp_path: Path
) -> None:
    out, episodes = tmp_path / "report.json", tmp_path / "episodes.jsonl"
    overrides = [
        "env.system_prompt=null",  # the env's own instructions
        "evaluation.settings.tool_schemas_in_prompt=true",
        "evaluation.settings.max_new_tokens=5",
        "evaluation.settings.max_total_tokens=2048",
        "evaluation.settings.top_p=0.9",
        "env.max_turns=1",
    ]
    code = main_eval(
        str(model_dir), "pacerl/CodeMath-v0", 2, out=str(out), max_tasks=2, episodes=str(episodes),
        overrides=overrides,
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert (report["tasks"], report["episodes"]) == (2, 4)
    resolved = report["run_config"]
    assert resolved["model"]["path"] == str(model_dir) and resolved["env"]["system_prompt"] is None
    assert resolved["evaluation"]["settings"]["top_p"] == 0.9 and report["config"]["top_p"] == 0.9
    assert load_config(None, [f"model.path={model_dir}"]).model.path == str(model_dir)
    lines = [json.loads(line) for line in episodes.read_text().splitlines()]
    assert len(lines) == 4
    for line in lines:
        prompt = line["segments"][0]
        assert prompt["origin"] == "prompt"
        assert (
            CODE_MATH_PROMPT in prompt["text"]
            and "<tools>" in prompt["text"]
            and '"python"' in prompt["text"]
        )
        model_turns = [s for s in line["segments"] if s["origin"] == "model"]
        assert len(model_turns) == 1  # env.max_turns=1
    # the defaults: no system prompt, no schemas (the tiny model learns its tools by SFT)
    main_eval(str(model_dir), "pacerl/CodeMath-v0", 1, episodes=str(episodes), max_tasks=1, temperature=0.0)
    prompt = json.loads(episodes.read_text().splitlines()[0])["segments"][0]["text"]
    assert CODE_MATH_PROMPT not in prompt and "<tools>" not in prompt


def test_a_served_model_is_evaluated_through_the_openai_backend(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pacerl.agents.models import load_model

    caplog.set_level(logging.INFO, logger="pacerl.display")

    model, tokenizer = load_model(model_dir)
    monkeypatch.setenv(KEY_VARIABLE, "served-key")
    out, episodes = tmp_path / "served.json", tmp_path / "served.jsonl"
    app = create_app(EmbeddedEngine(model, tokenizer), tokenizer, model_name="tiny", api_key="served-key")
    with ThreadServer(app) as server:
        code = main_eval(
            env_id="pacerl/CodeMath-v0", n=2, out=str(out), max_tasks=2, episodes=str(episodes),
            overrides=[
                "engine_backend=openai", f"openai.base_url={server.url}/v1",
                f"openai.api_key_env={KEY_VARIABLE}",
                "evaluation.settings.max_new_tokens=6", "evaluation.settings.max_total_tokens=2048",
            ],
        )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert (report["tasks"], report["episodes"], report["samples"]) == (2, 4, 2)
    assert report["run_config"]["engine_backend"] == "openai" and report["label"].startswith(server.url)
    assert not any(reason.startswith("failed") for reason in report["failures"]), report["failures"]
    served = [json.loads(line) for line in episodes.read_text().splitlines()]
    assert len(served) == 4 and all(e["turns"] >= 1 for e in served)
    assert all(any(m["role"] == "assistant" for m in e["messages"]) for e in served)
    progress = [r.getMessage() for r in caplog.records if r.name == "pacerl.display"]
    assert [line.split("  ")[0] for line in progress] == [f"eval episode {k}/4" for k in (1, 2, 3, 4)]
    pace = r"  \d+\.\d tokens/s  \d+\.\d\d (episodes/s|s/episode)  ETA \d+:\d\d:\d\d$"
    assert all(re.search(pace, line) for line in progress), progress


def test_a_dead_server_is_counted_not_hung_and_training_refuses_the_backend(tmp_path: Path) -> None:
    out = tmp_path / "dead.json"
    dead = f"http://127.0.0.1:{free_port()}/v1"
    overrides = ["engine_backend=openai", f"openai.base_url={dead}", "openai.model=m", "openai.max_retries=0"]
    with pytest.raises(
        RuntimeError, match=r"^every episode of pacerl/Math-v0 failed \(2 of 2, e\.g\. failed: "
    ):
        main_eval(
            env_id="pacerl/Math-v0", n=1, temperature=0.0, max_tasks=2, out=str(out), overrides=overrides
        )
    failures = json.loads(out.read_text())["failures"]  # the report is written all the same
    assert sum(failures.values()) == 2 and all("cannot reach" in reason for reason in failures)
    with pytest.raises(ConfigError, match="engine_backend=openai serves evaluation only"):
        import asyncio

        asyncio.run(train(load_config(None, ["engine_backend=openai", f"run_dir={tmp_path / 'run'}"])))
    with pytest.raises(ConfigError, match="--model: name a model directory"):
        main_eval(env_id="pacerl/Math-v0")
