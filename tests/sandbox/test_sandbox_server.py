"""The SandboxFusion-compatible server and the `remote` backend, over real HTTP on 127.0.0.1.

One server is the CLI (`pacerl serve sandbox`, a subprocess over the local backend); servers with
other settings (concurrency, queue, body cap, a misbehaving fake) run uvicorn on a thread.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastapi
import httpx
import psutil
import pytest
from fastapi.responses import JSONResponse, PlainTextResponse

from pacerl.cli import main
from pacerl.sandbox import ExecStatus, Limits, Sandbox, SandboxUsageError
from pacerl.sandbox.http_guard import (
    ACCEPT_FAILED,
    MIB,
    BodyBudget,
    BodyGuard,
    BudgetExhaustedError,
    HttpGuardConfig,
    QuietAcceptFailures,
    declared_length,
    open_files_needed,
)
from pacerl.sandbox.remote import RemoteOptions
from pacerl.sandbox.request import MAX_CODE_BYTES
from pacerl.sandbox.server import GUARD, create_app
from tests.helpers import BackendRuns, ThreadServer, free_port
from tests.hostile_http import (
    assert_idle_after_answer_then_partial_is_closed,
    assert_oversized_headers_are_431,
    assert_slow_body_is_408,
    assert_slow_headers_are_closed,
    detail,
    exchange,
    post_head,
    refused_then_closed_while_trickling,
)
from tests.sandbox.helpers import wait_for_ping

SERVER_TIMEOUT_S = 2.0
"""The CLI server's --timeout: what a request that asks for no run_timeout gets."""
SERVER_MAX_TIMEOUT_S = 3.0
"""The CLI server's --max-timeout: the most any request may run."""
SERVER_MAX_MEMORY_MB = 512
"""The CLI server's --max-memory-mb."""

