"""The `local` backend: Linux namespaces via bubblewrap (else `unshare`), sandboxes reset between runs.

Every run gets new user, PID, mount, network, IPC and UTS namespaces, a read-only root that holds
only /usr (the interpreter and its libraries), a private size-capped tmpfs work directory and /tmp,
a network namespace with nothing but loopback, and rlimits applied by the in-sandbox launcher. When
the host runs as root, bubblewrap itself is started under an unprivileged uid taken from a pool, so
RLIMIT_NPROC is enforced (the kernel exempts uid 0) and host files stay unwritable to the code.

Without bubblewrap, a root host falls back to util-linux `unshare` (new mount, PID, network, IPC and
UTS namespaces) and the launcher builds the same root itself before dropping to the pool uid; the
network namespace then has no interface up at all, not even loopback.

Latency: the in-sandbox launcher is a zygote, PID 1 of its sandbox, that has imported what snippets
use and forks the next run's process ahead of time. A one-shot run costs a pipe write, the code and a
process exit, not a sandbox and interpreter start. After each run the zygote kills every process of
the sandbox, wipes the work dir, /tmp, /dev/shm, System V IPC and keyrings, checks its own limits and
the network namespace against a snapshot, and forks the next process; the host puts the sandbox back
in the warm pool only once that reset is confirmed, in the background, so the next run does not wait
for it. A run the host had to end (timeout, CPU, output flood), a run that left more than a reset may
undo (its exit frame says so, before its result returns) and a reset that failed get the whole
sandbox killed, never reused. Each forked run starts a session of its own, so no setting of its
session (its autogroup's nice value) reaches the next run; PID 1's files that show what earlier runs
cost it are masked.

Nothing of a sandbox outlives `aclose()` or this process: `aclose()` waits for starts in flight and
kills whatever is left in the backend's cgroups, and a watchdog process (sandbox/_watchdog.py) ends
every sandbox of a host that died.

Sessions recycle their sandbox the same way (`LocalOptions.recycle_sessions`): the zygote then forks
one interpreter per episode and resets the sandbox at the session's close.

The warm pool, a one-shot run's host side and a session's calls are shared with the Docker backend
(sandbox/_warm_pool.py, sandbox/_box_session.py); this module starts, ends and measures the sandboxes,
and keeps the pools of session sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pacerl.sandbox._box_session import BoxSession, read_ready
from pacerl.sandbox._cgroup import (
    CgroupTree,
    SandboxCgroup,
    SessionCpuWatch,
    Spawner,
    cpus_available,
    fallback_bound,
    process_tree_cpu_s,
)
from pacerl.sandbox._proc import Child, spawn
from pacerl.sandbox._protocol import (
    LAUNCHER_SOURCE,
    MASKED_DIRS,
    MASKED_FILES,
    PRELOAD,
    RESET_MESSAGE,
    SANDBOX_ENV,
    WORK_DIR,
    SandboxProtocolError,
    UidPool,
    ZygoteFrames,
    frame_size,
    oneshot_config,
    session_config,
)
from pacerl.sandbox._warm_pool import MAX_RUNS, RESET_TIMEOUT_S, WarmPool, cpu_reason
from pacerl.sandbox.limits import Limits
from pacerl.sandbox.result import ExecResult, ExecStatus


@dataclass(frozen=True)
class LocalOptions:
    """Options of the `local` backend."""

    python: str = "/usr/bin/python3"
    """Interpreter inside the sandbox. It must live under /usr or under one of `ro_binds`."""
    ro_binds: tuple[str | tuple[str, str], ...] = ()
    """Extra host paths made visible read-only (e.g. a venv with numpy): a path at the same path, or a
    (host path, sandbox path) pair at another, for a host path that the sandbox's own /work, /tmp,
    /dev or /proc would hide."""
    warm_pool: int = 2
    """Sandboxes kept started and waiting for a one-shot job; 0 starts each run cold (in a sandbox
    of its own, killed after the run)."""
    idle_oneshot: int = 16
    """Sandboxes reset after a one-shot run kept waiting per work-dir size (at least `warm_pool`): a
    burst of concurrent runs starts this many, and the next burst finds them ready."""
    preload: tuple[str, ...] = PRELOAD
    """Modules a one-shot sandbox's zygote imports, so that the runs forked from it find them loaded.
    Each must import under the sandbox's interpreter (a sandbox whose zygote cannot import one fails
    to start)."""
    fresh_interpreter: bool = False
    """Give each one-shot run and each session episode an interpreter of its own (its forked process
    execs a new one, which imports `preload` again): its own string-hash secret (the order of a set of
    strings) and address-space layout, which runs forked from the zygote share with it. It costs an
    interpreter start per run, ahead of the run where the pool has time, in CPU time always
    (docs/sandbox.md)."""
    warm_sessions: int = 2
    """Session interpreters kept started per distinct session limits (one per episode); 0 disables."""
    max_concurrency: int = 32
    """Runs and session calls executing at once; more wait their turn."""
    uid_base: int = 61000
    """First uid of the pool that sandboxes run as when the host is root (one uid per live sandbox)."""
    uid_count: int = 1000
    """How many uids the pool holds."""
    bwrap: str | None = field(default=None)
    """Path to bubblewrap; None finds it on PATH."""
    isolation: str = "auto"
    """`bwrap`, `unshare` (root only), or `auto`: bubblewrap when present, else unshare."""
    cgroups: bool = True
    """Give every sandbox a cgroup of its own (memory, CPU time and tasks counted over all its
    processes, tmpfs pages included) where the host lets this process create one (root with cgroup v1
    controllers); elsewhere per-process rlimits and a CPU watch over /proc remain (`limits_mechanism`)."""
    recycle_sessions: bool = True
    """Reuse a closed session's sandbox for a later session with the same limits, after its zygote
    killed every process of the episode and wiped its files (a few ms instead of a sandbox start).
    Each is reused at most 256 times. False gives every session a sandbox of its own, killed at its
    close."""
    idle_sessions: int = 64
    """Recycled session sandboxes kept idle per limits (at least `warm_sessions`): an RL run closes and
    opens many sessions at once, and a returned sandbox that finds no room is killed."""

    def __post_init__(self) -> None:
        if min(self.warm_pool, self.warm_sessions, self.idle_sessions, self.idle_oneshot) < 0:
            raise ValueError("warm_pool, warm_sessions, idle_sessions and idle_oneshot must be >= 0")
        if not all(
            isinstance(name, str) and all(map(str.isidentifier, name.split("."))) for name in self.preload
        ):
            raise ValueError(f"preload must be module names, got {self.preload!r}")
        if self.max_concurrency < 1 or self.uid_count < 1:
            raise ValueError("max_concurrency and uid_count must be >= 1")
        if self.isolation not in ("auto", "bwrap", "unshare"):
            raise ValueError(f"isolation must be auto, bwrap or unshare, got {self.isolation!r}")
        if not self.python.startswith("/"):
            raise ValueError(f"python must be an absolute path inside the sandbox, got {self.python!r}")
        for source, target in _bind_pairs(self.ro_binds):
            inside = os.path.normpath(target)
            if not source.startswith("/") or not target.startswith("/") or inside in ("/", "//"):
                raise ValueError(f"ro_binds: {source!r} -> {target!r} needs absolute paths below /")
            for top in _SANDBOX_MOUNTS:
                if inside == top or inside.startswith(top + "/"):
                    raise ValueError(
                        f"ro_binds: {target} would be hidden by the sandbox's own {top}; bind it elsewhere "
                        f"with a (host path, sandbox path) pair, e.g. ({source!r}, '/opt/...')"
                    )
            _check_reachable(source)


_WATCHDOG_SOURCE = resources.files("pacerl.sandbox").joinpath("_watchdog.py").read_text()
"""The watchdog's program, passed with `python3 -I -c` (it imports nothing of the project)."""
_WATCHDOG_EXIT_S = 15.0
"""How long `aclose` waits for the watchdog to exit (it has nothing left to end: milliseconds)."""
_SANDBOX_MOUNTS = (WORK_DIR, "/tmp", "/dev", "/proc")
"""Where each sandbox mounts its own file systems, over anything bound there."""


