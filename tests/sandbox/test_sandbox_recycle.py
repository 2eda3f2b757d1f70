"""Recycled session sandboxes: a closed session's sandbox serves the next one only after its zygote
killed the episode's processes and wiped its state; whatever it cannot vouch for is discarded."""

from __future__ import annotations

import json
import platform
from collections.abc import Iterator

import psutil
import pytest

from pacerl.sandbox import ExecStatus, Sandbox
from pacerl.sandbox.local import LocalBackend
from tests.helpers import (
    CHANGE_WHAT_A_RESET_CANNOT_UNDO,
    LITTER,
    TAKEOVER,
    assert_taken_over_nothing,
    session_box,
)


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def recycling(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    # One idle sandbox per limits: the next session lands deterministically on the recycled one.
    with Sandbox("local", isolation=request.param, warm_sessions=1) as sandbox:
        yield sandbox


def backend(sandbox: Sandbox) -> LocalBackend:
    found = sandbox._backend
    assert isinstance(found, LocalBackend)
    return found


DIRTY = (
    "import builtins, json\nsecret = 1\n"
    + LITTER
    + r"""
os.environ['X'] = '1'
import string
string.ascii_letters = 'patched'
sys.path.append('/work/evil')
builtins.print = None
"""
)

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
        used = session_box(first)
        dirty = first.run(DIRTY)
        assert dirty.status is ExecStatus.OK, dirty
    assert backend(recycling).recycled == before + 1
    with recycling.session() as second:
        after = second.run(CHECK)
        assert session_box(second) is used  # the same sandbox, reused
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
        # A dead interpreter is noticed at once and said so, not found out at the call's timeout (whose
        # verdict would be TIMEOUT, "wall-clock limit ... exceeded").
        assert hit.status is not ExecStatus.TIMEOUT and "wall-clock" not in hit.reason, hit
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


# -- one episode cannot take over, or leave a trace in, the episodes that reuse its sandbox -----------


def test_no_episode_can_reach_the_host_pipes_or_take_over_later_ones(recycling: Sandbox) -> None:
    with recycling.session() as first:
        result = first.run(TAKEOVER)
        assert result.status is ExecStatus.OK, result
        report = json.loads(result.stdout)
        assert report, "the episode saw no other process"
        assert_taken_over_nothing(report)
    for number in range(8):  # later episodes on the same sandbox are answered by their own code
        with recycling.session() as later:
            answer = later.run(f"print('canary' in globals(), {number} * 7)")
            assert answer.stdout == f"False {number * 7}\n", answer


FORGERIES = {
    # A header announcing 400 MB: neither the zygote nor the host may buffer it.
    "huge": "os.write(reply, b'400000000\\n' + b'x' * 65536)",
    "empty": "os.write(reply, b'0\\n')",
    "malformed-header": "os.write(reply, b'abc\\n')",
    "wrong-schema": "os.write(reply, b'16\\n{\"ready\": true} ')",
}
FIND_REPLY_PIPE = """
import fcntl, os, stat
def fd_ok(fd):
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False
def writable(fd):
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
reply = next(fd for fd in range(3, 64) if fd_ok(fd) and writable(fd))  # the interpreter's reply pipe
"""


@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES.keys())
def test_a_forged_reply_ends_the_sandbox_with_a_clear_error(recycling: Sandbox, forgery: str) -> None:
    before = backend(recycling).recycled
    rss = psutil.Process().memory_info().rss
    code = FIND_REPLY_PIPE + forgery + "\nimport time\ntime.sleep(5)"
    with recycling.session() as session:
        session.run("kept = 1")
        result = session.run(code)
        assert result.status is ExecStatus.SANDBOX_ERROR, result
        assert "restarted" in result.reason, result
        after = session.run("print('kept' in globals())")
        assert after.status is ExecStatus.OK and after.stdout == "False\n", after
    assert psutil.Process().memory_info().rss - rss < 64 << 20  # nothing of the forged size was buffered
    assert backend(recycling).recycled == before + 1  # only the restarted, clean sandbox went back


