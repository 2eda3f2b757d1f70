"""The docker backend against a real dockerd: isolation settings, the warm pool, sessions, cleanup,
and a daemon that stops mid-run (a private dockerd on its own socket, so the shared one stays up)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from pacerl.sandbox import ExecResult, ExecStatus, Limits, Sandbox
from pacerl.sandbox.docker_backend import BACKEND_LABEL, OWNER_LABEL, DockerBackend, DockerOptions

pytestmark = pytest.mark.docker

CONTAINER_ID = (
    "import re\n"
    "mounts = open('/proc/self/mountinfo').read()\n"
    "print(re.search('containers/([0-9a-f]{64})/hostname', mounts)[1], flush=True)"
)
"""Code that prints the id of the container it runs in (docker bind-mounts /etc/hostname from a path
that names it, with cgroup v1 or v2 alike). Only where the code may read /proc: `open_proc_sandbox`."""


@pytest.fixture(scope="module")
def open_proc_sandbox(docker_image: str) -> Iterator[Sandbox]:
    """A docker sandbox whose code may read /proc (`hide_proc=False`), so that it can name its own
    container; the tests that use it are about containers' lifecycle, which /proc does not change."""
    with Sandbox("docker", image=docker_image, hide_proc=False) as sandbox:
        yield sandbox


def backend_of(sandbox: Sandbox) -> DockerBackend:
    backend = sandbox._backend
    assert isinstance(backend, DockerBackend)
    return backend


def containers(sandbox: Sandbox) -> list[str]:
    """Ids of every container (running or not) that this sandbox's backend created."""
    import docker

    label = f"{BACKEND_LABEL}={backend_of(sandbox).instance_id}"
    client = docker.DockerClient(base_url=backend_of(sandbox).base_url)
    try:
        return [c["Id"] for c in client.api.containers(all=True, filters={"label": label})]
    finally:
        client.close()


def gone(container_id: str, sandbox: Sandbox, seconds: float = 30.0) -> bool:
    """True once the container no longer exists (removal of used containers is in the background);
    False if it still does after `seconds`, a hang guard far past the daemon's usual second."""
    deadline = time.monotonic() + seconds
    while container_id in containers(sandbox):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _until(holds: Callable[[], bool], seconds: float = 60.0) -> bool:
    """Whether `holds()` came true; polls until it does, with `seconds` as a hang guard only."""
    deadline = time.monotonic() + seconds
    while not holds() and time.monotonic() < deadline:
        time.sleep(0.05)
    return holds()


