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
the container removed, never reused.

Sessions: PID 1 only waits and reaps, and the session launcher runs through `docker exec`; each
session (one episode) gets a container of its own, removed after it.

The docker SDK is blocking, so its calls run on a small thread pool owned by the backend. The exec
streams do not: they are "hijacked" HTTP connections opened here with asyncio, so the multiplexed
stdout/stderr are read on the event loop, capped as they arrive, and no bytes the HTTP layer might
have buffered are lost.

A stopped or crashed daemon is a `sandbox_error` result, never an exception or a hang; the next
call after the daemon returns reconnects and rebuilds the pool.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import json
import os
import socket
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import docker
from docker.errors import DockerException, ImageNotFound, NotFound
from docker.types import LogConfig

from sandbox._cgroup import ContainerCgroup, SessionCpuWatch, cpu_budget, cpus_available
from sandbox._handover import hand_over, wait_in_line
from sandbox._hide_proc import HIDE_PROC_EXIT, HIDE_PROC_FAILED
from sandbox._protocol import (
    DIED_NOTICE,
    LAUNCHER_SOURCE,
    MASKED_DIRS,
    MASKED_FILES,
    PRELOAD,
    READY_CAP,
    RESTART_NOTICE,
    SANDBOX_ENV,
    SESSION_GRACE_S,
    WORK_DIR,
    SandboxProtocolError,
    UidPool,
    ZygoteFrames,
    decode_ready,
    decode_reply,
    frame_size,
    oneshot_config,
    reply_cap,
    session_config,
    session_message,
    session_result,
)
from sandbox.image import DEFAULT_IMAGE, IDLE_COMMAND, PYTHON, ensure_image
from sandbox.limits import Limits
from sandbox.request import ExecRequest
from sandbox.result import ExecResult, ExecStatus, OutputCapture, classify_exit

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
_HIDE_PROC_SOURCE = resources.files("sandbox").joinpath("_hide_proc.py").read_text()
"""Run ahead of the launcher when `DockerOptions.hide_proc` (see sandbox/_hide_proc.py)."""
_STREAM_CHUNK = 65536
_MAX_RUNS = 256
"""One-shot runs one container serves before it is replaced (bounds what a slow leak could accumulate)."""
_RESET_TIMEOUT_S = 2.0
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
    preload: tuple[str, ...] = PRELOAD
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
                WORK_DIR: tmpfs,
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
        config["MaskedPaths"] = [*_DOCKER_MASKED_PATHS, *MASKED_FILES, *MASKED_DIRS]
        return config


class _ExecStream:
    """The hijacked connection of one `docker exec` or container attach: our bytes to its stdin, its
    stdout/stderr back.

    Docker multiplexes the two output streams with 8-byte headers (stream id, 3 zero bytes, size as
    big-endian uint32); `read_chunk` undoes that without ever holding more than one chunk.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._stream_id = 0
        self._remaining = 0

    @classmethod
    async def open(cls, address: tuple[str, str, int], path: str, body: bytes) -> _ExecStream:
        """POST `body` to `path` (an exec's start, a container's attach) and keep the upgraded connection."""
        scheme, host, port = address
        if scheme == "unix":
            reader, writer = await asyncio.open_unix_connection(host)
        else:
            reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: docker\r\n"
                f"Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            status = (await reader.readline()).split(maxsplit=2)
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if len(status) < 2 or status[1] not in (b"101", b"200"):
                detail = await reader.read(int(headers.get("content-length", "0")) or 2000)
                raise DockerException(f"{path} failed: {b' '.join(status[1:]).decode()} {detail.decode()}")
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def read_chunk(self) -> tuple[int, bytes] | None:
        """(stream id, bytes) with 1 = stdout and 2 = stderr; None at the end of the stream."""
        while self._remaining == 0:
            try:
                header = await self._reader.readexactly(8)
            except asyncio.IncompleteReadError as error:
                if error.partial:
                    raise EOFError("the Docker stream ended inside a frame header") from error
                return None
            self._stream_id, self._remaining = header[0], int.from_bytes(header[4:8], "big")
        chunk = await self._reader.read(min(self._remaining, _STREAM_CHUNK))
        if not chunk:
            raise EOFError("the Docker stream ended inside a frame")
        self._remaining -= len(chunk)
        return self._stream_id, chunk

    @property
    def is_open(self) -> bool:
        """False once the daemon closed the connection (the exec ended or the daemon went away)."""
        return (
            not self._reader.at_eof() and self._reader.exception() is None and not self._writer.is_closing()
        )

    def close(self) -> None:
        self._writer.close()


class _Box:
    """One container, with the stream of its launcher (a one-shot zygote's attach, a session's exec)."""

    def __init__(self, container_id: str, shape: _Shape, uid: int | None, since: float = 0.0) -> None:
        self.id = container_id
        self.shape = shape
        self.uid = uid
        self.since = since
        """Wall-clock time just before the container was created (where its events start)."""
        self.exec_id = ""
        self.stream: _ExecStream | None = None
        self.cgroup: ContainerCgroup | None = None
        """The container's cgroup files on this host (its CPU time and freezer), where readable."""
        self.frames = ZygoteFrames()
        """What a one-shot zygote wrote on stdout, parsed (its control frames, a run's output)."""
        self.stderr = OutputCapture(4096)
        """What the zygote itself wrote on stderr (why it failed, if it did)."""
        self.runs = 0
        self.recyclable = False
        """This host reads the container's CPU time and OOM kills, so they can be counted per run."""

    @property
    def ready(self) -> bool:
        return self.stream is not None and self.stream.is_open

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


