"""Progress and quiet: `pacerl eval`, SFT and a suite show what is done of how much, the rate and the
time left (a bar on a terminal, a log line now and then without one), and a served evaluation does not
log a line per HTTP request."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.models import build_tiny_moe, load_model, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.assembly import env_factory, training_tasks, warm_start
from pacerl.config import config_from_dict
from pacerl.display import EpisodeDisplay, ProgressDisplay, StepDisplay
from pacerl.evaluate import main_eval
from pacerl.openai_app import create_app
from pacerl.train import quiet_logging
from tests.helpers import ThreadServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "suites"
KEY_VARIABLE = "PACERL_TEST_PROGRESS_KEY"
HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def quiet_console() -> Console:
    """Not a terminal: the display logs lines instead of drawing a bar."""
    return Console(file=io.StringIO(), force_terminal=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny_tokenizer()
    return save_model(build_tiny_moe(tokenizer=tokenizer), tokenizer, tmp_path_factory.mktemp("m") / "model")


@pytest.fixture
def restore_http_loggers() -> Iterator[None]:
    """quiet_logging sets the HTTP clients' loggers' levels; put them back for the tests after."""
    levels = {name: logging.getLogger(name).level for name in HTTP_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_an_episode_display_reports_done_of_total_the_rate_and_the_time_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pacerl.display")
    clock = Clock()
    with EpisodeDisplay("eval", 8, clock=clock, console=quiet_console()) as display:
        clock.now += 4.0
        display.episode(100)  # 1 episode in 4 s: 0.25 episodes/s, 7 left
        clock.now += 4.0
        display.episode(60)  # 2 in 8 s
        for _ in range(6):
            clock.now += 1.0
            display.episode(0)
    lines = [r.getMessage() for r in caplog.records if r.name == "pacerl.display"]
    assert lines[0] == "eval episode 1/8  25.0 tokens/s  4.00 s/episode  ETA 0:00:28"
    assert lines[1] == "eval episode 2/8  20.0 tokens/s  4.00 s/episode  ETA 0:00:24"
    assert lines[-1] == "eval episode 8/8  11.4 tokens/s  1.75 s/episode  ETA 0:00:00"
    assert len(lines) == 8  # a log line per episode: a tenth of 8 rounds down to one


def test_the_rendered_line_without_progress_yet_has_no_rate_to_show() -> None:
    clock = Clock()
    display = ProgressDisplay("sft (clean)", 100, 0, clock=clock, console=quiet_console())
    assert display.line(0, "") == "sft (clean) step 0/100  ? steps/s  ETA ?"
    clock.now += 3725.0
    assert display.line(50, "loss 1.000") == "sft (clean) step 50/100  loss 1.000  74.50 s/step  ETA 1:02:05"


def test_a_resumed_run_measures_its_rate_from_where_it_resumed() -> None:
    clock = Clock()
    display = StepDisplay(1000, 900, clock=clock, console=quiet_console())
    clock.now += 50.0
    assert display.line(910, "") == "train step 910/1000  5.00 s/step  ETA 0:07:30"


def test_on_a_terminal_the_bar_shows_the_count_the_rate_and_the_time_left() -> None:
    clock = Clock()
    screen = Console(file=io.StringIO(), force_terminal=True, width=160, color_system=None)
    with EpisodeDisplay("eval gsm8k (1/2)", 10, clock=clock, console=screen) as display:
        assert display.interactive
        for _ in range(5):
            clock.now += 2.0
            display.episode(10)
    text = screen.file.getvalue()  # type: ignore[attr-defined]
    last = [line for line in text.replace("\r", "\n").splitlines() if "/10" in line][-1]  # the final state
    assert "eval gsm8k (1/2)" in last and "5/10" in last, text
    assert "5.0 tokens/s  2.00 s/episode  ETA 0:00:10" in last, text


def test_a_served_eval_logs_no_line_per_http_request(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    restore_http_loggers: None,
) -> None:
    caplog.set_level(logging.INFO)  # everything at INFO reaches the capture unless a logger is quieted
    model, tokenizer = load_model(model_dir)
    monkeypatch.setenv(KEY_VARIABLE, "served-key")
    app = create_app(EmbeddedEngine(model, tokenizer), tokenizer, model_name="tiny", api_key="served-key")
    with ThreadServer(app) as server:
        code = main_eval(
            env_id="pacerl/Math-v0", n=2, max_tasks=2,
            overrides=[
                "engine_backend=openai", f"openai.base_url={server.url}/v1",
                f"openai.api_key_env={KEY_VARIABLE}",
                "evaluation.settings.max_new_tokens=4", "evaluation.settings.max_total_tokens=1024",
            ],
        )  # fmt: skip
    assert code == 0
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "HTTP Request:" in m], messages
    progress = [r.getMessage() for r in caplog.records if r.name == "pacerl.display"]
    assert [line.split("  ")[0] for line in progress] == [f"eval episode {k}/4" for k in (1, 2, 3, 4)]
    assert all(
        re.search(r"  \d+\.\d\d (episodes/s|s/episode)  ETA \d+:\d\d:\d\d$", line) for line in progress
    ), progress


def test_the_http_request_lines_come_back_on_request(
    monkeypatch: pytest.MonkeyPatch, restore_http_loggers: None
) -> None:
    quiet_logging()
    assert not any(logging.getLogger(name).isEnabledFor(logging.INFO) for name in HTTP_LOGGERS)
    monkeypatch.setenv("PACERL_LOG_HTTP", "1")
    quiet_logging()
    assert all(logging.getLogger(name).isEnabledFor(logging.INFO) for name in HTTP_LOGGERS)


def test_a_suite_names_each_benchmark_in_its_progress(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pacerl.display")
    overrides = [
        "evaluation.settings.samples=1", "evaluation.settings.max_tasks=1",
        "evaluation.settings.max_new_tokens=4", "evaluation.settings.max_total_tokens=1024",
    ]  # fmt: skip
    assert main_eval(str(model_dir), overrides=overrides, suite="math", suite_dir=str(FIXTURES)) == 0
    progress = [r.getMessage().split("  ")[0] for r in caplog.records if r.name == "pacerl.display"]
    assert progress == [
        f"eval {name} ({k}/4) episode 1/1"
        for k, name in enumerate(("aime24", "aime25", "math500", "gsm8k"), start=1)
    ], progress


def test_the_sft_warm_start_reports_its_steps_with_rate_and_time_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pacerl.display")
    config = config_from_dict(
        {"env": {"id": "pacerl/Math-v0"}, "sft": {"when": "always", "steps": 3, "batch_size": 2}}
    )
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(tokenizer=tokenizer)
    stats = warm_start(config, model, tokenizer, training_tasks(env_factory(config)))
    assert stats["sft/steps"] == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "pacerl.display"]
    assert [line.split("  ")[0] for line in lines] == [f"sft (clean) step {k}/3" for k in (1, 2, 3)], lines
    pattern = r"^sft \(clean\) step \d/3  loss \d+\.\d{3}  \d+\.\d\d (steps/s|s/step)  ETA \d+:\d\d:\d\d$"
    assert all(re.match(pattern, line) for line in lines), lines
