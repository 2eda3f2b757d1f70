"""Hostile code on every backend that runs code here: a clear status, and the host untouched."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sandbox import ExecStatus, Limits, Sandbox

SHORT = Limits(timeout_s=3)


def leftover(marker: str) -> list[psutil.Process]:
    """Host processes whose command line carries `marker` (sandboxes share this kernel)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in part for part in cmdline):
            found.append(proc)
    return found


def wait_gone(marker: str, seconds: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while (procs := leftover(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return procs


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP service on the host's loopback that sandboxed code must not reach."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted: list[socket.socket] = []

    def accept() -> None:
        try:
            conn, _ = server.accept()
            accepted.append(conn)
        except OSError:
            return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()
    thread.join(timeout=2)
    assert not accepted, "sandboxed code reached a host loopback service"


def test_outside_network_unreachable(any_sandbox: Sandbox) -> None:
    code = """
import socket
for target in [("1.1.1.1", 53), ("8.8.8.8", 443)]:
    try:
        socket.create_connection(target, timeout=2).close()
        print("CONNECTED", target)
    except OSError as error:
        print("blocked", type(error).__name__)
try:
    socket.getaddrinfo("example.com", 443)
    print("RESOLVED")
except OSError:
    print("no dns")
"""
    result = any_sandbox.run(code, limits=Limits(timeout_s=10))
    assert result.status is ExecStatus.OK, result
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert result.stdout.count("blocked") == 2 and "no dns" in result.stdout


def test_host_loopback_unreachable(any_sandbox: Sandbox, host_listener: int) -> None:
    code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {host_listener}), timeout=2).close()
    print("CONNECTED")
except OSError as error:
    print("blocked", type(error).__name__)
"""
    result = any_sandbox.run(code, limits=SHORT)
    assert result.status is ExecStatus.OK, result
    assert "blocked" in result.stdout and "CONNECTED" not in result.stdout


def test_writes_outside_work_dir_denied(any_sandbox: Sandbox) -> None:
    code = """
import os
for path in ["/usr/pwned", "/etc/pwned", "/pwned", "/usr/lib/pwned", "/bin/pwned", "/proc/pwned"]:
    try:
        with open(path, "w") as handle:
            handle.write("x")
        print("WROTE", path)
    except OSError as error:
        print("denied", path)
with open("inside.txt", "w") as handle:
    handle.write("fine")
print("work dir ok", open("inside.txt").read())
"""
    result = any_sandbox.run(code, limits=SHORT)
    assert result.status is ExecStatus.OK, result
    assert "WROTE" not in result.stdout
    assert result.stdout.count("denied") == 6 and "work dir ok fine" in result.stdout


def test_host_files_invisible(any_sandbox: Sandbox, tmp_path: Path) -> None:
    secret = secrets.token_hex(8)
    host_tmp_file = Path("/tmp") / f"pacerl-secret-{secrets.token_hex(4)}"
    host_tmp_file.write_text(secret)
    project_file = Path(__file__).resolve()
    try:
        code = f"""
import os
paths = [{str(host_tmp_file)!r}, {str(project_file)!r}, "/root", "/home", {str(Path.home())!r},
         {str(project_file.parent.parent)!r}, "/etc/shadow", "/etc/passwd-"]
for path in paths:
    try:
        if os.path.isdir(path):
            print("LISTED", path, os.listdir(path))
        else:
            print("READ", path, open(path).read()[:40])
    except OSError:
        print("hidden", path)
print("tmp holds", os.listdir("/tmp"))
"""
        result = any_sandbox.run(code, limits=SHORT)
    finally:
        host_tmp_file.unlink()
    assert result.status is ExecStatus.OK, result
    assert secret not in result.stdout
    assert "READ" not in result.stdout
    for line in result.stdout.splitlines():
        if line.startswith("LISTED"):
            assert line.endswith("[]"), line  # a directory may exist in the image, but never with host files


def test_fork_bomb_contained(any_sandbox: Sandbox) -> None:
    marker = f"forkbomb{secrets.token_hex(4)}"
    code = f"""
import os, sys
sys.argv[0] = {marker!r}
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    started = time.monotonic()
    result = any_sandbox.run(code, limits=Limits(timeout_s=3, max_processes=32))
    assert time.monotonic() - started < 15
    assert result.status in (ExecStatus.TIMEOUT, ExecStatus.ERROR), result
    assert not wait_gone(marker)
    assert any_sandbox.run("print('alive')", limits=SHORT).stdout == "alive\n"


def test_process_limit_enforced(any_sandbox: Sandbox) -> None:
    code = """
import os, time
children = 0
try:
    for _ in range(100):
        pid = os.fork()
        if pid == 0:
            time.sleep(5)
            os._exit(0)
        children += 1
except OSError as error:
    print("refused after", children)
"""
    result = any_sandbox.run(code, limits=Limits(timeout_s=10, max_processes=10))
    assert "refused after" in result.stdout, result
    assert int(result.stdout.split()[-1]) < 10


def test_memory_bomb(any_sandbox: Sandbox) -> None:
    result = any_sandbox.run(
        "blocks = []\nwhile True:\n    blocks.append(bytearray(50_000_000))", limits=SHORT
    )
    assert result.status is ExecStatus.MEMORY, result
    assert "MemoryError" in result.stderr


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import time\ntime.sleep(60)",
        "import subprocess\nsubprocess.run(['sleep', '60'])",
    ],
    ids=["cpu-loop", "sleep", "child-sleep"],
)
def test_timeouts(any_sandbox: Sandbox, code: str) -> None:
    started = time.monotonic()
    result = any_sandbox.run(code, limits=Limits(timeout_s=1.5))
    elapsed = time.monotonic() - started
    assert result.status is ExecStatus.TIMEOUT, result
    assert result.exit_code is None or result.exit_code < 0
    assert elapsed < 8, elapsed


