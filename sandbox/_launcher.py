"""The program that runs *inside* every sandbox (local namespaces and Docker alike).

It is started before any job is known (so a pool of warm sandboxes can wait for work) and is a
zygote that runs no code of the user's itself: the code runs in processes it forks. It is the
sandbox's PID 1, except in a Docker session's container (exec'd there, it serves one episode).

In `oneshot` mode (see `oneshot_zygote`, sandbox/_launcher_oneshot.py) it imports what snippets use,
forks the next run's process ahead of time, and serves one run after another: the process reads its
job (one length-prefixed JSON frame), writes the job's files into the work directory, applies the
rlimits, and then becomes the user's program (Python code runs in this very interpreter, bash
replaces it by exec). After each run the zygote kills every process of the sandbox and resets it, as
between sessions.

In `session` mode (see `session`, sandbox/_launcher_session.py) it forks one small REPL per episode
and resets the sandbox for the next episode. The REPL: one frame in, one frame out per call, globals
kept between calls, each call's stdout/stderr captured in files on the private tmpfs (so the host
reads only the capped head), a per-call SIGALRM that interrupts runaway cells without losing the
session.

The launcher is one source made of three files, joined in this order by `LAUNCHER_SOURCE`
(sandbox/_protocol.py): this one (what both modes share: frames, files, rlimits, the reset, the pipe
relays, the `unshare` fallback), sandbox/_launcher_session.py, and sandbox/_launcher_oneshot.py,
which ends with the entry point of every mode. It is one source because it reaches the sandbox as
the argument of `python3 -I -c`: a sandbox holds no copy of the project and could not import it
(with `DockerOptions.hide_proc`, sandbox/_hide_proc.py goes ahead of it). So each later part uses
the names of the parts before it as its own globals (it imports them from here for the type checker
only), and all of it runs as `<string>`, the file name whose frames `print_exception` leaves out of
the user's tracebacks. A module a part imports at its top is loaded in every zygote, and so in every
run forked from it: the parts import at their tops only the modules the launcher always needs,
anything else inside the function that uses it.

Standard library only; runs under `python3 -I`. It must not import the project.
"""

import base64
import contextlib
import json
import linecache
import os
import resource
import signal
import sys
import traceback
import types
from typing import Any

Job = dict[str, Any]


def read_frame(fd: int) -> Job | None:
    header = b""
    while not header.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            return None
        header += byte
    size = int(header)
    payload = bytearray()
    while len(payload) < size:
        chunk = os.read(fd, min(size - len(payload), 1 << 20))
        if not chunk:
            return None
        payload += chunk
    frame: Job = json.loads(payload)
    return frame


def write_frame(fd: int, obj: Job) -> None:
    payload = json.dumps(obj).encode()
    data = b"%d\n" % len(payload) + payload
    while data:
        written = os.write(fd, data)
        data = data[written:]


def write_files(files: dict[str, str], status_fd: int) -> None:
    """Write the job's files below the work directory. The host refused every path and size that
    cannot fit; a write that fails anyway is still the caller's input, not the sandbox's fault, so it
    ends the run as the code's own error would (a message on stderr, exit status 1) on every backend:
    the start is announced first, or the host would report a sandbox that failed to start."""
    for path, content in files.items():
        try:
            write_file(path, base64.b64decode(content))
        except OSError as error:
            print(f"[sandbox] could not write the file {path!r}: {error.strerror or error}", file=sys.stderr)
            sys.stderr.flush()
            announce_start(status_fd)
            os._exit(1)


def write_file(path: str, data: bytes) -> None:
    """Create `path` (normal and relative) one component at a time from directory descriptors, so that
    no depth or whole-path length the host accepted can fail here."""
    *parents, name = path.split("/")
    directory = os.open(".", os.O_PATH | os.O_DIRECTORY)
    try:
        for part in parents:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=directory)
            inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
            os.close(directory)
            directory = inner
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o666, dir_fd=directory)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    finally:
        os.close(directory)


