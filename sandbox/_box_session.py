"""A session's calls to its interpreter: what the `local` and `docker` backends' sessions share.

A session is one Python interpreter (the launcher in session mode, sandbox/_launcher.py) in a box of
its own; each call writes `session_message(request)` and reads one reply frame back. `BoxSession`
holds what is the same in both backends: a call's wall clock (the in-sandbox alarm first, the host's
kill after a grace period), a protocol error or a dead interpreter ending the box, the restart on the
next call with its notice, the session's CPU watch moved on after each call, and the box frozen
between calls when the episode left something running in it.

Each backend keeps what differs: where a session's box comes from and where it goes (`start`,
`_restart`, `_release`: the local backend lends a sandbox from a pool and recycles it at the end; the
Docker backend gives each session a container of its own, removed after it), and how it tells why an
interpreter died (`_died`: the local sandbox's cgroup counts its OOM kills, the Docker backend first
asks whether its daemon still answers and then the daemon's events).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from typing import ClassVar, Generic, Protocol, TypeVar

from pacerl.sandbox._cgroup import SessionCpuWatch
from pacerl.sandbox._protocol import (
    DIED_NOTICE,
    READY_CAP,
    RESTART_NOTICE,
    SESSION_GRACE_S,
    SandboxProtocolError,
    decode_ready,
    decode_reply,
    reply_cap,
    session_message,
    session_result,
)
from pacerl.sandbox._warm_pool import wall_clock_reason
from pacerl.sandbox.limits import Limits
from pacerl.sandbox.request import ExecRequest
from pacerl.sandbox.result import ExecResult, ExecStatus


class SessionBox(Protocol):
    """The box of a session: its interpreter's stream, and a freezer between calls."""

    busy: bool
    """A call was sent and its reply not read back: the box is in no state to reuse."""

    @property
    def alive(self) -> bool:
        """The interpreter's stream is still open."""

    async def send(self, data: bytes) -> None:
        """Write `data` to the interpreter's stdin."""

    async def read_frame(self, cap: int) -> bytes:
        """One frame's payload; SandboxProtocolError for a bad header or one over `cap` bytes."""

    def pause(self) -> None:
        """Between calls: freeze the box if the episode left anything running in it (where the host can)."""

    def resume(self) -> None:
        """Thaw a box `pause` froze."""


async def read_ready(box: SessionBox, within_s: float) -> None:
    """Wait up to `within_s` seconds for the interpreter's ready frame (once it started, or after a
    reset); TimeoutError, EOFError, ValueError or SandboxProtocolError where none comes."""
    decode_ready(await asyncio.wait_for(box.read_frame(READY_CAP), within_s))


SB = TypeVar("SB", bound=SessionBox)


class BoxSession(abc.ABC, Generic[SB]):
    """A live Python interpreter in one box; globals survive between calls.

    A cell that runs past its timeout is interrupted inside the sandbox (SIGALRM) and the session
    lives on. If the alarm cannot stop it (a C loop, a handler swallowed it) the host ends the whole
    box after a grace period; the next call starts a fresh interpreter and says so in stderr.
    """

    _failures: ClassVar[tuple[type[BaseException], ...]] = (OSError, EOFError)
    """What the interpreter's stream raises when the box (or what runs it) died."""

    def __init__(self, slots: asyncio.Semaphore, limits: Limits) -> None:
        self._slots = slots
        """The backend's: runs and session calls executing at once."""
        self.limits = limits
        self._box: SB | None = None
        self._lost_state = False
        """The interpreter was ended: the next call says its variables are gone."""
        self._lock = asyncio.Lock()
        self._cpu: SessionCpuWatch | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Get a box with a ready interpreter, and start watching its CPU budget."""

    @abc.abstractmethod
    async def _restart(self) -> ExecResult | None:
        """Let a dead box go and start again; a result (the call's) when no box could be started."""

    @abc.abstractmethod
    async def _release(self, reusable: bool) -> None:
        """Let the session's box go: recycled where `reusable`, it is healthy and the backend reuses
        boxes; else ended."""

    @abc.abstractmethod
    async def _died(
        self, box: SB, error: BaseException, limits: Limits, notice: str, started: float
    ) -> ExecResult:
        """The result of a call whose interpreter died (`error` cut its stream); the box is ended."""

    def _died_result(self, status: ExecStatus, reason: str, notice: str, started: float) -> ExecResult:
        return ExecResult(status, None, "", notice + DIED_NOTICE, time.monotonic() - started, reason)

    async def run(self, request: ExecRequest) -> ExecResult:
        """Run one cell (Python only); the value of a trailing expression is printed."""
        if request.language != "python":
            raise ValueError("sessions run python only")
        if request.files:
            raise ValueError("sessions take no files; write them from the code")
        async with self._lock, self._slots:
            notice = ""
            if self._box is None or not self._box.alive:
                if self._box is not None:  # it died between calls (its CPU budget ran out, say)
                    self._lost_state = True
                failed = await self._restart()
                if failed is not None:
                    return failed
                if self._lost_state:
                    notice = RESTART_NOTICE
                    self._lost_state = False
            return await self._call(request, notice)

    async def _call(self, request: ExecRequest, notice: str) -> ExecResult:
        box = self._box
        assert box is not None
        limits = request.limits
        started = time.monotonic()
        died: tuple[type[BaseException], ...] = (*self._failures, ValueError)
        if self._cpu is not None:
            self._cpu.set_budget(limits.effective_cpu_s)
        box.resume()
        try:
            box.busy = True  # until the reply is read: a cancelled call leaves a frame in flight
            await box.send(session_message(request))
            payload = await asyncio.wait_for(
                box.read_frame(reply_cap(limits)), limits.timeout_s + SESSION_GRACE_S
            )
            reply = decode_reply(payload, limits)
            box.busy = False
        except TimeoutError:
            await self._kill()
            reason = f"{wall_clock_reason(limits)}; the session was restarted"
            return ExecResult(ExecStatus.TIMEOUT, None, notice, "", time.monotonic() - started, reason)
        except SandboxProtocolError as error:
            await self._kill()
            return ExecResult.sandbox_error(f"{error}; the session was restarted", time.monotonic() - started)
        except died as error:
            return await self._died(box, error, limits, notice, started)
        box.pause()
        if self._cpu is not None:
            with contextlib.suppress(*self._failures):
                await self._cpu.start_window(self.limits.effective_cpu_s)
        return session_result(reply, limits, notice, time.monotonic() - started)

    async def _kill(self) -> None:
        await self._release(reusable=False)
        self._lost_state = True

    async def reset(self) -> None:
        """Forget every variable: a fresh interpreter in a clean box."""
        async with self._lock:
            await self._release(reusable=True)
            self._lost_state = False
            await self.start()
