"""The Sandbox API: results, misuse, lifecycle, concurrency, and local-backend specifics."""

from __future__ import annotations

import asyncio
import mmap
import secrets
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pacerl.sandbox import ExecRequest, ExecResult, ExecStatus, Limits, Sandbox, SandboxUsageError
from pacerl.sandbox.result import OutputCapture, classify_exit
from tests.helpers import BackendRuns


def test_ok_run_reports_everything(local_sandbox: Sandbox) -> None:
    started = time.monotonic()
    result = local_sandbox.run("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    took = time.monotonic() - started
    assert result.status is ExecStatus.OK and result.ok
    assert (result.exit_code, result.stdout, result.stderr) == (0, "out\n", "err\n")
    assert 0 < result.duration_s <= took  # the run's own time, in seconds, within the call's
    assert ExecResult.from_json(result.to_json()) == result


def test_exit_codes_exceptions_and_signals(local_sandbox: Sandbox) -> None:
    assert local_sandbox.run("raise SystemExit(7)").exit_code == 7
    failed = local_sandbox.run("def f():\n    raise KeyError('k')\nf()")
    assert failed.status is ExecStatus.ERROR and failed.exit_code == 1
    assert 'File "/work/main.py", line 2, in f' in failed.stderr
    assert "raise KeyError('k')" in failed.stderr  # source lines appear in tracebacks
    killed = local_sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert killed.status is ExecStatus.ERROR and killed.exit_code == -signal.SIGSEGV
    syntax = local_sandbox.run("def (:")
    assert syntax.status is ExecStatus.ERROR and "SyntaxError" in syntax.stderr


def test_stdin_files_and_bash(local_sandbox: Sandbox) -> None:
    code = "import sys, json\ndata = json.load(open('cfg/a.json'))\nprint(data['k'], sys.stdin.read())"
    result = local_sandbox.run(code, stdin=b"piped", files={"cfg/a.json": '{"k": 5}'})
    assert result.stdout == "5 piped\n", result
    bash = local_sandbox.run(
        'read line; echo "got $line"; ls; exit 3', language="bash", stdin="x\n", files={"f": b""}
    )
    assert (bash.status, bash.exit_code, bash.stdout) == (ExecStatus.ERROR, 3, "got x\nf\n")


def test_user_modules_import_from_the_work_dir(local_sandbox: Sandbox) -> None:
    result = local_sandbox.run("import helper\nprint(helper.VALUE)", files={"helper.py": "VALUE = 11"})
    assert result.stdout == "11\n", result


def test_runs_as_an_unprivileged_user_without_capabilities(local_sandbox: Sandbox) -> None:
    code = "import os\nprint(os.getuid(), os.geteuid())\nprint(open('/proc/self/status').read())"
    result = local_sandbox.run(code)
    uid, euid = map(int, result.stdout.split("\n")[0].split())
    assert uid != 0 and euid != 0
    cap_eff = next(line for line in result.stdout.splitlines() if line.startswith("CapEff"))
    assert cap_eff.split()[1] == "0000000000000000"


def test_runs_do_not_share_state(local_sandbox: Sandbox) -> None:
    local_sandbox.run("open('/work/left.txt', 'w').write('x')\nopen('/tmp/left.txt', 'w').write('x')")
    result = local_sandbox.run("import os\nprint(os.listdir('/work'), os.listdir('/tmp'))")
    assert result.stdout == "[] []\n", result


def test_work_dir_is_size_capped(local_sandbox: Sandbox) -> None:
    code = "\n".join(
        [
            "n = 0",
            "try:",
            "    for i in range(100):",
            "        open(f'f{i}', 'wb').write(b'0' * 1_000_000)",
            "        n += 1",
            "except OSError as error:",
            "    print('stopped at', n, error.strerror)",
        ]
    )
    result = local_sandbox.run(code, limits=Limits(work_dir_mb=8, max_file_mb=4))
    assert "stopped at" in result.stdout and "No space left" in result.stdout, result
    big = local_sandbox.run("open('big', 'wb').write(b'0' * 3_000_000)", limits=Limits(max_file_mb=2))
    assert big.status is ExecStatus.ERROR and "File too large" in big.stderr, big


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"code": 123}, "code must be str"),
        ({"code": b"print(1)"}, "code must be str"),
        ({"code": "print(1)\x00"}, "NUL byte"),
        ({"code": "#" * (1024 * 1024 + 1)}, "larger than"),
        ({"code": "print(1)", "language": "cobol"}, "unknown language 'cobol'"),
        ({"code": "print(1)", "stdin": 5}, "stdin must be str or bytes"),
        ({"code": "print(1)", "files": ["a"]}, "files must be a mapping"),
        ({"code": "print(1)", "files": {"../escape": "x"}}, "inside the work directory"),
        ({"code": "print(1)", "files": {"/etc/x": "x"}}, "inside the work directory"),
        ({"code": "print(1)", "limits": {"timeout_s": 1}}, "limits must be a sandbox.Limits"),
    ],
)
def test_misuse_raises_clearly_before_any_work(
    local_sandbox: Sandbox, kwargs: dict[str, object], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reached = BackendRuns(local_sandbox, monkeypatch)
    with pytest.raises(SandboxUsageError, match=message):
        local_sandbox.run(**kwargs)  # type: ignore[arg-type]
    assert reached.requests == []  # refused before the backend was asked for anything


@pytest.mark.parametrize(
    "changes",
    [{"timeout_s": 0}, {"timeout_s": -1}, {"memory_mb": 1}, {"max_processes": 0}, {"output_kill_bytes": 10}],
)
def test_invalid_limits_are_rejected(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="out of range"):
        Limits(**changes)  # type: ignore[arg-type]


def test_unknown_backend_and_option() -> None:
    with pytest.raises(ValueError, match="unknown sandbox backend 'vm'"):
        Sandbox("vm")
    with pytest.raises(ValueError, match=r"unknown option.*warm_pol.*valid:.*warm_pool"):
        Sandbox("local", warm_pol=3)


def test_closed_sandbox_refuses_work() -> None:
    sandbox = Sandbox("local", warm_pool=0)
    sandbox.close()
    sandbox.close()
    with pytest.raises(RuntimeError, match="closed"):
        sandbox.run("print(1)")


def test_missing_bubblewrap_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="bubblewrap not found at /nonexistent/bwrap"):
        Sandbox("local", bwrap="/nonexistent/bwrap", isolation="bwrap")


