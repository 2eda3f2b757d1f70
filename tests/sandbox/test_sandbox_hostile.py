"""Hostile code on every backend that runs code here: a clear status, and the host untouched."""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pacerl.sandbox import ExecStatus, Limits, Sandbox
from pacerl.sandbox.local import LocalBackend

SHORT = Limits(timeout_s=3)


def leftover(marker: str) -> list[psutil.Process]:
    """Host processes whose command line carries `marker` (sandboxes share this kernel)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in part for part in cmdline):
            found.append(proc)
    return found


def wait_gone(marker: str, seconds: float = 30.0) -> list[psutil.Process]:
    """The processes carrying `marker` once none is left, or (a hang guard) those left after `seconds`."""
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


@pytest.mark.slow
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
import json
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
import json
import os
paths = [{str(host_tmp_file)!r}, {str(project_file)!r}, "/root", "/home", {str(Path.home())!r},
         {str(project_file.parents[2])!r}, "/etc/shadow", "/etc/passwd-"]
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


@pytest.mark.slow
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
    result = any_sandbox.run(code, limits=Limits(timeout_s=3, max_processes=32))
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
    # The memory limit ends it; the wall-clock limit only guards against a hang, and is generous because
    # zero-filling 50 MB blocks on a loaded machine can take longer than SHORT's 3 s to reach the limit.
    result = any_sandbox.run(
        "blocks = []\nwhile True:\n    blocks.append(bytearray(50_000_000))", limits=Limits(timeout_s=60)
    )
    assert result.status is ExecStatus.MEMORY, result
    assert "MemoryError" in result.stderr


@pytest.mark.parametrize(
    "code",
    [
        "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\nprint('woke')",
        "import time\ntime.sleep(60)\nprint('woke')",
        "import subprocess\nsubprocess.run(['sh', '-c', 'sleep 60; echo woke'])",
    ],
    ids=["cpu-loop", "sleep", "child-sleep"],
)
@pytest.mark.slow
def test_timeouts(any_sandbox: Sandbox, code: str) -> None:
    # Each program would print "woke" after 60 s: its absence, and the reason naming the wall-clock
    # limit, say that the run was ended by its 1.5 s limit and not waited out (however long it took).
    result = any_sandbox.run(code, limits=Limits(timeout_s=1.5))
    assert result.status is ExecStatus.TIMEOUT, result
    assert result.reason == "wall-clock limit of 1.5 s exceeded", result
    assert result.exit_code is None or result.exit_code < 0
    assert "woke" not in result.stdout, result
    assert result.duration_s >= 1.5, result  # not ended early either


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
import json
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


SOAK = """
import json, os, sys, time
from pathlib import Path

import psutil

from pacerl.sandbox import Sandbox
from pacerl.sandbox.docker_backend import DockerBackend
from pacerl.sandbox.local import LocalBackend

runs, sessions, options = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])


def until(holds, seconds=60.0):
    deadline = time.monotonic() + seconds  # a hang guard only
    while not holds() and time.monotonic() < deadline:
        time.sleep(0.1)
    return holds()


def quiet(sandbox):
    backend = sandbox._backend
    if isinstance(backend, LocalBackend):
        return not backend._filling and not any(backend._returning.values()) and not backend._closing
    assert isinstance(backend, DockerBackend), backend
    return not backend._starting and not backend._removing


async def trim_local(backend):
    # Reset one-shot sandboxes wait in the pool up to `idle_oneshot` (a burst is served by those it left):
    # compare the host's resources at the same occupancy, the started-ahead ones only.
    for key, pool in backend._warm.items():
        while len(pool) > backend._pool_size(key):
            backend._discard(pool.pop())


def settle(sandbox):
    if isinstance(sandbox._backend, LocalBackend):
        sandbox._loop.submit(trim_local(sandbox._backend)).result()
    assert until(lambda: quiet(sandbox)), "the warm pools never finished refilling"


def fds():
    return len(os.listdir("/proc/self/fd"))


def children():
    return len(psutil.Process().children(recursive=True))


def cgroups():
    base = Path("/sys/fs/cgroup/pids")
    return sum(len([d for d in t.iterdir() if d.is_dir()]) for t in base.glob(f"pacerl-{os.getpid()}-*"))