def stdin_fd(data: bytes) -> int:
    """A file descriptor positioned at the start of `data` (an in-memory file: no pipe to fill)."""
    fd = os.memfd_create("stdin", 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def replace_fd(fd: int, target: int) -> None:
    os.dup2(fd, target)
    os.close(fd)


def apply_limits(limits: Job, cpu_hard: int | None = None) -> None:
    def set_limit(kind: int, soft: int, hard: int | None = None) -> None:
        resource.setrlimit(kind, (soft, soft if hard is None else hard))

    set_limit(resource.RLIMIT_AS, limits["memory_bytes"])
    set_limit(resource.RLIMIT_CPU, limits["cpu_s"], cpu_hard or limits["cpu_s"] + 1)
    set_limit(resource.RLIMIT_NPROC, limits["max_processes"])
    set_limit(resource.RLIMIT_FSIZE, limits["max_file_bytes"])
    set_limit(resource.RLIMIT_NOFILE, limits["max_open_files"])
    set_limit(resource.RLIMIT_CORE, 0)
    # A write past RLIMIT_FSIZE should fail with EFBIG (readable), not kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def new_main_module() -> types.ModuleType:
    module = types.ModuleType("__main__")
    module.__file__ = os.path.join(os.getcwd(), "main.py")
    module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    return module


def print_exception(error: BaseException) -> None:
    # Skip this launcher's own frames (it runs as "<string>") so the traceback reads like the user's.
    trace = error.__traceback__
    while trace is not None and trace.tb_frame.f_code.co_filename == "<string>":
        trace = trace.tb_next
    traceback.print_exception(type(error), error, trace)


def register_source(filename: str, code: str) -> None:
    """Let tracebacks show the user's source lines although no such file exists."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)


def announce_start(status_fd: int) -> None:
    """Say that the sandbox is up, or that the user's code starts now (then hide the channel)."""
    if status_fd >= 0:
        os.write(status_fd, b"R")
        os.close(status_fd)


def take_host_pipes(status_fd: int, lib: Any) -> tuple[int, int, Job]:
    """A zygote's start: say it is up, keep the host's pipes (stdin, stdout) on descriptors of its own,
    put /dev/null where they were (so nothing a child inherits reaches the host), and record the clean
    state its resets restore."""
    announce_start(status_fd)
    host_in, host_out = os.dup(0), os.dup(1)
    replace_fd(os.open(os.devnull, os.O_RDONLY), 0)
    replace_fd(os.open(os.devnull, os.O_WRONLY), 1)
    return host_in, host_out, snapshot(lib)


def exit_status(error: SystemExit) -> int:
    """The exit status `raise SystemExit(code)` gives in CPython (a message goes to stderr, status 1)."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code & 0xFF
    print(error.code, file=sys.stderr)
    return 1


# -- what both zygotes share: the reset between runs or episodes, the raw syscalls it needs, and the
# relaying of frames between pipes with splice(2) (the zygotes: sandbox/_launcher_session.py and
# sandbox/_launcher_oneshot.py)

PR_SET_DUMPABLE = 4
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEYCTL_LINK, KEYCTL_GET_PERSISTENT = 1, 7, 8, 22
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31}
IOPRIO_WHO_PROCESS = 1
RESET_DEADLINE_S = 1.5
HEADER_DIGITS = 12
RESET_BUDGET = {"inodes": 1024, "bytes": 64 << 20, "ipc": 64}
"""The most a run or episode may leave for its sandbox's reset to undo: files and directories on the
wiped tmpfs mounts, their bytes, System V objects. Undoing that much takes a few milliseconds; a run
that leaves more has its sandbox discarded instead (its mounts go with it, in the kernel), so no reset
that long is paid by the next run, and none runs unbounded on no run's CPU budget."""
IPC_INFO_CALLS = (("shmctl", 14, 0), ("msgctl", 12, 0), ("semctl", 19, 7))
"""(libc call, its *_INFO command, which int of the answer counts the objects in use): SHM_INFO's
used_ids, MSG_INFO's msgpool and SEM_INFO's semusz, read in O(1) whatever the number of objects."""


class ProtocolViolationError(Exception):
    """The episode wrote something on its reply pipe that is not a well-formed reply."""


def libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def syscall(lib: Any, numbers: dict[str, int], *args: int) -> int | None:
    """A raw syscall by per-architecture number; None where this architecture is not listed."""
    import ctypes
    import platform

    number = numbers.get(platform.machine())
    if number is None:
        return None
    result: int = lib.syscall(number, *(ctypes.c_long(arg) for arg in args))
    return result


def forget_keyrings(lib: Any) -> None:
    """Empty the keyrings that outlive processes (user, user-session and persistent: per uid and user
    namespace) so that nothing stored in one episode or sandbox reaches the next with the same uid."""
    # Getting the persistent keyring links it into the user keyring, so that one is cleared after.
    persistent = syscall(lib, SYS_KEYCTL, KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_USER_KEYRING)
    if persistent is not None and persistent > 0:
        syscall(lib, SYS_KEYCTL, KEYCTL_CLEAR, persistent)
    syscall(lib, SYS_KEYCTL, KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING)
    syscall(lib, SYS_KEYCTL, KEYCTL_CLEAR, KEY_SPEC_USER_SESSION_KEYRING)
    # As the kernel makes it, the user-session keyring holds one link: to the user keyring.
    syscall(lib, SYS_KEYCTL, KEYCTL_LINK, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING)


def dir_state(path: str) -> tuple[int, int, int, int, int, tuple[str, ...]]:
    st = os.lstat(path)
    xattrs = tuple(sorted(os.listxattr(path, follow_symlinks=False)))
    return st.st_ino, st.st_mode, st.st_uid, st.st_atime_ns, st.st_mtime_ns, xattrs


def dev_entries() -> dict[str, tuple[int, int]]:
    return {
        entry.name: (entry.inode(), entry.stat(follow_symlinks=False).st_mode) for entry in os.scandir("/dev")
    }


def sockets() -> list[str]:
    """The socket counters of the sandbox's network namespace: every socket of any family
    (`sockets: used`, unix, netlink and packet ones included), and TCP's sockets in use (an orphan,
    closed by its process but not done with its peer, is still one) and TIME_WAIT sockets, which
    outlive their processes. The counters, not the tables: listing /proc/net/udp or
    tcp walks the host's whole hash table (tens of microseconds a table), and the count of a namespace's
    sockets already covers every row those tables could show."""
    rows = []
    for table in ("sockstat", "sockstat6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/net/{table}") as handle:
            for line in handle:
                kind, _, counters = line.partition(":")
                fields = counters.split()
                pairs = dict(zip(fields[::2], fields[1::2], strict=False))
                # alloc, mem and TCP's orphan count are host-wide (another process's connection moves
                # them), the others this namespace's
                keys = {"sockets": ("used",), "TCP": ("inuse", "tw"), "TCP6": ("inuse",)}
                rows.append(
                    f"{kind}: " + " ".join(f"{key} {pairs.get(key)}" for key in keys.get(kind, ("inuse",)))
                )
    return rows


def network_counters() -> list[bytes]:
    """The traffic counters of the sandbox's network namespace (per interface, per protocol): code
    that used the network, even only to fail to reach it, leaves them changed, and they cannot be reset."""
    counters = []
    for table in ("dev", "snmp", "snmp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/net/{table}", "rb") as handle:
            counters.append(handle.read())
    return counters


def autogroup_nice() -> str:
    """The nice value of this process's autogroup (the CPU weight of every process of its session)."""
    try:
        with open("/proc/self/autogroup") as handle:
            return handle.read().split()[-1]
    except OSError:
        return "-"  # no autogroups in this kernel (or no /proc): nothing to hand on either


def usage(paths: list[str]) -> tuple[int, int]:
    """(inodes, bytes) in use on the file systems of `paths` (statvfs: O(1), whatever they hold)."""
    inodes = used = 0
    for path in paths:
        stats = os.statvfs(path)
        inodes += stats.f_files - stats.f_ffree
        used += (stats.f_blocks - stats.f_bfree) * stats.f_frsize
    return inodes, used


def ipc_objects(lib: Any) -> int:
    """System V shared memory segments, message queues and semaphore sets of the IPC namespace."""
    import ctypes

    info = ctypes.create_string_buffer(256)
    count = 0
    for call, command, field in IPC_INFO_CALLS:
        args = (0, 0, command, info) if call == "semctl" else (0, command, info)
        if getattr(lib, call)(*args) >= 0:
            count += int.from_bytes(info.raw[4 * field : 4 * field + 4], sys.byteorder)
    return count


def over_budget(clean: Job, lib: Any) -> str | None:
    """What the run or episode left past `RESET_BUDGET` (its processes already gone), else None."""
    inodes, used = usage(list(clean["wiped"]))
    left = {
        "inodes": inodes - clean["usage"][0],
        "bytes": used - clean["usage"][1],
        "ipc": ipc_objects(lib),
    }
    over = [f"{left[key]} {key}" for key, most in RESET_BUDGET.items() if left[key] > most]
    return f"left more than a reset undoes: {', '.join(over)}" if over else None


RLIMITS = tuple(name for name in dir(resource) if name.startswith("RLIMIT_"))


def snapshot(lib: Any) -> Job:
    """What a clean sandbox looks like, taken before any user code ran; `reset` restores or checks it."""
    wiped = [path for path in (os.getcwd(), "/tmp", "/dev/shm") if os.access(path, os.W_OK)]
    return {
        "wiped": {path: dir_state(path) for path in wiped},
        "dev": dev_entries() if os.access("/dev", os.W_OK) else None,
        # Directories the code can read but not restore (Docker's /dev is writable to root alone; its
        # access time still moves when it is listed): they must not change at all.
        "fixed": {
            path: dir_state(path)
            for path in ("/dev", "/dev/pts", "/dev/mqueue")
            if path not in wiped and os.path.isdir(path)
        },
        "usage": usage(wiped),
        "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in RLIMITS},
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "autogroup": autogroup_nice(),
        "ioprio": syscall(lib, SYS_IOPRIO_GET, IOPRIO_WHO_PROCESS, 0),
        "scheduler": os.sched_getscheduler(0),
        "affinity": os.sched_getaffinity(0),
        "sockets": sockets(),
        "network": network_counters(),
    }


def remove_tree(path: str) -> None:
    """Delete everything below `path` (the user's own files: it may have chmod-ed them to 0)."""
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.path, 0o700)
            remove_tree(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)


