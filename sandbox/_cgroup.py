"""Whole-sandbox limits: one cgroup per sandbox for memory, CPU time and processes.

Per-process rlimits bound each process, not the sandbox: six children of 400 MiB each pass a 512 MiB
RLIMIT_AS, memfds, /dev/shm and tmpfs pages count against none of them, and a background child's CPU
escapes a session cell's RLIMIT_CPU. A cgroup counts every process of the sandbox, its anonymous and
shared memory and the pages of its tmpfs mounts, and its CPU time as one number.

The host creates the cgroups in its own cgroup (so they stay under whatever limits the host runs
with) and starts each sandbox inside one: the spawning thread joins the sandbox's cgroups, forks, and
leaves them again (cgroup v1 places threads one by one), so the sandbox's first process is born
inside and everything it forks inherits the placement, with no window in which it runs outside.

Mechanisms, in order of preference (`CgroupTree.detect`):
- cgroup v1 with the `memory`, `cpuacct` and `pids` controllers writable (root on most hosts and
  on this project's machines): memory.limit_in_bytes (+ memsw where swap accounting exists),
  pids.max, and cpuacct.usage read by the host's CPU budget (`cpu_budget`).
- none: the per-process rlimits stay the only bound. `fallback_bound` says what they still cap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from typing import TypeVar

from pacerl.sandbox._watchdog import end_cgroup

T = TypeVar("T")

CONTROLLERS = ("memory", "cpuacct", "pids")
"""The cgroup v1 controllers a sandbox cgroup needs."""
OPTIONAL_CONTROLLERS = ("freezer",)
"""Used where present: a session's sandbox is frozen between calls, so nothing it left running
(a background loop, a daemon) uses CPU or acts while the agent is not calling it."""
_ROOT = Path("/sys/fs/cgroup")
_MIN_CHECK_S = 0.02
"""Shortest wait between two reads of a sandbox's CPU time (bounds the overshoot to CPUs x this)."""


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                if controller:
                    paths[controller] = path
    return paths