def _check_reachable(source: str) -> None:
    """Refuse a bind the sandbox could not mount: as root, sandboxes start as unprivileged pool uids,
    which reach a host path only through folders every user may enter (bubblewrap resolves the source
    as that uid). A 0700 folder above it (a private home, a checkout made by mktemp) would otherwise
    surface as a sandbox that fails to start."""
    path = Path(source)
    if not path.exists():
        raise ValueError(f"ro_binds: {source} does not exist on the host")
    if os.geteuid() != 0:
        return  # the sandbox runs as this user, who reaches what they named
    for folder in [*reversed(path.parents), path if path.is_dir() else path.parent]:
        if not folder.stat().st_mode & stat.S_IXOTH:
            raise ValueError(
                f"ro_binds: {source} cannot be reached by the sandbox's unprivileged user: {folder} has mode "
                f"{stat.S_IMODE(folder.stat().st_mode):04o} (other users may not enter it); bind a copy from "
                "a folder others can enter, or chmod o+x the folders above it"
            )


def _bind_pairs(binds: tuple[str | tuple[str, str], ...]) -> list[tuple[str, str]]:
    """(host path, sandbox path) of each `ro_binds` entry."""
    return [(bind, bind) if isinstance(bind, str) else (bind[0], bind[1]) for bind in binds]