def kill_all() -> None:
    """SIGKILL every other process of the PID namespace (this zygote is its PID 1), until none is left."""
    import time

    me, deadline = os.getpid(), time.monotonic() + RESET_DEADLINE_S
    while True:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        # Every child was just sent SIGKILL, so a blocking wait ends promptly (a child stuck in the
        # kernel holds us up to the host's reset timeout, after which the host kills the sandbox).
        with contextlib.suppress(ChildProcessError):
            while True:
                os.waitpid(-1, 0)
        if not [pid for pid in os.listdir("/proc") if pid.isdigit() and int(pid) not in (1, me)]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("processes survived the reset")
        time.sleep(0.001)


def remove_ipc(lib: Any) -> None:
    """System V IPC objects belong to the IPC namespace, which outlives the episode: remove them all."""
    for kind in ("shm", "sem", "msg"):
        with open(f"/proc/sysvipc/{kind}") as table:
            ids = [int(line.split()[1]) for line in table.readlines()[1:] if line.strip()]
        if not ids:
            continue
        for ident in ids:  # IPC_RMID is 0; semctl takes a semaphore number before the command
            if kind == "sem":
                lib.semctl(ident, 0, 0)
            else:
                getattr(lib, f"{kind}ctl")(ident, 0, None)
        with open(f"/proc/sysvipc/{kind}") as table:
            if len([line for line in table.readlines()[1:] if line.strip()]) > 0:
                raise RuntimeError(f"System V {kind} objects survived the reset")