def test_missing_interpreter_is_a_sandbox_error() -> None:
    with Sandbox("local", python="/usr/bin/no-such-python", warm_pool=0) as sandbox:
        result = sandbox.run("print(1)")
    assert result.status is ExecStatus.SANDBOX_ERROR
    assert "failed to start" in result.reason and "no-such-python" in result.reason


async def test_many_concurrent_async_runs(local_sandbox: Sandbox) -> None:
    results = await asyncio.gather(*(local_sandbox.arun(f"print({i} * 2)") for i in range(40)))
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(40)]


@pytest.mark.slow
async def test_concurrency_cap_queues_runs() -> None:
    async with Sandbox("local", max_concurrency=2, warm_pool=0) as sandbox:
        started = time.monotonic()
        code = "import time\ntime.sleep(0.6)"
        results = await asyncio.gather(*(sandbox.arun(code) for _ in range(4)))
        elapsed = time.monotonic() - started
    assert all(r.ok for r in results)
    assert elapsed >= 1.2, elapsed


def test_sandbox_dies_with_its_host_process() -> None:
    marker = f"orphan{secrets.token_hex(4)}"
    script = (
        "import sys\n"
        "from pacerl.sandbox import Sandbox, Limits\n"
        "box = Sandbox('local', warm_pool=1)\n"
        "print('ready', flush=True)\n"
        f"box.run(\"import subprocess\\nsubprocess.run(['bash', '-c', 'exec -a {marker} sleep 300'])\","
        " limits=Limits(timeout_s=300))\n"
    )
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 60  # hang guards: each wait ends at its event
        while not _with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _with_marker(marker), "the sandboxed sleep never started"
        host.send_signal(signal.SIGKILL)
        host.wait()
        deadline = time.monotonic() + 30
        while _with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _with_marker(marker), "sandboxed processes outlived the host process"
    finally:
        host.kill()


