"""A misspelt key is refused before the library loads (`pacerl.config_keys`, read from the config classes'
source), and that reader knows exactly the keys the built config has."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from pacerl.config import RunConfig, load_config
from pacerl.config_keys import Section, check_keys, run_config_keys
from pacerl.settings import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _section_type(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    found = [arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg) and isinstance(arg, type)]
    return found[0] if found else None


def assert_same_keys(cls: type, section: Section, where: str) -> int:
    """The fields of `cls` and of `section`, and of every section below, are the same; the count checked."""
    hints = typing.get_type_hints(cls)
    names = {field.name for field in dataclasses.fields(cls)}
    assert set(section.fields) == names, f"{where or 'RunConfig'}: {set(section.fields) ^ names}"
    checked = len(names)
    for name in names:
        nested = _section_type(hints[name])
        child = section.fields[name]
        if nested is None:
            assert child is None or name in section.free, f"{where}{name} is a value, read as a section"
        else:
            assert child is not None, f"{where}{name} is a section ({nested.__name__}), read as a value"
            checked += assert_same_keys(nested, child, f"{where}{name}.")
    return checked


def test_the_source_reader_knows_every_key_of_the_run_config() -> None:
    assert assert_same_keys(RunConfig, run_config_keys(), "") > 150


def test_a_misspelt_key_is_refused_where_it_is() -> None:
    with pytest.raises(ConfigError, match=r"unknown key loop\.stepz \(known here: .*steps"):
        check_keys({}, ["loop.stepz=1"])
    with pytest.raises(ConfigError, match=r"unknown key learner\.loss\.gspo\.epsilonz"):
        check_keys({"learner": {"loss": {"gspo": {"epsilonz": 1}}}})
    check_keys({"learner": {"loss": {"options": {"anything": {"deep": 1}}}}}, ["env.sandbox.memory_mb=64"])
    check_keys({}, ["filter.target_groups=4"])  # an earlier version's key: the loader says where it went
    with pytest.raises(ConfigError, match=r"filter\.target_groups moved to filter\.pace\.target_groups"):
        load_config(None, ["filter.target_groups=4"])


def test_pacerl_train_refuses_a_misspelt_key_before_torch_loads(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pacerl.cli import main\n"
        "code = main(['train', 'loop.stepz=1'])\n"
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split() == ["2", "False", "False"], done.stderr
    assert "pacerl: error: config: unknown key loop.stepz (known here:" in done.stderr
    assert not (tmp_path / "runs").exists()