def reset(clean: Job, lib: Any) -> None:
    """Make the sandbox as it was before the first episode, or raise (then the host discards it)."""
    kill_all()  # first: nothing may run while we clean
    over = over_budget(clean, lib)
    if over is not None:
        raise RuntimeError(f"the episode {over}")
    remove_ipc(lib)
    forget_keyrings(lib)
    for path, state in clean["wiped"].items():
        os.chmod(path, 0o700)
        remove_tree(path)
        # Every extended attribute goes, default and access ACLs (system.posix_acl_*) included.
        for name in os.listxattr(path, follow_symlinks=False):
            os.removexattr(path, name, follow_symlinks=False)
        if os.listdir(path):
            raise RuntimeError(f"{path} could not be emptied")
        os.chmod(path, state[1] & 0o7777)
        # Timestamps are restored too (a cell could encode bits in them); atime last, as reading the
        # directory moves it.
        os.utime(path, ns=(state[3], state[4]), follow_symlinks=False)
        if dir_state(path) != state:
            raise RuntimeError(f"{path} could not be restored")
    if clean["dev"] is not None:
        for entry in os.scandir("/dev"):
            if entry.name not in clean["dev"]:
                if entry.is_dir(follow_symlinks=False):
                    remove_tree(entry.path)
                    os.rmdir(entry.path)
                else:
                    os.unlink(entry.path)
        if dev_entries() != clean["dev"]:
            raise RuntimeError("/dev was changed")
    # Same-uid code may lower this process's rlimits (prlimit), priorities or affinity, which the next
    # episode would inherit, and the network namespace keeps sockets in TIME_WAIT after their processes
    # are gone and counts its traffic: none of that can be undone from here, so refuse to go on rather
    # than hand it on.
    now = snapshot(lib)
    for key in (
        "fixed",
        "rlimits",
        "nice",
        "autogroup",
        "ioprio",
        "scheduler",
        "affinity",
        "sockets",
        "network",
    ):
        if now[key] != clean[key]:
            raise RuntimeError(f"the sandbox's {key} changed")