class DockerBackend:
    """Runs code in Docker containers: one-shot runs in warm ones reset between runs, sessions in one each."""

    name = "docker"

    def __init__(self, options: DockerOptions | None = None) -> None:
        self.options = options or DockerOptions()
        self._url = self.options.base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        self._address = _parse_address(self._url)
        self._labels = {LABEL: "1", BACKEND_LABEL: uuid.uuid4().hex, OWNER_LABEL: _this_process()}
        # Nothing here talks to the daemon: a backend made while dockerd is down works once it is back.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.options.api_threads, thread_name_prefix="pacerl-docker"
        )
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._image_lock = threading.Lock()
        self._uids = (
            UidPool(self.options.uid_base, self.options.uid_count) if self.options.user is None else None
        )
        self._slots = asyncio.Semaphore(self.options.max_concurrency)
        self._warm: list[_Box] = []
        self._pool_shape = _Shape.of(Limits())
        self._starting: list[tuple[_Shape, asyncio.Task[_Box]]] = []
        """Pool boxes being started, not yet claimed by a run."""
        self._lent: dict[_Shape, int] = {}
        """Boxes in a run, per shape (they count toward the pool: most come back)."""
        self._returning: dict[_Shape, int] = {}
        """Boxes whose reset is in flight, per shape."""
        self._waiting: dict[_Shape, deque[asyncio.Future[_Box | None]]] = {}
        """Runs waiting for a resetting box, first come first served."""
        self._resets: set[asyncio.Task[None]] = set()
        self.recycled = 0
        """Containers reset and returned to the warm pool after a run (a counter, for tests)."""
        self.discards: collections.Counter[str] = collections.Counter()
        """Containers removed after a run that ended by itself, by reason: `litter` (the run left more
        than a reset may undo, `RESET_BUDGET` in sandbox/_launcher.py). A counter, for tests."""
        self._removing: set[asyncio.Task[None]] = set()
        self._sessions: set[DockerSession] = set()
        self._created_any = False
        self._closed = False
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
            command.append(oneshot_config(self.options.preload, self.options.fresh_interpreter))
        config = {
            "command": command,
            "user": user,
            "working_dir": WORK_DIR,
            "environment": SANDBOX_ENV,
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
        return _HIDE_PROC_SOURCE + LAUNCHER_SOURCE if self.options.hide_proc else LAUNCHER_SOURCE

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
            box.stream = await _ExecStream.open(self._address, path, b"")
            await self._call(self._start_container, container_id)
            box.cgroup = ContainerCgroup.find(container_id)
            box.recyclable = box.cgroup is not None and box.cgroup.oom_kills() is not None
        except BaseException:
            self._dispose(box)
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
                "exec_create", container_id, command, stdin=True, stdout=True, stderr=True, workdir=WORK_DIR
            )
            box.exec_id = created_exec["Id"]
            path = f"/v{self._client.api.api_version}/exec/{box.exec_id}/start"
            box.stream = await _ExecStream.open(self._address, path, b'{"Detach": false, "Tty": false}')
        except BaseException:
            self._dispose(box)
            raise
        return box

    def _remove_late(self, uid: int | None, created: asyncio.Future[str]) -> None:
        if created.cancelled() or created.exception() is not None:
            self._give_uid(uid)
        else:
            self._dispose(_Box(created.result(), self._pool_shape, uid))

    def _give_uid(self, uid: int | None) -> None:
        if uid is not None and self._uids is not None:
            self._uids.give(uid)

    def _dispose(self, box: _Box) -> None:
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

    @property
    def _cpus(self) -> float:
        return min(self.options.cpus, cpus_available())

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

    def _refill(self) -> None:
        """Start boxes until those of the wanted shape (warm, starting, in a run or resetting) make
        `warm_pool`.

        A start that fails is dropped silently: the next run then starts cold, reports the failure,
        and calls this again. No task loops here, so a dead daemon costs one failed call per slot.
        """
        if self._closed:
            return
        shape = self._pool_shape
        have = sum(box.shape == shape for box in self._warm) + sum(s == shape for s, _ in self._starting)
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
        self._put_ready(task.result())

    def _put_ready(self, box: _Box) -> None:
        """A box ready for a job: to the first run waiting for its shape, else into the pool (removed
        when the pool already holds `idle_oneshot` of its shape)."""
        if hand_over(self._waiting.get(box.shape, deque()), box):
            return
        same = sum(other.shape == box.shape for other in self._warm)
        if self._closed or same >= max(self.options.warm_pool, self.options.idle_oneshot):
            self._dispose(box)
            return
        self._warm.append(box)
        self._trim()

    def _trim(self) -> None:
        """Dispose of warm boxes of shapes no run asks for any more, beyond the pool's size."""
        shape = self._pool_shape
        while len(self._warm) + len(self._starting) > self.options.warm_pool:
            stale = next((box for box in self._warm if box.shape != shape), None)
            if stale is None:
                return
            self._warm.remove(stale)
            self._dispose(stale)

    def _discard_warm(self) -> None:
        warm, self._warm = self._warm, []
        for box in warm:
            self._dispose(box)

    async def _take_box(self, limits: Limits) -> _Box:
        """A box for one run, counted as lent (a run's box returns to the pool unless `_end_run` says
        otherwise): a warm one, else one about to finish its reset, else one starting, else a new one."""
        shape = _Shape.of(limits)
        self._pool_shape = shape  # the pool follows what runs ask for
        self._lent[shape] = self._lent.get(shape, 0) + 1
        try:
            return await self._find_box(shape)
        except BaseException:
            self._lent[shape] -= 1
            raise

    async def _find_box(self, shape: _Shape) -> _Box:
        while True:
            for box in [box for box in reversed(self._warm) if box.shape == shape]:
                self._warm.remove(box)  # the most recently reset first: still hot in the caches
                if box.ready and not (box.cgroup is not None and box.cgroup.gone()):
                    self._refill()
                    return box
                self._dispose(box)
            waiting = self._waiting.setdefault(shape, deque())
            if self._returning.get(shape, 0) <= len(waiting):
                break
            # A reset takes milliseconds, a new container hundreds of them: wait for the reset.
            handed = await wait_in_line(waiting, self._put_ready)
            if handed is not None:
                return handed
            if self._closed:
                raise RuntimeError("this sandbox is closed")
        # No warm box: claim one already starting for the pool rather than start yet another, which
        # would only compete with it for the daemon's time.
        claimed = next((entry for entry in self._starting if entry[0] == shape), None)
        if claimed is not None:
            self._starting.remove(claimed)
        self._refill()
        if claimed is None:
            return await self._start_zygote(shape)
        try:
            return await asyncio.shield(claimed[1])
        except asyncio.CancelledError:
            claimed[1].add_done_callback(self._dispose_started)
            raise

    def _dispose_started(self, task: asyncio.Task[_Box]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._dispose(task.result())

    def _end_run(self, box: _Box, reusable: bool) -> None:
        """After a run: a box whose run ended by itself goes back once its zygote confirms the reset (in
        the background), where this host can count its CPU time and OOM kills per run; any other is
        removed and replaced."""
        self._lent[box.shape] -= 1
        if (
            reusable
            and not self._closed
            and self.options.warm_pool > 0
            and box.runs < _MAX_RUNS
            and box.ready
            and box.recyclable
        ):
            box.runs += 1
            self._returning[box.shape] = self._returning.get(box.shape, 0) + 1
            task = asyncio.get_running_loop().create_task(self._await_reset(box))
            self._resets.add(task)
            task.add_done_callback(self._resets.discard)
        else:
            self._dispose(box)
        self._refill()

    async def _await_reset(self, box: _Box) -> None:
        ready = False
        try:
            with contextlib.suppress(TimeoutError, SandboxProtocolError, *_FAILURES):
                ready = await asyncio.wait_for(box.read_frames(lambda: box.frames.ready), _RESET_TIMEOUT_S)
        finally:
            self._returning[box.shape] -= 1
            if ready and not self._closed:
                self.recycled += 1
                self._put_ready(box)
            else:
                self._dispose(box)
                # A run waiting for this box starts another instead (which joins the pool after its
                # run); only without one does the pool start a replacement.
                if not hand_over(self._waiting.get(box.shape, deque()), None):
                    self._refill()

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

    # -- one-shot runs -------------------------------------------------------------------------------

    async def run(self, request: ExecRequest) -> ExecResult:
        """Run one program in a clean container (fresh, or reset after an earlier run) and report it."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        async with self._slots:
            began = time.monotonic()
            try:
                box = await asyncio.wait_for(self._take_box(request.limits), self.options.api_timeout_s * 2)
            except (*_FAILURES, TimeoutError) as error:
                self._discard_warm()
                reason = self._unreachable("could not start a Docker sandbox", error)
                return ExecResult.sandbox_error(reason, time.monotonic() - began)
            reusable = False
            try:
                result, reusable = await self._run_in(box, request)
                return result
            finally:
                self._end_run(box, reusable)

    async def _run_in(self, box: _Box, request: ExecRequest) -> tuple[ExecResult, bool]:
        """The run's result, and whether it ended by itself (its box may then be reset and reused)."""
        assert box.stream is not None
        limits = request.limits
        frames = box.frames
        out, err = OutputCapture(limits.output_cap_bytes), OutputCapture(limits.output_cap_bytes)
        started = time.monotonic()
        deadline = started + limits.timeout_s
        failure: BaseException | None = None
        try:  # a new container's zygote says it is ready once it has forked the run's process
            up = await asyncio.wait_for(box.read_frames(lambda: frames.ready), limits.timeout_s)
        except (TimeoutError, SandboxProtocolError, *_FAILURES) as error:
            up, failure = False, error
        if not up:
            await self._kill(box)
            detail = box.stderr.text().strip()
            if detail.startswith(HIDE_PROC_FAILED):
                return ExecResult.sandbox_error(f"{detail[-500:]} (see DockerOptions.hide_proc)"), False
            if not await self._daemon_answers():
                cause = failure or EOFError("the container's stream ended")
                return ExecResult.sandbox_error(self._unreachable("the Docker sandbox failed", cause)), False
            detail = frames.failure or detail or str(failure or "")
            return ExecResult.sandbox_error(f"the sandbox failed to start: {detail[-500:]}"), False
        job = json.dumps(request.to_wire()).encode()
        # Without the container's cgroup file the daemon's stats cost a round trip: count from zero
        # then (such a container serves this run alone).
        try:
            cpu_start = box.cgroup.cpu_s() if box.cgroup is not None else 0.0
        except OSError as error:  # the container died after it was taken (a daemon that stopped)
            await self._kill(box)
            return ExecResult.sandbox_error(self._unreachable("the Docker sandbox failed", error)), False
        oom_start = box.cgroup.oom_kills() if box.cgroup is not None else None

        async def used() -> float:
            return await self._cpu_s(box) - cpu_start

        def over() -> bool:
            return out.total + err.total > limits.output_kill_bytes

        frames.begin(out, err)
        pump = asyncio.ensure_future(box.read_frames(lambda: frames.exit is not None or over()))
        cpu_spent = asyncio.ensure_future(
            cpu_budget(used, limits.effective_cpu_s, self._cpus, read_first=False)
        )
        with contextlib.suppress(*_FAILURES):  # a stream that broke: the pump sees its end
            await box.stream.send(b"%d\n" % len(job) + job)
        await asyncio.wait(
            {pump, cpu_spent}, timeout=max(0.0, deadline - time.monotonic()), return_when="FIRST_COMPLETED"
        )
        out_of_cpu = cpu_spent.done() and not pump.done()
        cpu_spent.cancel()
        if not pump.done():
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, *_FAILURES, SandboxProtocolError):
                await pump
        if not pump.cancelled():
            failure = pump.exception()
        ended = not pump.cancelled() and failure is None and not pump.result()
        if frames.exit is not None and not over():
            code, reached, resettable = frames.exit
            result, ended_itself = await self._exited(
                box, code, reached, out, err, time.monotonic() - started, oom_start
            )
            if ended_itself and not resettable:
                self.discards["litter"] += 1
            return result, ended_itself and resettable
        # Ended from here (or dead): the container goes.
        killed = await self._kill(box)
        duration = time.monotonic() - started
        if over():
            reason = "output limit exceeded"
            return ExecResult.captured(ExecStatus.OUTPUT_LIMIT, None, out, err, duration, reason), False
        if isinstance(failure, SandboxProtocolError):
            return ExecResult.sandbox_error(f"{failure}; the sandbox was ended", duration), False
        if ended or failure is not None:  # the stream ended before the run's exit frame
            with contextlib.suppress(*_FAILURES):
                if await self._oom_since(box, oom_start, pid1_died=True):
                    reason = "memory limit exceeded (the container's memory cap)"
                    return ExecResult.captured(ExecStatus.MEMORY, None, out, err, duration, reason), False
            if not killed or not await self._daemon_answers():
                cause = failure or EOFError("the container's stream ended")
                return ExecResult.sandbox_error(
                    self._unreachable("the Docker sandbox failed", cause), duration
                ), False
            detail = (frames.failure or box.stderr.text().strip() or str(failure or ""))[-500:]
            return ExecResult.sandbox_error(f"the sandbox ended during the run: {detail}", duration), False
        if not killed:
            cause = TimeoutError("the container could not be killed")
            return ExecResult.sandbox_error(
                self._unreachable("the Docker sandbox failed", cause), duration
            ), False
        if out_of_cpu:
            reason = f"CPU-time limit of {limits.effective_cpu_s} s exceeded (all processes together)"
            return ExecResult.captured(ExecStatus.TIMEOUT, None, out, err, duration, reason), False
        reason = f"wall-clock limit of {limits.timeout_s:g} s exceeded"
        return ExecResult.captured(ExecStatus.TIMEOUT, None, out, err, duration, reason), False

    async def _exited(
        self,
        box: _Box,
        exit_code: int,
        reached: bool,
        out: OutputCapture,
        err: OutputCapture,
        duration: float,
        oom_start: int | None,
    ) -> tuple[ExecResult, bool]:
        """The result of a run whose process exited (the zygote's exit frame)."""
        if exit_code == HIDE_PROC_EXIT and err.text().startswith(HIDE_PROC_FAILED):
            reason = f"{err.text().strip()[-500:]} (see DockerOptions.hide_proc)"
            return ExecResult.sandbox_error(reason, duration), False
        if not reached:  # the forked process failed before the user's code began
            return ExecResult.sandbox_error(
                f"the sandbox failed to start: {err.text().strip()[-500:]}", duration
            ), False
        status, reason = classify_exit(exit_code, err.text())
        if status is not ExecStatus.OK:
            try:
                oom = await self._oom_since(box, oom_start, pid1_died=False, killed=exit_code == -9)
            except _FAILURES as error:
                return ExecResult.sandbox_error(
                    self._unreachable("the Docker sandbox failed", error), duration
                ), False
            if oom:
                reason = "memory limit exceeded (the container's memory cap)"
                return ExecResult.captured(ExecStatus.MEMORY, exit_code, out, err, duration, reason), True
        return ExecResult.captured(status, exit_code, out, err, duration, reason), True

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

    async def _daemon_answers(self) -> bool:
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
        for waiting in self._waiting.values():
            for future in waiting:
                if not future.done():
                    future.set_result(None)
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