def test_output_flood_truncated(any_sandbox: Sandbox) -> None:
    limits = Limits(timeout_s=20, output_cap_bytes=1000, output_kill_bytes=2_000_000)
    result = any_sandbox.run("while True:\n    print('x' * 999)", limits=limits)
    assert result.status is ExecStatus.OUTPUT_LIMIT, result
    assert result.stdout_truncated
    assert len(result.stdout) < 1200
    assert "truncated by the sandbox" in result.stdout


def test_big_but_allowed_output_is_capped_with_marker(any_sandbox: Sandbox) -> None:
    result = any_sandbox.run("print('y' * 50_000)", limits=Limits(timeout_s=5, output_cap_bytes=100))
    assert result.status is ExecStatus.OK, result
    assert result.stdout.startswith("y" * 100)
    assert "[... 49901 more bytes truncated by the sandbox ...]" in result.stdout


@pytest.mark.parametrize("style", ["sigterm", "setsid-daemon", "double-fork"])
def test_nothing_survives_the_run(any_sandbox: Sandbox, style: str) -> None:
    marker = f"survivor{secrets.token_hex(4)}"
    spawn = {
        "sigterm": f"""
import signal, subprocess
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen(["bash", "-c", "trap '' TERM; exec -a {marker} sleep 300"])
print("spawned")
""",
        "setsid-daemon": f"""
import subprocess
subprocess.Popen(["bash", "-c", "exec -a {marker} sleep 300"], start_new_session=True)
print("spawned")
""",
        "double-fork": f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("bash", ["bash", "-c", "exec -a {marker} sleep 300"])
    os._exit(0)
print("spawned")
""",
    }[style]
    result = any_sandbox.run(spawn, limits=SHORT)
    assert "spawned" in result.stdout, result
    assert not wait_gone(marker), f"{style}: a process outlived its sandbox"


def test_timeout_kills_the_whole_tree(any_sandbox: Sandbox) -> None:
    marker = f"treekill{secrets.token_hex(4)}"
    code = f"""
import subprocess, time
subprocess.Popen(["bash", "-c", "exec -a {marker} sleep 300"], start_new_session=True)
time.sleep(60)
"""
    result = any_sandbox.run(code, limits=Limits(timeout_s=1))
    assert result.status is ExecStatus.TIMEOUT
    assert not wait_gone(marker)


def backend_label(sandbox: Sandbox) -> str:
    if sandbox.backend_name == "local" and sandbox.options.get("isolation") == "unshare":
        return "local-unshare"
    return sandbox.backend_name


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_runs_leak_nothing(any_sandbox: Sandbox) -> None:
    runs = {"local": 1000, "local-unshare": 200, "docker": 60}[backend_label(any_sandbox)]
    any_sandbox.run("print(0)")  # warm pools and lazy clients exist before the baseline
    time.sleep(0.5)
    fds, children = _open_fds(), len(psutil.Process().children(recursive=True))
    tmp_entries = set(os.listdir("/tmp"))
    for i in range(runs):
        result = any_sandbox.run(f"print({i})")
        assert result.stdout == f"{i}\n", result
    time.sleep(0.5)
    assert _open_fds() <= fds + 2
    assert len(psutil.Process().children(recursive=True)) <= children + 2
    # Temp dirs a leak would leave (Python's tempfile names, pacerl's own); runc's transient
    # runc-process* files and other test processes' files are not ours.
    new = {name for name in set(os.listdir("/tmp")) - tmp_entries if name.startswith(("tmp", "pacerl"))}
    time.sleep(1)  # a leak stays; another process's transient temp dir does not
    assert {name for name in new if os.path.exists(f"/tmp/{name}")} == set()
