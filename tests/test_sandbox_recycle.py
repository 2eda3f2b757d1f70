"""Recycled session sandboxes: a closed session's sandbox serves the next one only after its zygote
killed the episode's processes and wiped its state; whatever it cannot vouch for is discarded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandbox import ExecStatus, Sandbox
from sandbox.local import LocalBackend


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def recycling(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    # One idle sandbox per limits: the next session lands deterministically on the recycled one.
    with Sandbox("local", isolation=request.param, warm_sessions=1) as sandbox:
        yield sandbox


def backend(sandbox: Sandbox) -> LocalBackend:
    found = sandbox._backend
    assert isinstance(found, LocalBackend)
    return found


INIT_START = "open('/proc/1/stat').read().rsplit(')', 1)[1].split()[19]"
"""When the sandbox's PID 1 started: the same value means the same sandbox."""

DIRTY = r"""
import builtins, ctypes, json, os, subprocess, sys, time
secret = 1
open('/work/left.txt', 'w').write('x')
os.makedirs('/work/locked/deeper')
open('/work/locked/deeper/f', 'w').write('y')
os.chmod('/work/locked/deeper', 0)
os.chmod('/work/locked', 0)
open('/tmp/left.txt', 'w').write('x')
if os.access('/dev/shm', os.W_OK):
    open('/dev/shm/left', 'w').write('x')
subprocess.Popen(['sleep', '1000'])
if os.fork() == 0:  # a daemon: double fork, new session, orphaned to PID 1
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)
    os._exit(0)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(4242, 4096, 0o1600) >= 0  # IPC_CREAT | 0600: a System V segment outlives processes
os.environ['X'] = '1'
json.dumps = None
sys.path.append('/work/evil')
builtins.print = None
"""

CHECK = r"""
import json, os, sys
pids = {int(p) for p in os.listdir('/proc') if p.isdigit()}
state = {
    'secret': 'secret' in globals(),
    'work': os.listdir('/work'),
    'tmp': [name for name in os.listdir('/tmp') if name != '.pacerl-io'],
    'shm': os.listdir('/dev/shm') if os.path.isdir('/dev/shm') else [],
    'others': sorted(pids - {1, os.getppid(), os.getpid()}),
    'env': dict(os.environ),
    'evil_path': '/work/evil' in sys.path,
    'ipc': open('/proc/sysvipc/shm').read().splitlines()[1:],
}
print(json.dumps(state))
"""


def test_recycled_session_starts_clean(recycling: Sandbox) -> None:
    before = backend(recycling).recycled
    with recycling.session() as first:
        fresh = first.run(CHECK)
        dirty = first.run(DIRTY)
        assert dirty.status is ExecStatus.OK, dirty
        init_started = first.run(INIT_START).stdout
    assert backend(recycling).recycled == before + 1
    with recycling.session() as second:
        assert second.run(INIT_START).stdout == init_started  # the same sandbox, reused
        after = second.run(CHECK)
        assert after.status is ExecStatus.OK, after
        assert after.stdout == fresh.stdout, (fresh.stdout, after.stdout)
        assert '"secret": false' in after.stdout and '"others": []' in after.stdout
        assert '"X"' not in after.stdout


def test_episode_cannot_read_or_write_the_zygote(recycling: Sandbox) -> None:
    code = r"""
import os
for mode in ('rb', 'r+b'):
    try:
        open(f'/proc/{os.getppid()}/mem', mode)
        print('opened', mode)
    except PermissionError:
        print('denied', mode)
"""
    with recycling.session() as session:
        result = session.run(code)
    assert result.stdout == "denied rb\ndenied r+b\n", result


@pytest.mark.parametrize(
    "attack", ["import os\nos.kill(os.getppid(), 9)", "import os\nos.kill(-1, 9)\nimport time\ntime.sleep(1)"]
)
def test_killing_the_zygote_gives_the_next_session_a_working_sandbox(recycling: Sandbox, attack: str) -> None:
    with recycling.session() as first:
        first.run("x = 1")
        first.run(attack)  # under unshare the zygote is PID 1, which its namespace cannot kill
    with recycling.session() as second:
        result = second.run("print('x' in globals())\nprint(1 + 1)")
        assert result.status is ExecStatus.OK and result.stdout == "False\n2\n", result


def test_reset_uses_a_clean_interpreter(recycling: Sandbox) -> None:
    with recycling.session() as session:
        session.run("secret = 1\nimport os\nos.environ['X'] = '1'")
        session.reset()
        result = session.run("import os\nprint('secret' in globals(), 'X' in os.environ)")
        assert result.stdout == "False False\n", result


def test_recycling_can_be_turned_off() -> None:
    with Sandbox("local", recycle_sessions=False) as sandbox:
        for _ in range(3):
            with sandbox.session() as session:
                assert session.run("1 + 1").stdout == "2\n"
        assert backend(sandbox).recycled == 0