def _running(marker: str) -> bool:
    """Whether a process whose command line carries `marker` runs on this host (containers' too)."""
    return any(marker in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


def test_ok_run_exit_codes_and_signals(docker_sandbox: Sandbox) -> None:
    result = docker_sandbox.run("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (result.status, result.exit_code, result.stdout, result.stderr) == (
        ExecStatus.OK,
        0,
        "out\n",
        "err\n",
    )
    assert docker_sandbox.run("raise SystemExit(7)").exit_code == 7
    failed = docker_sandbox.run("def f():\n    raise KeyError('k')\nf()")
    assert failed.status is ExecStatus.ERROR and 'File "/work/main.py", line 2, in f' in failed.stderr
    killed = docker_sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert (killed.status, killed.exit_code) == (ExecStatus.ERROR, -signal.SIGSEGV)


def test_stdin_files_and_bash(docker_sandbox: Sandbox) -> None:
    code = "import sys, json\ndata = json.load(open('cfg/a.json'))\nprint(data['k'], sys.stdin.read())"
    result = docker_sandbox.run(code, stdin=b"piped", files={"cfg/a.json": '{"k": 5}'})
    assert result.stdout == "5 piped\n", result
    bash = docker_sandbox.run(
        'read line; echo "got $line"; ls; exit 3', language="bash", stdin="x\n", files={"f": ""}
    )
    assert (bash.status, bash.exit_code, bash.stdout) == (ExecStatus.ERROR, 3, "got x\nf\n")


@pytest.mark.slow
def test_timeout_kills_the_container(open_proc_sandbox: Sandbox) -> None:
    code = CONTAINER_ID + "\nimport time\ntime.sleep(60)\nprint('woke')"
    result = open_proc_sandbox.run(code, limits=Limits(timeout_s=1))
    assert result.status is ExecStatus.TIMEOUT and result.exit_code is None, result
    # Ended by its 1 s limit, not waited out: the code never got to print after its sleep.
    assert result.reason == "wall-clock limit of 1 s exceeded" and "woke" not in result.stdout, result
    assert gone(result.stdout.strip(), open_proc_sandbox)


def test_memory_limits(docker_sandbox: Sandbox) -> None:
    result = docker_sandbox.run("x = bytearray(2 * 1024**3)", limits=Limits(memory_mb=256))
    assert result.status is ExecStatus.MEMORY and "MemoryError" in result.stderr, result
    # Processes each under RLIMIT_AS, together past the container's memory cap: the cgroup's OOM
    # killer takes the biggest, the launcher, and the status still says why.
    code = """
import os, time
read, write = os.pipe()
for _ in range(2):
    if os.fork() == 0:
        block = bytearray(150 * 1024 * 1024)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(write, b"1")
        time.sleep(60)
        os._exit(0)
os.close(write)
assert os.read(read, 1) + os.read(read, 1) == b"11"  # both children hold their memory
big = bytearray(400 * 1024 * 1024)
for i in range(0, len(big), 4096):
    big[i] = 1
print("survived")
"""
    crowd = docker_sandbox.run(code, limits=Limits(memory_mb=450, work_dir_mb=16, timeout_s=20))
    assert (crowd.status, crowd.exit_code, crowd.stdout) == (ExecStatus.MEMORY, -9, ""), crowd


@pytest.mark.slow
def test_process_limit_and_fork_bomb(docker_sandbox: Sandbox) -> None:
    code = """
import os, time
children = 0
try:
    for _ in range(100):
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        children += 1
except OSError:
    print("refused after", children)
"""
    result = docker_sandbox.run(code, limits=Limits(max_processes=12))
    assert "refused after" in result.stdout and int(result.stdout.split()[-1]) < 12, result
    bomb = docker_sandbox.run(
        "import os\nwhile True:\n    os.fork()", limits=Limits(timeout_s=2, max_processes=16)
    )
    assert bomb.status in (ExecStatus.TIMEOUT, ExecStatus.ERROR), bomb
    assert docker_sandbox.run("print('alive')").stdout == "alive\n"


def test_isolation_settings(docker_sandbox: Sandbox) -> None:
    code = """
import ctypes, os, socket
print(sorted(name for _, name in socket.if_nameindex()))
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2)
    print("CONNECTED")
except OSError as error:
    print("no network", error.strerror)
for path in ("/usr/x", "/x", "/etc/x"):
    try:
        open(path, "w")
        print("WROTE", path)
    except OSError as error:
        print("read-only", error.strerror)
open("/work/ok", "w").write("fine")
open("/tmp/ok", "w").write("fine")
# The code may not read /proc/self/status: ask the kernel directly (capget v3: two 32-bit halves).
libc = ctypes.CDLL(None, use_errno=True)
header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
assert libc.capget(header, data) == 0
cap_eff = data[0] | data[3] << 32
print("uid", os.getuid(), os.geteuid(), f"{cap_eff:016x}", libc.prctl(39, 0, 0, 0, 0))  # PR_GET_NO_NEW_PRIVS
"""
    lines = docker_sandbox.run(code).stdout.splitlines()
    assert lines[0] == "['lo']", lines
    assert lines[1].startswith("no network"), lines
    assert lines[2:5] == ["read-only Read-only file system"] * 3, lines
    _, uid, euid, cap_eff, no_new_privs = lines[5].split()
    assert int(uid) != 0 and int(euid) != 0
    assert (cap_eff, no_new_privs) == ("0000000000000000", "1")


def test_work_dir_is_size_capped(docker_sandbox: Sandbox) -> None:
    code = "try:\n    open('big', 'wb').write(b'0' * 12_000_000)\nexcept OSError as e:\n    print(e.strerror)"
    result = docker_sandbox.run(code, limits=Limits(work_dir_mb=8, max_file_mb=64))
    assert result.stdout == "No space left on device\n", result


def test_warm_containers_are_reset_and_reused_between_runs(open_proc_sandbox: Sandbox) -> None:
    open_proc_sandbox.run("print(0)")
    backend = backend_of(open_proc_sandbox)
    deadline = time.monotonic() + 60  # a hang guard: the pool refills in the background
    while (
        len(warm := [box.id for pool in list(backend._warm.values()) for box in list(pool) if box.alive])
        < backend.options.warm_pool
    ):
        assert time.monotonic() < deadline, "the warm pool never refilled"
        time.sleep(0.05)
    dirty = (
        "import os, subprocess\nopen('/work/left', 'w').write('x')\nopen('/tmp/left', 'w').write('x')\n"
        "open('/dev/shm/left', 'w').write('x')\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "os.environ['LEFT'] = '1'"
    )
    first = open_proc_sandbox.run(CONTAINER_ID + "\n" + dirty)
    first_id = first.stdout.split()[0]
    assert first.status is ExecStatus.OK and first_id in warm, first
    check = (
        "\nimport os\nothers = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]"
        "\nprint(os.listdir('/work'), os.listdir('/tmp'), os.listdir('/dev/shm'), 'LEFT' in os.environ,"
        " others)"
    )
    used = set()
    for _ in range(3 * backend.options.warm_pool):
        later = open_proc_sandbox.run(CONTAINER_ID + check)
        container, state = later.stdout.split("\n")[:2]
        assert container in warm, later  # every run found a container that was waiting for it
        assert state == "[] [] [] False ['1']", later  # reset: no file, process (but PID 1) or variable left
        used.add(container)
    assert first_id in used  # the first run's container served again once reset
    assert first_id in containers(open_proc_sandbox)


def test_orphans_holding_stdout_do_not_delay_the_result(docker_sandbox: Sandbox) -> None:
    # The orphan holds stdout for 30 s, then writes to it: a result that waited for the orphan would
    # carry "late"; this one ends with the program. (The daemon itself closes an exec's output about
    # 2 s after its process exits, orphans or not: not reading on until then is a latency, not an event.)
    code = "import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 30; echo late'])\nprint('done')"
    result = docker_sandbox.run(code, limits=Limits(timeout_s=60))
    assert (result.status, result.stdout) == (ExecStatus.OK, "done\n"), result


def test_output_flood_is_killed(docker_sandbox: Sandbox) -> None:
    limits = Limits(timeout_s=20, output_cap_bytes=1000, output_kill_bytes=1_000_000)
    result = docker_sandbox.run("while True:\n    print('x' * 999)", limits=limits)
    # Ended by the flood, not by the 20 s limit: the status and reason say which.
    assert result.status is ExecStatus.OUTPUT_LIMIT and result.stdout_truncated, result
    assert result.reason == "output limit exceeded", result


def test_session_lifecycle(open_proc_sandbox: Sandbox) -> None:
    with open_proc_sandbox.session() as session:
        container = session.run(CONTAINER_ID).stdout.strip()
        session.run("x = 6 * 7")
        assert session.run("x").stdout == "42\n"
        assert session.run(CONTAINER_ID).stdout.strip() == container
        session.reset()
        assert session.run("print('x' in globals())").stdout == "False\n"
        fresh = session.run(CONTAINER_ID).stdout.strip()
        assert fresh != container and gone(container, open_proc_sandbox)
    assert fresh not in containers(open_proc_sandbox)  # close waits until the container is removed


def test_close_leaves_no_containers(docker_image: str) -> None:
    sandbox = Sandbox("docker", image=docker_image, warm_pool=3)
    sandbox.run("print(1)", limits=Limits(memory_mb=128))
    session = sandbox.session()
    session.run("y = 1")
    assert containers(sandbox)
    sandbox.close()
    sandbox.close()
    assert containers(sandbox) == []


def test_containers_of_a_killed_host_process_are_reaped(docker_image: str) -> None:
    import docker

    script = (
        "import time\n"
        "from pacerl.sandbox import Sandbox\n"
        f"box = Sandbox('docker', image={docker_image!r}, warm_pool=2)\n"
        "box.run('print(1)')\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n"
    )
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    client = docker.DockerClient()
    try:
        assert host.stdout is not None and host.stdout.readline() == "ready\n"
        owned = [
            c["Id"]
            for c in client.api.containers(all=True, filters={"label": OWNER_LABEL})
            if c["Labels"][OWNER_LABEL].split(":")[1] == str(host.pid)
        ]
        assert owned, "the host process should own warm containers"
        host.kill()  # no close(): its containers are orphans now
        host.wait()
        with Sandbox("docker", image=docker_image, warm_pool=0) as successor:
            assert successor.run("print(2)").stdout == "2\n"
        left = {c["Id"] for c in client.api.containers(all=True, filters={"label": OWNER_LABEL})}
        assert not left & set(owned), "orphaned containers survived the next backend's start"
    finally:
        host.kill()
        client.close()


@pytest.mark.slow
async def test_concurrent_runs(docker_sandbox: Sandbox) -> None:
    results = await asyncio.gather(*(docker_sandbox.arun(f"print({i} * 2)") for i in range(8)))
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(8)]