class DockerSession:
    """A live Python interpreter in one container; globals survive between calls.

    Timeouts work as in the local backend: an in-sandbox SIGALRM interrupts a runaway cell and the
    session lives on; if that fails, the host kills the container after a grace period and the next
    call starts a fresh one, saying so in stderr. `reset` and a restart get a new container.
    """

    def __init__(self, backend: DockerBackend, limits: Limits) -> None:
        self._backend = backend
        self.limits = limits
        self._box: _Box | None = None
        self._stdout = bytearray()
        self._stderr = OutputCapture(4096)
        self._lost_state = False
        self._lock = asyncio.Lock()
        self._cpu: SessionCpuWatch | None = None
        self._idle_tasks: int | None = None
        self._frozen = False

    async def start(self) -> None:
        self._stdout, self._stderr = bytearray(), OutputCapture(4096)
        self._box = await self._backend._start_box(
            _Shape.of(self.limits), "session", "-1", session_config(self.limits, False)
        )
        try:
            decode_ready(await asyncio.wait_for(self._read_frame(READY_CAP), 30))
        except BaseException as error:
            self._backend._dispose(self._box)
            self._box = None
            if isinstance(error, EOFError | ValueError | SandboxProtocolError):
                detail = f"{error}: {self._stderr.text()[-500:]}"
                raise RuntimeError(f"sandbox session failed to start: {detail}") from error
            raise
        box, backend = self._box, self._backend

        async def used() -> float:
            return await backend._cpu_s(box)

        def end() -> None:  # past its CPU budget the container goes; the next call restarts
            asyncio.get_running_loop().create_task(backend._kill(box))

        self._cpu = SessionCpuWatch(used, backend._cpus, end)
        await self._cpu.start_window(self.limits.effective_cpu_s)
        # Tasks of an idle session: more between calls means the episode left something running.
        self._idle_tasks = box.cgroup.tasks() if box.cgroup is not None else None
        self._frozen = False

    async def _more(self) -> None:
        assert self._box is not None and self._box.stream is not None
        item = await self._box.stream.read_chunk()
        if item is None:
            raise EOFError("the sandbox closed its output")
        stream_id, chunk = item
        if stream_id == 2:
            self._stderr.feed(chunk)
        else:
            self._stdout += chunk

    async def _read_frame(self, cap: int) -> bytes:
        """One frame's payload; SandboxProtocolError for a bad header or one over `cap` bytes."""
        while b"\n" not in self._stdout:
            if len(self._stdout) > 256:
                raise SandboxProtocolError("malformed frame header from the sandbox")
            await self._more()
        header, _, rest = bytes(self._stdout).partition(b"\n")
        size = frame_size(header, cap)
        self._stdout = bytearray(rest)
        while len(self._stdout) < size:
            await self._more()
        payload = bytes(self._stdout[:size])
        del self._stdout[:size]
        return payload

    async def run(self, request: ExecRequest) -> ExecResult:
        """Run one cell (Python only); the value of a trailing expression is printed."""
        if request.language != "python":
            raise ValueError("sessions run python only")
        if request.files:
            raise ValueError("sessions take no files; write them from the code")
        async with self._lock, self._backend._slots:
            notice = ""
            if self._box is None or not self._box.ready:
                if self._box is not None:  # its container went away between calls
                    self._backend._dispose(self._box)
                    self._box = None
                    self._lost_state = True
                try:
                    await self.start()
                except (*_FAILURES, RuntimeError, TimeoutError) as error:
                    reason = self._backend._unreachable("could not restart the Docker session", error)
                    return ExecResult.sandbox_error(reason)
                if self._lost_state:
                    notice = RESTART_NOTICE
                    self._lost_state = False
            return await self._call(request, notice)

    async def _call(self, request: ExecRequest, notice: str) -> ExecResult:
        assert self._box is not None and self._box.stream is not None
        limits = request.limits
        started = time.monotonic()
        if self._cpu is not None:
            self._cpu.set_budget(limits.effective_cpu_s)
        if self._frozen and self._box.cgroup is not None:
            self._box.cgroup.thaw()
            self._frozen = False
        try:
            await self._box.stream.send(session_message(request))
            payload = await asyncio.wait_for(
                self._read_frame(reply_cap(limits)), limits.timeout_s + SESSION_GRACE_S
            )
            reply = decode_reply(payload, limits)
        except TimeoutError:
            await self._kill()
            reason = f"wall-clock limit of {limits.timeout_s:g} s exceeded; the session was restarted"
            return ExecResult(ExecStatus.TIMEOUT, None, notice, "", time.monotonic() - started, reason)
        except SandboxProtocolError as error:
            await self._kill()
            return ExecResult.sandbox_error(f"{error}; the session was restarted", time.monotonic() - started)
        except (*_FAILURES, ValueError) as error:
            box = self._box
            await self._kill()
            if not await self._backend._daemon_answers():
                reason = self._backend._unreachable("the Docker session failed", error)
                return ExecResult.sandbox_error(reason, time.monotonic() - started)
            stderr = notice + DIED_NOTICE
            status, reason = ExecStatus.ERROR, str(error)
            if self._cpu is not None and self._cpu.exhausted:
                reason = f"CPU-time limit of {limits.effective_cpu_s} s exceeded (all processes together)"
                return ExecResult(ExecStatus.TIMEOUT, None, "", stderr, time.monotonic() - started, reason)
            with contextlib.suppress(*_FAILURES):
                if await self._backend._call(self._backend._oom_killed, box):
                    status, reason = ExecStatus.MEMORY, "memory limit exceeded (the container's memory cap)"
            return ExecResult(status, None, "", stderr, time.monotonic() - started, reason)
        self._pause(self._box)
        if self._cpu is not None:
            with contextlib.suppress(*_FAILURES):
                await self._cpu.start_window(self.limits.effective_cpu_s)
        return session_result(reply, limits, notice, time.monotonic() - started)

    def _pause(self, box: _Box) -> None:
        """Freeze the container until the next call if the episode left anything running in it, so
        nothing uses CPU or acts between calls (where this host exposes its freezer)."""
        cgroup, idle = box.cgroup, self._idle_tasks
        if cgroup is None or cgroup.freeze_file is None or idle is None:
            return
        tasks = cgroup.tasks()
        if tasks is not None and tasks > idle:
            cgroup.freeze()
            self._frozen = True

    async def _kill(self) -> None:
        if self._cpu is not None:
            self._cpu.stop()
        if self._box is not None:
            await self._backend._kill(self._box)
            self._backend._dispose(self._box)
        self._box = None
        self._lost_state = True

    async def reset(self) -> None:
        """Forget every variable: a fresh interpreter in a fresh container."""
        async with self._lock:
            if self._cpu is not None:
                self._cpu.stop()
            if self._box is not None:
                self._backend._dispose(self._box)
                self._box = None
            self._lost_state = False
            await self.start()

    async def aclose(self) -> None:
        """Remove the session's container (and wait until it is gone). Idempotent."""
        async with self._lock:
            if self._cpu is not None:
                self._cpu.stop()
            if self._box is not None:
                box, self._box = self._box, None
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


def _parse_address(url: str) -> tuple[str, str, int]:
    """("unix", path, 0) or ("tcp", host, port) for a daemon URL; other schemes are refused."""
    parts = urlsplit(url)
    if parts.scheme == "unix" and parts.path:
        return "unix", parts.path, 0
    if parts.scheme in ("tcp", "http") and parts.hostname:
        if os.environ.get("DOCKER_TLS_VERIFY") and not url.startswith("http:"):
            raise ValueError("the docker sandbox does not support TLS daemon connections (DOCKER_TLS_VERIFY)")
        return "tcp", parts.hostname, parts.port or 2375
    raise ValueError(f"unsupported Docker daemon address {url!r}; use unix:///path or tcp://host:port")