class _Watchdog:
    """The host's end of its sandboxes' watchdog (sandbox/_watchdog.py): a process of its own that ends
    every sandbox of this backend (its cgroups, the process groups it was told of) once this process
    closes the backend or dies, which no kernel signal does in every case."""

    def __init__(self, folders: list[str]) -> None:
        command = [sys.executable, "-I", "-c", _WATCHDOG_SOURCE, str(os.getpid()), json.dumps(folders)]
        self._popen = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True, start_new_session=True
        )
        self._lock = threading.Lock()
        """Sandboxes start on the spawner thread and go on the loop's: one line at a time."""

    def started(self, group: int) -> None:
        """A sandbox's first process started, leading process group `group` (what the watchdog kills
        where no cgroup holds the sandbox)."""
        self._send(b"+%d\n" % group)

    def released(self, group: int) -> None:
        """That sandbox was killed and is about to be reaped: its group's id may be reused after."""
        self._send(b"-%d\n" % group)

    def _send(self, line: bytes) -> None:
        assert self._popen.stdin is not None
        with self._lock, contextlib.suppress(OSError):  # a watchdog someone killed: nothing to tell
            self._popen.stdin.write(line)
            self._popen.stdin.flush()

    async def close(self) -> None:
        """Let it go (it finds nothing left to end) and reap it. Its exit is watched on the loop (a
        pidfd), not waited for on a thread: none may start once the interpreter is exiting (a
        `Sandbox` closed by an atexit hook)."""
        with self._lock, contextlib.suppress(OSError):
            assert self._popen.stdin is not None
            self._popen.stdin.close()
        if self._popen.poll() is not None:
            return
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()
        pidfd = os.pidfd_open(self._popen.pid)  # not reaped yet, so the pid is still its own

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, on_exit)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(exited, _WATCHDOG_EXIT_S)
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        self._popen.poll()


class _Box:
    """One bubblewrap sandbox process (its launcher waits for a job or serves a session)."""

    def __init__(
        self,
        child: Child,
        info_read: int,
        status_read: int,
        uid: int | None,
        pool: UidPool | None,
        cgroup: SandboxCgroup | None,
        backend: LocalBackend,
    ) -> None:
        self.child = child
        self.cgroup = cgroup
        """The sandbox's own cgroup (memory, CPU and task limits over all its processes), if any."""
        self._info_read = info_read
        self._status_read = status_read
        self._uid = uid
        self._pool = pool
        self._backend = backend
        backend._live.add(self)
        self.greeted = False
        """A session launcher's ready frame has been read (a recycled sandbox answered it at reset)."""
        self.busy = False
        """A session call was sent and its reply not read back: the sandbox is in no state to reuse."""
        self.runs = 0
        """One-shot runs, or sessions, this sandbox served (`MAX_RUNS` at most)."""
        self._idle_tasks: int | None = None
        self._frozen = False
        self.spawner_left: asyncio.Future[None] | None = None
        """Done once the spawner thread has left this sandbox's cgroup (freezing waits for it)."""
        self.frames = ZygoteFrames()
        """What a one-shot zygote wrote on stdout, parsed (its control frames, a run's output)."""

    @property
    def alive(self) -> bool:
        """Its first process (the zygote, or bubblewrap above it) has not exited."""
        return self.child.alive

    usable = recyclable = alive
    """A local sandbox that is alive may take a job, and be reset after one (its costs are always
    counted per run)."""

    async def send(self, data: bytes) -> None:
        await self.child.write(data)

    async def read_frame(self, cap: int) -> bytes:
        """One frame's payload; SandboxProtocolError for a bad header or one over `cap` bytes."""
        size = frame_size(await self.child.read_line(self.child.stdout_fd, limit=256), cap)
        return await self.child.read_exactly(self.child.stdout_fd, size)

    async def read_frames(self, until: Callable[[], bool]) -> bool:
        """Feed the one-shot zygote's stdout to `frames` until `until()` holds; False if the stream
        ended first (the sandbox died). SandboxProtocolError for anything malformed."""
        while not until():
            chunk = await self.child.read_chunk(self.child.stdout_fd)
            if not chunk:
                return False
            self.frames.feed(chunk)
        return True

    async def wait_ready(self, within_s: float) -> bool:
        """Whether the one-shot zygote said within `within_s` seconds that it is ready for a job (False
        if it died, wrote something malformed or took longer)."""
        with contextlib.suppress(TimeoutError, OSError, SandboxProtocolError):
            return await asyncio.wait_for(self.read_frames(lambda: self.frames.ready), within_s)
        return False

    def stderr_text(self) -> str:
        """What the sandbox's own processes (bubblewrap, the zygote) wrote on stderr and is still unread."""
        with contextlib.suppress(OSError):
            return os.read(self.child.stderr_fd, 65536).decode("utf-8", "replace").strip()
        return ""

    async def note_idle(self) -> None:
        """Remember how many tasks the sandbox has when nothing of the user's runs (zygote and
        interpreter waiting): more than that between calls means something was left running."""
        if self.cgroup is not None and self.cgroup.can_freeze:
            if self.spawner_left is not None:
                with contextlib.suppress(Exception):  # a failed move leaves it home, or it stays put
                    await self.spawner_left
                if not self.spawner_left.done() or self.spawner_left.exception() is not None:
                    return  # never frozen: the spawner thread may still be inside
            self._idle_tasks = self.cgroup.tasks()

    def pause(self) -> None:
        """Between a session's calls: freeze every process of the sandbox if the episode left any
        running (where the host has a freezer cgroup), so none uses CPU or acts meanwhile."""
        if (
            self.cgroup is not None
            and self._idle_tasks is not None
            and self.cgroup.tasks() > self._idle_tasks
        ):
            self.cgroup.freeze()
            self._frozen = True

    def resume(self) -> None:
        if self._frozen and self.cgroup is not None:
            self.cgroup.thaw()
            self._frozen = False

    async def cpu_s(self) -> float:
        """CPU time used so far by every process of this sandbox together."""
        if self.cgroup is not None:
            return self.cgroup.cpu_s()
        return process_tree_cpu_s(self.child.pid)

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def _inner_pid(self) -> int | None:
        """The pid of the sandbox's init as bubblewrap reported it on --info-fd."""
        with contextlib.suppress(OSError, ValueError):
            data = os.read(self._info_read, 4096)
            return int(json.loads(data)["child-pid"])
        return None

    def kill(self) -> None:
        """Tear the whole sandbox down: every process in its cgroup; its first process's group, which
        bubblewrap's child stays in until the sandbox is set up (killed before, it would wait forever
        for word from its parent); and its PID-namespace init, whose death kills every process in it."""
        if self.cgroup is not None:
            self.cgroup.kill_processes()  # thawed first: a frozen process holds its SIGKILL
        if self.child.popen.returncode is None:  # not reaped yet, so its pid still names its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGKILL)
        inner = self._inner_pid()
        if inner is not None and self.child.alive and _parent_of(inner) == self.child.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(inner, signal.SIGKILL)
        self.child.kill()

    async def close(self) -> None:
        self.kill()
        self._backend._watchdog.released(self.child.pid)
        await self.child.close()
        self._backend._live.discard(self)
        for fd in (self._info_read, self._status_read):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._uid is not None and self._pool is not None:
            self._pool.give(self._uid)
            self._uid = None
        if self.cgroup is not None:
            self.cgroup.remove()  # one still holding exiting processes goes at the next sweep
            self.cgroup = None