def _with_marker(marker: str) -> bool:
    return any(marker in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


def test_output_capture_keeps_the_head_and_counts_the_rest() -> None:
    capture = OutputCapture(cap=5)
    for chunk in (b"abc", b"defg", b"hi"):
        capture.feed(chunk)
    assert capture.total == 9 and capture.truncated
    assert capture.text() == "abcde\n[... 4 more bytes truncated by the sandbox ...]\n"
    exact = OutputCapture(cap=3)
    exact.feed(b"abc")
    assert not exact.truncated and exact.text() == "abc"
    broken = OutputCapture(cap=10)
    broken.feed(b"\xff\xfeok")
    assert broken.text() == "\ufffd\ufffdok"


@pytest.mark.parametrize(
    ("code", "stderr", "status", "reason"),
    [
        (0, "", ExecStatus.OK, ""),
        (1, "Traceback...\nMemoryError\n", ExecStatus.MEMORY, "memory limit exceeded"),
        (-24, "", ExecStatus.TIMEOUT, "CPU time limit exceeded"),
        (-11, "", ExecStatus.ERROR, "killed by signal 11"),
        (2, "usage", ExecStatus.ERROR, "exit code 2"),
    ],
)
def test_classify_exit(code: int, stderr: str, status: ExecStatus, reason: str) -> None:
    assert classify_exit(code, stderr) == (status, reason)


def test_exit_semantics_match_cpython(local_sandbox: Sandbox) -> None:
    code = (
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread joined'))).start()\n"
        "sys.stdout.write('unflushed tail')\n"
    )
    result = local_sandbox.run(code)
    assert result.stdout == "unflushed tailthread joined\natexit ran\n", result
    message = local_sandbox.run("import sys\nsys.exit('fatal: bad input')")
    assert (message.exit_code, message.stderr) == (1, "fatal: bad input\n")
    assert local_sandbox.run("raise SystemExit(300)").exit_code == 300 & 0xFF


def normal_paths(files: dict[str, str]) -> list[str]:
    return list(ExecRequest.build("pass", files=files).files)


def test_every_legal_file_name_is_kept() -> None:
    assert normal_paths({"..foo": "", "a/..b": "", "...": "", "a b/new\nline": ""}) == [
        "..foo",
        "a/..b",
        "...",
        "a b/new\nline",
    ]
    # Empty and "." components go, ".." is resolved: the same file the kernel would write.
    assert normal_paths({"./x//y": "", "a/../c": "", "p/./q/../r": ""}) == ["x/y", "c", "p/r"]
    with pytest.raises(
        SandboxUsageError, match=r"^file path 'a/../../b' must stay inside the work directory$"
    ):
        normal_paths({"a/../../b": ""})
    longest_name = "é" * 127 + "e"  # 255 bytes: NAME_MAX counts bytes, not characters
    longest_path = "/".join(["d" * 255] * 15) + "/" + "f" * 255  # 16 * 255 + 15 = 4,095 bytes
    assert normal_paths({longest_name: "", longest_path: ""}) == [longest_name, longest_path]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"a/b": "", "a": ""}, r"^file path 'a' is also the directory of file 'a/b'$"),
        ({"x/y/z": "", "x": ""}, r"^file path 'x' is also the directory of file 'x/y/z'$"),
        ({"a/b": "", "./a//b": ""}, r"^file paths 'a/b' and './a//b' name the same file$"),
        ({"é" * 128: ""}, r"has a 256-byte name; the limit is 255 \(NAME_MAX\)$"),
        (
            {"/".join(["d" * 255] * 15) + "/" + "f" * 254 + "/x": ""},
            r"is 4096 bytes; the limit is 4095 \(PATH_MAX\)$",
        ),
        ({"a/": ""}, r"^file path 'a/' names a directory, not a file$"),
        ({".": ""}, r"names a directory, not a file$"),
        ({"a/.": ""}, r"names a directory, not a file$"),
        ({"a/..": ""}, r"names a directory, not a file$"),
        ({"\udc80": ""}, r"is not valid Unicode text"),
    ],
)
def test_unwritable_file_paths_are_refused(files: dict[str, str], message: str) -> None:
    with pytest.raises(SandboxUsageError, match=message):
        ExecRequest.build("pass", files=files)


@pytest.mark.skipif(mmap.PAGESIZE != 4096, reason="the numbers below are for 4 KiB pages")
def test_files_must_fit_the_work_dir_in_whole_pages() -> None:
    one_mib = Limits(work_dir_mb=1)
    # 1 MiB = 256 pages: 254 pages, then 4,097 bytes take 2 more, and an empty file none.
    fits = {"a": b"0" * (1024 * 1024 - 8192), "b": b"0" * 4097, "empty": b""}
    assert list(ExecRequest.build("pass", files=fits, limits=one_mib).files) == ["a", "b", "empty"]
    with pytest.raises(SandboxUsageError, match=r"^files need 1052672 bytes of the work directory"):
        ExecRequest.build("pass", files=fits | {"c": b"0"}, limits=one_mib)
    ExecRequest.build("pass", files=fits | {"c": b"0"}, limits=Limits(work_dir_mb=2))
