"""pacerl allows every Python from 3.11 on (`requires-python`). The suite runs on 3.11 (the CPU build of
torch here is for 3.11); on the newer interpreters of this machine, without the dependencies, this checks
what breaks first across versions: every source file compiles (with warnings as errors: 3.12 made invalid
escape sequences a SyntaxWarning), and every standard-library module the project imports still exists
(3.12 and 3.13 removed distutils, imp, asynchat, cgi, pipes, crypt and more). The in-sandbox launcher,
which runs under the host's own `python3` whatever its version, is stdlib-only, so it is covered whole."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEWER = ("3.12", "3.13")
SOURCES = sorted(
    path
    for folder in ("pacerl", "agents", "envs", "trainer", "sandbox", "tests", "benchmarks")
    for path in (ROOT / folder).rglob("*.py")
    if not (ROOT / folder).is_symlink() and "pacerl/agents" not in str(path)
)

CHECK = """
import importlib.util, json, sys, warnings
files, modules = json.loads(sys.stdin.read())
warnings.simplefilter("error")
broken = []
for name in files:
    try:
        compile(open(name, encoding="utf-8").read(), name, "exec")
    except (SyntaxError, SyntaxWarning, DeprecationWarning) as error:
        broken.append(f"{name}: {type(error).__name__}: {error}")
missing = [m for m in modules if importlib.util.find_spec(m) is None]
print(json.dumps({"version": list(sys.version_info[:2]), "broken": broken, "missing": missing}))
"""


def interpreter(version: str) -> str:
    """The path of `python<version>`: on the PATH, else the version pyenv holds (pyenv's shim refuses a
    version that is installed but not selected)."""
    found = shutil.which(f"python{version}")
    if found:
        check = subprocess.run([found, "-c", "pass"], capture_output=True, check=False)
        if check.returncode == 0:
            return found
    pyenv = shutil.which("pyenv")
    if pyenv:
        versions = subprocess.run(
            [pyenv, "versions", "--bare"], capture_output=True, text=True
        ).stdout.split()
        for installed in sorted((v for v in versions if v.startswith(f"{version}.")), reverse=True):
            prefix = subprocess.run(
                [pyenv, "prefix", installed], capture_output=True, text=True
            ).stdout.strip()
            if prefix and Path(prefix, "bin", f"python{version}").exists():
                return str(Path(prefix, "bin", f"python{version}"))
    pytest.fail(f"no Python {version} on this machine (PATH or pyenv): the version check cannot run")


def stdlib_imports() -> list[str]:
    """Every standard-library module (top-level name) the project's sources import."""
    names: set[str] = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return sorted(names & sys.stdlib_module_names)


def test_requires_python_has_no_upper_bound() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert {f"Programming Language :: Python :: {v}" for v in ("3.11", *NEWER)} <= set(project["classifiers"])


def test_the_sources_are_found() -> None:
    assert len(SOURCES) > 200 and ROOT / "sandbox" / "_launcher.py" in SOURCES
    assert {"asyncio", "json", "resource", "signal"} <= set(stdlib_imports())


@pytest.mark.slow  # compiles every source file twice
@pytest.mark.parametrize("version", NEWER)
def test_every_source_compiles_and_every_stdlib_import_exists_on_a_newer_python(version: str) -> None:
    python = interpreter(version)
    payload = json.dumps([[str(path) for path in SOURCES], stdlib_imports()])
    done = subprocess.run(
        [python, "-I", "-c", CHECK], input=payload, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen["version"] == [int(part) for part in version.split(".")]
    assert seen["broken"] == [] and seen["missing"] == []


@pytest.mark.slow
def test_the_check_catches_what_a_newer_python_refuses(tmp_path: Path) -> None:
    python = interpreter(NEWER[0])
    bad = tmp_path / "bad.py"
    bad.write_text('PATTERN = "\\d+"\n')  # an invalid escape sequence: a SyntaxWarning from 3.12 on
    payload = json.dumps([[str(bad)], ["distutils", "json"]])
    done = subprocess.run(
        [python, "-I", "-c", CHECK], input=payload, capture_output=True, text=True, check=True
    )
    seen = json.loads(done.stdout)
    # the warning, raised as an error, comes back as the SyntaxError it will become
    assert len(seen["broken"]) == 1 and "invalid escape sequence" in seen["broken"][0]
    assert seen["missing"] == ["distutils"]  # removed in 3.12