def start_fresh(lib: Any) -> None:
    """What a forked run or episode process does first, so that it starts as a new sandbox's would."""
    # A session of its own, so an autogroup of its own: the kernel shares an autogroup's nice value
    # (/proc/self/autogroup) among every process of a session, and the zygote's session outlives runs.
    os.setsid()
    # The zygote is non-dumpable; the run's own process must not be (or its /proc/self files turn
    # root-owned and unreadable to it).
    lib.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    syscall(lib, SYS_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, 0)  # a fresh keyring, dies with the process


def own_command() -> list[str]:
    """This interpreter's command line up to its program (`python -I -c SOURCE`): what a fresh
    interpreter of a run or an episode is started with."""
    with open("/proc/self/cmdline", "rb") as handle:
        argv = handle.read().split(b"\0")
    return [os.fsdecode(arg) for arg in argv[: argv.index(b"-c") + 2]]


def exec_fresh(command: list[str], mode: str, config: str, *fds: int) -> None:
    """Become a new interpreter running this launcher in `mode` (`run`, `repl`), handing it `fds`."""
    for fd in fds:
        os.set_inheritable(fd, True)
    os.execv(command[0], [*command, mode, config, *map(str, fds)])


def wait_readable(source: int, pidfd: int) -> bool:
    """True once the interpreter's pipe has data; False once the interpreter has died and the pipe is
    empty (processes it forked may hold the pipe's write end, so EOF alone would not tell)."""
    import select

    ready, _, _ = select.select([source, pidfd], [], [])
    return source in ready


