"""SandboxFusion's official client (`sandbox-fusion`) against a real `pacerl serve sandbox` on 127.0.0.1.

Requested limits are honoured up to the server's maximum and a cap is reported; what this server cannot
run fails at once, in one request (the client retries any exception it raises: a non-200 answer and a
`SandboxError` alike, five attempts with exponential backoff for `run_code`). The code under test reads
its own CPU rlimit, which the local backend sets from the run's timeout, so no test waits for a limit.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pydantic.v1
import pytest
import requests
import sandbox_fusion
from sandbox_fusion import RunCodeRequest, RunJupyterRequest, RunStatus

from pacerl.cli import main
from pacerl.sandbox import Limits, Sandbox
from pacerl.sandbox.limits import RequestMaxima
from pacerl.sandbox.server import MAXIMA, create_app
from tests.helpers import free_port
from tests.sandbox.helpers import wait_for_ping

DEFAULT_TIMEOUT_S = 10
"""The server's --timeout: what a request that names no run_timeout gets."""
MAX_TIMEOUT_S = 20
"""The server's --max-timeout: above the 10 s default, so a 15 s request is honoured in full."""
READ_CPU_LIMIT = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU)[0])"
"""Prints the run's CPU-seconds limit, which the local backend sets to the run's timeout."""


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("fusion") / "server.log"
    argv = [sys.executable, "-m", "pacerl.cli", "serve", "sandbox", "--backend", "local", "--port", str(port)]
    argv += [
        "--timeout",
        str(DEFAULT_TIMEOUT_S),
        "--max-timeout",
        str(MAX_TIMEOUT_S),
        "--max-memory-mb",
        "1024",
    ]
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for_ping(f"http://127.0.0.1:{port}", process, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


class Wire:
    """Every HTTP request the official client sends, and the JSON it got back."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.answers: list[Any] = []


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    """Counts the client's requests at its one call to `requests.post`."""
    seen = Wire()
    real_post = requests.post

    def post(address: str, **kwargs: Any) -> requests.Response:
        seen.paths.append(httpx.URL(address).path)
        response = real_post(address, **kwargs)
        seen.answers.append(response.json())
        return response

    monkeypatch.setattr(sandbox_fusion.client.requests, "post", post)
    return seen


def test_a_15_s_run_timeout_below_the_maximum_is_honoured(url: str, wire: Wire) -> None:
    answer = sandbox_fusion.run_code(
        RunCodeRequest(code=READ_CPU_LIMIT, language="python", run_timeout=15), endpoint=url
    )
    assert answer.status == RunStatus.Success and answer.run_result is not None
    assert answer.run_result.stdout == "15\n"  # not cut to the 10 s default
    assert wire.paths == ["/run_code"] and "capped" not in wire.answers[0]


def test_a_run_timeout_above_the_maximum_is_capped_and_the_cap_reported(url: str, wire: Wire) -> None:
    answer = sandbox_fusion.run_code(
        RunCodeRequest(code=READ_CPU_LIMIT, language="python", run_timeout=600), endpoint=url
    )
    # The client parses the answer, `capped` and all, and the run got the server's maximum.
    assert answer.status == RunStatus.Success and answer.run_result is not None
    assert answer.run_result.stdout == f"{MAX_TIMEOUT_S}\n"
    assert wire.answers[0]["capped"] == [{"limit": "run_timeout", "requested": 600, "applied": MAX_TIMEOUT_S}]


def test_a_request_asking_for_nothing_gets_the_servers_defaults(url: str) -> None:
    # SandboxFusion's client always sends run_timeout (10 s); a plain HTTP client may leave it out.
    code = READ_CPU_LIMIT + "\nprint(resource.getrlimit(resource.RLIMIT_AS)[0] // 2**20)"
    plain = httpx.post(f"{url}/run_code", json={"code": code, "language": "python"}, timeout=30).json()
    assert plain["run_result"]["stdout"] == f"{DEFAULT_TIMEOUT_S}\n{Limits().memory_mb}\n", plain
    assert "capped" not in plain

    asked = {"code": code, "language": "python", "run_timeout": 12, "memory_limit_MB": 900}
    honoured = httpx.post(f"{url}/run_code", json=asked, timeout=30).json()
    assert honoured["run_result"]["stdout"] == "12\n900\n" and "capped" not in honoured

    asked["memory_limit_MB"] = 4096
    capped = httpx.post(f"{url}/run_code", json=asked, timeout=30).json()
    assert capped["run_result"]["stdout"] == "12\n1024\n"
    assert capped["capped"] == [{"limit": "memory_limit_MB", "requested": 4096, "applied": 1024}]


@pytest.mark.parametrize("language", ["cpp", "python2"])
def test_an_unsupported_language_fails_in_one_request(url: str, wire: Wire, language: str) -> None:
    # cpp is on SandboxFusion's list, python2 only on its client's: either way nothing can run it here.
    answer = sandbox_fusion.run_code(RunCodeRequest(code="int main() {}", language=language), endpoint=url)
    assert wire.paths == ["/run_code"], "the client retried"
    assert answer.status == RunStatus.Failed and answer.run_result is None
    assert answer.message == f"language {language!r} is not supported by this server; supported: python, bash"


def test_a_language_outside_sandboxfusions_list_never_reaches_the_server(url: str, wire: Wire) -> None:
    with pytest.raises(pydantic.v1.ValidationError, match="language"):
        RunCodeRequest(code="x", language="klingon")
    assert wire.paths == []  # and were it sent, HTTP 422 as SandboxFusion (test_sandbox_server.py)


def test_run_jupyter_fails_in_one_request(url: str, wire: Wire) -> None:
    answer = sandbox_fusion.run_jupyter(RunJupyterRequest(cells=["1 + 1"]), endpoint=url)
    assert wire.paths == ["/run_jupyter"], "the client retried"
    assert answer.status == RunStatus.Failed and "run_jupyter is not supported" in answer.message


def test_unknown_paths_answer_as_sandboxfusion(url: str) -> None:
    missing = httpx.post(f"{url}/no_such_endpoint", json={}, timeout=5)
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    wrong_method = httpx.get(f"{url}/run_code", timeout=5)
    assert (wrong_method.status_code, wrong_method.json()) == (405, {"detail": "Method Not Allowed"})


def test_request_maxima_are_validated_and_must_cover_the_defaults() -> None:
    assert RequestMaxima() == MAXIMA and MAXIMA.timeout_s > Limits().timeout_s
    assert MAXIMA.memory_mb > Limits().memory_mb
    with pytest.raises(ValueError, match=r"RequestMaxima\.timeout_s"):
        RequestMaxima(timeout_s=0)
    with pytest.raises(ValueError, match=r"RequestMaxima\.memory_mb"):
        RequestMaxima(memory_mb=8)
    with Sandbox("local", limits=Limits(timeout_s=30)) as sandbox:
        with pytest.raises(ValueError, match=r"default timeout \(30 s\) is above .* \(20 s\)"):
            create_app(sandbox, 1, maxima=RequestMaxima(timeout_s=20))
        with pytest.raises(ValueError, match=r"--max-memory-mb"):
            create_app(sandbox, 1, maxima=RequestMaxima(memory_mb=256))


def test_the_cli_refuses_a_default_above_the_maximum(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "sandbox", "--timeout", "30", "--max-timeout", "20"]) == 2
    assert "raise the maximum (--max-timeout)" in capsys.readouterr().err


def test_cli_help_documents_defaults_and_maxima(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "sandbox", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"wall-clock seconds a request gets when it asks for none (default: {Limits().timeout_s})" in text
    assert (
        f"most run_timeout honoured; more is capped, and the answer says so (default: {MAXIMA.timeout_s})"
        in text
    )
    assert (
        f"most memory_limit_MB honoured; more is capped, and the answer says so (default: {MAXIMA.memory_mb})"
        in text
    )