RESPONSE_KEYS = {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
RUN_RESULT_KEYS = {"status", "execution_time", "return_code", "stdout", "stderr"}


def start_cli_server(port: int, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "pacerl.cli", "serve", "sandbox", "--backend", "local"]
    argv += ["--port", str(port), "--max-concurrency", "4", "--timeout", str(SERVER_TIMEOUT_S)]
    argv += ["--max-timeout", str(SERVER_MAX_TIMEOUT_S), "--max-memory-mb", str(SERVER_MAX_MEMORY_MB), *flags]
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    wait_for_ping(f"http://127.0.0.1:{port}", process, log)
    return process


@pytest.fixture(scope="module")
def cli_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `pacerl serve sandbox` subprocess shared by the module."""
    port = free_port()
    process = start_cli_server(port, tmp_path_factory.mktemp("server") / "server.log")
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def remote(cli_url: str) -> Iterator[Sandbox]:
    with Sandbox("remote", url=cli_url) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def local() -> Iterator[Sandbox]:
    """A local sandbox for the thread servers."""
    with Sandbox("local", limits=Limits(timeout_s=SERVER_TIMEOUT_S)) as sandbox:
        yield sandbox


def post(url: str, **request: Any) -> httpx.Response:
    return httpx.post(f"{url}/run_code", timeout=30, **request)


# -- the CLI path ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_server_serves_and_shuts_down_cleanly(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    process = start_cli_server(port, log)
    try:
        url = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["status"] == "ok" and health["backend"] == "local"
        assert health["languages"] == ["python", "bash"] and health["max_concurrency"] == 4
        answer = post(url, json={"code": "print(6 * 7)", "language": "python"}).json()
        assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "42\n"
        sandboxes = psutil.Process(process.pid).children(recursive=True)
        assert sandboxes, "the local backend keeps warm sandboxes as children of the server"
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=30)
    output = log.read_text()
    # uvicorn shuts down gracefully, then re-raises the SIGTERM so the process ends by it.
    assert returncode == -signal.SIGTERM, output
    assert "Traceback" not in output and "Finished server process" in output, output
    assert "Closed the local sandbox" in output, output
    _, alive = psutil.wait_procs(sandboxes, timeout=10)
    assert not alive, f"sandboxes outlived the server: {alive}"


# -- the remote backend against the CLI server -------------------------------------------------------------


def test_remote_round_trips_ok_error_and_timeout(remote: Sandbox) -> None:
    ok = remote.run("print('hi')")
    assert (ok.status, ok.exit_code, ok.stdout, ok.stderr) == (ExecStatus.OK, 0, "hi\n", "")
    assert ok.duration_s > 0

    failed = remote.run("import sys\nprint('partial')\nsys.exit(3)")
    assert (failed.status, failed.exit_code, failed.stdout) == (ExecStatus.ERROR, 3, "partial\n")
    assert failed.reason == "exit code 3"

    raised = remote.run("1 / 0")
    assert raised.status is ExecStatus.ERROR and "ZeroDivisionError" in raised.stderr

    slow = remote.run("import time\ntime.sleep(30)\nprint('woke')", limits=Limits(timeout_s=0.5))
    assert slow.status is ExecStatus.TIMEOUT and slow.exit_code is None, slow
    assert "0.5 s" in slow.reason and "woke" not in slow.stdout, slow  # ended by the caller's limit


def test_remote_passes_stdin_and_files_to_python_and_bash(remote: Sandbox) -> None:
    files: dict[str, str | bytes] = {"data/in.txt": "from a file\n", "blob.bin": bytes(range(256))}
    code = (
        "import hashlib\n"
        "print(input().upper())\n"
        "print(open('data/in.txt').read(), end='')\n"
        "print(hashlib.sha256(open('blob.bin', 'rb').read()).hexdigest())\n"
    )
    result = remote.run(code, stdin="shout\n", files=files)
    digest = hashlib.sha256(bytes(range(256))).hexdigest()
    assert result.status is ExecStatus.OK, result
    assert result.stdout == f"SHOUT\nfrom a file\n{digest}\n"

    bash = remote.run('read name; echo "hello $name"; cat data/in.txt', "bash", stdin="bash\n", files=files)
    assert (bash.status, bash.stdout) == (ExecStatus.OK, "hello bash\nfrom a file\n"), bash


def test_remote_reads_memory_and_output_limit_verdicts(remote: Sandbox) -> None:
    hog = remote.run("block = bytearray(300 * 1024 * 1024)", limits=Limits(memory_mb=64))
    assert hog.status is ExecStatus.MEMORY and hog.reason == "memory limit exceeded", hog
    assert "MemoryError" in hog.stderr

    flood = remote.run("import sys\nsys.stdout.write('x' * 9_000_000)")
    assert flood.status is ExecStatus.OUTPUT_LIMIT and flood.exit_code is None, flood.reason
    assert flood.stdout_truncated and "more bytes truncated" in flood.stdout


def test_remote_caps_output_at_the_callers_limit(remote: Sandbox) -> None:
    small = remote.run("print('y' * 1000)", limits=Limits(output_cap_bytes=100))
    assert small.status is ExecStatus.OK and small.stdout_truncated and not small.stderr_truncated
    assert small.stdout.startswith("y" * 100)
    assert small.stdout.endswith("[... 901 more bytes truncated by the sandbox ...]\n")

    # Past the server's own cap (the default 16 KiB) the server's marker is folded into the count.
    big = remote.run("print('z' * 20_000)")
    assert big.stdout_truncated
    assert big.stdout.endswith(f"[... {20_001 - 16_384} more bytes truncated by the sandbox ...]\n")


def test_remote_refuses_binary_stdin_loudly(remote: Sandbox) -> None:
    with pytest.raises(SandboxUsageError, match="stdin as text"):
        remote.run("print(1)", stdin=b"\xff\xfe")


# -- the exact SandboxFusion shapes ------------------------------------------------------------------------


def test_success_has_the_exact_sandboxfusion_shape(cli_url: str) -> None:
    request = {
        "code": "import sys\nprint(sys.stdin.read().strip()[::-1])",
        "language": "python",
        "compile_timeout": 10,
        "run_timeout": SERVER_MAX_TIMEOUT_S,  # at the maximum, so not capped
        "memory_limit_MB": -1,
        "stdin": "olleh",
        "files": {},
        "fetch_files": [],
    }
    response = post(cli_url, json=request)
    assert response.status_code == 200
    body = response.json()
    assert set(body) == RESPONSE_KEYS and set(body["run_result"]) == RUN_RESULT_KEYS
    assert body["status"] == "Success" and body["message"] == ""
    assert body["compile_result"] is None and body["executor_pod_name"] is None and body["files"] == {}
    run = body["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 0, "hello\n", "")
    assert isinstance(run["execution_time"], float) and run["execution_time"] > 0


def test_failures_map_to_sandboxfusion_verdicts(cli_url: str) -> None:
    def run(**request: Any) -> dict[str, Any]:
        response = post(cli_url, json={"language": "python", **request})
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        assert set(body) - {"capped"} == RESPONSE_KEYS
        return body

    failed = run(code="raise SystemExit(4)")
    assert (failed["status"], failed["run_result"]["status"]) == ("Failed", "Finished")
    assert failed["run_result"]["return_code"] == 4 and failed["message"] == "[error] exit code 4"

    killed = run(code="import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert killed["status"] == "Failed" and killed["run_result"]["return_code"] == -9

    slow = run(code="import time\ntime.sleep(30)", run_timeout=0.5)
    assert slow["status"] == "Failed" and slow["message"].startswith("[timeout] ")
    assert slow["run_result"]["status"] == "TimeLimitExceeded" and slow["run_result"]["return_code"] is None

    # memory_limit_MB above the server's maximum (512) is capped: a 1 GiB allocation still fails.
    hog = run(code="block = bytearray(1024 ** 3)", memory_limit_MB=100_000)
    assert (hog["status"], hog["run_result"]["status"]) == ("Failed", "Finished")
    assert hog["capped"] == [
        {"limit": "memory_limit_MB", "requested": 100_000, "applied": SERVER_MAX_MEMORY_MB}
    ]
    assert hog["message"] == "[memory] memory limit exceeded" and hog["run_result"]["return_code"] == 1

    flood = run(code="import sys\nsys.stdout.write('x' * 9_000_000)")
    assert flood["status"] == "Failed" and flood["message"] == "[output_limit] output limit exceeded"
    assert flood["run_result"]["status"] == "Finished" and flood["run_result"]["return_code"] is None

    bash = run(code="echo out; echo err >&2; exit 2", language="bash")
    assert bash["run_result"]["stdout"] == "out\n" and bash["run_result"]["stderr"] == "err\n"
    assert bash["status"] == "Failed" and bash["run_result"]["return_code"] == 2

    # Files with null content are skipped, as SandboxFusion skips them.
    files = {"a.txt": base64.b64encode(b"A").decode(), "skipped.txt": None}
    listing = run(
        code="import os\nprint(sorted(f for f in os.listdir('.') if f.endswith('.txt')))", files=files
    )
    assert listing["run_result"]["stdout"] == "['a.txt']\n"


@pytest.mark.slow
def test_run_timeout_is_capped_at_the_server_maximum(cli_url: str) -> None:
    code = "import time\ntime.sleep(30)\nprint('woke')"
    body = post(cli_url, json={"code": code, "language": "python", "run_timeout": 600})
    answer = body.json()
    # Ended by the server's 3 s maximum (the message names it, `capped` says so), not the asked-for 600 s.
    assert answer["run_result"]["status"] == "TimeLimitExceeded"
    assert answer["message"] == f"[timeout] wall-clock limit of {SERVER_MAX_TIMEOUT_S:g} s exceeded"
    assert answer["capped"] == [{"limit": "run_timeout", "requested": 600, "applied": SERVER_MAX_TIMEOUT_S}]
    assert "woke" not in answer["run_result"]["stdout"]


def test_valid_requests_this_server_cannot_serve_are_failed_not_retryable(cli_url: str) -> None:
    # `Failed`, not `SandboxError` or a 4xx: SandboxFusion's client retries those (test_fusion_client.py).
    cpp = post(cli_url, json={"code": "int main() {}", "language": "cpp"})
    assert cpp.status_code == 200
    assert cpp.json()["status"] == "Failed" and "supported: python, bash" in cpp.json()["message"]
    assert set(cpp.json()) == RESPONSE_KEYS and cpp.json()["run_result"] is None

    fetch = post(cli_url, json={"code": "print(1)", "language": "python", "fetch_files": ["out.txt"]})
    assert fetch.json()["status"] == "Failed" and "fetch_files" in fetch.json()["message"]


def test_ping_and_health(cli_url: str) -> None:
    ping = httpx.get(f"{cli_url}/v1/ping", timeout=5)
    assert ping.status_code == 200 and ping.json() == "pong"
    health = httpx.get(f"{cli_url}/health", timeout=5).json()
    assert health["running"] == 0 and health["waiting"] == 0
    assert health["limits"] == {
        "run_timeout": {"default": SERVER_TIMEOUT_S, "max": SERVER_MAX_TIMEOUT_S},
        "memory_limit_MB": {"default": 512, "max": SERVER_MAX_MEMORY_MB},
    }


# -- malformed requests ------------------------------------------------------------------------------------

JSON = {"content-type": "application/json"}
MALFORMED: list[tuple[str, dict[str, Any], int, str]] = [
    ("not JSON", {"content": b"print(1)", "headers": JSON}, 422, "JSON decode error"),
    ("not UTF-8", {"content": b"\xff\xfe{}", "headers": JSON}, 422, "JSON decode error"),
    ("form body", {"content": b"code=print(1)"}, 422, "Content-Type: application/json"),
    ("deeply nested", {"content": b"[" * 100_000, "headers": JSON}, 400, "error parsing the body"),
    ("a JSON array", {"json": ["print(1)", "python"]}, 422, "valid dictionary"),
    ("empty object", {"json": {}}, 422, '"code"'),
    ("no language", {"json": {"code": "print(1)"}}, 422, '"language"'),
    ("code not a string", {"json": {"code": 123, "language": "python"}}, 422, "valid string"),
    ("unknown language", {"json": {"code": "x", "language": "klingon"}}, 422, "'python', 'cpp'"),
    ("NUL in code", {"json": {"code": "print(1)\x00", "language": "python"}}, 422, "NUL byte"),
    ("code too large", {"json": {"code": "#" * (MAX_CODE_BYTES + 1), "language": "python"}}, 422, "cap"),
    ("lone surrogate", {"content": b'{"code": "\\ud800", "language": "python"}', "headers": JSON}, 422,
     "not valid Unicode"),
    ("stdin surrogate", {"content": b'{"code": "", "language": "bash", "stdin": "\\udc80"}', "headers": JSON},
     422, "stdin is not valid Unicode"),
    ("stdin not text", {"json": {"code": "", "language": "python", "stdin": [1]}}, 422, "valid string"),
    ("bad base64", {"json": {"code": "", "language": "python", "files": {"a": "!!nope"}}}, 422, "base64"),
    ("files a list", {"json": {"code": "", "language": "python", "files": ["a"]}}, 422, "valid dictionary"),
    ("escaping path", {"json": {"code": "", "language": "python", "files": {"../x": "eA=="}}}, 422,
     "inside the work directory"),
    ("negative timeout", {"json": {"code": "", "language": "python", "run_timeout": -1}}, 422,
     "greater than 0"),
    ("timeout not a number", {"json": {"code": "", "language": "python", "run_timeout": "soon"}}, 422,
     "valid number"),
    ("NaN timeout", {"content": b'{"code": "", "language": "python", "run_timeout": NaN}', "headers": JSON},
     422, "finite number"),
    ("tiny memory", {"json": {"code": "", "language": "python", "memory_limit_MB": 8}}, 422,
     "memory_limit_MB must be -1 or >= 32"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "request_", "status", "says"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_get_4xx_with_a_message(
    cli_url: str, case: str, request_: dict[str, Any], status: int, says: str
) -> None:
    response = post(cli_url, **request_)
    assert response.status_code == status, (case, response.status_code, response.text[:500])
    assert response.json()["detail"], case
    assert says in response.text, (case, response.text[:500])
    assert len(response.content) < 20_000, "errors must not echo the input back"


def test_oversized_bodies_are_refused_before_parsing(local: Sandbox) -> None:
    small_bodies = HttpGuardConfig(max_body_bytes=10_000, body_budget_bytes=10_000)
    with ThreadServer(create_app(local, 2, guard=small_bodies), free_port()) as server:
        declared = post(server.url, json={"code": "#" * 20_000, "language": "python"})
        assert declared.status_code == 413 and "10000 bytes" in declared.json()["detail"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the server has to count
            yield b'{"code": "'
            for _ in range(20):
                yield b"#" * 1000
            yield b'", "language": "python"}'

        streamed = post(server.url, content=chunks(), headers=JSON)
        assert streamed.status_code == 413
        assert post(server.url, json={"code": "print(1)", "language": "python"}).json()["status"] == "Success"


# -- concurrency -------------------------------------------------------------------------------------------


async def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        return list(await asyncio.gather(*(client.post(f"{url}/run_code", json=b) for b in bodies)))


def test_concurrency_limit_holds(local: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests against a limit of two, the runs held in the sandbox until all four have arrived:
    two run and two wait, then all four are served, never more than two at once."""
    runs = BackendRuns(local, monkeypatch)
    runs.proceed.clear()
    request = {"code": "print('ran')", "language": "python"}
    with ThreadServer(create_app(local, 2), free_port()) as server:

        async def scenario() -> tuple[list[httpx.Response], dict[str, Any]]:
            async with httpx.AsyncClient(timeout=60) as client:
                sent = [
                    asyncio.ensure_future(client.post(f"{server.url}/run_code", json=request))
                    for _ in range(4)
                ]
                held = await _until(client, server.url, running=2, waiting=2)
                runs.proceed.set()
                return list(await asyncio.gather(*sent)), held

        answers, held = asyncio.run(scenario())
    assert held["running"] == 2 and held["waiting"] == 2 and runs.peak == 2
    assert [a.json()["status"] for a in answers] == ["Success"] * 4 and runs.finished == 4


def test_queue_cap_answers_503_at_once(local: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the one slot busy and the one queue place taken, a third request is refused while the
    first is still held in the sandbox: it was answered without waiting for any room."""
    runs = BackendRuns(local, monkeypatch)
    runs.proceed.clear()
    request = {"code": "print('ran')", "language": "python"}
    with ThreadServer(create_app(local, 1, max_queue=1), free_port()) as server:

        async def scenario() -> tuple[list[httpx.Response], httpx.Response, int]:
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.ensure_future(client.post(f"{server.url}/run_code", json=request))
                await _until(client, server.url, running=1, waiting=0)
                second = asyncio.ensure_future(client.post(f"{server.url}/run_code", json=request))
                await _until(client, server.url, running=1, waiting=1)
                third = await client.post(f"{server.url}/run_code", json=request)
                finished_before = runs.finished
                runs.proceed.set()
                return list(await asyncio.gather(first, second)), third, finished_before

        served, refused, finished_before = asyncio.run(scenario())
    assert finished_before == 0  # the refusal came while the first run was still held
    assert [a.json()["status"] for a in served] == ["Success", "Success"]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "queued" in refused.json()["detail"]


async def _until(client: httpx.AsyncClient, url: str, **expected: int) -> dict[str, Any]:
    """The server's /health once it shows `expected`; the deadline is a hang guard only."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health: dict[str, Any] = (await client.get(f"{url}/health")).json()
        if all(health[key] == value for key, value in expected.items()):
            return health
        await asyncio.sleep(0.02)
    raise AssertionError(f"the server never reached {expected}")


# -- a dead or misbehaving service -------------------------------------------------------------------------


def test_dead_server_is_a_quick_sandbox_error_and_recovery_is_automatic(local: Sandbox) -> None:
    port = free_port()  # nothing listens here yet
    url = f"http://127.0.0.1:{port}"
    with Sandbox("remote", url=url, retries=2, backoff_s=0.05) as remote:
        down = remote.run("print('hi')")
        # Refused at once (ConnectError, not a timeout waited for), three times as configured.
        assert down.status is ExecStatus.SANDBOX_ERROR and down.exit_code is None
        assert f"127.0.0.1:{port}" in down.reason and "ConnectError" in down.reason
        assert "after 3 attempts" in down.reason

        with ThreadServer(create_app(local, 2), port):
            up = remote.run("print('hi')")
        assert (up.status, up.stdout) == (ExecStatus.OK, "hi\n"), up


def _misbehaving_app(hits: dict[str, int], release: threading.Event) -> fastapi.FastAPI:
    """Services that answer wrongly; "/slow" answers only once `release` is set."""
    app = fastapi.FastAPI()

    def count(name: str) -> None:
        hits[name] = hits.get(name, 0) + 1

    @app.post("/garbage/run_code")
    async def garbage() -> PlainTextResponse:
        count("garbage")
        return PlainTextResponse("<html>definitely not JSON</html>")

    @app.post("/wrong/run_code")
    async def wrong() -> JSONResponse:
        count("wrong")
        return JSONResponse({"status": "Splendid", "message": ""})

    @app.post("/busy/run_code")
    async def busy() -> JSONResponse:
        count("busy")
        return JSONResponse({"detail": "overloaded"}, status_code=503)

    @app.post("/refuse/run_code")
    async def refuse() -> JSONResponse:
        count("refuse")
        return JSONResponse({"detail": "nope"}, status_code=422)

    @app.post("/slow/run_code")
    async def slow() -> JSONResponse:
        count("slow")
        # No answer until the test has its result: only the client's own timeout can end the call.
        answered = await asyncio.to_thread(release.wait, 60)
        return JSONResponse({"answered": answered})

    return app


def test_misbehaving_services_become_sandbox_errors(local: Sandbox) -> None:
    hits: dict[str, int] = {}
    release = threading.Event()
    with ThreadServer(_misbehaving_app(hits, release), free_port()) as server:

        def run(path: str, **options: Any) -> Any:
            with Sandbox("remote", url=f"{server.url}/{path}", backoff_s=0.01, **options) as remote:
                return remote.run("print(1)", limits=Limits(timeout_s=0.5))

        garbage = run("garbage")
        assert garbage.status is ExecStatus.SANDBOX_ERROR and "not a SandboxFusion response" in garbage.reason
        wrong = run("wrong")
        assert wrong.status is ExecStatus.SANDBOX_ERROR and "status" in wrong.reason
        busy = run("busy", retries=3)
        assert busy.status is ExecStatus.SANDBOX_ERROR and "HTTP 503" in busy.reason
        refused = run("refuse", retries=3)
        assert (
            refused.status is ExecStatus.SANDBOX_ERROR and "refused the request (HTTP 422)" in refused.reason
        )
        # The service never answers while this call lasts: it ends by the client's own timeout (the run's
        # 0.5 s plus 0.3 s of slack, and the connect timeout), once, not retried (one hit below).
        try:
            slow = run("slow", request_timeout_slack_s=0.3, retries=3)
        finally:
            release.set()
        assert slow.status is ExecStatus.SANDBOX_ERROR and "no answer within" in slow.reason, slow
    assert hits == {"garbage": 1, "wrong": 1, "busy": 4, "refuse": 1, "slow": 1}


def test_remote_options_are_validated_and_the_endpoint_normalised() -> None:
    assert RemoteOptions(url="http://h:1/").endpoint == "http://h:1/run_code"
    assert RemoteOptions(url="http://h:1/run_code").endpoint == "http://h:1/run_code"
    for bad in ("h:1", "http://", "ftp://h/", "http://[::1"):
        with pytest.raises(ValueError, match="url"):
            RemoteOptions(url=bad)
    with pytest.raises(ValueError, match="retries"):
        RemoteOptions(retries=-1)
    with pytest.raises(ValueError, match="unknown option"):
        Sandbox("remote", endpoint="http://h:1")


# -- sessions by replay ------------------------------------------------------------------------------------


def test_remote_session_keeps_state_by_replay(remote: Sandbox) -> None:
    with remote.session(Limits(timeout_s=1)) as session:
        first = session.run("x = 40\nprint('defined')")
        assert (first.status, first.stdout) == (ExecStatus.OK, "defined\n"), first
        second = session.run("x += 2\nx")  # the first cell's print is replayed silently
        assert (second.stdout, second.stderr) == ("42\n", ""), second
        assert session.run("def f(n):\n    return n * x\nf(2)").stdout == "84\n"

        failed = session.run("y = 1\n1 / 0")
        assert failed.status is ExecStatus.ERROR and failed.exit_code == 1
        assert "ZeroDivisionError" in failed.stderr and "<cell" in failed.stderr
        assert "run_cell" not in failed.stderr  # the driver's own frames are hidden

        loop = session.run("print('before')\nwhile True:\n    pass")
        assert loop.status is ExecStatus.TIMEOUT and loop.stdout == "before\n", loop

        assert session.run("name = input()", stdin="ada\n").ok
        after = session.run("print(x, name, 'y' in globals())")  # failed cells are not kept
        assert after.stdout == "42 ada False\n", after

        session.reset()
        forgotten = session.run("x")
        assert forgotten.status is ExecStatus.ERROR and "NameError" in forgotten.stderr


def test_remote_session_reports_a_replay_that_diverges(remote: Sandbox) -> None:
    with remote.session(Limits(timeout_s=1)) as session:
        assert session.run("kept = 1").ok
        # Cell 2 holds only before a moment on the clock, so its replay after that moment fails. Should
        # its first run come too late (a slow machine), it failed and was not kept: a later moment is
        # tried, so the machine's speed makes the test wait longer, never fail.
        for margin_s in (1.0, 4.0, 16.0, 64.0):
            deadline = time.time() + margin_s
            if session.run(f"import time\nassert time.time() < {deadline}").ok:
                break
        else:
            pytest.fail("cell 2 never ran before its deadline")
        time.sleep(max(0.0, deadline - time.time()) + 0.1)
        broken = session.run("print(kept)")
        assert broken.status is ExecStatus.SANDBOX_ERROR, broken
        assert "replaying cell 2 failed (AssertionError" in broken.reason
        assert "did not run" in broken.reason
        assert session.run("print(kept)").stdout == "1\n"  # cells before the divergence survive


@pytest.mark.slow
def test_remote_session_output_cap_and_unstoppable_cell(remote: Sandbox) -> None:
    with remote.session(Limits(timeout_s=0.5, output_cap_bytes=100)) as session:
        loud = session.run("print('w' * 1000)")
        assert loud.ok and loud.stdout_truncated
        assert loud.stdout.endswith("[... 901 more bytes truncated by the sandbox ...]\n")
        code = "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        code += "time.sleep(30)\nprint('woke')"
        stuck = session.run(code)
        # The cell ignores its own alarm: the service's limit stopped the whole replay, not its 30 s sleep.
        assert stuck.status is ExecStatus.TIMEOUT and "was not kept" in stuck.reason, stuck
        assert "woke" not in stuck.stdout, stuck
        assert session.run("1 + 1").stdout == "2\n"


# -- hostile clients ---------------------------------------------------------------------------------------

GUARDED_FLAGS = ["--header-timeout", "0.5", "--body-timeout", "1", "--max-body-bytes", "1000000"]
GUARDED_FLAGS += ["--body-budget-bytes", "3000000"]
"""The hostile-client tests' CLI server: short read timeouts and a small body cap, set by flags."""


@pytest.fixture(scope="module")
def guarded_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A `pacerl serve sandbox` subprocess with GUARDED_FLAGS; its port."""
    port = free_port()
    process = start_cli_server(port, tmp_path_factory.mktemp("guarded") / "server.log", *GUARDED_FLAGS)
    yield port
    process.terminate()
    process.wait(timeout=30)


def test_a_declared_length_over_the_cap_is_413_at_once(guarded_port: int) -> None:
    # 20 digits (about 1e20, the most h11 lets through): the old server waited for that body forever.
    # The answer comes before any of the body; a client that sends it anyway has it dropped, and the
    # connection closed within the header timeout.
    for declared in (10**20 - 1, 1_000_001):
        status, _, body = refused_then_closed_while_trickling(guarded_port, post_head("/run_code", declared))
        assert status == 413 and detail(body) == "request body larger than 1000000 bytes", declared
    # 21 digits or more h11 itself refuses as a bad Content-Length, and closes.
    status, headers, _ = exchange(guarded_port, post_head("/run_code", 10**20))
    assert status == 400 and headers["connection"] == "close"
    assert httpx.get(f"http://127.0.0.1:{guarded_port}/v1/ping", timeout=5).json() == "pong"


async def test_a_malformed_content_length_is_400_before_the_app() -> None:
    """h11 refuses these first; the guard refuses them too, under any server."""
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    guard = BodyGuard(app, HttpGuardConfig(), BodyBudget(HttpGuardConfig().body_budget_bytes, 1))
    cases = [
        ([(b"content-length", b"1e20")], "got '1e20'"),
        ([(b"content-length", b"-5")], "non-negative integer"),
        ([(b"content-length", b"5"), (b"content-length", b"6")], "conflicting"),
    ]
    for headers, says in cases:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any], into: list[dict[str, Any]] = sent) -> None:
            into.append(message)

        async def receive() -> dict[str, Any]:
            raise AssertionError("the body of a malformed request must not be read")

        scope = {"type": "http", "method": "POST", "path": "/run_code", "headers": headers}
        await guard(scope, receive, send)
        assert sent[0]["status"] == 400 and (b"connection", b"close") in sent[0]["headers"]
        assert says in detail(sent[1]["body"]), sent[1]["body"]
    # Content-Length 10**5000 is 413 (Python would refuse to make an int of it).
    assert declared_length([(b"content-length", b"9" * 5000)], 100) == (101, "")
    assert declared_length([(b"content-length", b"0" * 5000 + b"7")], 100) == (7, "")
    assert reached == []


def test_a_slow_body_is_408_and_the_connection_closed(guarded_port: int) -> None:
    assert_slow_body_is_408(guarded_port, "/run_code", b'{"code": "pr')


@pytest.mark.slow
def test_slow_headers_are_closed(guarded_port: int) -> None:
    assert_slow_headers_are_closed(guarded_port, "/run_code", connections=100)
    ping = b"GET /v1/ping HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    assert_idle_after_answer_then_partial_is_closed(guarded_port, ping, "/run_code")
    assert httpx.get(f"http://127.0.0.1:{guarded_port}/v1/ping", timeout=5).json() == "pong"


def test_oversized_headers_are_431_and_the_connection_closed(guarded_port: int) -> None:
    bodies = assert_oversized_headers_are_431(guarded_port, "/v1/ping")
    assert [detail(body) for body in bodies] == ["request line and headers larger than 16384 bytes"] * 3


def test_a_streamed_body_over_the_cap_is_413(guarded_port: int) -> None:
    def chunks() -> Iterator[bytes]:  # chunked, no Content-Length: the guard counts what arrives
        yield b'{"code": "'
        for _ in range(11):
            yield b"#" * 100_000
        yield b'", "language": "python"}'

    answer = post(f"http://127.0.0.1:{guarded_port}", content=chunks(), headers=JSON)
    assert answer.status_code == 413 and answer.json()["detail"] == "request body larger than 1000000 bytes"


async def _bodies_reach(client: httpx.AsyncClient, url: str, **expected: int) -> None:
    for _ in range(500):  # bounded: up to 10 s
        bodies = (await client.get(f"{url}/health")).json()["bodies"]
        if all(bodies[key] == value for key, value in expected.items()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the body budget never reached {expected}")


@pytest.mark.slow
def test_concurrent_large_bodies_wait_for_the_body_budget(local: Sandbox) -> None:
    """Six 0.9 MB bodies against a budget of three: three are read and run, three wait unread, and
    every one is answered in the end. (The old server read all six at once, whatever their size.)"""
    guard = HttpGuardConfig(max_body_bytes=1_000_000, body_budget_bytes=3_000_000)
    app = create_app(local, 8, guard=guard)
    nap = {"code": "import sys, time\nsys.stdin.read()\ntime.sleep(1)", "language": "python"}
    big = {**nap, "stdin": "x" * 900_000}
    with ThreadServer(app, free_port()) as server:

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                sent = [
                    asyncio.ensure_future(client.post(f"{server.url}/run_code", json=big)) for _ in range(6)
                ]
                await _bodies_reach(client, server.url, holders=3, waiting=3)
                return list(await asyncio.gather(*sent))

        answers = asyncio.run(scenario())
    assert [a.json()["status"] for a in answers] == ["Success"] * 6
    budget = app.state.body_budget
    assert budget.peak_holders == 3 and budget.peak_reserved_bytes <= 3_000_000
    assert (budget.holders, budget.reserved_bytes, budget.waiting) == (0, 0, 0)


@pytest.mark.slow
def test_a_full_body_queue_is_503_at_once(local: Sandbox) -> None:
    guard = HttpGuardConfig(max_body_bytes=1_000_000, body_budget_bytes=1_000_000, max_waiting=1)
    nap = {"code": "import sys, time\nsys.stdin.read()\ntime.sleep(1)", "language": "python"}
    big = {**nap, "stdin": "x" * 900_000}
    with ThreadServer(create_app(local, 8, guard=guard), free_port()) as server:

        async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.ensure_future(client.post(f"{server.url}/run_code", json=big))
                await _bodies_reach(client, server.url, holders=1)
                second = asyncio.ensure_future(client.post(f"{server.url}/run_code", json=big))
                await _bodies_reach(client, server.url, holders=1, waiting=1)
                third = await client.post(f"{server.url}/run_code", json=big)
                return list(await asyncio.gather(first, second)), third

        served, refused = asyncio.run(scenario())
    assert [a.json()["status"] for a in served] == ["Success", "Success"]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["detail"] == (
        "server busy: 1 requests already wait for room to read their body; try again later"
    )


async def test_the_body_budget_lets_small_bodies_past_large_ones_and_times_out() -> None:
    budget = BodyBudget(total_bytes=10, max_waiting=2)
    order: list[str] = []

    async def take(name: str, nbytes: int, hold: asyncio.Event) -> None:
        async with budget.reserve(nbytes, timeout_s=30):
            order.append(name)
            await hold.wait()

    hold_first, hold_small, hold_big = asyncio.Event(), asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(take("first", 6, hold_first))
    await asyncio.sleep(0)  # one turn of the loop: the task takes its first step
    big = asyncio.create_task(take("big", 10, hold_big))
    small = asyncio.create_task(take("small", 1, hold_small))
    await asyncio.sleep(0)
    assert order == ["first", "small"] and budget.waiting == 1, "a small body fits: it goes ahead"
    second_big = asyncio.create_task(take("second big", 10, hold_big))
    await asyncio.sleep(0)
    assert budget.waiting == 2 and budget.reserved_bytes == 7
    with pytest.raises(BudgetExhaustedError, match="2 requests already wait"):
        async with budget.reserve(5, timeout_s=30):
            pass
    hold_first.set()
    hold_small.set()
    await asyncio.gather(first, small)
    hold_big.set()
    await asyncio.gather(big, second_big)
    assert order == ["first", "small", "big", "second big"], "large bodies keep their arrival order"
    assert (budget.reserved_bytes, budget.holders, budget.waiting) == (0, 0, 0)
    assert (budget.peak_reserved_bytes, budget.peak_holders) == (10, 2)

    hog = asyncio.Event()
    holder = asyncio.create_task(take("hog", 10, hog))
    await asyncio.sleep(0)
    with pytest.raises(BudgetExhaustedError, match=r"within 0\.05 s"):
        async with budget.reserve(1, timeout_s=0.05):
            pass
    assert budget.waiting == 0, "a waiter that timed out leaves the queue"
    hog.set()
    await holder


def test_http_guard_config_is_validated() -> None:
    with pytest.raises(ValueError, match="body_budget_bytes"):
        HttpGuardConfig(max_body_bytes=10, body_budget_bytes=5)
    for field in ("header_timeout_s", "body_timeout_s", "max_connections"):
        with pytest.raises(ValueError, match=field):
            HttpGuardConfig(**{field: 0})
    with pytest.raises(ValueError, match="max_waiting"):
        HttpGuardConfig(max_waiting=-1)


def test_the_open_file_limit_is_raised_or_the_connection_cap_lowered() -> None:
    """A server raises its soft limit on open files to fit its connections, an accept backlog's worth
    more twice over and SPARE_FILES; under a hard limit too low for that, fewer connections are kept."""
    probe = (
        "import resource, sys; from pacerl.sandbox.http_guard import allow_open_files; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
        "fits = [allow_open_files(n) for n in (50, 2048)]; "
        "print(*fits, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )

    def fits(soft: int, hard: int) -> list[int]:
        run = subprocess.run(
            [sys.executable, "-c", probe, str(soft), str(hard)], capture_output=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
        return [int(word) for word in run.stdout.split()]

    assert open_files_needed(50) == 50 + 2 * 50 + 256 and open_files_needed(2048) == 3 * 2048 + 256
    assert fits(512, 512) == [50, (512 - 256) // 3, 512]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # a child may not raise it
    hard = 8192 if hard == resource.RLIM_INFINITY else hard
    assert hard >= 3 * 2048 + 256, f"this test needs a hard limit of {3 * 2048 + 256} open files"
    assert fits(1024, hard) == [50, 2048, 3 * 2048 + 256]


def test_accept_failures_are_logged_once_a_minute() -> None:
    """asyncio (3.11) retries accept() for every connection waiting after it fails for want of file
    descriptors, and reports each failure with a traceback: thousands of lines a second. The servers'
    event loops log one line a minute at most, with the count of those left out."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    loop = asyncio.new_event_loop()
    quiet = QuietAcceptFailures()
    failure = {"message": ACCEPT_FAILED, "exception": OSError(24, "Too many open files")}
    try:
        for _ in range(2000):
            quiet(loop, failure)
        assert len(lines) == 1 and "Too many open files" in lines[0] and quiet.unlogged == 1999
        quiet.last_logged -= 60  # as if a minute had passed
        quiet(loop, failure)
        assert len(lines) == 2 and "1999 failures not logged" in lines[1]
    finally:
        log.removeHandler(handler)
        loop.close()


def test_cli_help_shows_the_servers_real_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert GUARD.max_body_bytes == 98 * MIB and GUARD.body_budget_bytes == 128 * MIB
    with pytest.raises(SystemExit):
        main(["serve", "sandbox", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "longer is HTTP 413 (default: 98 MiB" in text and "(default: 128 MiB)" in text
    assert f"then it is closed (default: {HttpGuardConfig().header_timeout_s})" in text


def test_the_servers_environment_stays_out_of_its_sandboxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"serversecret{time.monotonic_ns()}"
    monkeypatch.setenv("PACERL_TEST_SERVER_TOKEN", secret)  # inherited by the server process
    port = free_port()
    process = start_cli_server(port, tmp_path / "server.log")
    code = (
        "import os\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError:\n        pass\n"
        "print(dict(os.environ))"
    )
    try:
        with Sandbox("remote", url=f"http://127.0.0.1:{port}") as sandbox:
            result = sandbox.run(code)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert result.status is ExecStatus.OK and "PATH" in result.stdout, result
    assert secret not in result.stdout
