"""One-shot runs reuse their sandbox (local) or container (docker) only after its zygote killed every
process of the run and reset what it changed; whatever the reset cannot vouch for is discarded. Each
test holds a single warm sandbox, so the next run deterministically lands on the one just used."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterator

import pytest

from pacerl.sandbox import ExecRequest, ExecStatus, Limits, Sandbox
from pacerl.sandbox.docker_backend import DockerBackend
from pacerl.sandbox.local import LocalBackend
from tests.helpers import CHANGE_WHAT_A_RESET_CANNOT_UNDO, LITTER, TAKEOVER, assert_taken_over_nothing


@pytest.fixture(
    scope="module",
    params=["bwrap", "unshare", pytest.param("docker", marks=pytest.mark.docker)],
)
def reused(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """One warm sandbox that every run of the test shares (docker: code may read /proc)."""
    if request.param == "docker":
        image = request.getfixturevalue("docker_image")
        options: dict[str, object] = {"image": image, "hide_proc": False, "warm_pool": 1, "idle_oneshot": 1}
        with Sandbox("docker", **options) as sandbox:
            yield sandbox
    else:
        with Sandbox("local", isolation=request.param, warm_pool=1, idle_oneshot=1) as sandbox:
            yield sandbox


def settle(sandbox: Sandbox) -> None:
    """Wait until the last run's sandbox is back in the pool (or discarded and replaced)."""
    backend = sandbox._backend
    deadline = time.monotonic() + 60  # a hang guard: a reset takes milliseconds
    while time.monotonic() < deadline:
        if isinstance(backend, LocalBackend):
            busy = backend._resets or backend._filling
        else:
            assert isinstance(backend, DockerBackend)
            busy = backend._resets or backend._starting
        if not busy:
            return
        time.sleep(0.01)
    raise AssertionError("the one-shot pool never settled")


def sandbox_id(sandbox: Sandbox) -> object:
    """The sandbox (local) or container (docker) that serves the next run, as the backend handed it
    over: the same object means the same sandbox. (The code cannot tell: PID 1's files are masked.)"""
    settle(sandbox)
    backend = sandbox._backend
    served: list[object] = []
    run_in = backend._run_in  # type: ignore[attr-defined]

    async def recorded(box: object, request: ExecRequest) -> object:
        served.append(box)
        return await run_in(box, request)

    backend._run_in = recorded  # type: ignore[attr-defined]
    try:
        result = sandbox.run("print('served')")
    finally:
        del backend._run_in  # type: ignore[attr-defined]
    assert result.stdout == "served\n", result
    settle(sandbox)
    return served[0]


DIRTY = (
    LITTER
    + r"""
os.umask(0)
print('dirty')
"""
)

CHECK = r"""
import json, os, resource, sys
pids = {int(p) for p in os.listdir('/proc') if p.isdigit()}
print(json.dumps({
    'work': os.listdir('/work'),
    'tmp': os.listdir('/tmp'),
    'shm': os.listdir('/dev/shm'),
    'modes': [oct(os.stat(path).st_mode) for path in ('/work', '/tmp', '/dev/shm')],
    'others': sorted(pids - {1, os.getpid()}),
    'env': dict(os.environ),
    'ipc': open('/proc/sysvipc/shm').read().splitlines()[1:],
    'umask': os.umask(0o22),
    'rlimits': [resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith('RLIMIT_')],
    'fds': sorted(os.listdir('/proc/self/fd')),
    'modules': sorted(name for name in sys.modules if not name.startswith('_')),
}, sort_keys=True))
"""


def test_a_reused_sandbox_hands_on_no_file_process_or_state(reused: Sandbox) -> None:
    before = sandbox_id(reused)
    fresh = reused.run(CHECK)
    assert fresh.status is ExecStatus.OK, fresh
    dirty = reused.run(DIRTY)
    assert (dirty.status, dirty.stdout) == (ExecStatus.OK, "dirty\n"), dirty
    after = reused.run(CHECK)
    assert after.status is ExecStatus.OK, after
    assert sandbox_id(reused) == before  # the same sandbox served every run: it was reset, not replaced
    assert json.loads(after.stdout) == json.loads(fresh.stdout)
    assert json.loads(after.stdout)["others"] == []


LATE_WRITER = """
import subprocess, sys
writer = 'import time\\nwhile True:\\n    print("LEAK", flush=True)\\n    time.sleep(0.01)'
subprocess.Popen([sys.executable, '-c', writer])
print('started')
"""


def test_output_of_leftover_processes_never_reaches_the_next_run(reused: Sandbox) -> None:
    before = sandbox_id(reused)
    first = reused.run(LATE_WRITER)
    assert first.status is ExecStatus.OK and first.stdout.startswith("started"), first
    for _ in range(3):
        later = reused.run("import time\ntime.sleep(0.1)\nprint('mine')")
        assert (later.status, later.stdout, later.stderr) == (ExecStatus.OK, "mine\n", ""), later
    assert sandbox_id(reused) == before