_PoolKey = tuple[str, str]
"""(launcher mode, limits as JSON) of a warm pool: a warm sandbox's tmpfs size and a session's rlimits
are fixed when it starts, so each distinct setting has its own pool."""
_MAX_POOLS = 8
_START_TIMEOUT_S = 30.0
"""How long a new sandbox's zygote may take to say it is ready (an interpreter start, imports)."""


_MEMORY_REASON = "memory limit of {} MiB exceeded (all processes of the sandbox together)"
_TASK_OVERHEAD = 4
"""Tasks of a sandbox that are not the user's: bubblewrap's outer process, its init (or the zygote)
and the launcher's interpreter all count, as they do in the uid's RLIMIT_NPROC, and the spawner
thread stays in a sandbox it started for a moment (`Spawner`)."""


def _cgroup_limits(limits: Limits) -> tuple[int, int]:
    """(memory bytes, tasks) of a sandbox's cgroup for `limits`."""
    return limits.memory_mb * 1024 * 1024, limits.max_processes + _TASK_OVERHEAD


def _oneshot_key(limits: Limits) -> _PoolKey:
    # Only the tmpfs size is fixed at start; the job carries every other limit.
    return "oneshot", json.dumps({"work_dir_mb": limits.work_dir_mb})


def _session_key(limits: Limits) -> _PoolKey:
    return "session", json.dumps(dataclasses.asdict(limits), sort_keys=True)


_TOP_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_TOP_SYMLINKS = {f"/{top}": os.readlink(f"/{top}") for top in _TOP_DIRS if Path(f"/{top}").is_symlink()}
"""Merged-/usr systems link /bin, /lib... into /usr; the sandbox's root repeats those links."""


def _find_isolation(options: LocalOptions) -> tuple[str | None, str | None]:
    """(bubblewrap path, None) or (None, unshare path), per `options.isolation`; a clear error if neither."""
    if options.isolation in ("auto", "bwrap"):
        bwrap = options.bwrap or shutil.which("bwrap")
        if bwrap is not None and os.access(bwrap, os.X_OK):
            return bwrap, None
        if options.isolation == "bwrap":
            raise RuntimeError(f"bubblewrap not found at {bwrap or 'PATH'}: apt-get install bubblewrap")
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare and setpriv and os.geteuid() == 0:
        return None, unshare
    raise RuntimeError(
        "the local sandbox needs bubblewrap (apt-get install bubblewrap), or root with util-linux's "
        "unshare and setpriv for the fallback"
    )


