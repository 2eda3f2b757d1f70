"""Recycled session sandboxes: a closed session's sandbox serves the next one only after its zygote
killed the episode's processes and wiped its state; whatever it cannot vouch for is discarded."""

from __future__ import annotations

import platform
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
import string
string.ascii_letters = 'patched'
sys.path.append('/work/evil')
builtins.print = None
"""

CHECK = r"""
import json, os, string, sys
pids = {int(p) for p in os.listdir('/proc') if p.isdigit()}
state = {
    'secret': 'secret' in globals(),
    'work': os.listdir('/work'),
    'tmp': [name for name in os.listdir('/tmp') if name != '.pacerl-io'],
    'shm': os.listdir('/dev/shm') if os.path.isdir('/dev/shm') else [],
    'others': sorted(pids - {1, os.getppid(), os.getpid()}),
    'env': dict(os.environ),
    'evil_path': '/work/evil' in sys.path,
    'module': string.ascii_letters,
    'ipc': open('/proc/sysvipc/shm').read().splitlines()[1:],
}
print(json.dumps(state))
"""


def test_recycled_session_starts_clean(recycling: Sandbox) -> None:
    before = backend(recycling).recycled
    with recycling.session() as first:
        fresh = first.run(CHECK)
        init_started = first.run(INIT_START).stdout
        dirty = first.run(DIRTY)
        assert dirty.status is ExecStatus.OK, dirty
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


ATTACKS = {
    "kill-zygote": "import os\nos.kill(os.getppid(), 9)",
    "kill-all": "import os\nos.kill(-1, 9)\nimport time\ntime.sleep(1)",
    # The interpreter dies while a forked process still holds its reply pipe: the zygote must notice.
    "break-repl": (
        "import builtins, os, time\nif os.fork() == 0:\n    time.sleep(1000)\nbuiltins.print = None\n1"
    ),
}


@pytest.mark.parametrize("attack", ATTACKS.values(), ids=ATTACKS.keys())
def test_killing_the_zygote_gives_the_next_session_a_working_sandbox(recycling: Sandbox, attack: str) -> None:
    with recycling.session() as first:
        first.run("x = 1")
        hit = first.run(attack)  # under unshare the zygote is PID 1, which its namespace cannot kill
        assert hit.duration_s < 5, hit  # a dead interpreter is noticed at once, not at the timeout
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


SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}
"""(add_key, keyctl) syscall numbers: keyrings are reached through ctypes, there is no stdlib API."""


@pytest.mark.skipif(platform.machine() not in SYSCALLS, reason="keyctl syscall numbers unknown here")
def test_keyrings_do_not_carry_over(recycling: Sandbox) -> None:
    add_key, keyctl = SYSCALLS[platform.machine()]
    rings = "(-4, -5, -3)"  # the user, user-session and session keyrings
    setup = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nrings = {rings}\n"
    plant = setup + f"print([libc.syscall({add_key}, b'user', b'leak', b'data', 4, r) > 0 for r in rings])"
    # KEYCTL_SEARCH (10) for the key planted in each keyring
    find = setup + f"print([libc.syscall({keyctl}, 10, r, b'user', b'leak', 0) > 0 for r in rings])"
    before = backend(recycling).recycled
    with recycling.session() as first:
        assert first.run(plant).stdout == "[True, True, True]\n"
        assert first.run(find).stdout == "[True, True, True]\n"
    with recycling.session() as second:
        assert backend(recycling).recycled == before + 1
        assert second.run(find).stdout == "[False, False, False]\n"