ENDINGS = {
    "sigkill-self": "import os\nos.kill(os.getpid(), 9)",
    "kill-all": "import os, time\nos.kill(-1, 9)\ntime.sleep(1)",
    "kill-zygote": "import os, time\nos.kill(1, 9)\ntime.sleep(0.2)\nprint('still here')",
    "segfault": "import ctypes\nctypes.string_at(0)",
    "exit-skipping-cleanup": "import os\nos._exit(3)",
    "exec-away": "import os\nos.execv('/bin/sh', ['sh', '-c', 'kill -9 $$'])",
    "close-stdout": "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.2)",
}


@pytest.mark.parametrize("ending", ENDINGS.values(), ids=ENDINGS.keys())
def test_a_run_that_kills_its_interpreter_does_not_poison_the_next(reused: Sandbox, ending: str) -> None:
    before = sandbox_id(reused)
    ended = reused.run(ending, limits=Limits(timeout_s=10))
    # The zygote is PID 1: nothing in the sandbox can kill it, so every ending is the run's own.
    assert ended.status in (ExecStatus.OK, ExecStatus.ERROR), ended
    assert "wall-clock" not in ended.reason, ended
    following = reused.run(
        "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit())[:1], 6 * 7)"
    )
    assert (following.status, following.stdout) == (ExecStatus.OK, "[1] 42\n"), following
    assert sandbox_id(reused) == before  # the sandbox survived and was reset, not replaced


def test_no_run_can_reach_the_zygote_or_take_over_later_runs(reused: Sandbox) -> None:
    result = reused.run(TAKEOVER)
    assert result.status is ExecStatus.OK, result
    report = json.loads(result.stdout)
    assert "ptrace 1" in report, report  # it saw the zygote
    assert_taken_over_nothing(report)
    for number in range(8):  # later runs on the same sandbox are answered by their own code
        answer = reused.run(f"print({number} * 7)")
        assert answer.stdout == f"{number * 7}\n", answer


def test_a_run_stopped_by_the_host_gets_a_new_sandbox(reused: Sandbox) -> None:
    before = sandbox_id(reused)
    stopped = reused.run("import time\ntime.sleep(30)", limits=Limits(timeout_s=1))
    assert stopped.status is ExecStatus.TIMEOUT, stopped
    flood = reused.run("while True:\n    print('x' * 999)", limits=Limits(output_kill_bytes=100_000))
    assert flood.status is ExecStatus.OUTPUT_LIMIT, flood
    after = sandbox_id(reused)
    assert after != before  # killed, never reset and reused
    assert reused.run("print('fine')").stdout == "fine\n"


CANNOT_UNDO = {
    **CHANGE_WHAT_A_RESET_CANNOT_UNDO,
    "network-counters": (
        "import socket\ntry:\n    socket.create_connection(('10.1.2.3', 80), timeout=1)\nexcept OSError:\n"
        "    pass\nudp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n    udp.sendto(b'x', ('127.0.0.1', 9))\nexcept OSError:\n    pass"
    ),
}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="raw syscall numbers of x86_64")
@pytest.mark.parametrize("change", CANNOT_UNDO.values(), ids=CANNOT_UNDO.keys())
def test_what_a_reset_cannot_undo_gets_the_sandbox_discarded(reused: Sandbox, change: str) -> None:
    before = sandbox_id(reused)
    made = reused.run(change, limits=Limits(timeout_s=10))
    assert made.status in (ExecStatus.OK, ExecStatus.ERROR), made  # no loopback under unshare: no socket
    assert sandbox_id(reused) != before, "a sandbox it could not reset was reused"


@pytest.mark.docker
def test_a_docker_run_that_lists_dev_gets_a_new_container(docker_image: str) -> None:
    # Docker's /dev is writable to root alone, yet listing it moves its access time, which the
    # container's user cannot put back: a later run could read it, so the container goes.
    with Sandbox("docker", image=docker_image, hide_proc=False, warm_pool=1, idle_oneshot=1) as sandbox:
        before = sandbox_id(sandbox)
        assert sandbox.run("import os\nprint(len(os.listdir('/dev')) > 0)").stdout == "True\n"
        assert sandbox_id(sandbox) != before


@pytest.mark.docker
def test_docker_code_reads_no_cgroup_counter(docker_image: str) -> None:
    # A container's cgroup files would show the CPU time and peak memory of the runs it served before.
    with Sandbox("docker", image=docker_image, warm_pool=1) as sandbox:
        result = sandbox.run("import os\nprint(os.listdir('/sys'), os.path.exists('/sys/fs/cgroup'))")
    assert (result.status, result.stdout) == (ExecStatus.OK, "[] False\n"), result  # no sysfs at all


def test_preloaded_modules_are_loaded_and_random_differs_per_run(reused: Sandbox) -> None:
    code = "import sys, random\nprint('fractions' in sys.modules, random.getrandbits(64))"
    first, second = reused.run(code), reused.run(code)
    assert first.stdout.startswith("True ") and second.stdout.startswith("True "), (first, second)
    assert first.stdout != second.stdout  # each forked run reseeds, as a fresh interpreter would
