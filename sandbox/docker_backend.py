"""The `docker` backend: warm containers reset between runs, one container per session, via dockerd.

Every container has no network (`network_mode="none"`), a read-only root, size-capped tmpfs mounts
at /work, /tmp and /dev/shm owned by its user, memory, swap, pid and CPU caps, no capabilities,
`no-new-privileges`, and a non-root user (by default a uid of its own, so RLIMIT_NPROC counts never
mix between containers). It runs the same in-sandbox launcher as the local backend
(sandbox/_launcher.py), so rlimits, files, stdin and results mean the same thing.

One-shot runs: the container's PID 1 is the launcher's one-shot zygote, attached before the
container starts (its stdin, stdout and stderr are one hijacked connection). It serves one run after
another in processes forked from it and resets the container after each (every process killed, the
work dir, /tmp and /dev/shm wiped, its own limits and the network namespace checked), as in the local
backend; a run costs a write and the code's own run time, no call to the daemon. A container goes
back to the warm pool only once its zygote confirmed the reset, and only where this host can read
the container's cgroup (its CPU time and OOM kills are then counted per run); a run the host had to
end (timeout, CPU, flood), a run that left more than a reset may undo, or a reset that failed gets
the container removed, never reused. The pool and a run's host side are shared with the local
backend (sandbox/_warm_pool.py); this module says what a container is to them.

Sessions: PID 1 only waits and reaps, and the session launcher runs through `docker exec`; each
session (one episode) gets a container of its own, removed after it. A session's calls are shared
with the local backend too (sandbox/_box_session.py).

The docker SDK is blocking, so its calls run on a small thread pool owned by the backend. The exec
streams do not: they are "hijacked" HTTP connections opened with asyncio (sandbox/_docker_stream.py),
so the multiplexed
stdout/stderr are read on the event loop, capped as they arrive, and no bytes the HTTP layer might
have buffered are lost.

A stopped or crashed daemon is a `sandbox_error` result, never an exception or a hang; the next
call after the daemon returns reconnects and rebuilds the pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import docker
from docker.errors import DockerException, ImageNotFound, NotFound
from docker.types import LogConfig

from pacerl.sandbox import _protocol as protocol
from pacerl.sandbox._box_session import BoxSession, read_ready
from pacerl.sandbox._cgroup import ContainerCgroup, SessionCpuWatch, cpus_available
from pacerl.sandbox._docker_stream import ExecStream, parse_address
from pacerl.sandbox._hide_proc import HIDE_PROC_EXIT, HIDE_PROC_FAILED
from pacerl.sandbox._warm_pool import WarmPool, cpu_reason
from pacerl.sandbox.image import DEFAULT_IMAGE, IDLE_COMMAND, PYTHON, ensure_image
from pacerl.sandbox.limits import Limits
from pacerl.sandbox.result import ExecResult, ExecStatus, OutputCapture

T = TypeVar("T")

LABEL = "pacerl.sandbox"
"""Label on every container this backend creates (value "1")."""
BACKEND_LABEL = "pacerl.sandbox.backend"
"""Label whose value identifies the backend instance that created a container (for cleanup)."""
OWNER_LABEL = "pacerl.sandbox.owner"
"""Label naming the process that created a container (`host:pid:start-time`): containers whose
process died without closing its backend (SIGKILL, OOM) are removed by the next backend on the host."""

_FAILURES = (DockerException, OSError, EOFError)
"""What a failing daemon raises: SDK errors, connection errors (requests' are OSErrors), cut streams."""
_EXEC_FAILED = "OCI runtime exec failed"
"""What the daemon writes to an exec's output when runc cannot start its process."""
_HIDE_PROC_SOURCE = resources.files("pacerl.sandbox").joinpath("_hide_proc.py").read_text()
"""Run ahead of the launcher when `DockerOptions.hide_proc` (see sandbox/_hide_proc.py)."""
_MEMORY_REASON = "memory limit exceeded (the container's memory cap)"
_DOCKER_MASKED_PATHS = (
    "/proc/asound",
    "/proc/acpi",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
"""What Docker masks in every container by default (its releases differ by a path or two: these are
all of them); a container that names its own `MaskedPaths` gets those alone."""


@dataclass(frozen=True)
class DockerOptions:
    """Options of the `docker` backend."""

    image: str = DEFAULT_IMAGE
    """Image every container runs; it needs the interpreter at `python` and /bin/bash. Never pulled."""
    build_image: bool = True
    """When the daemon lacks `image`, build it from the host's interpreter (sandbox.image); else fail."""
    warm_pool: int = 4
    """Containers kept started, with a zygote waiting for a job; 0 starts each run cold (in a
    container of its own, removed after the run)."""
    idle_oneshot: int = 16
    """Containers reset after a one-shot run kept waiting (at least `warm_pool`): a burst of concurrent
    runs starts this many, and the next burst finds them ready."""
    preload: tuple[str, ...] = protocol.PRELOAD
    """Modules a one-shot container's zygote imports, so that the runs forked from it find them loaded."""
    fresh_interpreter: bool = False
    """Give each one-shot run an interpreter of its own, exec'd by its forked process (its own string-
    hash secret and address-space layout, at the cost of an interpreter start per run); as
    `LocalOptions.fresh_interpreter`. Sessions have a container, so an interpreter, of their own."""
    max_concurrency: int = 16
    """Runs and session calls executing at once; more wait their turn."""
    base_url: str | None = None
    """Daemon address, "unix:///path" or "tcp://host:port" (no TLS); None reads DOCKER_HOST."""
    cpus: float = 1.0
    """CPUs each container may use (`nano_cpus`)."""
    user: str | None = None
    """Fixed "uid[:gid]" for every container; None gives each live container its own uid (pool below)."""
    uid_base: int = 62000
    """First uid of the pool (distinct from the local backend's pool, so their process counts never mix)."""
    uid_count: int = 1000
    """How many uids the pool holds (at least the number of containers alive at once)."""
    python: str = PYTHON
    """Interpreter inside the image that runs the launcher."""
    api_timeout_s: float = 30.0
    """Timeout of each call to the daemon; a daemon that hangs longer yields `sandbox_error`."""
    api_threads: int = 8
    """Threads (and pooled daemon connections) for the blocking SDK calls."""
    hide_proc: bool = True
    """Let the code open no file under /proc (Landlock, Linux 5.13+), whose mount tables show the
    daemon's /var/lib/docker paths and the container's id; False where the kernel lacks Landlock (every
    run is a `sandbox_error` saying so otherwise)."""

    def __post_init__(self) -> None:
        if min(self.warm_pool, self.idle_oneshot) < 0:
            raise ValueError("warm_pool and idle_oneshot must be >= 0")
        if self.max_concurrency < 1 or self.uid_count < 1 or self.api_threads < 1:
            raise ValueError("max_concurrency, uid_count and api_threads must be >= 1")
        if not all(
            isinstance(name, str) and all(map(str.isidentifier, name.split("."))) for name in self.preload
        ):
            raise ValueError(f"preload must be module names, got {self.preload!r}")
        if not 0 < self.cpus <= 1024 or not 0 < self.api_timeout_s <= 3600:
            raise ValueError(f"cpus ({self.cpus}) and api_timeout_s ({self.api_timeout_s}) must be positive")
        if self.user is not None and self.user.split(":")[0] in ("", "0", "root"):
            raise ValueError(f"user must be a non-root uid[:gid], got {self.user!r}")
        if not self.python.startswith("/"):
            raise ValueError(f"python must be an absolute path inside the image, got {self.python!r}")


@dataclass(frozen=True)
class _Shape:
    """The limits fixed when a container is created; a run needs a container of its own shape."""

    memory_mb: int
    work_dir_mb: int
    max_processes: int

    @classmethod
    def of(cls, limits: Limits) -> _Shape:
        return cls(limits.memory_mb, limits.work_dir_mb, limits.max_processes)

    def host_config(self, api: Any, cpus: float, owner: str | None) -> Any:
        """`owner` ("uid,gid" of the container's user, where numeric) owns the tmpfs mounts, so that a
        zygote can restore their modes and times after a run."""
        tmpfs = f"rw,exec,nosuid,nodev,size={self.work_dir_mb}m,mode=1777"
        if owner is not None:
            uid, gid = owner.split(",")
            tmpfs += f",uid={uid},gid={gid}"
        # RLIMIT_AS stops one process at memory_mb; the cgroup holds every process of the container
        # together, tmpfs and /dev/shm pages included, to the same figure.
        memory = f"{self.memory_mb}m"
        config = api.create_host_config(
            network_mode="none",
            read_only=True,
            tmpfs={
                protocol.WORK_DIR: tmpfs,
                "/tmp": tmpfs,
                # As Docker's own /dev/shm (noexec, the same size), but owned by the container's user.
                "/dev/shm": tmpfs.replace(",exec,", ",noexec,"),
                # sysfs names the host's block devices (/sys/block), and the container's cgroup files
                # count the CPU time and peak memory of every run it served: the code sees none of
                # it (as in a local sandbox, which has no /sys at all). Docker then mounts no cgroup
                # file system either.
                "/sys": "ro,nosuid,nodev,noexec,size=4k,mode=555",
            },
            mem_limit=memory,
            memswap_limit=memory,
            pids_limit=self.max_processes + 8,  # RLIMIT_NPROC is the real cap; this one contains escapes
            nano_cpus=int(cpus * 1e9),
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            log_config=LogConfig(type="none"),
        )
        # Docker's own masked paths, and the sandboxes' (the API takes one list, which replaces Docker's).
        config["MaskedPaths"] = [*_DOCKER_MASKED_PATHS, *protocol.MASKED_FILES, *protocol.MASKED_DIRS]
        return config


class _Box:
    """One container, with the stream of its launcher (a one-shot zygote's attach, a session's exec)."""

    def __init__(self, container_id: str, shape: _Shape, uid: int | None, since: float = 0.0) -> None:
        self.id = container_id
        self.shape = shape
        self.uid = uid
        self.since = since
        """Wall-clock time just before the container was created (where its events start)."""
        self.exec_id = ""
        self.stream: ExecStream | None = None
        self.cgroup: ContainerCgroup | None = None
        """The container's cgroup files on this host (its CPU time and freezer), where readable."""
        self.frames = protocol.ZygoteFrames()
        """What a one-shot zygote wrote on stdout, parsed (its control frames, a run's output)."""
        self.stderr = OutputCapture(4096)
        """What the launcher itself wrote on stderr (why it failed, if it did)."""
        self._stdout = bytearray()
        """A session's stdout read ahead of the frame being parsed."""
        self.runs = 0
        self.counted = False
        """This host reads the container's CPU time and OOM kills, so they can be counted per run."""
        self.busy = False
        """A session call was sent and its reply not read back."""
        self.idle_tasks: int | None = None
        """Tasks of the idle session: more between calls means the episode left something running."""
        self._frozen = False

    @property
    def alive(self) -> bool:
        """The launcher's stream is open (the daemon has not closed it: its process lives)."""
        return self.stream is not None and self.stream.is_open

    @property
    def usable(self) -> bool:
        return self.alive and not (self.cgroup is not None and self.cgroup.gone())

    @property
    def recyclable(self) -> bool:
        return self.alive and self.counted

    async def send(self, data: bytes) -> None:
        assert self.stream is not None
        await self.stream.send(data)

    async def _more(self) -> None:
        """Read one chunk of the stream: stderr into `stderr`, stdout ahead into `_stdout`."""
        assert self.stream is not None
        item = await self.stream.read_chunk()
        if item is None:
            raise EOFError("the sandbox closed its output")
        stream_id, chunk = item
        if stream_id == 2:
            self.stderr.feed(chunk)
        else:
            self._stdout += chunk

    async def read_frame(self, cap: int) -> bytes:
        """One frame's payload; SandboxProtocolError for a bad header or one over `cap` bytes."""
        while b"\n" not in self._stdout:
            if len(self._stdout) > 256:
                raise protocol.SandboxProtocolError("malformed frame header from the sandbox")
            await self._more()
        header, _, rest = bytes(self._stdout).partition(b"\n")
        size = protocol.frame_size(header, cap)
        self._stdout = bytearray(rest)
        while len(self._stdout) < size:
            await self._more()
        payload = bytes(self._stdout[:size])
        del self._stdout[:size]
        return payload

    async def read_frames(self, until: Callable[[], bool]) -> bool:
        """Feed the one-shot zygote's output to `frames` until `until()` holds; False if the stream
        ended first. SandboxProtocolError for anything malformed, the daemon's errors as they come."""
        assert self.stream is not None
        while not until():
            item = await self.stream.read_chunk()
            if item is None:
                return False
            stream_id, chunk = item
            if stream_id == 2:
                self.stderr.feed(chunk)
            else:
                self.frames.feed(chunk)
        return True

    async def wait_ready(self, within_s: float) -> bool:
        with contextlib.suppress(TimeoutError, protocol.SandboxProtocolError, *_FAILURES):
            return await asyncio.wait_for(self.read_frames(lambda: self.frames.ready), within_s)
        return False

    def stderr_text(self) -> str:
        return self.stderr.text().strip()

    def pause(self) -> None:
        """Freeze the container until the next call if the episode left anything running in it, so
        nothing uses CPU or acts between calls (where this host exposes its freezer)."""
        cgroup, idle = self.cgroup, self.idle_tasks
        if cgroup is None or cgroup.freeze_file is None or idle is None:
            return
        tasks = cgroup.tasks()
        if tasks is not None and tasks > idle:
            cgroup.freeze()
            self._frozen = True

    def resume(self) -> None:
        if self._frozen and self.cgroup is not None:
            self.cgroup.thaw()
            self._frozen = False


class DockerBackend(WarmPool[_Shape, _Box]):
    """Runs code in Docker containers: one-shot runs in warm ones reset between runs, sessions in one each."""

    name = "docker"
    _failures = _FAILURES
    _start_failures = (*_FAILURES, TimeoutError)

    def __init__(self, options: DockerOptions | None = None) -> None:
        self.options = options or DockerOptions()
        super().__init__(self.options.max_concurrency, min(self.options.cpus, cpus_available()))
        self._url = self.options.base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        self._address = parse_address(self._url)
        self._labels = {LABEL: "1", BACKEND_LABEL: uuid.uuid4().hex, OWNER_LABEL: _this_process()}
        # Nothing here talks to the daemon: a backend made while dockerd is down works once it is back.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.options.api_threads, thread_name_prefix="pacerl-docker"
        )
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._image_lock = threading.Lock()
        self._uids = (
            protocol.UidPool(self.options.uid_base, self.options.uid_count)
            if self.options.user is None
            else None
        )
        self._pool_shape = _Shape.of(Limits())
        """The shape the pool keeps warm: the latest run's (containers of other shapes are trimmed)."""
        self._starting: list[tuple[_Shape, asyncio.Task[_Box]]] = []
        """Pool boxes being started, not yet claimed by a run."""
        self._removing: set[asyncio.Task[None]] = set()
        self._sessions: set[DockerSession] = set()
        self._created_any = False
        self._close_task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        """The daemon this backend talks to."""
        return self._url

    @property
    def instance_id(self) -> str:
        """The value of `BACKEND_LABEL` on every container of this backend."""
        return self._labels[BACKEND_LABEL]

    # -- daemon calls (blocking SDK, on the backend's threads) ------------------------------------------

    def _api(self) -> Any:
        with self._client_lock:
            if self._client is None:
                client = docker.DockerClient(
                    base_url=self._url,
                    timeout=int(self.options.api_timeout_s + 0.999),
                    max_pool_size=self.options.api_threads,
                )
                # docker-py keeps one connection pool per URL (per container, per exec), so kept-alive
                # connections are almost never reused and linger by the dozen; a unix-socket connect
                # costs far less than those idle descriptors.
                client.api.headers["Connection"] = "close"
                self._client = client
                _reap_orphans(client.api)
            return self._client.api

    async def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(function, *args, **kwargs))

    async def _api_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`APIClient.<method>(...)` on a backend thread (the client itself is made there too)."""
        return await self._call(lambda: getattr(self._api(), method)(*args, **kwargs))

    def _create(self, shape: _Shape, uid: int | None, zygote: bool) -> str:
        """Create one container (a one-shot zygote's, stdin open for the attach, or a session's, whose
        PID 1 only reaps); returns its id."""
        api = self._api()
        user = self.options.user or f"{uid}:{uid}"
        ids = user.split(":")
        owner = f"{ids[0]},{ids[-1]}" if all(part.isdigit() for part in ids) else None
        command = list(IDLE_COMMAND)
        if zygote:
            command = [self.options.python, "-I", "-c", self._launcher, "oneshot", "-1"]
            command.append(protocol.oneshot_config(self.options.preload, self.options.fresh_interpreter))
        config = {
            "command": command,
            "user": user,
            "working_dir": protocol.WORK_DIR,
            "environment": protocol.SANDBOX_ENV,
            "hostname": "sandbox",
            "labels": self._labels,
            "host_config": shape.host_config(api, self.options.cpus, owner),
            "stop_signal": "SIGKILL",  # PID 1 ignores SIGTERM; a daemon shutdown must not wait for it
            "stdin_open": zygote,  # with stdin_once: the zygote's stdin closes when our attach does
        }
        try:
            container_id: str = api.create_container(self.options.image, **config)["Id"]
        except ImageNotFound:
            if not self.options.build_image:
                raise
            with self._image_lock:
                ensure_image(self.options.image, base_url=self._url)
            container_id = api.create_container(self.options.image, **config)["Id"]
        self._created_any = True
        return container_id

    def _start_container(self, container_id: str) -> None:
        """Start a created container (removed if that fails)."""
        try:
            self._api().start(container_id)
        except BaseException:
            with contextlib.suppress(*_FAILURES):
                self._api().remove_container(container_id, force=True)
            raise

    def _create_started(self, shape: _Shape, uid: int | None) -> str:
        container_id = self._create(shape, uid, zygote=False)
        self._start_container(container_id)
        return container_id

    @property
    def _launcher(self) -> str:
        return (
            _HIDE_PROC_SOURCE + protocol.LAUNCHER_SOURCE
            if self.options.hide_proc
            else protocol.LAUNCHER_SOURCE
        )

    def _oom_killed(self, box: _Box) -> bool:
        """Whether the cgroup's OOM killer struck in this container (docker only flags OOMKilled on
        the container when its PID 1 dies, so an exec'd process shows up as an `oom` event alone)."""
        events = self._api().events(
            since=box.since - 1, until=time.time(), filters={"container": box.id, "event": "oom"}, decode=True
        )
        try:
            return any(True for _ in events)
        finally:
            events.close()

    def _remove_now(self, container_id: str) -> None:
        with contextlib.suppress(NotFound):
            self._api().remove_container(container_id, force=True)

    def _kill_now(self, container_id: str) -> None:
        with contextlib.suppress(NotFound):
            try:
                self._api().kill(container_id)
            except docker.errors.APIError as error:
                if error.status_code != 409:  # 409: not running any more, which is what we wanted
                    raise

    # -- containers ----------------------------------------------------------------------------------

    async def _new_box(self, shape: _Shape, create: Callable[..., str], *args: Any) -> _Box:
        """A box for the container `create(shape, uid, *args)` makes on a worker thread, under a uid of
        the pool. Cancelled meanwhile, the thread still finishes: the container is removed when it does."""
        uid = self._uids.take() if self._uids is not None else None
        since = time.time()
        created = asyncio.ensure_future(self._call(create, shape, uid, *args))
        try:
            container_id = await asyncio.shield(created)
        except asyncio.CancelledError:
            created.add_done_callback(functools.partial(self._remove_late, uid))
            raise
        except BaseException:
            self._give_uid(uid)
            raise
        return _Box(container_id, shape, uid, since)

    async def _start_zygote(self, shape: _Shape) -> _Box:
        """A container whose PID 1 is a one-shot zygote, attached before it started (so nothing it
        writes is missed); it says when it is ready for a job."""
        box = await self._new_box(shape, self._create, True)
        container_id = box.id
        try:
            path = f"/v{self._client.api.api_version}/containers/{container_id}/attach"
            path += "?stream=1&stdin=1&stdout=1&stderr=1"
            box.stream = await ExecStream.open(self._address, path, b"")
            await self._call(self._start_container, container_id)
            box.cgroup = ContainerCgroup.find(container_id)
            box.counted = box.cgroup is not None and box.cgroup.oom_kills() is not None
        except BaseException:
            self._discard(box)
            raise
        return box

    async def _start_box(self, shape: _Shape, *launcher_args: str) -> _Box:
        """A started container whose launcher is exec'd and attached (a session's interpreter)."""
        box = await self._new_box(shape, self._create_started)
        container_id = box.id
        box.cgroup = ContainerCgroup.find(container_id)
        try:
            command = [self.options.python, "-I", "-c", self._launcher, *launcher_args]
            created_exec = await self._api_call(
                "exec_create",
                container_id,
                command,
                stdin=True,
                stdout=True,
                stderr=True,
                workdir=protocol.WORK_DIR,
            )
            box.exec_id = created_exec["Id"]
            path = f"/v{self._client.api.api_version}/exec/{box.exec_id}/start"
            box.stream = await ExecStream.open(self._address, path, b'{"Detach": false, "Tty": false}')
        except BaseException:
            self._discard(box)
            raise
        return box

    def _remove_late(self, uid: int | None, created: asyncio.Future[str]) -> None:
        if created.cancelled() or created.exception() is not None:
            self._give_uid(uid)
        else:
            self._discard(_Box(created.result(), self._pool_shape, uid))

    def _give_uid(self, uid: int | None) -> None:
        if uid is not None and self._uids is not None:
            self._uids.give(uid)

    def _discard(self, box: _Box) -> None:
        """Close the box's stream and remove its container in the background (aclose waits for it)."""
        _thaw(box)
        if box.stream is not None:
            box.stream.close()
        task = asyncio.get_running_loop().create_task(self._remove(box))
        self._removing.add(task)
        task.add_done_callback(self._removing.discard)

    async def _remove(self, box: _Box) -> None:
        _thaw(box)
        try:
            await self._call(self._remove_now, box.id)
        except (*_FAILURES, RuntimeError):
            pass  # the daemon is down (or the backend closing): the label sweep in aclose retries
        finally:
            self._give_uid(box.uid)

    async def _cpu_s(self, box: _Box) -> float:
        """CPU time of every process of the container together: from its cgroup on this host, else
        from the daemon's one-shot stats."""
        if box.cgroup is not None:
            return box.cgroup.cpu_s()
        stats = await self._api_call("stats", box.id, stream=False, one_shot=True)
        return int(stats["cpu_stats"]["cpu_usage"]["total_usage"]) / 1e9

    async def _kill(self, box: _Box) -> bool:
        """Kill the container now (its processes die with its PID 1); False if the daemon did not answer."""
        # Close our end first: a daemon blocked writing output nobody reads would hold the kill up
        # for its 10 s grace period.
        _thaw(box)
        if box.stream is not None:
            box.stream.close()
        try:
            await asyncio.wait_for(self._call(self._kill_now, box.id), self.options.api_timeout_s)
        except (*_FAILURES, TimeoutError):
            return False
        return True

    # -- the warm pool (sandbox/_warm_pool.py keeps it; these say what a container is) ------------------

    def _pool_size(self, key: _Shape) -> int:
        return self.options.warm_pool

    def _idle_cap(self, key: _Shape) -> int:
        return max(self.options.warm_pool, self.options.idle_oneshot)

    def _coming(self, key: _Shape) -> int:
        # A reset takes milliseconds, a new container hundreds of them; a run claims a container
        # already starting for the pool (`_start_for_run`) rather than wait in line for it.
        return self._returning.get(key, 0)

    def _refill(self, key: _Shape | None = None) -> None:
        """Start boxes until those of the wanted shape (warm, starting, in a run or resetting) make
        `warm_pool`. The pool follows `_pool_shape`, whatever the shape of the box that asks (`key`).

        A start that fails is dropped silently: the next run then starts cold, reports the failure,
        and calls this again. No task loops here, so a dead daemon costs one failed call per slot.
        """
        if self._closed:
            return
        shape = self._pool_shape
        have = len(self._warm.get(shape, [])) + sum(s == shape for s, _ in self._starting)
        have += self._lent.get(shape, 0) + self._returning.get(shape, 0)
        for _ in range(self.options.warm_pool - have):
            task = asyncio.get_running_loop().create_task(self._start_zygote(shape))
            entry = (shape, task)
            self._starting.append(entry)
            task.add_done_callback(functools.partial(self._landed, entry))
        self._trim()

    def _landed(self, entry: tuple[_Shape, asyncio.Task[_Box]], task: asyncio.Task[_Box]) -> None:
        if entry not in self._starting:
            return  # a run claimed it while it was starting
        self._starting.remove(entry)
        if task.cancelled() or task.exception() is not None:
            return
        self._put_ready(entry[0], task.result())

    def _put_ready(self, key: _Shape, box: _Box) -> None:
        super()._put_ready(key, box)
        self._trim()

    def _trim(self) -> None:
        """Dispose of warm boxes of shapes no run asks for any more, beyond the pool's size."""
        shape = self._pool_shape
        while sum(map(len, self._warm.values())) + len(self._starting) > self.options.warm_pool:
            stale = next((pool for key, pool in self._warm.items() if key != shape and pool), None)
            if stale is None:
                return
            self._discard(stale.pop(0))

    def _discard_warm(self) -> None:
        warm, self._warm = self._warm, {}
        for pool in warm.values():
            for box in pool:
                self._discard(box)

    async def _take_for_run(self, key: _Shape) -> _Box:
        self._pool_shape = key  # the pool follows what runs ask for
        box = await asyncio.wait_for(self._take(key), self.options.api_timeout_s * 2)
        self._refill()
        return box

    async def _start_for_run(self, key: _Shape) -> _Box:
        # No warm box: claim one already starting for the pool rather than start yet another, which
        # would only compete with it for the daemon's time.
        claimed = next((entry for entry in self._starting if entry[0] == key), None)
        if claimed is not None:
            self._starting.remove(claimed)
        self._refill()
        if claimed is None:
            return await self._start_zygote(key)
        try:
            return await asyncio.shield(claimed[1])
        except asyncio.CancelledError:
            claimed[1].add_done_callback(self._discard_started)
            raise

    def _discard_started(self, task: asyncio.Task[_Box]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._discard(task.result())

    def _unreachable(self, what: str, error: BaseException) -> str:
        detail = str(error).strip() or type(error).__name__
        if isinstance(error, DockerException) and not isinstance(error, docker.errors.APIError):
            detail = f"cannot reach the Docker daemon at {self._url}: {detail}"
        elif isinstance(error, OSError | EOFError | TimeoutError):
            detail = (
                f"the Docker daemon at {self._url} is unreachable or stopped answering "
                f"({type(error).__name__}: {detail})"
            )
        return f"{what}: {detail[:600]}"

    # -- one-shot runs: sandbox/_warm_pool.py runs them, these say what a container is ----------------

    def _oneshot_key(self, limits: Limits) -> _Shape:
        return _Shape.of(limits)

    def _could_not_start(self, error: BaseException, duration: float) -> ExecResult:
        self._discard_warm()
        return ExecResult.sandbox_error(
            self._unreachable("could not start a Docker sandbox", error), duration
        )

    async def _failed_start(self, box: _Box, failure: BaseException | None) -> ExecResult:
        await self._kill(box)
        detail = box.stderr_text()
        if detail.startswith(HIDE_PROC_FAILED):
            return ExecResult.sandbox_error(f"{detail[-500:]} (see DockerOptions.hide_proc)")
        if not await self._answers():
            return self._lost(failure, 0.0)
        detail = box.frames.failure or detail or str(failure or "")
        return ExecResult.sandbox_error(f"the sandbox failed to start: {detail[-500:]}")

    async def _run_marks(self, box: _Box, limits: Limits) -> tuple[float, int | None] | ExecResult:
        # Without the container's cgroup file the daemon's stats cost a round trip: count from zero
        # then (such a container serves this run alone).
        try:
            cpu_start = box.cgroup.cpu_s() if box.cgroup is not None else 0.0
        except OSError as error:  # the container died after it was taken (a daemon that stopped)
            await self._kill(box)
            return self._lost(error, 0.0)
        return cpu_start, box.cgroup.oom_kills() if box.cgroup is not None else None

    async def _end(self, box: _Box) -> BaseException | None:
        return None if await self._kill(box) else TimeoutError("the container could not be killed")

    def _exit_refused(self, code: int, err: OutputCapture, duration: float) -> ExecResult | None:
        if code == HIDE_PROC_EXIT and err.text().startswith(HIDE_PROC_FAILED):
            reason = f"{err.text().strip()[-500:]} (see DockerOptions.hide_proc)"
            return ExecResult.sandbox_error(reason, duration)
        return None

    def _memory_reason(self, limits: Limits) -> str:
        return _MEMORY_REASON

    def _lost(self, cause: BaseException | None, duration: float) -> ExecResult:
        cause = cause or EOFError("the container's stream ended")
        return ExecResult.sandbox_error(self._unreachable("the Docker sandbox failed", cause), duration)

    async def _oom_since(self, box: _Box, start: int | None, *, pid1_died: bool, killed: bool = True) -> bool:
        """Whether the container's OOM killer struck during this run: from its cgroup's counter where
        this host reads it, else (a container that serves one run) from the daemon."""
        if box.cgroup is not None and start is not None:
            now = box.cgroup.oom_kills()
            if now is not None:
                return now > start
        if not killed:
            return False
        # Docker flags OOMKilled on the container only when its PID 1 dies; an OOM kill of any other
        # process shows up as an `oom` event alone.
        if pid1_died and (await self._api_call("inspect_container", box.id))["State"].get("OOMKilled"):
            return True
        oom: bool = await self._call(self._oom_killed, box)
        return oom

    # -- sessions --------------------------------------------------------------------------------------

    async def open_session(self, limits: Limits) -> DockerSession:
        """Start a persistent interpreter in a container of its own."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        session = DockerSession(self, limits)
        try:
            await session.start()
        except DockerException as error:  # callers expect OSError/RuntimeError-family failures
            raise RuntimeError(self._unreachable("could not start a Docker session", error)) from error
        self._sessions.add(session)
        return session

    async def _answers(self) -> bool:
        try:
            await asyncio.wait_for(self._api_call("ping"), 5)
        except (*_FAILURES, TimeoutError):
            return False
        return True

    # -- lifecycle -----------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Remove every container this backend created. Idempotent."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closed = True
        starting, self._starting = [task for _, task in self._starting], []
        for task in [*starting, *self._resets]:
            task.cancel()
        await asyncio.gather(*starting, *self._resets, return_exceptions=True)
        self._wake_all()
        for session in list(self._sessions):
            await session.aclose()
        self._discard_warm()
        while self._removing:
            await asyncio.gather(*list(self._removing), return_exceptions=True)
        # Calls still in flight (a cancelled fill's container creation) finish before the sweep looks.
        await asyncio.to_thread(self._executor.shutdown, True)
        if self._created_any:
            left = await asyncio.to_thread(self._sweep)
            if left:
                warnings.warn(
                    f"the docker sandbox could not remove container(s) {', '.join(left)} ({self._url})",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self._client is not None:
            self._client.close()

    def _sweep(self) -> list[str]:
        """Remove every container carrying this backend's label; ids it could not remove."""
        try:
            api = self._api()
            found = api.containers(
                all=True, quiet=True, filters={"label": f"{BACKEND_LABEL}={self._labels[BACKEND_LABEL]}"}
            )
        except _FAILURES:
            return ["(unknown: cannot list)"]
        left = []
        for container in found:
            try:
                self._remove_now(container["Id"])
            except _FAILURES:
                left.append(container["Id"][:12])
        return left


class DockerSession(BoxSession[_Box]):
    """A live Python interpreter in one container; globals survive between calls.

    Timeouts work as in the local backend: an in-sandbox SIGALRM interrupts a runaway cell and the
    session lives on; if that fails, the host kills the container after a grace period and the next
    call starts a fresh one, saying so in stderr. `reset` and a restart get a new container.
    """

    _failures = _FAILURES

    def __init__(self, backend: DockerBackend, limits: Limits) -> None:
        super().__init__(backend._slots, limits)
        self._backend = backend

    async def start(self) -> None:
        backend = self._backend
        box = await backend._start_box(
            _Shape.of(self.limits), "session", "-1", protocol.session_config(self.limits, False)
        )
        self._box = box
        try:
            await read_ready(box, 30)
        except BaseException as error:
            backend._discard(box)
            self._box = None
            if isinstance(error, EOFError | ValueError | protocol.SandboxProtocolError):
                detail = f"{error}: {box.stderr.text()[-500:]}"
                raise RuntimeError(f"sandbox session failed to start: {detail}") from error
            raise

        async def used() -> float:
            return await backend._cpu_s(box)

        def end() -> None:  # past its CPU budget the container goes; the next call restarts
            asyncio.get_running_loop().create_task(backend._kill(box))

        self._cpu = SessionCpuWatch(used, backend._cpus, end)
        await self._cpu.start_window(self.limits.effective_cpu_s)
        box.idle_tasks = box.cgroup.tasks() if box.cgroup is not None else None

    async def _restart(self) -> ExecResult | None:
        await self._release(reusable=True)  # its container went away: nothing left to kill
        try:
            await self.start()
        except (*_FAILURES, RuntimeError, TimeoutError) as error:
            return ExecResult.sandbox_error(
                self._backend._unreachable("could not restart the Docker session", error)
            )
        return None

    async def _release(self, reusable: bool) -> None:
        """Remove the container in the background (a session's is never reused); unless `reusable`
        (a healthy one), kill it first, at once."""
        if self._cpu is not None:
            self._cpu.stop()
        box, self._box = self._box, None
        if box is not None:
            if not reusable:
                await self._backend._kill(box)
            self._backend._discard(box)

    async def _died(
        self, box: _Box, error: BaseException, limits: Limits, notice: str, started: float
    ) -> ExecResult:
        await self._kill()
        if not await self._backend._answers():
            reason = self._backend._unreachable("the Docker session failed", error)
            return ExecResult.sandbox_error(reason, time.monotonic() - started)
        if self._cpu is not None and self._cpu.exhausted:
            return self._died_result(ExecStatus.TIMEOUT, cpu_reason(limits), notice, started)
        with contextlib.suppress(*_FAILURES):
            if await self._backend._call(self._backend._oom_killed, box):
                return self._died_result(ExecStatus.MEMORY, _MEMORY_REASON, notice, started)
        return self._died_result(ExecStatus.ERROR, str(error), notice, started)

    async def aclose(self) -> None:
        """Remove the session's container (and wait until it is gone). Idempotent."""
        async with self._lock:
            if self._cpu is not None:
                self._cpu.stop()
            box, self._box = self._box, None
            if box is not None:
                if box.stream is not None:
                    box.stream.close()
                await self._backend._remove(box)
        self._backend._sessions.discard(self)


def _thaw(box: _Box) -> None:
    """A session's container is frozen between calls; v1 holds a frozen process's SIGKILL until
    it is thawed, so thaw before any kill or removal."""
    if box.cgroup is not None:
        with contextlib.suppress(OSError):
            box.cgroup.thaw()


def _this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (tells a live process from a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _reap_orphans(api: Any) -> None:
    """Remove sandbox containers whose creating process on this host is gone."""
    try:
        found = api.containers(all=True, filters={"label": f"{LABEL}=1"})
    except _FAILURES:
        return  # the daemon is down; the next client will try again
    host = socket.gethostname()
    for container in found:
        owner = container.get("Labels", {}).get(OWNER_LABEL, "")
        owner_host, _, rest = owner.partition(":")
        pid, _, started = rest.partition(":")
        if owner_host != host or not pid.isdigit() or _start_time(int(pid)) == started:
            continue
        with contextlib.suppress(*_FAILURES):
            api.remove_container(container["Id"], force=True)
