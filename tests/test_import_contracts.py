"""The layering of docs/design.md is a contract `make lint` checks (`lint-imports`, [tool.importlinter] in
pyproject.toml); these keep the contract itself honest. And the project installs under one import name,
`pacerl`: the parts live in the repository's top-level folders, linked into pacerl/."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("trainer", "agents", "envs", "sandbox")


def contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["name"]: contract for contract in config["contracts"]}


def front_door() -> set[str]:
    """Every module and subpackage of pacerl that is not one of the four parts."""
    names = {path.stem for path in (ROOT / "pacerl").glob("*.py") if path.stem != "__init__"}
    names |= {path.name for path in (ROOT / "pacerl").iterdir() if (path / "__init__.py").exists()}
    return {f"pacerl.{name}" for name in names - set(PARTS)}


def test_the_parts_are_linked_into_pacerl() -> None:
    for part in PARTS:
        link = ROOT / "pacerl" / part
        assert link.is_symlink() and link.resolve() == (ROOT / part).resolve(), part


def test_the_layers_are_the_design_cards() -> None:
    (layers,) = [c["layers"] for c in contracts().values() if c["type"] == "layers"]
    assert isinstance(layers, list)
    assert layers[1:] == [f"pacerl.{part}" for part in PARTS]
    assert set(layers[0].split(" : ")) == front_door()  # the whole front door sits above the parts


def test_every_private_sandbox_module_is_forbidden_to_the_other_parts() -> None:
    private = {
        f"pacerl.sandbox.{path.stem}" for path in (ROOT / "sandbox").glob("_*.py") if path.stem != "__init__"
    }
    (contract,) = [c for c in contracts().values() if "private" in str(c["name"])]
    assert set(contract["forbidden_modules"]) == private  # type: ignore[arg-type]
    others = front_door() | {f"pacerl.{part}" for part in PARTS if part != "sandbox"}
    assert set(contract["source_modules"]) == others  # type: ignore[arg-type]


def test_the_checker_catches_a_lower_part_importing_a_higher_one(tmp_path: Path) -> None:
    # The same contracts on a copy of the tree in which envs imports the trainer: broken.
    for part in ("pacerl", *PARTS):
        subprocess.run(["cp", "-a", str(ROOT / part), str(tmp_path / part)], check=True)
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    checked = [Path(sys.executable).parent / "lint-imports", "--no-cache"]
    clean = subprocess.run(
        checked, cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}
    )
    assert clean.returncode == 0, clean.stdout
    with (tmp_path / "envs" / "jsonl.py").open("a") as module:
        module.write("\nimport pacerl.trainer.pool  # noqa: E402\n")
    broken = subprocess.run(
        checked, cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}
    )
    assert broken.returncode == 1 and "pacerl.envs.jsonl -> pacerl.trainer.pool" in broken.stdout


def test_no_module_imports_a_part_by_its_bare_name() -> None:
    """Everything imported as pacerl.*: a bare `agents` (a name other packages own) would load a second
    copy of the module from the checkout, and would not exist in an installed wheel."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import pacerl\n"
        "for info in pkgutil.walk_packages(pacerl.__path__, 'pacerl.'):\n"
        # the Ray extra is optional; the launcher's parts are one script run inside a sandbox
        "    if '.ray_runtime' in info.name or '._launcher' in info.name or info.name.endswith('__main__'):\n"
        "        continue\n"
        "    importlib.import_module(info.name)\n"
        "parts = ('agents', 'envs', 'trainer', 'sandbox')\n"
        "bare = sorted(n for n in sys.modules if n.split('.')[0] in parts)\n"
        "print(len([n for n in sys.modules if n.startswith('pacerl.')]), bare)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    count, bare = done.stdout.split(" ", 1)
    assert int(count) > 100 and bare.strip() == "[]"


def test_tests_import_helpers_from_helper_modules_never_from_other_test_modules() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "tests").rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if line.lstrip().startswith("from tests.") and ".test_" in line.split(" import ")[0]
    ]
    assert offenders == []