FINGERPRINT = r"""
import ctypes, json, os, resource, socket, platform
uid = str(os.getuid())
libc = ctypes.CDLL(None, use_errno=True)
def norm(text):
    return text.replace(uid, 'UID')
def entry(path):
    st = os.lstat(path)
    xattrs = {}
    for name in os.listxattr(path, follow_symlinks=False):
        xattrs[name] = os.getxattr(path, name, follow_symlinks=False).hex()
    listing = sorted(os.listdir(path)) if os.path.isdir(path) else None
    return [oct(st.st_mode), st.st_uid == os.getuid(), xattrs, listing]
LIMIT_NAMES = [name for name in dir(resource) if name.startswith('RLIMIT_')]
mounts = []
for line in open('/proc/self/mountinfo'):
    fields = line.split()
    dash = fields.index('-')
    mounts.append(norm(' '.join(fields[3:6] + fields[dash + 1:])))
def table(name):
    try:
        return open(f'/proc/net/{name}').read().splitlines()[1:]
    except OSError:
        return 'absent'
KEYCTL_READ, KEYCTL_GET_PERSISTENT = 11, 22
def ring(spec):  # the number of keys a keyring holds (KEYCTL_READ on a keyring lists 4-byte serials)
    buffer = ctypes.create_string_buffer(4096)
    return libc.syscall(250, KEYCTL_READ, spec, buffer, 4096) // 4
persistent = libc.syscall(250, KEYCTL_GET_PERSISTENT, -1, -3)  # linked into the session keyring
print(json.dumps({
    'mounts': mounts,
    'paths': {path: entry(path) for path in ('/', '/work', '/tmp', '/dev', '/dev/shm')},
    'proc': sorted(name for name in os.listdir('/proc') if not name.isdigit()),
    'dev': {name: oct(os.lstat('/dev/' + name).st_mode) for name in sorted(os.listdir('/dev'))},
    'rlimits': {name: resource.getrlimit(getattr(resource, name)) for name in LIMIT_NAMES},
    'nice': os.getpriority(os.PRIO_PROCESS, 0),
    'ioprio': libc.syscall(252, 1, 0),
    'init': [libc.syscall(252, 1, 1), os.getpriority(os.PRIO_PROCESS, 1)],  # PID 1's I/O and CPU priority
    'scheduler': [os.sched_getscheduler(0), sorted(os.sched_getaffinity(0))],
    'keyrings': [ring(-3), ring(-4), ring(-5), ring(persistent)],
    'sockets': {name: table(name) for name in ('tcp', 'tcp6', 'udp', 'udp6', 'unix', 'raw')},
    'env': dict(os.environ),
    'processes': sorted(open(f'/proc/{p}/comm').read().strip() for p in os.listdir('/proc') if p.isdigit()),
    'ipc': {kind: open(f'/proc/sysvipc/{kind}').read().splitlines()[1:] for kind in ('shm', 'sem', 'msg')},
    'hostname': socket.gethostname(),
    'umask': os.umask(0o22),
    'cwd': [os.getcwd(), sorted(os.listdir('.'))],
}, sort_keys=True))
"""

CHANGE_WHAT_A_RESET_UNDOES = r"""
import ctypes, os, struct, subprocess, time, platform
libc = ctypes.CDLL(None, use_errno=True)
entries = ((1, 7), (4, 5), (0x20, 0))  # user::rwx group::r-x other::---
acl = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', tag, perm, 0xFFFFFFFF) for tag, perm in entries)
for path in ('/work', '/tmp', '/dev/shm', '/dev'):
    changes = (('system.posix_acl_default', acl), ('system.posix_acl_access', acl), ('user.mark', b'1'))
    for name, value in changes:
        try:
            os.setxattr(path, name, value)
        except OSError:
            pass
    try:
        os.chmod(path, 0o705)
    except OSError:
        pass
    try:
        open(path + '/left', 'w').write('x')
    except OSError:
        pass
os.umask(0)
if platform.machine() == 'x86_64':
    persistent = libc.syscall(250, 22, -1, -3)
    for spec in (-4, -5, persistent):  # user, user-session and persistent keyrings
        libc.syscall(248, b'user', b'left', b'data', 4, spec)
libc.shmget(4243, 4096, 0o1600)
libc.semget(4244, 1, 0o1600)
libc.msgget(4245, 0o1600)
subprocess.Popen(['sleep', '1000'])
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="raw syscall numbers of x86_64")
def test_a_recycled_sandbox_is_indistinguishable_from_a_fresh_one(recycling: Sandbox) -> None:
    options = {**recycling.options, "recycle_sessions": False}
    with Sandbox("local", **options) as fresh_only, fresh_only.session() as fresh:
        reference = json.loads(fresh.run(FINGERPRINT).stdout)
    with recycling.session() as first:
        assert first.run(FINGERPRINT).status is ExecStatus.OK
        changed = first.run(CHANGE_WHAT_A_RESET_UNDOES)
        assert changed.status is ExecStatus.OK, changed
    before = backend(recycling).recycled
    with recycling.session() as second:
        assert backend(recycling).recycled == before  # the first one's sandbox is this one
        seen = json.loads(second.run(FINGERPRINT).stdout)
    assert seen == reference
    for name, change in CHANGE_WHAT_A_RESET_CANNOT_UNDO.items():
        recycled = backend(recycling).recycled
        with recycling.session() as episode:
            made = episode.run(change).status is ExecStatus.OK  # no loopback under unshare: no socket
        if made:
            assert backend(recycling).recycled == recycled, f"{name}: a sandbox it could not reset was reused"
        with recycling.session() as next_one:
            assert json.loads(next_one.run(FINGERPRINT).stdout) == reference, name