def splice_exactly(source: int, target: int, size: int, pidfd: int | None = None) -> None:
    """Move `size` bytes from one pipe to another inside the kernel (never through this process)."""
    while size:
        if pidfd is not None and not wait_readable(source, pidfd):
            raise EOFError("the session interpreter died")
        moved = os.splice(source, target, size)
        if not moved:
            raise EOFError("the pipe closed mid-frame")
        size -= moved


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


HEADER_BUFFER = bytearray(64)
"""Where frame headers are read, with whatever payload bytes arrive in the same read: those are
passed on at once and the buffer wiped, so no payload stays in the zygote's memory."""


def read_header(source: int, pidfd: int | None) -> tuple[bytes, int, int]:
    """Read up to a frame's header line into HEADER_BUFFER: (the header without its newline, where
    the payload bytes read with it start in the buffer, how many there are). None-pidfd sources are
    the host's; an interpreter's pipe is watched for its death. EOFError at the end of the stream."""
    view, got = memoryview(HEADER_BUFFER), 0
    while True:
        if pidfd is not None and not wait_readable(source, pidfd):
            raise EOFError("the session interpreter died")
        count = os.readv(source, [view[got:]])
        if not count:
            raise EOFError("the stream ended")
        got += count
        end = HEADER_BUFFER.find(b"\n", 0, got)
        if end >= 0:
            return bytes(HEADER_BUFFER[:end]), end + 1, got - end - 1
        if got == len(HEADER_BUFFER):
            raise ProtocolViolationError("a malformed frame header")


def pass_on(
    target: int, header: bytes, start: int, extra: int, size: int, source: int, pidfd: int | None
) -> None:
    """Write `header` and the `extra` payload bytes already in HEADER_BUFFER, wipe the buffer, then
    splice the rest of the `size`-byte payload from `source`."""
    if extra > size:
        raise ProtocolViolationError("more than one frame at once")
    write_all(target, header + b"\n")
    write_all(target, memoryview(HEADER_BUFFER)[start : start + extra])
    HEADER_BUFFER[:] = bytes(len(HEADER_BUFFER))
    splice_exactly(source, target, size - extra, pidfd)


# -- the `unshare` fallback: build the sandbox's root ourselves (bubblewrap does this otherwise) -------

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {"x86_64": {"unshare": 272, "clone": 56}, "aarch64": {"unshare": 97, "clone": 220}}
SYS_CLONE3, CLONE_NEWUSER, X32_SYSCALL_BIT = 435, 0x10000000, 0x40000000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06


def refuse_user_namespaces(libc: Any) -> None:
    """A seccomp filter that refuses new user namespaces (EPERM for clone/unshare with CLONE_NEWUSER;
    ENOSYS for clone3, whose flags a filter cannot read, so libc falls back to clone) and every
    syscall of another ABI. In a user namespace of its own, code could mount unsized tmpfs and
    escape the sandbox's memory limit; bubblewrap's --disable-userns does this job when it runs."""
    import ctypes
    import platform

    machine = platform.machine()
    if machine not in AUDIT_ARCH:
        raise OSError(f"no seccomp filter for {machine}; use bubblewrap")
    numbers = SYSCALLS[machine]
    program = [  # (code, jump if true, jump if false, k); jumps are relative to the next instruction
        (BPF_LD_ABS, 0, 0, 4),  # 0: the syscall's ABI
        (BPF_JEQ, 0, 8, AUDIT_ARCH[machine]),  # 1: another ABI -> refuse
        (BPF_LD_ABS, 0, 0, 0),  # 2: the syscall number
        (BPF_JGE, 6, 0, X32_SYSCALL_BIT),  # 3: x32 numbers -> refuse
        (BPF_JEQ, 6, 0, SYS_CLONE3),  # 4: clone3 -> ENOSYS
        (BPF_JEQ, 1, 0, numbers["unshare"]),  # 5
        (BPF_JEQ, 0, 2, numbers["clone"]),  # 6: neither -> allow
        (BPF_LD_ABS, 0, 0, 16),  # 7: flags (first argument, low word)
        (BPF_JSET, 1, 0, CLONE_NEWUSER),  # 8
        (BPF_RET, 0, 0, SECCOMP_RET_ALLOW),  # 9
        (BPF_RET, 0, 0, SECCOMP_RET_ERRNO | 1),  # 10: EPERM
        (BPF_RET, 0, 0, SECCOMP_RET_ERRNO | 38),  # 11: ENOSYS
    ]

    class SockFilter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint),
        ]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(program))(*(SockFilter(*row) for row in program))
    fprog = SockFprog(len(program), filters)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


