"""`Sandbox`: the one entry point. A backend by name, sync and async faces, persistent sessions.

Every backend is asyncio-native. A `Sandbox` owns one event loop on a private thread where all of
its processes, pipes and HTTP connections live; the sync methods block on that loop, and the async
methods await it from whatever loop the caller runs. So hundreds of concurrent runs cost no thread
each, and a caller's loop never touches the backend's file descriptors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from pacerl.sandbox.limits import Limits
from pacerl.sandbox.request import ExecRequest
from pacerl.sandbox.result import ExecResult

T = TypeVar("T")


class BackendSession(Protocol):
    """A live interpreter inside one sandbox."""

    async def run(self, request: ExecRequest) -> ExecResult: ...
    async def reset(self) -> None: ...
    async def aclose(self) -> None: ...


class Backend(Protocol):
    """What every backend provides. Implementations live in sandbox.local, .docker_backend, .remote."""

    name: str

    async def run(self, request: ExecRequest) -> ExecResult: ...
    async def open_session(self, limits: Limits) -> BackendSession: ...
    async def aclose(self) -> None: ...


def _local(options: Mapping[str, Any]) -> Backend:
    from pacerl.sandbox.local import LocalBackend, LocalOptions

    return LocalBackend(_build(LocalOptions, options))


def _docker(options: Mapping[str, Any]) -> Backend:
    from pacerl.sandbox.docker_backend import DockerBackend, DockerOptions

    return DockerBackend(_build(DockerOptions, options))


def _remote(options: Mapping[str, Any]) -> Backend:
    from pacerl.sandbox.remote import RemoteBackend, RemoteOptions

    return RemoteBackend(_build(RemoteOptions, options))


BACKENDS: dict[str, Callable[[Mapping[str, Any]], Backend]] = {
    "local": _local,
    "docker": _docker,
    "remote": _remote,
}
"""Backend factories by name. Options are checked against each backend's options dataclass."""


def _build(options_type: type[T], options: Mapping[str, Any]) -> T:
    known = {f.name for f in dataclasses.fields(options_type)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for {options_type.__name__}; "
            f"valid: {', '.join(sorted(known))}"
        )
    built: T = options_type(**options)
    return built


class _LoopThread:
    """An event loop running forever on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a Sandbox method was called from inside its own loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class Sandbox:
    """Runs untrusted code under enforced limits.

    >>> with Sandbox("local") as sandbox:
    ...     sandbox.run("print(1 + 1)").stdout
    '2\\n'

    `backend` is one of `BACKENDS` ("local", "docker", "remote"); `options` go to that backend's
    options dataclass (e.g. `warm_pool=4`, `image=...`, `url=...`). `limits` are the defaults of
    every run and session of this sandbox; a call may pass its own.
    """

    def __init__(self, backend: str = "local", *, limits: Limits | None = None, **options: Any) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown sandbox backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.limits = limits or Limits()
        self._loop = _LoopThread(f"pacerl-sandbox-{backend}")
        try:
            self._backend = self._loop.submit(_construct(BACKENDS[backend], options)).result()
        except BaseException:
            self._loop.stop()
            raise
        self.backend_name = backend
        self.options: dict[str, Any] = dict(options)
        """The backend options this sandbox was made with."""
        self._closed = False

    # -- one-shot runs -------------------------------------------------------------------------------

    def run(
        self,
        code: str,
        language: str = "python",
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `code` in a fresh sandbox and wait for the result."""
        request = ExecRequest.build(code, language, stdin, files, limits or self.limits)
        return self._submit(self._backend.run(request)).result()

    async def arun(
        self,
        code: str,
        language: str = "python",
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """The async twin of `run`."""
        request = ExecRequest.build(code, language, stdin, files, limits or self.limits)
        return await asyncio.wrap_future(self._submit(self._backend.run(request)))

    # -- sessions ------------------------------------------------------------------------------------

    def session(self, limits: Limits | None = None) -> Session:
        """A persistent interpreter (started at its first call) whose variables survive between calls."""
        self._check_open()
        return Session(self, limits or self.limits)

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop warm sandboxes and the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.submit(self._backend.aclose()).result(timeout=60)
        finally:
            self._loop.stop()

    async def aclose(self) -> None:
        """The async twin of `close`."""
        if not self._closed:
            await asyncio.to_thread(self.close)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Sandbox is closed")

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise RuntimeError("this Sandbox is closed")
        return self._loop.submit(coro)


async def _construct(factory: Callable[[Mapping[str, Any]], Backend], options: Mapping[str, Any]) -> Backend:
    return factory(options)


class Session:
    """A live Python interpreter in its own sandbox; each call is one cell.

    The value of a cell's trailing expression is printed, as in a notebook. A cell past its timeout
    is interrupted and the session lives on; if the whole sandbox had to be killed, the next call
    starts a fresh interpreter and its stderr says that earlier variables are gone.
    """

    def __init__(self, sandbox: Sandbox, limits: Limits) -> None:
        self._sandbox = sandbox
        self.limits = limits
        self._backend_session: BackendSession | None = None
        self._closed = False

    async def _ensure(self) -> BackendSession:
        if self._backend_session is None:
            self._backend_session = await self._sandbox._backend.open_session(self.limits)
        return self._backend_session

    async def _run(self, request: ExecRequest) -> ExecResult:
        try:
            live = await self._ensure()
        except (OSError, RuntimeError, TimeoutError, EOFError, ValueError) as error:
            return ExecResult.sandbox_error(f"could not start a session: {error}")
        return await live.run(request)

    def _request(self, code: str, stdin: str | bytes | None, limits: Limits | None) -> ExecRequest:
        if self._closed:
            raise RuntimeError("this session is closed")
        return ExecRequest.build(code, "python", stdin, None, limits or self.limits)

    def run(self, code: str, stdin: str | bytes | None = None, limits: Limits | None = None) -> ExecResult:
        """Run one cell and wait for its result."""
        request = self._request(code, stdin, limits)
        return self._sandbox._submit(self._run(request)).result()

    async def arun(
        self, code: str, stdin: str | bytes | None = None, limits: Limits | None = None
    ) -> ExecResult:
        """The async twin of `run`."""
        request = self._request(code, stdin, limits)
        return await asyncio.wrap_future(self._sandbox._submit(self._run(request)))

    async def _reset(self) -> None:
        if self._backend_session is not None:
            await self._backend_session.reset()

    def reset(self) -> None:
        """Forget every variable (a fresh interpreter)."""
        self._sandbox._submit(self._reset()).result()

    async def areset(self) -> None:
        """The async twin of `reset`."""
        await asyncio.wrap_future(self._sandbox._submit(self._reset()))

    async def _close(self) -> None:
        if self._backend_session is not None:
            await self._backend_session.aclose()
            self._backend_session = None

    def close(self) -> None:
        """Stop the interpreter and release its sandbox. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._sandbox._closed:
            self._sandbox._submit(self._close()).result()

    async def aclose(self) -> None:
        """The async twin of `close`."""
        if self._closed:
            return
        self._closed = True
        if not self._sandbox._closed:
            await asyncio.wrap_future(self._sandbox._submit(self._close()))

    @property
    def started(self) -> bool:
        """True while an interpreter is running for this session."""
        return self._backend_session is not None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