def test_missing_interpreter_is_a_sandbox_error(docker_image: str) -> None:
    with Sandbox("docker", image=docker_image, python="/usr/bin/nope", warm_pool=0) as sandbox:
        result = sandbox.run("print(1)")
    assert result.status is ExecStatus.SANDBOX_ERROR and "/usr/bin/nope" in result.reason, result


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="non-root"):
        DockerOptions(user="0:0")
    with pytest.raises(ValueError, match="unsupported Docker daemon address"):
        DockerBackend(DockerOptions(base_url="ssh://host"))
    with pytest.raises(ValueError, match="unknown option"):
        Sandbox("docker", warm=3)


# -- a daemon that goes away ---------------------------------------------------------------------------


class PrivateDaemon:
    """A dockerd of our own: private socket, data root, exec root (so its own containerd) and, through
    `unshare --net`, its own network namespace, so nothing it does to networking (dockerd deletes the
    host's docker0 when started with `--bridge none`) reaches the shared daemon."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"unix://{root}/docker.sock"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["unshare", "--net", "--", "dockerd", "--host", self.url, "--data-root", f"{self.root}/data"]
        argv += ["--exec-root", f"{self.root}/exec", "--pidfile", f"{self.root}/dockerd.pid"]
        argv += ["--bridge", "none", "--iptables=false", "--ip6tables=false", "--ip-masq=false"]
        with open(self.root / "dockerd.log", "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=log)
        import docker

        deadline = time.monotonic() + 30
        while True:
            try:
                docker.DockerClient(base_url=self.url, timeout=2).close()
                return
            except docker.errors.DockerException:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"private dockerd did not start: {self.log()}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, as `systemctl stop docker` or `pkill dockerd` do (unshare exec'd dockerd: same pid)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)
        self.process = None

    def log(self) -> str:
        return (self.root / "dockerd.log").read_text()[-2000:]


@pytest.fixture
def private_daemon(docker_image: str) -> Iterator[PrivateDaemon]:
    if os.geteuid() != 0 or shutil.which("dockerd") is None or shutil.which("unshare") is None:
        message = "a private dockerd needs root, dockerd and unshare"
        if os.environ.get("PACERL_REQUIRE_DOCKER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    # A short path: the daemon's and containerd's unix sockets live under it (108-byte limit).
    daemon = PrivateDaemon(Path(tempfile.mkdtemp(prefix="pacerl-dockerd-", dir="/tmp")))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.stop()
        for mounted in ("exec", "data"):
            subprocess.run(["umount", "-R", str(daemon.root / mounted)], capture_output=True, check=False)
        shutil.rmtree(daemon.root, ignore_errors=True)


@pytest.mark.slow
def test_dead_daemon_is_a_sandbox_error_and_recovers(private_daemon: PrivateDaemon) -> None:
    from pacerl.sandbox.image import ensure_image

    image = ensure_image(base_url=private_daemon.url)
    private_daemon.stop()
    # Made while the daemon is down: construction succeeds, runs report the failure.
    with Sandbox("docker", image=image, base_url=private_daemon.url, warm_pool=2) as sandbox:
        down = sandbox.run("print(1)")
        assert down.status is ExecStatus.SANDBOX_ERROR and "Docker daemon" in down.reason, down
        with sandbox.session() as session:
            assert session.run("1").status is ExecStatus.SANDBOX_ERROR
        private_daemon.start()
        assert sandbox.run("print(2)").stdout == "2\n"

        # A run whose code is running (its marked sleep seen on this host) when the daemon stops: it
        # ends as a sandbox error, long before its 300 s sleep or its 600 s limit would end it.
        marker = f"inflight{secrets.token_hex(4)}"
        code = (
            f"import subprocess\nsubprocess.run(['bash', '-c', 'exec -a {marker} sleep 300'])\nprint('woke')"
        )
        results: list[ExecResult] = []
        in_flight = threading.Thread(
            target=lambda: results.append(sandbox.run(code, limits=Limits(timeout_s=600)))
        )
        in_flight.start()
        assert _until(lambda: _running(marker)), "the in-flight run never started its code"
        private_daemon.stop()
        in_flight.join(timeout=120)  # a hang guard: the run must notice, not wait for its code
        assert not in_flight.is_alive(), "the run hung when its daemon stopped"
        (stopped,) = results
        assert stopped.status is ExecStatus.SANDBOX_ERROR and stopped.reason, stopped
        assert "woke" not in stopped.stdout, stopped

        private_daemon.start()
        recovered = [sandbox.run(f"print({i})").stdout for i in range(3)]
        assert recovered == ["0\n", "1\n", "2\n"]
    assert containers(sandbox) == []
