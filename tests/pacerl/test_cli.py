"""The `pacerl` command: `sandbox run` prints one JSON ExecResult; `demo` runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PACERL = [sys.executable, "-m", "pacerl.cli"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PACERL, *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_sandbox_run_file_prints_one_json_object(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text("import sys\nprint(sys.stdin.read()[::-1])")
    data = tmp_path / "in.txt"
    data.write_text("abc")
    done = run_cli("sandbox", "run", str(program), "--stdin", str(data), "--timeout", "5")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "ok" and result["stdout"] == "cba\n" and result["exit_code"] == 0


@pytest.mark.slow
def test_sandbox_run_stdin_program_with_limits() -> None:
    done = run_cli("sandbox", "run", "-", "--timeout", "1", stdin="while True:\n    pass\n")
    assert done.returncode == 1
    result = json.loads(done.stdout)
    assert result["status"] == "timeout" and result["exit_code"] is None


def test_sandbox_run_bash_and_backend_option() -> None:
    done = run_cli("sandbox", "run", "-", "--language", "bash", "--option", "warm_pool=0", stdin="echo hi\n")
    assert json.loads(done.stdout)["stdout"] == "hi\n", done.stderr


@pytest.mark.slow
def test_bad_input_gets_a_one_line_error() -> None:
    missing = run_cli("sandbox", "run", "/nonexistent/prog.py")
    assert missing.returncode == 2 and missing.stderr.startswith("pacerl: error:")
    bad_option = run_cli("sandbox", "run", "-", "--option", "warm_pol=1", stdin="print(1)")
    assert bad_option.returncode == 2 and "unknown option(s) warm_pol" in bad_option.stderr
    bad_language = run_cli("sandbox", "run", "-", "--language", "cobol", stdin="x")
    assert bad_language.returncode == 2 and "unknown language 'cobol'" in bad_language.stderr


def test_demo_solves_and_contains() -> None:
    done = run_cli("demo")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "solved 4/4" in done.stdout and "contained 7/7 attacks" in done.stdout
