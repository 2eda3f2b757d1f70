"""pacerl installs under one import name: its wheel holds `pacerl/` alone (the parts as pacerl.agents,
pacerl.envs, pacerl.trainer, pacerl.sandbox), so it installs beside packages that own the names
`agents`, `envs`, `trainer` or `sandbox` (openai-agents owns `agents`) and both import."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # builds the wheel

PROBE = """
import json, sys
import agents, envs
import pacerl
from pacerl.agents.trajectory import Trajectory
from pacerl.envs import load_tasks
from pacerl.sandbox._protocol import LAUNCHER_SOURCE
import pacerl.cli
print(json.dumps({
    "agents": agents.OWNER, "envs": envs.OWNER, "pacerl": pacerl.__file__,
    "trajectory": Trajectory.__module__, "tasks": len(load_tasks("codemath-val")),
    "launcher": len(LAUNCHER_SOURCE),
    "bare": sorted(n for n in sys.modules if n.split(".")[0] in ("trainer", "sandbox")),
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        ".",
    ]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=600)
    (built,) = out.glob("pacerl-*.whl")
    return built


def test_the_wheel_holds_one_import_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {name for name in top if not name.endswith(".dist-info")} == {"pacerl"}
    for part in ("agents", "envs", "trainer", "sandbox"):
        assert f"pacerl/{part}/__init__.py" in names, part
    assert "pacerl/envs/data/codemath-val.jsonl" in names  # package data travels under the new name
    assert "pacerl/sandbox/_launcher_oneshot.py" in names


def test_the_wheel_installs_and_imports_beside_a_package_that_owns_agents(
    wheel: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    for name in ("agents", "envs"):  # another distribution's packages, installed beside pacerl's
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"OWNER = 'another package ({name})'\n")
    # From outside the checkout, with the target first on the path: the installed copy, not this tree.
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen["agents"] == "another package (agents)" and seen["envs"] == "another package (envs)"
    assert Path(seen["pacerl"]).is_relative_to(site)
    assert (
        seen["trajectory"] == "pacerl.agents.trajectory" and seen["tasks"] > 0 and seen["launcher"] > 10_000
    )
    assert seen["bare"] == []