def _write(path: Path, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


@dataclass(frozen=True)
class CgroupTree:
    """Where this process's sandbox cgroups live: one folder per controller, made at first use."""

    folders: dict[str, Path]
    """Controller -> the folder under which each sandbox gets a cgroup of its own."""
    leftovers: list[Path] = field(default_factory=list)
    """Sandbox cgroups whose removal found processes still exiting; `sweep` retries them."""

    @staticmethod
    def detect(name: str) -> CgroupTree | None:
        """The tree for this process (`name` is its folder: one per backend), or None where the
        controllers are missing or not writable (not root, cgroup v2 without delegation)."""
        own = _own_cgroups()
        folders: dict[str, Path] = {}
        for controller in (*CONTROLLERS, *OPTIONAL_CONTROLLERS):
            folder = _ROOT / controller / own.get(controller, "-").lstrip("/") / name
            try:
                if controller not in own:
                    raise OSError(f"no {controller} controller")
                folder.mkdir(exist_ok=True)
                if not os.access(folder / "cgroup.procs", os.W_OK):
                    raise PermissionError(folder)
            except OSError:
                if controller in CONTROLLERS:
                    for made in folders.values():
                        with contextlib.suppress(OSError):
                            made.rmdir()
                    return None
                continue
            folders[controller] = folder
        tree = CgroupTree(folders)
        tree.sweep_dead_owners()
        return tree

    def create(self, name: str) -> SandboxCgroup:
        """An empty cgroup for one sandbox (its limits are set before anything runs in it)."""
        paths = {controller: folder / name for controller, folder in self.folders.items()}
        made: list[Path] = []
        try:
            for path in paths.values():
                path.mkdir()
                made.append(path)
            cgroup = SandboxCgroup(paths, self.leftovers)
        except BaseException:
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        return cgroup

    def sweep(self) -> None:
        """Retry the removals that found processes still exiting."""
        for path in list(self.leftovers):
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            self.leftovers.remove(path)

    def _sweep_all(self) -> None:
        """Remove every empty sandbox cgroup (only where no sandbox of this tree lives any more)."""
        for folder in self.folders.values():
            with contextlib.suppress(OSError):
                for child in folder.iterdir():
                    if child.is_dir():
                        with contextlib.suppress(OSError):
                            child.rmdir()

    def sweep_dead_owners(self) -> None:
        """End what is left of the sandboxes of host processes that died without cleaning up (SIGKILL,
        OOM) and whose watchdog did not (it was killed too), and remove their folders."""
        for controller, folder in self.folders.items():
            for other in folder.parent.glob("pacerl-*-*"):
                owner = other.name.split("-")[1]
                if other == folder or not owner.isdigit() or Path(f"/proc/{owner}").exists():
                    continue
                dead = CgroupTree({controller: other})
                dead.kill_all()
                dead.remove()

    def kill_all(self) -> bool:
        """Thaw and SIGKILL every process of every sandbox cgroup of this tree (never this process,
        whose spawner thread may be in one); True if any was still there."""
        held = False
        for folder in self.folders.values():
            with contextlib.suppress(OSError):
                for cgroup in folder.iterdir():
                    if cgroup.is_dir():
                        held = end_cgroup(cgroup, os.getpid()) or held
        return held

    def remove(self) -> None:
        """Remove this tree once its sandboxes are gone (empty cgroups first, then the folders)."""
        self._sweep_all()
        for folder in self.folders.values():
            with contextlib.suppress(OSError):
                folder.rmdir()


class SandboxCgroup:
    """The cgroups of one sandbox."""

    _COUNTERS = (("cpuacct", "cpuacct.usage"), ("pids", "pids.current"), ("memory", "memory.oom_control"))
    """Files read while the sandbox lives, through descriptors opened with it (so every sandbox holds
    the same ones, used or not)."""

    def __init__(self, paths: dict[str, Path], leftovers: list[Path]) -> None:
        self.paths = paths
        self._leftovers = leftovers
        self._limits: tuple[int, int] | None = None
        self._fds: dict[str, int] = {}
        try:
            for controller, name in self._COUNTERS:
                self._fds[f"{controller}/{name}"] = os.open(
                    paths[controller] / name, os.O_RDONLY | os.O_CLOEXEC
                )
        except BaseException:
            for fd in self._fds.values():
                os.close(fd)
            raise

    def set_limits(self, memory_bytes: int, max_tasks: int) -> None:
        """Cap the sandbox's memory (anonymous, shared, tmpfs and kernel, all processes) and tasks."""
        if self._limits == (memory_bytes, max_tasks):
            return  # most runs keep the pool's defaults: no writes on the request path
        self._limits = (memory_bytes, max_tasks)
        memory = self.paths["memory"]
        memsw = memory / "memory.memsw.limit_in_bytes"
        # With swap accounting, memory+swap is capped at the same figure: no paging out past it. The
        # kernel wants memory <= memory+swap at every moment, so the order depends on the direction.
        current = int((memory / "memory.limit_in_bytes").read_text())
        order = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
        if memsw.exists() and memory_bytes > current:
            order.reverse()
        for name in order:
            if (memory / name).exists():
                _write(memory / name, str(memory_bytes))
        _write(self.paths["pids"] / "pids.max", str(max_tasks))

    def take_thread(self) -> None:
        """Move the calling thread into this cgroup: the processes it forks are born here."""
        tid = str(threading.get_native_id())
        for path in self.paths.values():
            _write(path / "tasks", tid)

    def send_thread_home(self) -> None:
        """Move the calling thread back to this process's own cgroups (<own>/<tree>/<sandbox>)."""
        tid = str(threading.get_native_id())
        for path in self.paths.values():
            _write(path.parent.parent / "tasks", tid)

    @property
    def can_freeze(self) -> bool:
        return "freezer" in self.paths

    def freeze(self) -> None:
        """Stop every process of the sandbox where it stands (they keep their state)."""
        if self.can_freeze:
            _write(self.paths["freezer"] / "freezer.state", "FROZEN")

    def thaw(self) -> None:
        """Let the sandbox's processes run again (also before killing them: v1 holds a frozen
        process's SIGKILL until it is thawed)."""
        if self.can_freeze:
            with contextlib.suppress(OSError):  # gone already (ENOENT, ENODEV): nothing left to thaw
                _write(self.paths["freezer"] / "freezer.state", "THAWED")

    def _read(self, controller: str, name: str) -> bytes:
        """A counter file, read through its descriptor kept open (re-read from offset 0: these are
        read between every two session calls and around every run, and an open per read costs
        several times more)."""
        return os.pread(self._fds[f"{controller}/{name}"], 256, 0)

    def tasks(self) -> int:
        """Processes and threads in the sandbox now."""
        return int(self._read("pids", "pids.current"))

    def cpu_s(self) -> float:
        """CPU time used by every process that ever ran in the sandbox, in seconds."""
        return int(self._read("cpuacct", "cpuacct.usage")) / 1e9

    def oom_kills(self) -> int:
        """Processes the kernel killed for the sandbox's memory limit so far."""
        with contextlib.suppress(OSError, ValueError):
            return parse_oom_kills(self._read("memory", "memory.oom_control").decode())
        return 0

    def kill_processes(self) -> None:
        """Thaw the sandbox and SIGKILL every process in it (but this one's spawner thread): whatever
        started, also what no pid the host knows of names (a bubblewrap child whose parent died)."""
        end_cgroup(self.paths["freezer" if self.can_freeze else "pids"], os.getpid())

    def remove(self) -> None:
        """Remove the cgroups; one still holding exiting processes is left to `CgroupTree.sweep`."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for path in self.paths.values():
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as error:
                if error.errno != errno.EBUSY:
                    raise
                self._leftovers.append(path)


@dataclass(frozen=True)
class ContainerCgroup:
    """A Docker container's own cgroup files, where the daemon runs on this host and they are readable
    (cgroupfs or systemd driver, cgroup v1 or v2)."""

    cpu_file: Path
    """cpuacct.usage (v1) or cpu.stat (v2)."""
    tasks_file: Path | None
    """pids.current: the container's processes and threads now."""
    freeze_file: Path | None
    """freezer.state (v1) or cgroup.freeze (v2), if writable."""
    oom_file: Path | None = None
    """memory.oom_control (v1) or memory.events (v2): how many processes the OOM killer took."""

    @staticmethod
    def find(container_id: str) -> ContainerCgroup | None:
        def existing(path: Path) -> Path | None:
            return path if path.exists() else None

        v1 = [f"docker/{container_id}", f"system.slice/docker-{container_id}.scope"]
        for folder in v1:
            for cpu in ("cpuacct", "cpu,cpuacct"):
                cpu_file = _ROOT / cpu / folder / "cpuacct.usage"
                if cpu_file.exists():
                    freeze = _ROOT / "freezer" / folder / "freezer.state"
                    return ContainerCgroup(
                        cpu_file,
                        existing(_ROOT / "pids" / folder / "pids.current"),
                        freeze if os.access(freeze, os.W_OK) else None,
                        existing(_ROOT / "memory" / folder / "memory.oom_control"),
                    )
        for folder in v1:
            cpu_file = _ROOT / folder / "cpu.stat"
            if cpu_file.exists():
                freeze = _ROOT / folder / "cgroup.freeze"
                return ContainerCgroup(
                    cpu_file,
                    existing(_ROOT / folder / "pids.current"),
                    freeze if os.access(freeze, os.W_OK) else None,
                    existing(_ROOT / folder / "memory.events"),
                )
        return None

    def oom_kills(self) -> int | None:
        """Processes of the container the OOM killer took so far (None where this is not counted)."""
        if self.oom_file is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            return parse_oom_kills(self.oom_file.read_text())
        return None

    def cpu_s(self) -> float:
        return read_cpu_file(self.cpu_file)

    def gone(self) -> bool:
        """Whether the container no longer exists (its cgroup was removed: a dead daemon kills it)."""
        return not self.cpu_file.exists()

    def tasks(self) -> int | None:
        return int(self.tasks_file.read_text()) if self.tasks_file is not None else None

    def freeze(self) -> None:
        if self.freeze_file is not None:
            _write(self.freeze_file, "FROZEN" if self.freeze_file.name == "freezer.state" else "1")

    def thaw(self) -> None:
        if self.freeze_file is not None:
            with contextlib.suppress(FileNotFoundError):
                _write(self.freeze_file, "THAWED" if self.freeze_file.name == "freezer.state" else "0")


class Spawner:
    """Starts sandboxes on one thread of its own that waits, ahead of time, inside the next sandbox's
    still empty cgroup, so that what it forks is born there.

    Moving a thread between cgroups waits for an RCU grace period (about 10 ms here) whenever no move
    happened just before, so that move is made after each start, off the request path, not during
    it. The thread stays in the sandbox it just started until then: its cgroup allows one task more."""

    def __init__(self, tree: CgroupTree | None) -> None:
        self._tree = tree
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pacerl-sandbox-spawn")
        self._next: SandboxCgroup | None = None
        self._current: SandboxCgroup | None = None
        """The cgroup the thread is in (a sandbox it started, or the next one's)."""
        self._closed = False

    def submit(
        self, start: Callable[[SandboxCgroup | None], T]
    ) -> tuple[concurrent.futures.Future[T], concurrent.futures.Future[None]]:
        """Run `start(cgroup)` on the spawner thread, which is inside `cgroup` (None without cgroups);
        the thread then moves on into a new empty cgroup for the next start. Returns the start's
        future and one that is done once the thread has left the started sandbox's cgroup (before
        that, the sandbox must not be frozen: the thread would freeze with it)."""

        def job() -> T:
            cgroup = None
            if self._tree is not None:
                cgroup = self._next or self._place(self._tree.create(token_hex(6)))
                self._next = None
            return start(cgroup)

        return self._executor.submit(job), self._executor.submit(self._prepare)

    def _place(self, cgroup: SandboxCgroup) -> SandboxCgroup:
        cgroup.take_thread()
        self._current = cgroup
        return cgroup

    def _prepare(self) -> None:
        if self._tree is None or self._next is not None:
            return
        try:
            self._next = self._place(self._tree.create(token_hex(6)))
        except OSError:  # no new cgroup now: at least leave the sandbox's (the next start retries)
            if self._current is not None:
                self._current.send_thread_home()
                self._current = None

    def close(self) -> None:
        """Bring the thread home, remove the unused cgroup, and stop (without waiting)."""

        def finish() -> None:
            if self._current is not None:
                with contextlib.suppress(OSError):
                    self._current.send_thread_home()
            if self._next is not None:
                self._next.remove()

        if self._closed:
            return
        self._closed = True
        # At interpreter exit no job can be scheduled; the thread's end empties the cgroup, which the
        # next backend on this host removes with its dead owner's folder.
        with contextlib.suppress(RuntimeError):
            self._executor.submit(finish)
        self._executor.shutdown(wait=False)


_TICKS = os.sysconf("SC_CLK_TCK")


def process_tree_cpu_s(root: int) -> float:
    """CPU time of `root` and every process below it, in seconds, from /proc (the fallback without a
    cpuacct cgroup). Each live or zombie process counts its own time plus that of the children it
    reaped; a sandbox's PID 1 reaps every orphan, so no process that ever ran is missed."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                # After the command: state ppid ... utime(12) stime(13) cutime(14) cstime(15), 0-based.
                ticks = sum(int(value) for value in fields[11:15])
                stats[int(entry.name)] = (int(fields[1]), ticks / _TICKS)
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo += children.get(pid, [])
    return total


def cpus_available() -> int:
    """CPUs this process (and so a sandbox it starts) may run on."""
    return max(1, len(os.sched_getaffinity(0)))


async def cpu_budget(
    used_s: Callable[[], Awaitable[float]], budget_s: float, cpus: float, *, read_first: bool = True
) -> None:
    """Return once `await used_s()` has reached `budget_s`. It reads the usage only when the budget
    could first have run out (the remaining seconds spread over `cpus`), so an idle sandbox costs a
    read every budget/cpus seconds and the overshoot stays under cpus x 20 ms of CPU. Without
    `read_first` the usage is taken to start at zero and the first read waits (a run just begun)."""
    remaining = budget_s - await used_s() if read_first else budget_s
    while remaining > 0:
        await asyncio.sleep(max(remaining / cpus, _MIN_CHECK_S))
        remaining = budget_s - await used_s()


SESSION_CPU_GRACE_S = 2.0
"""CPU seconds past a session call's `cpu_s` before the host ends the whole sandbox: the in-sandbox
per-cell limit (whole seconds, on the interpreter alone) interrupts a runaway cell first and keeps
the session; the host's count over every process catches what that cannot (background children)."""


class SessionCpuWatch:
    """The CPU budget of a session's sandbox, counted over all its processes: from the end of one call
    to the end of the next (the time between calls included), they may use the call's `cpu_s` plus
    `SESSION_CPU_GRACE_S`; past it `on_exhausted` runs (the backend ends the sandbox). One task
    watches for the whole session; a new window or budget only moves its marks."""

    def __init__(
        self, used_s: Callable[[], Awaitable[float]], cpus: float, on_exhausted: Callable[[], None]
    ) -> None:
        self._used_s = used_s
        self._cpus = cpus
        self._on_exhausted = on_exhausted
        self._base = 0.0
        self._budget = 0.0
        self._task: asyncio.Task[None] | None = None
        self.exhausted = False
        """The budget ran out (the backend was told to end the sandbox)."""

    async def start_window(self, cpu_s: float) -> None:
        """Begin a new window now (at a session's start or a call's end)."""
        self._base = await self._used_s()
        self.set_budget(cpu_s)

    def set_budget(self, cpu_s: float) -> None:
        """Keep the window, set its budget (a call with limits of its own)."""
        budget = cpu_s + SESSION_CPU_GRACE_S
        # A sleeping watch wakes no later than a larger budget needs; a smaller one needs a new wake-up.
        restart = self._task is None or budget < self._budget
        self._budget = budget
        if restart:
            self.stop()
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        async def used() -> float:
            return await self._used_s() - self._base

        while True:
            await cpu_budget(used, self._budget, self._cpus)
            if await used() >= self._budget:  # not a window moved on meanwhile
                break
        self.exhausted = True
        self._on_exhausted()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def parse_oom_kills(text: str) -> int:
    """The `oom_kill` count in a cgroup v1 `memory.oom_control` or v2 `memory.events` file."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise ValueError("no oom_kill count")


def read_cpu_file(path: Path) -> float:
    """Seconds of CPU from a cgroup v1 `cpuacct.usage` (ns) or a v2 `cpu.stat` (usage_usec)."""
    text = path.read_text()
    if path.name == "cpu.stat":
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        raise ValueError(f"no usage_usec in {path}")
    return int(text) / 1e9


def fallback_bound(memory_mb: int, max_processes: int, max_open_files: int, max_file_mb: int) -> str:
    """What per-process rlimits still bound without cgroups, in words (for the backend's report)."""
    per_process = memory_mb + max_open_files * max_file_mb
    return (
        f"no writable cgroup: limits hold per process; memory is bounded only by processes x "
        f"(address space + open files x file size) = {max_processes} x {per_process} MiB plus the "
        "tmpfs sizes, and CPU time by processes x cpu_s"
    )
