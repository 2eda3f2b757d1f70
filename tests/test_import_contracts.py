"""The layering of docs/design.md is a contract `make lint` checks (`lint-imports`, [tool.importlinter] in
pyproject.toml); these keep the contract itself honest."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["name"]: contract for contract in config["contracts"]}


def test_the_layers_are_the_design_cards() -> None:
    layers = [c for c in contracts().values() if c["type"] == "layers"]
    assert [c["layers"] for c in layers] == [["pacerl", "trainer", "agents", "envs", "sandbox"]]


def test_every_private_sandbox_module_is_forbidden_to_the_other_parts() -> None:
    private = {f"sandbox.{path.stem}" for path in (ROOT / "sandbox").glob("_*.py") if path.stem != "__init__"}
    (contract,) = [c for c in contracts().values() if "private" in str(c["name"])]
    assert set(contract["forbidden_modules"]) == private  # type: ignore[arg-type]


def test_the_checker_catches_a_lower_part_importing_a_higher_one(tmp_path: Path) -> None:
    # The same contracts on a copy of the tree in which envs imports the trainer: broken.
    for part in ("pacerl", "trainer", "agents", "envs", "sandbox"):
        subprocess.run(["cp", "-r", str(ROOT / part), str(tmp_path / part)], check=True)
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    checked = [Path(sys.executable).parent / "lint-imports", "--no-cache"]
    clean = subprocess.run(
        checked, cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}
    )
    assert clean.returncode == 0, clean.stdout
    with (tmp_path / "envs" / "jsonl.py").open("a") as module:
        module.write("\nimport trainer.pool  # noqa: E402\n")
    broken = subprocess.run(
        checked, cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}
    )
    assert broken.returncode == 1 and "envs.jsonl -> trainer.pool" in broken.stdout


def test_tests_import_helpers_from_helper_modules_never_from_other_test_modules() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "tests").rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if line.lstrip().startswith("from tests.") and ".test_" in line.split(" import ")[0]
    ]
    assert offenders == []