def setup_root(spec: Job) -> None:
    """Running as root, PID 1 of fresh mount/PID/net/IPC/UTS namespaces: assemble a read-only root
    holding only `spec["binds"]` ((host path, sandbox path) pairs), private tmpfs work dir and /tmp,
    then drop to `spec["uid"]` for good."""
    import ctypes
    import socket

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(
        source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
    ) -> None:
        def encode(text: str | None) -> bytes | None:
            return None if text is None else text.encode()

        if libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"mount {target}: {os.strerror(error)}")

    def bind(source: str, target: str, writable: bool = False) -> None:
        mount(source, target, None, MS_BIND | MS_REC)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if writable else MS_RDONLY)
        mount(None, target, None, flags)

    uid, size, new = spec["uid"], spec["size"], "/tmp"
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below leaks to the host's mount table
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for source, target in spec["binds"]:  # (host path, sandbox path)
        if os.path.isdir(source):
            os.makedirs(new + target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(new + target), exist_ok=True)
            open(new + target, "w").close()
        bind(source, new + target)
    for name, target in spec["symlinks"].items():
        os.symlink(target, new + name)
    os.mkdir(new + "/dev")
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for device in ("null", "zero", "full", "random", "urandom"):
        open(f"{new}/dev/{device}", "w").close()
        bind(f"/dev/{device}", f"{new}/dev/{device}", writable=True)
    os.symlink("/proc/self/fd", new + "/dev/fd")
    # POSIX shared memory and semaphores (multiprocessing) live in /dev/shm: a tmpfs of its own, sized.
    os.mkdir(new + "/dev/shm")
    mount(
        "tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777,uid={uid},gid={uid}"
    )
    # /dev read-only, as bubblewrap's: not even its access time moves (recycled sandboxes check it).
    mount(None, new + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.mkdir(new + "/proc")
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # As bubblewrap's binds do: PID 1 (this process, the zygote to be) must not show the runs' costs
    # to later runs, nor /proc the host's block devices; /dev/null on a nodev mount cannot be opened.
    sealed = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
    for path in spec["masked_files"]:
        mount("/dev/null", new + path, None, MS_BIND)
        mount(None, new + path, None, sealed)
    for path in spec["masked_dirs"]:
        mount("tmpfs", new + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    for path in (spec["work"], "/tmp"):
        os.makedirs(new + path, exist_ok=True)
        mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=700,uid={uid},gid={uid}")
    os.chdir(new)
    if libc.pivot_root(b".", b".") != 0 or libc.umount2(b".", 2) != 0:  # 2 = MNT_DETACH
        raise OSError(ctypes.get_errno(), "pivot_root failed")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    socket.sethostname("sandbox")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    # Changing credentials cleared unshare's --kill-child parent-death signal: set it again, so that
    # killing unshare still takes this PID namespace (and every process in it) down.
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PDEATHSIG) failed")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS) failed")
    refuse_user_namespaces(libc)
    # Keyrings are per uid here (no user namespace), and pool uids are reused by later sandboxes.
    forget_keyrings(libc)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["work"])


def close_inherited_fds(keep: int) -> None:
    """Close every descriptor but the standard three and `keep`: nothing the host's process tree held
    open by accident may reach the user's code."""
    if keep >= 3:
        os.closerange(3, keep)
        os.closerange(keep + 1, 1 << 20)
    else:
        os.closerange(3, 1 << 20)