with Sandbox(**options) as box:
    box.run("print(0)")  # warm pools and lazy clients exist before the baseline
    with box.session() as session:
        session.run("1")
    settle(box)
    before = {"fds": fds(), "children": children(), "cgroups": cgroups()}
    rss, tmp_entries = psutil.Process().memory_info().rss, set(os.listdir("/tmp"))
    for i in range(runs):
        result = box.run(f"print({i})")
        assert result.stdout == f"{i}\\n", result
    for i in range(sessions):
        with box.session() as session:
            session.run(f"x = {i}")
            assert session.run("x").stdout == f"{i}\\n"
    settle(box)
    # What the backend releases late (a cgroup still holding exiting processes) may take a moment.
    until(lambda: fds() <= before["fds"] + 2 and children() <= before["children"] + 2)
    until(lambda: cgroups() <= before["cgroups"] + 2)
    after = {"fds": fds(), "children": children(), "cgroups": cgroups()}
    # Temp dirs a leak would leave (Python's tempfile names, pacerl's own); another process's
    # transient temp dir goes, a leak stays.
    new = {n for n in set(os.listdir("/tmp")) - tmp_entries if n.startswith(("tmp", "pacerl"))}
    until(lambda: not any(os.path.exists(f"/tmp/{n}") for n in new), seconds=30)
    left = sorted(n for n in new if os.path.exists(f"/tmp/{n}"))
    targets = sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                     if os.path.exists(f"/proc/self/fd/{fd}"))
    growth = psutil.Process().memory_info().rss - rss
report = {"before": before, "after": after, "rss_growth": growth, "tmp_left": left, "fd_targets": targets}
print(json.dumps(report))
"""


@pytest.mark.slow
def test_many_runs_leak_nothing(any_sandbox: Sandbox, request: pytest.FixtureRequest) -> None:
    """A soak: thousands of one-shot runs and hundreds of recycled sessions leave no process,
    descriptor, temp dir, cgroup or memory behind. It runs in a process of its own, so that what the
    other tests' sandboxes and threads do meanwhile cannot count as this backend's leak."""
    label = backend_label(any_sandbox)
    runs = {"local": 2000, "local-unshare": 300, "docker": 60}[label]
    sessions = {"local": 300, "local-unshare": 100, "docker": 10}[label]
    options: dict[str, object] = {
        "local": {"backend": "local"},
        "local-unshare": {"backend": "local", "isolation": "unshare"},
        "docker": {"backend": "docker", "image": request.getfixturevalue("docker_image")}
        if label == "docker"
        else {},
    }[label]
    soak = subprocess.run(
        [sys.executable, "-c", SOAK, str(runs), str(sessions), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert soak.returncode == 0, soak.stderr[-3000:]
    report = json.loads(soak.stdout.splitlines()[-1])
    before, after = report["before"], report["after"]
    assert after["fds"] <= before["fds"] + 2, (before, after, report["fd_targets"])
    assert after["children"] <= before["children"] + 2, (before, after)
    assert after["cgroups"] <= before["cgroups"] + 2, (before, after)
    assert report["rss_growth"] < 64 << 20
    assert report["tmp_left"] == []


def test_code_inherits_no_host_descriptor(any_sandbox: Sandbox) -> None:
    code = "import os\nprint(sorted(int(fd) for fd in os.listdir('/dev/fd')))"
    result = any_sandbox.run(code, limits=SHORT)
    assert result.status is ExecStatus.OK, result
    assert result.stdout == "[0, 1, 2, 3]\n", result  # 3 is the listing's own descriptor


# -- host secrets, whole-sandbox memory, CPU and tasks (every process of the sandbox counted together) --


@pytest.mark.slow
def test_host_environment_invisible_to_every_process(
    any_sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"hostsecret{secrets.token_hex(6)}"
    monkeypatch.setenv("PACERL_TEST_API_KEY", secret)
    code = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: under unshare this makes /proc/self/environ readable again
seen = []
for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:
    try:
        seen.append(open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace'))
    except OSError:
        pass
seen.append(repr(dict(os.environ)))
print('\n'.join(seen))
"""
    # A new sandbox: its warm processes start after the variable is set.
    with Sandbox(any_sandbox.backend_name, **any_sandbox.options) as fresh:
        for result in (fresh.run(code), fresh.session().run(code)):
            assert result.status is ExecStatus.OK, result
            assert "PATH" in result.stdout  # it read something
            assert secret not in result.stdout