def _parent_of(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    return None


class LocalBackend(WarmPool[_PoolKey, _Box]):
    """Runs code in bubblewrap sandboxes on this machine."""

    name = "local"

    def __init__(self, options: LocalOptions | None = None) -> None:
        self.options = options or LocalOptions()
        self._bwrap, self._unshare = _find_isolation(self.options)
        self._setpriv = shutil.which("setpriv")
        super().__init__(self.options.max_concurrency, cpus_available())
        self._uids = UidPool(self.options.uid_base, self.options.uid_count) if os.geteuid() == 0 else None
        self._filling: dict[_PoolKey, asyncio.Task[None]] = {}
        self._sessions: set[LocalSession] = set()
        self._starting: dict[_PoolKey, int] = {}
        """Sandboxes the pool's fill is starting (supply too)."""
        self._closing: set[asyncio.Task[None]] = set()
        tree_name = f"pacerl-{os.getpid()}-{secrets.token_hex(4)}"
        self._cgroups = CgroupTree.detect(tree_name) if self.options.cgroups else None
        self._spawner = Spawner(self._cgroups)
        """Starts sandboxes off the event loop, each born inside its own cgroup."""
        self._starts: set[asyncio.Future[tuple[subprocess.Popen[bytes], SandboxCgroup | None]]] = set()
        """Sandbox starts on the spawner thread not yet finished."""
        self._live: set[_Box] = set()
        """Every sandbox started and not yet closed (in a pool, a run or a session, or being killed)."""
        folders = [] if self._cgroups is None else [str(path) for path in self._cgroups.folders.values()]
        self._watchdog = _Watchdog(folders)
        self._extra_processes = 1 if self._unshare is not None else 0
        """Under `unshare` the zygote is a process of the sandbox's uid that bubblewrap's (uncounted)
        outer process is not: the code keeps the same budget."""

    @property
    def limits_mechanism(self) -> str:
        """How the whole-sandbox limits are enforced here, in words."""
        if self._cgroups is not None:
            return "cgroup v1 per sandbox (memory, cpuacct, pids): all its processes counted together"
        defaults = Limits()
        bound = fallback_bound(
            defaults.memory_mb, defaults.max_processes, defaults.max_open_files, defaults.max_file_mb
        )
        return f"{bound}; CPU time summed from /proc over the sandbox's process tree"

    # -- sandbox processes ---------------------------------------------------------------------------

    def _bwrap_argv(self, launcher_args: list[str], limits: Limits, info_fd: int) -> list[str]:
        assert self._bwrap is not None
        size = str(limits.work_dir_mb * 1024 * 1024)
        argv = [self._bwrap, "--info-fd", str(info_fd), "--unshare-all", "--unshare-user", "--disable-userns"]
        # The zygote becomes PID 1 itself: bubblewrap's reaper would otherwise be a same-uid,
        # ptraceable process holding the host's pipes.
        argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--as-pid-1"]
        for source, target in self._read_only_binds():
            argv += ["--ro-bind", source, target]
        for name, target in _TOP_SYMLINKS.items():
            argv += ["--symlink", target, name]
        argv += ["--proc", "/proc"]
        # What PID 1 (the zygote, which bubblewrap's child becomes) shows of earlier runs, and what names
        # the host's block devices: /dev/null cannot be opened on bubblewrap's nodev binds.
        for path in MASKED_FILES:
            argv += ["--ro-bind", "/dev/null", path]
        for path in MASKED_DIRS:
            argv += ["--size", "4096", "--perms", "0555", "--tmpfs", path, "--remount-ro", path]
        argv += ["--dev", "/dev", "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm"]
        argv += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", WORK_DIR, "--chdir", WORK_DIR]
        # /dev read-only: no modes, ACLs, xattrs or entries there that could outlive an episode.
        argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--clearenv"]
        for key, value in SANDBOX_ENV.items():
            argv += ["--setenv", key, value]
        return [*argv, "--", self.options.python, "-I", "-c", LAUNCHER_SOURCE, *launcher_args]

    def _unshare_argv(self, launcher_args: list[str], limits: Limits, uid: int) -> list[str]:
        assert self._unshare is not None
        spec = {
            "uid": uid,
            "size": limits.work_dir_mb * 1024 * 1024,
            "binds": self._read_only_binds(),
            "symlinks": _TOP_SYMLINKS,
            "work": WORK_DIR,
            "env": SANDBOX_ENV,
            "masked_files": MASKED_FILES,
            "masked_dirs": MASKED_DIRS,
        }
        # setpriv's parent-death signal survives its exec of unshare, so the sandbox dies with us.
        argv = ["setpriv", "--pdeathsig", "SIGKILL", "--", self._unshare]
        argv += ["--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child", "--"]
        return [*argv, self.options.python, "-I", "-c", LAUNCHER_SOURCE, *launcher_args, json.dumps(spec)]

    def _read_only_binds(self) -> list[tuple[str, str]]:
        """(host path, sandbox path) of every read-only bind: the interpreter's system dirs, then the
        options' own."""
        paths = [
            "/usr",
            *(f"/{top}" for top in _TOP_DIRS if Path(f"/{top}").is_dir() and f"/{top}" not in _TOP_SYMLINKS),
        ]
        if Path("/etc/ld.so.cache").exists():
            paths.append("/etc/ld.so.cache")
        return [(path, path) for path in paths] + _bind_pairs(self.options.ro_binds)

    async def _spawn(self, mode: str, limits: Limits, limits_json: str = "-") -> _Box:
        """Start one sandbox. The blocking part runs on the backend's spawner thread: joining a new
        cgroup can wait for an RCU grace period (~10 ms), which must not stall the event loop."""
        info_read, info_write = os.pipe()
        status_read, status_write = os.pipe()
        os.set_blocking(info_read, False)
        os.set_blocking(status_read, False)
        uid = self._uids.take() if self._uids is not None else None
        start = functools.partial(self._start, mode, limits, limits_json, info_write, status_write, uid)
        start_future, thread_left = self._spawner.submit(start)
        started = asyncio.wrap_future(start_future)

        def discard(future: asyncio.Future[tuple[subprocess.Popen[bytes], SandboxCgroup | None]]) -> None:
            if not future.cancelled() and future.exception() is None:
                popen, cgroup = future.result()
                self._discard(_Box(Child(popen), info_read, status_read, uid, self._uids, cgroup, self))
            else:
                release()

        def release() -> None:
            for fd in (info_read, status_read):
                os.close(fd)
            if uid is not None and self._uids is not None:
                self._uids.give(uid)

        self._starts.add(started)
        started.add_done_callback(self._starts.discard)
        try:
            popen, cgroup = await asyncio.shield(started)
        except asyncio.CancelledError:
            started.add_done_callback(discard)  # the thread still starts it: tear it down when it has
            raise
        except BaseException:
            release()
            raise
        box = _Box(Child(popen), info_read, status_read, uid, self._uids, cgroup, self)
        box.spawner_left = asyncio.wrap_future(thread_left)
        return box

    def _start(
        self,
        mode: str,
        limits: Limits,
        limits_json: str,
        info_write: int,
        status_write: int,
        uid: int | None,
        cgroup: SandboxCgroup | None,
    ) -> tuple[subprocess.Popen[bytes], SandboxCgroup | None]:
        """Start the sandbox's first process (on the spawner thread, which is inside `cgroup`)."""
        try:
            if self._closed:  # `aclose` waits for the starts before this one, and kills what they started
                raise RuntimeError("this sandbox is closed")
            if self._cgroups is not None and cgroup is not None:
                self._cgroups.sweep()
                cgroup.set_limits(*_cgroup_limits(limits))
            launcher_args = [mode, str(status_write), limits_json]
            if self._bwrap is not None:
                argv = self._bwrap_argv(launcher_args, limits, info_write)
            else:
                assert uid is not None
                argv = self._unshare_argv(launcher_args, limits, uid)
            # bubblewrap starts as the pool uid; the unshare fallback starts as root and drops itself.
            # setpriv switches the uid after exec: Popen's own user= forbids vfork, and forking this
            # (torch-sized) process cost ~20 ms of CPU per sandbox.
            as_user: dict[str, Any] = {}
            if uid is not None and self._bwrap:
                if self._setpriv is not None:
                    ids = ["--reuid", str(uid), "--regid", str(uid), "--clear-groups"]
                    argv = [self._setpriv, *ids, "--", *argv]
                else:
                    as_user = {"user": uid, "group": uid, "extra_groups": []}
            # Only bubblewrap reads the info descriptor; the launcher closes whatever else it inherits.
            fds = (info_write, status_write) if self._bwrap else (status_write,)
            # A clean environment from the first process on: bubblewrap's and unshare's own processes
            # are visible inside (/proc/1/environ), so the host's variables must never reach them.
            env = dict(SANDBOX_ENV)
            popen = spawn(argv, pass_fds=fds, env=env, **as_user)
            self._watchdog.started(popen.pid)  # its process group (it starts a session of its own)
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            os.close(info_write)
            os.close(status_write)
        return popen, cgroup

    def _pool_size(self, key: _PoolKey) -> int:
        return self.options.warm_pool if key[0] == "oneshot" else self.options.warm_sessions

    def _idle_cap(self, key: _PoolKey) -> int:
        """How many recycled sandboxes may wait in a pool (more than are started ahead)."""
        idle = self.options.idle_oneshot if key[0] == "oneshot" else self.options.idle_sessions
        return max(self._pool_size(key), idle)

    async def _spawn_for(self, key: _PoolKey) -> _Box:
        mode, limits_json = key
        limits = Limits(**json.loads(limits_json))
        fresh = self.options.fresh_interpreter
        config = (
            session_config(limits, fresh)
            if mode == "session"
            else oneshot_config(self.options.preload, fresh)
        )
        return await self._spawn(mode, limits, config)

    async def _fill(self, key: _PoolKey) -> None:
        pool = self._warm.setdefault(key, [])
        while not self._closed and len(pool) + self._supply(key) < self._pool_size(key):
            pool.append(await self._spawn_for(key))

    async def _fill_oneshot(self, key: _PoolKey, count: int) -> None:
        """Start `count` one-shot sandboxes (already counted as starting, so that a run waits for
        them rather than start one more) and hand each over once its zygote says it is ready."""
        try:
            while count and not self._closed:
                try:
                    box = await self._spawn_for(key)
                except OSError:
                    self._wake_one(key)  # a run waiting for this sandbox starts one itself (and reports)
                    return
                ready = False
                try:
                    ready = await box.wait_ready(_START_TIMEOUT_S)
                finally:
                    count -= 1
                    self._starting[key] -= 1
                    if not ready:
                        self._discard(box)
                if not ready:
                    self._wake_one(key)  # the next run starts one itself, and reports why it failed
                    return
                self._put_ready(key, box)
        finally:
            self._starting[key] -= count

    def _supply(self, key: _PoolKey) -> int:
        """Sandboxes of a pool that are not waiting in it but will be (lent, resetting or starting)."""
        return self._lent.get(key, 0) + self._returning.get(key, 0) + self._starting.get(key, 0)

    def _refill(self, key: _PoolKey) -> None:
        if self._closed or not self._pool_size(key) or key in self._filling:
            return
        if key not in self._warm and len(self._warm) >= _MAX_POOLS:
            return  # many distinct limits in use: the rarer ones start cold
        if key[0] == "oneshot":
            count = self._pool_size(key) - len(self._warm.get(key, [])) - self._supply(key)
            if count <= 0:
                return
            self._starting[key] = self._starting.get(key, 0) + count  # at once: runs wait for them
            task = asyncio.get_running_loop().create_task(self._fill_oneshot(key, count))
        else:
            task = asyncio.get_running_loop().create_task(self._fill(key))
        self._filling[key] = task
        task.add_done_callback(lambda _: self._filling.pop(key, None))

    async def _take_box(self, key: _PoolKey, refill: bool = True) -> _Box:
        """A warm sandbox for `key` if one waits, else a fresh one. The pool refills behind us, or
        (`refill=False`) only when it had none: the caller refills once its run is over, so that
        starting the next sandbox does not compete with this run on a small machine."""
        pool = self._warm.get(key, [])
        box = None
        while pool and box is None:
            # Sessions take the most recently returned sandbox (a recycled one, still hot in the caches).
            candidate = pool.pop() if key[0] == "session" else pool.pop(0)
            if candidate.child.alive:
                box = candidate
            else:
                await candidate.close()
        if refill or box is None:
            self._refill(key)
        return box if box is not None else await self._spawn_for(key)

    def _lend(self, key: _PoolKey) -> None:
        if self.options.recycle_sessions:
            self._lent[key] = self._lent.get(key, 0) + 1

    async def _give_back(self, key: _PoolKey, box: _Box, reusable: bool) -> None:
        """Return a session's sandbox: reset and pooled when it is healthy and there is room, else killed."""
        if self.options.recycle_sessions:
            self._lent[key] -= 1
        pool = self._warm.get(key)
        pooled = False
        try:
            if (
                reusable
                and self.options.recycle_sessions
                and not self._closed
                and pool is not None
                and len(pool) < self._idle_cap(key)
                and box.child.alive
                and not box.busy
                and box.runs < MAX_RUNS
            ):
                with contextlib.suppress(TimeoutError, EOFError, OSError, ValueError, SandboxProtocolError):
                    box.resume()
                    await box.send(RESET_MESSAGE)
                    await read_ready(box, RESET_TIMEOUT_S)
                    pooled = not self._closed and len(pool) < self._idle_cap(key)
            if pooled:
                assert pool is not None
                box.runs += 1
                pool.append(box)
                self.recycled += 1
        finally:
            if not pooled:  # also when cancelled mid-reset: a sandbox is pooled clean or killed
                await box.close()
                self._refill(key)

    # -- one-shot runs: sandbox/_warm_pool.py runs them, these say what a local sandbox is -------------

    def _oneshot_key(self, limits: Limits) -> _PoolKey:
        return _oneshot_key(limits)

    def _coming(self, key: _PoolKey) -> int:
        return self._returning.get(key, 0) + self._starting.get(key, 0)

    async def _start_for_run(self, key: _PoolKey) -> _Box:
        return await self._spawn_for(key)

    def _could_not_start(self, error: BaseException, duration: float) -> ExecResult:
        return ExecResult.sandbox_error(f"could not start a sandbox: {error}")

    def _discard(self, box: _Box) -> None:
        """Kill a sandbox and release it in the background (`aclose` waits for it)."""
        box.kill()
        task = asyncio.get_running_loop().create_task(box.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _end(self, box: _Box) -> BaseException | None:
        box.kill()
        with contextlib.suppress(TimeoutError, OSError, SandboxProtocolError):  # what it wrote is still read
            await asyncio.wait_for(box.read_frames(lambda: False), 5)
        return None

    async def _failed_start(self, box: _Box, failure: BaseException | None) -> ExecResult:
        box.kill()
        cause = "" if failure is None else str(failure) or type(failure).__name__
        detail = (box.frames.failure or cause or box.stderr_text())[-500:]
        return ExecResult.sandbox_error(f"the sandbox failed to start: {detail}")

    async def _run_marks(self, box: _Box, limits: Limits) -> tuple[float, int | None]:
        if box.cgroup is not None:  # the job's own limits, over every process of the sandbox
            box.cgroup.set_limits(*_cgroup_limits(limits))
        return await box.cpu_s(), box.oom_kills()

    async def _cpu_s(self, box: _Box) -> float:
        return await box.cpu_s()

    async def _oom_since(self, box: _Box, start: int | None, *, pid1_died: bool, killed: bool = True) -> bool:
        return start is not None and box.oom_kills() > start

    def _memory_reason(self, limits: Limits) -> str:
        return _MEMORY_REASON.format(limits.memory_mb)

    # -- sessions --------------------------------------------------------------------------------------

    async def open_session(self, limits: Limits) -> LocalSession:
        """Start a persistent interpreter in its own sandbox."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        session = LocalSession(self, limits)
        await session.start()
        self._sessions.add(session)
        return session

    async def aclose(self) -> None:
        """Stop every sandbox: nothing of one outlives this call. Idempotent."""
        if self._closed and not self._live and not self._starts:
            return
        self._closed = True
        fills = list(self._filling.values())
        for task in fills:
            task.cancel()
        # A cancelled fill discards the sandbox it was starting: that must happen now, while the
        # closing below still waits for discarded sandboxes (and the watchdog still listens).
        await asyncio.gather(*fills, return_exceptions=True)
        for reset in list(self._resets):
            reset.cancel()
        await asyncio.gather(*self._resets, return_exceptions=True)
        self._wake_all()
        # Every start already on the spawner thread finishes (a cancelled one's sandbox is discarded as
        # it lands); a later one refuses, as the backend is closed.
        await asyncio.gather(*self._starts, return_exceptions=True)
        warm, self._warm = self._warm, {}
        for pool in warm.values():
            for box in pool:
                await box.close()
        for session in list(self._sessions):
            await session.aclose()
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        for box in list(self._live):  # a run's or a starting session's, still in flight
            await box.close()
        self._spawner.close()
        if self._cgroups is not None:
            self._cgroups.kill_all()  # whatever no box held any more
        await self._watchdog.close()
        if self._cgroups is not None:
            self._cgroups.remove()  # what still holds exiting processes goes with the next backend's sweep


class LocalSession(BoxSession[_Box]):
    """A live Python interpreter in one sandbox; globals survive between calls.

    A cell that runs past its timeout is interrupted inside the sandbox (SIGALRM) and the session
    lives on. If the alarm cannot stop it (a C loop, a handler swallowed it) the host kills the whole
    sandbox after a grace period; the next call starts a fresh interpreter and says so in stderr.
    `reset` gets a clean (fresh or recycled) sandbox.
    """

    def __init__(self, backend: LocalBackend, limits: Limits) -> None:
        super().__init__(backend._slots, limits)
        self._backend = backend
        self._oom_kills = 0

    async def start(self) -> None:
        key = _session_key(self.limits)
        self._box = await self._backend._take_box(key)
        self._backend._lend(key)
        if not self._box.greeted:
            try:
                await read_ready(self._box, 30)
            except (SandboxProtocolError, EOFError) as error:
                raise RuntimeError(f"sandbox session failed to start: {error}") from None
            self._box.greeted = True
        # Past its CPU budget the whole sandbox is ended; the next call restarts the session.
        self._oom_kills = self._box.oom_kills()
        self._cpu = SessionCpuWatch(self._box.cpu_s, self._backend._cpus, self._box.kill)
        await self._cpu.start_window(self.limits.effective_cpu_s)
        await self._box.note_idle()

    async def _restart(self) -> None:
        await self._release(reusable=False)
        await self.start()

    async def _release(self, reusable: bool) -> None:
        """Hand the sandbox back (recycled if `reusable` and healthy, else killed)."""
        if self._cpu is not None:
            self._cpu.stop()
        box, self._box = self._box, None
        if box is not None:
            await self._backend._give_back(_session_key(self.limits), box, reusable)

    async def _died(
        self, box: _Box, error: BaseException, limits: Limits, notice: str, started: float
    ) -> ExecResult:
        out_of_cpu = self._cpu is not None and self._cpu.exhausted
        # Compared with the count at the session's start (read only now, off the common path, and
        # before the sandbox goes): a background process killed for memory in an earlier call also
        # counts, as the sandbox did run out of memory then.
        out_of_memory = box.oom_kills() > self._oom_kills
        await self._kill()
        if out_of_cpu:
            return self._died_result(ExecStatus.TIMEOUT, cpu_reason(limits), notice, started)
        if out_of_memory:
            reason = _MEMORY_REASON.format(limits.memory_mb)
            return self._died_result(ExecStatus.MEMORY, reason, notice, started)
        return self._died_result(ExecStatus.ERROR, str(error), notice, started)

    async def aclose(self) -> None:
        """Release the session's sandbox (recycled when healthy, else killed). Idempotent."""
        async with self._lock:
            await self._release(reusable=True)
        self._backend._sessions.discard(self)
