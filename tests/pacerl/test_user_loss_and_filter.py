"""A user's policy loss and staleness filter in their own module, outside the package, named
`module:NAME` (as a user's env is named `module:Name-v0`): `pacerl train` trains with them, their own
options reach them, and a name that does not resolve is one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pacerl.config import ConfigError, load_config
from pacerl.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]

USER_MODULE = '''
"""A scaled GSPO loss and a newest-first filter, each logging its calls to CALLS (a JSON-lines file)."""
import dataclasses
import json
import os

from pacerl.trainer.losses import ClipConfig, gspo_loss
from pacerl.trainer.policy_losses import PolicyLoss
from pacerl.trainer.filters import StalenessFilter

CALLS = os.environ["USER_PLUGIN_CALLS"]


def _log(**entry):
    with open(CALLS, "a") as file:
        file.write(json.dumps(entry) + "\\n")


@dataclasses.dataclass(frozen=True)
class ScaleSettings:
    scale: float = 1.0


def scaled_gspo(inputs, config):
    output = gspo_loss(
        inputs.logprobs, inputs.behaviour, inputs.advantages, inputs.mask,
        ClipConfig(config.eps_low, config.eps_high), denominator=inputs.denominator,
    )
    _log(kind="loss", scale=config.settings.scale, sequences=int(inputs.mask.shape[0]))
    return dataclasses.replace(output, loss=output.loss * config.settings.scale)


SCALED_GSPO = PolicyLoss(scaled_gspo, settings=ScaleSettings, sat="sequence")


@dataclasses.dataclass(frozen=True)
class KeepSettings:
    keep: int = 1


def newest_first(pool, batch_groups, v_now, drift):
    """Drop all but the newest `keep` groups beyond a batch; draw the newest first."""
    keep = pool.config.settings.keep
    order = list(range(len(pool.pooled_groups())))[::-1]
    drawn, spare = order[:batch_groups], order[batch_groups:]
    _log(kind="filter", pooled=len(order), drawn=len(drawn), rejected=len(spare[keep:]))
    return spare[keep:], drawn


NEWEST_FIRST = StalenessFilter(newest_first, reason="newest_first", settings=KeepSettings)
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    (root / "user_plugins.py").write_text(textwrap.dedent(USER_MODULE))
    return root


@pytest.mark.slow
def test_a_user_loss_and_filter_train_through_the_cli(user_module: Path, tmp_path: Path) -> None:
    calls, run_dir = tmp_path / "calls.jsonl", tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(user_module), "USER_PLUGIN_CALLS": str(calls)}
    command = [
        sys.executable, "-m", "pacerl", "train", f"run_dir={run_dir}",
        "learner.loss.name=user_plugins:SCALED_GSPO", 'learner.loss.options={"scale": 0.5}',
        "filter.name=user_plugins:NEWEST_FIRST", 'filter.options={"keep": 0}',
        "sft.steps=2", "loop.steps=2", "loop.batch_groups=1", "rollout.group_size=4",
        "filter.max_concurrent_groups=3", "evaluation.every=0", "evaluation.settings.max_tasks=4",
        "learner.drop_zero_advantage=false",  # a barely warm model's groups still reach the loss
    ]  # fmt: skip
    trained = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert trained.returncode == 0, trained.stderr
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["learner"]["loss"]["name"] == "user_plugins:SCALED_GSPO"
    assert saved["learner"]["loss"]["options"] == {"scale": 0.5}
    assert saved["filter"] == {**saved["filter"], "name": "user_plugins:NEWEST_FIRST", "options": {"keep": 0}}
    entries = [json.loads(line) for line in calls.read_text().splitlines()]
    filtered = [e for e in entries if e["kind"] == "filter"]
    assert len(filtered) >= 2 and all(e["drawn"] == 1 for e in filtered)  # one select per step
    rows = [row for row in read_metrics(run_dir) if "reward" in row]
    assert len(rows) == 2
    # the filter's rejections are counted under its own reason, every one of them
    rejected = sum(e["rejected"] for e in filtered)
    assert rows[-1].get("rejected/newest_first", 0.0) == rejected
    # the loss ran on every step, with the options the config gave it
    losses = [e for e in entries if e["kind"] == "loss"]
    assert len(losses) >= 2 and all(e["scale"] == 0.5 for e in losses)
    assert [row["updated"] for row in rows] == [1.0, 1.0]


def test_a_user_name_that_does_not_resolve_is_one_clear_line(user_module: Path) -> None:
    sys.path.insert(0, str(user_module))
    os.environ.setdefault("USER_PLUGIN_CALLS", os.devnull)
    try:
        cases = {
            "learner.loss.name=no_such_module:X": "cannot import module 'no_such_module'",
            "learner.loss.name=user_plugins:MISSING": "is not a PolicyLoss or a loss function",
            "learner.loss.name=ppo": "loss name must be one of gspo, gspo_token, grpo",
            "filter.name=user_plugins:SCALED_GSPO": "is not a StalenessFilter",
            "filter.name=fifo": "name must be one of none, max_age, admission, pace or module:name",
            'learner.loss.options={"scale": 2}': "'gspo' takes learner.loss.gspo, not learner.loss.options",
        }
        for override, message in cases.items():
            with pytest.raises(ConfigError, match=message):
                load_config(None, [override])
        with pytest.raises(ConfigError, match=r"filter.options do not fit KeepSettings"):
            load_config(None, ["filter.name=user_plugins:NEWEST_FIRST", 'filter.options={"kept": 1}'])
        chosen = load_config(None, ["filter.name=user_plugins:NEWEST_FIRST", 'filter.options={"keep": 3}'])
        assert chosen.filter.settings.keep == 3 and chosen.filter.filter.reason == "newest_first"
    finally:
        sys.path.remove(str(user_module))


def test_a_module_registers_under_a_name_of_its_own() -> None:
    import dataclasses

    from pacerl.trainer.filters import FILTERS, register_filter
    from pacerl.trainer.policy_losses import LOSSES, PolicyLoss, register_loss

    loss = PolicyLoss(LOSSES["gspo"].compute)
    register_loss("my_gspo_copy", loss)
    register_loss("my_gspo_copy", loss)  # the same entry again: a module imported twice
    try:
        assert load_config(None, ["learner.loss.name=my_gspo_copy"]).learner.loss.loss is loss
        with pytest.raises(ValueError, match="a different loss is registered as 'my_gspo_copy'"):
            register_loss("my_gspo_copy", PolicyLoss(LOSSES["grpo"].compute))
        with pytest.raises(ValueError, match="without ':'"):
            register_loss("mine:x", loss)
        with pytest.raises(ValueError, match="must be a StalenessFilter"):
            register_filter("not_a_filter", loss)  # type: ignore[arg-type]
        newest = dataclasses.replace(FILTERS["none"], reason="mine")
        register_filter("my_fifo", newest)
        assert load_config(None, ["filter.name=my_fifo"]).filter.filter is newest
    finally:
        LOSSES.pop("my_gspo_copy", None)
        FILTERS.pop("my_fifo", None)