MEMORY_HOGS = {
    # Six children of 100 MiB each: every one stays under a per-process 256 MiB limit.
    "children": """
import os, time
children = []
for _ in range(6):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        block = bytearray(100 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(write, b'1')
        time.sleep(30)
        os._exit(0)
    os.close(write)
    os.read(read, 1)  # allocated (or killed trying)
    children.append(pid)
alive = [pid for pid in children if os.waitpid(pid, os.WNOHANG) == (0, 0)]
print('held', len(alive) * 100, 'MiB')
""",
    # memfds are shared memory, counted by no address-space limit.
    "memfd": """
import json
import os
fds, total = [], 0
try:
    for i in range(60):
        fd = os.memfd_create(f'm{i}')
        os.write(fd, b'x' * (16 << 20))
        fds.append(fd)
        total += 16
except OSError as error:
    pass
print('held', total, 'MiB')
""",
    "dev-shm": """
import json
import os
total = 0
try:
    for i in range(32):
        with open(f'/dev/shm/fill{i}', 'wb') as handle:
            handle.write(b'x' * (32 << 20))
        total += 32
except OSError:
    pass
print('held', total, 'MiB')
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("hog", MEMORY_HOGS.values(), ids=MEMORY_HOGS.keys())
def test_memory_is_limited_for_the_whole_sandbox(any_sandbox: Sandbox, hog: str) -> None:
    limits = Limits(timeout_s=60, memory_mb=256, max_open_files=128, max_file_mb=64, work_dir_mb=512)
    result = any_sandbox.run(hog, limits=limits)
    if result.status is ExecStatus.OK:
        held = int(result.stdout.split()[1])
        assert held < 256, result  # what it could hold in all stays under the sandbox's limit
    else:
        assert result.status is ExecStatus.MEMORY, result
    assert any_sandbox.run("print('alive')", limits=SHORT).stdout == "alive\n"


def test_nested_user_namespaces_refused(any_sandbox: Sandbox) -> None:
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x20000
print('unshare', libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), ctypes.get_errno())
import subprocess
try:
    print('tool', subprocess.run(['unshare', '-Urm', 'true'], capture_output=True).returncode)
except FileNotFoundError:
    print('tool missing')
"""
    result = any_sandbox.run(code, limits=SHORT)
    assert result.status is ExecStatus.OK, result
    lines = result.stdout.splitlines()
    assert lines[0].startswith("unshare -1 "), result
    assert lines[1] != "tool 0", result


@pytest.mark.slow
def test_cpu_time_is_limited_for_the_whole_sandbox(any_sandbox: Sandbox) -> None:
    # Eight workers of 1.5 CPU-seconds each: every one stays under a per-process cpu_s of 3.
    code = """
import os, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
pids = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        burn(1.5)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
print('all done', os.times().children_user + os.times().children_system)
"""
    result = any_sandbox.run(code, limits=Limits(timeout_s=120, cpu_s=3))
    assert result.status is ExecStatus.TIMEOUT, result
    assert "CPU" in result.reason and "all done" not in result.stdout, result


@pytest.mark.slow
def test_session_cpu_counts_background_processes(any_sandbox: Sandbox) -> None:
    # A cell that leaves a child burning CPU (it ignores SIGXCPU) and then waits: the CPU of the
    # sandbox's processes together is what is limited, so the call ends long before its wall limit.
    limits = Limits(timeout_s=120, cpu_s=2)
    burner = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    code = (
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {burner!r}])\ntime.sleep(100)"
    )
    with any_sandbox.session(limits) as session:
        result = session.run(code)
        assert result.status is ExecStatus.TIMEOUT and "CPU" in result.reason, result
        again = session.run("print('alive')")
        assert again.status is ExecStatus.OK and again.stdout == "alive\n", again
        assert "restarted" in again.stderr, again


@pytest.mark.slow
def test_session_sandbox_sleeps_between_calls(any_sandbox: Sandbox) -> None:
    # A freezer cgroup stops everything a session left running while no call is in flight.
    burner = (
        "import os, signal, time\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n"
        "    open('/work/next', 'w').write(repr(time.process_time()))\n"
        "    os.replace('/work/next', '/work/used')"
    )
    start = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {burner!r}])"
    # The first read waits for the child's first write (a loaded machine may start it late); no bound on
    # time is asserted, only on the CPU the child used.
    used = "import os, time\ntime.sleep(0.2)\nwhile not os.path.exists('/work/used'):\n    time.sleep(0.05)\n"
    used += "print(open('/work/used').read())"
    with any_sandbox.session(Limits(timeout_s=60, cpu_s=30)) as session:
        assert session.run(start).status is ExecStatus.OK
        before = float(session.run(used).stdout)
        time.sleep(3)  # the child would burn most of three CPU-seconds here if it ran
        after = float(session.run(used).stdout)
    assert after - before < 1.0, (before, after)  # it ran only during the second call (0.2 s)


@pytest.mark.slow
def test_without_cgroups_the_fallback_says_so_and_still_counts_cpu() -> None:
    # Hosts where this process may not create cgroups (not root, cgroup v2 without delegation) keep
    # per-process rlimits and sum CPU time over the sandbox's process tree from /proc.
    with Sandbox("local", cgroups=False, warm_pool=0) as sandbox:
        backend = sandbox._backend
        assert isinstance(backend, LocalBackend)
        assert backend.limits_mechanism.startswith("no writable cgroup"), backend.limits_mechanism
        workers = "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n"
        workers += "        end = time.process_time() + 1.5\n        while time.process_time() < end:\n"
        workers += "            pass\n        os._exit(0)\nwhile True:\n    try:\n        os.wait()\n"
        workers += "    except ChildProcessError:\n        break\nprint('all done')"
        result = sandbox.run(workers, limits=Limits(timeout_s=120, cpu_s=3))
        assert result.status is ExecStatus.TIMEOUT and "CPU" in result.reason, result
