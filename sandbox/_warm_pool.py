"""The warm pool of one-shot sandboxes, and a one-shot run in one of them: the host side that the
`local` and `docker` backends share.

Both backends start sandboxes ("boxes") whose PID 1 is the launcher's one-shot zygote
(sandbox/_launcher.py): it says when it is ready, takes one job, forks the run's process, reports its
exit and resets the box for the next run. What the host does with that is the same whatever a box
is (processes under bubblewrap or `unshare`, or a Docker container), so it is written once here:

- `WarmPool._take`: a box for a run: a warm one, else one whose reset (or start) is about to end
  (runs wait in line for those, `pacerl.sandbox._handover`), else a new one.
- `WarmPool._end_run`, `_await_reset`, `_put_ready`: a box whose run ended by itself goes back to
  the pool, or to the first run waiting, only once its zygote confirmed the reset, in the
  background; any other is discarded and the pool refills.
- `WarmPool._run_in`: one run in a box: the job sent, the output pumped and capped, the CPU time of
  all the box's processes watched against the run's budget, the wall-clock deadline kept, and the
  outcome told apart (exit, memory, CPU, wall clock, output flood, a box that died).

Each backend keeps what is its own, behind the abstract methods of `WarmPool`: how a box starts
(`_start_for_run`), is discarded and ended (`_discard`, `_end`), and counts its CPU time and OOM
kills (`_run_marks`, `_cpu_s`, `_oom_since`), and what a failure of what runs the boxes looks like
(`_failures`, `_answers`, `_lost`: a Docker daemon that stopped answering).

Left apart where the backends genuinely differ:
- How a pool fills and what it is keyed by. The local backend keeps a pool per (mode, limits) key,
  session sandboxes' included, and counts the starts of a fill as coming, so that runs wait for
  them; the Docker backend's single pool follows the shape of the latest run (`_pool_shape`), trims
  containers of other shapes, and a run claims a container already starting for it.
- Why a box failed to start (`_failed_start`), and the Docker backend's check of a run that exited
  because Landlock is missing (`_exit_refused`).
- Sessions: sandbox/_box_session.py shares a session's calls; where its box comes from and goes (a
  recycled local sandbox, or a container of its own) stays with each backend.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import functools
import json
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import ClassVar, Generic, Protocol, TypeVar

from pacerl.sandbox._cgroup import cpu_budget
from pacerl.sandbox._handover import hand_over, wait_in_line
from pacerl.sandbox._protocol import SandboxProtocolError, ZygoteFrames
from pacerl.sandbox.limits import Limits
from pacerl.sandbox.request import ExecRequest
from pacerl.sandbox.result import ExecResult, ExecStatus, OutputCapture, classify_exit

MAX_RUNS = 256
"""One-shot runs (or sessions) one box serves before it is replaced (bounds what a slow leak could
accumulate)."""
RESET_TIMEOUT_S = 2.0
"""How long a zygote may take to confirm the reset after a run before its box is discarded."""


def cpu_reason(limits: Limits) -> str:
    """Why a run or session call that used up its CPU budget was ended."""
    return f"CPU-time limit of {limits.effective_cpu_s} s exceeded (all processes together)"


def wall_clock_reason(limits: Limits) -> str:
    """Why a run or session call that ran past its timeout was ended."""
    return f"wall-clock limit of {limits.timeout_s:g} s exceeded"


class ZygoteBox(Protocol):
    """One sandbox whose PID 1 is the launcher's one-shot zygote, talked to over a stream."""

    frames: ZygoteFrames
    """What the zygote wrote on stdout, parsed (its control frames, a run's output)."""
    runs: int
    """Runs (or sessions) this box served so far."""

    @property
    def usable(self) -> bool:
        """The box may take a job now (its zygote's stream is open, the sandbox still there)."""

    @property
    def recyclable(self) -> bool:
        """The box may be reset and serve another run (alive, and what a run costs it is counted per run)."""

    async def read_frames(self, until: Callable[[], bool]) -> bool:
        """Feed the zygote's stdout to `frames` until `until()` holds; False if the stream ended first.
        SandboxProtocolError for anything malformed."""

    async def wait_ready(self, within_s: float) -> bool:
        """Whether the zygote said within `within_s` seconds that it is ready for a job (False if it
        died, wrote something malformed or took longer)."""

    async def send(self, data: bytes) -> None:
        """Write `data` to the launcher's stdin."""

    def stderr_text(self) -> str:
        """What the box's own processes (the zygote, bubblewrap) wrote on stderr, stripped."""


K = TypeVar("K", bound=Hashable)
B = TypeVar("B", bound=ZygoteBox)


class WarmPool(abc.ABC, Generic[K, B]):
    """Warm one-shot boxes per pool key, lent to runs and taken back after a confirmed reset; and one
    run in a box. A backend subclasses it with its pool key `K` and box type `B`."""

    _failures: ClassVar[tuple[type[BaseException], ...]] = (OSError, EOFError)
    """What a box's stream raises when it breaks (the box, or what runs it, died)."""
    _start_failures: ClassVar[tuple[type[BaseException], ...]] = (OSError,)
    """What taking a box for a run raises when none could be started: the run's result then says why."""

    def __init__(self, max_concurrency: int, cpus: float) -> None:
        self._slots = asyncio.Semaphore(max_concurrency)
        """Runs and session calls executing at once; more wait their turn."""
        self._cpus = cpus
        """CPUs a box's processes may use at once (how soon a CPU budget could run out)."""
        self._warm: dict[K, list[B]] = {}
        """Boxes waiting for a job, per pool key, the most recently reset last."""
        self._lent: dict[K, int] = {}
        """Boxes in a run (or a session) per pool: they count as supply when refilling, as most return."""
        self._returning: dict[K, int] = {}
        """One-shot boxes whose reset is in flight, per pool (supply too)."""
        self._waiting: dict[K, deque[asyncio.Future[B | None]]] = {}
        """Runs waiting for a box about to be ready, first come first served."""
        self._resets: set[asyncio.Task[None]] = set()
        self._extra_processes = 0
        """Added to a run's RLIMIT_NPROC: processes of the box's uid that are not the code's own."""
        self.recycled = 0
        """Boxes reset and returned to a warm pool after a one-shot run (or a session), a counter for
        tests and benchmarks."""
        self.discards: collections.Counter[str] = collections.Counter()
        """Boxes discarded after a run that ended by itself, by reason: `litter` (the run left more than
        a reset may undo, `RESET_BUDGET` in sandbox/_launcher.py). A counter, for tests and benchmarks."""
        self._closed = False

    # -- what each backend says ----------------------------------------------------------------------

    @abc.abstractmethod
    def _oneshot_key(self, limits: Limits) -> K:
        """The pool whose boxes can serve a run with `limits` (what is fixed when a box starts)."""

    @abc.abstractmethod
    def _pool_size(self, key: K) -> int:
        """Boxes of pool `key` kept started ahead; 0 starts each run cold, in a box never reused."""

    @abc.abstractmethod
    def _idle_cap(self, key: K) -> int:
        """How many ready boxes pool `key` may hold (a burst leaves more than were started ahead)."""

    @abc.abstractmethod
    def _coming(self, key: K) -> int:
        """Boxes of pool `key` on their way into it that a run had better wait for than start another."""

    @abc.abstractmethod
    def _refill(self, key: K) -> None:
        """Start boxes for pool `key` in the background until it holds what it should."""

    @abc.abstractmethod
    async def _start_for_run(self, key: K) -> B:
        """A box of pool `key` for a run that found none ready and none coming."""

    @abc.abstractmethod
    def _discard(self, box: B) -> None:
        """Kill `box` and release it in the background (closing the backend waits for that)."""

    @abc.abstractmethod
    async def _end(self, box: B) -> BaseException | None:
        """Kill a box during a run, from the host (what it wrote before is still read); None once it is
        dead, else why the host could not make sure of that."""

    @abc.abstractmethod
    async def _failed_start(self, box: B, failure: BaseException | None) -> ExecResult:
        """End a box whose zygote never said it was ready for the job, and say why."""

    @abc.abstractmethod
    def _could_not_start(self, error: BaseException, duration: float) -> ExecResult:
        """The result of a run for which no box could be started (`_start_failures`)."""

    @abc.abstractmethod
    async def _run_marks(self, box: B, limits: Limits) -> tuple[float, int | None] | ExecResult:
        """Ready the box for a job with `limits`: its CPU seconds and OOM kills so far, which the run
        is counted from (None: OOM kills are not counted here), or a result if it cannot run it."""

    @abc.abstractmethod
    async def _cpu_s(self, box: B) -> float:
        """CPU time of every process of the box together so far."""

    @abc.abstractmethod
    async def _oom_since(self, box: B, start: int | None, *, pid1_died: bool, killed: bool = True) -> bool:
        """Whether the OOM killer struck in the box since its count was `start`. `pid1_died`: the box's
        PID 1 is gone with it; `killed`: the run's process was SIGKILLed (hints for a backend that
        must ask elsewhere where it has no count)."""

    @abc.abstractmethod
    def _memory_reason(self, limits: Limits) -> str:
        """Why a run killed for its box's memory limit ended."""

    def _exit_refused(self, code: int, err: OutputCapture, duration: float) -> ExecResult | None:
        """A result for a run whose process exited because the box could not host it at all; None
        when the exit is the code's own."""
        return None

    async def _answers(self) -> bool:
        """Whether what runs the boxes (a daemon) still answers: a box that died with it is no fault of
        the run's."""
        return True

    def _lost(self, cause: BaseException | None, duration: float) -> ExecResult:
        """The result of a run whose box was lost with what runs it (`_end` or `_answers` failed)."""
        return ExecResult.sandbox_error(f"the sandbox was lost: {cause or 'its stream ended'}", duration)

    async def _take_for_run(self, key: K) -> B:
        """A box of pool `key` for one run, counted as lent."""
        return await self._take(key)

    # -- the pool ------------------------------------------------------------------------------------

    async def _take(self, key: K) -> B:
        """A box for one run, counted as lent (it returns to the pool unless `_end_run` says otherwise):
        a waiting one, else one about to finish its reset or start, else a new one."""
        box = await self._take_ready(key)
        self._lent[key] = self._lent.get(key, 0) + 1
        if box is not None:
            return box
        try:
            return await self._start_for_run(key)
        except BaseException:
            self._lent[key] -= 1
            raise

    async def _take_ready(self, key: K) -> B | None:
        """A box of pool `key` ready for a job, or handed over as its reset (or start) ends; None when
        none is coming (the caller starts one)."""
        pool = self._warm.setdefault(key, [])
        while True:
            while pool:
                box = pool.pop()  # the most recently reset: its pages are still hot in the caches
                if box.usable:
                    return box
                self._discard(box)
            waiting = self._waiting.setdefault(key, deque())
            if self._coming(key) <= len(waiting):
                return None
            # A reset takes a few milliseconds, and a box already starting comes sooner than one
            # started now: on the same CPUs (or the same daemon), a second start would only slow both.
            handed = await wait_in_line(waiting, functools.partial(self._put_ready, key))
            if handed is not None:
                return handed
            if self._closed:
                raise RuntimeError("this sandbox is closed")

    def _put_ready(self, key: K, box: B) -> None:
        """A box ready for a job: to the first run waiting for one of its pool, else into the pool
        (discarded when the pool already holds `_idle_cap`)."""
        if hand_over(self._waiting.get(key, deque()), box):
            return
        pool = self._warm.setdefault(key, [])
        if self._closed or len(pool) >= self._idle_cap(key):
            self._discard(box)
        else:
            pool.append(box)

    def _end_run(self, key: K, box: B, reusable: bool) -> None:
        """After a run: a box whose run ended by itself goes back once its zygote confirms the reset
        (in the background, off the next run's path); any other is discarded and replaced."""
        self._lent[key] -= 1
        if (
            reusable
            and not self._closed
            and self._pool_size(key) > 0
            and box.runs < MAX_RUNS
            and box.recyclable
        ):
            box.runs += 1
            self._returning[key] = self._returning.get(key, 0) + 1
            task = asyncio.get_running_loop().create_task(self._await_reset(key, box))
            self._resets.add(task)
            task.add_done_callback(self._resets.discard)
        else:
            self._discard(box)
        self._refill(key)

    async def _await_reset(self, key: K, box: B) -> None:
        ready = False
        try:
            ready = await box.wait_ready(RESET_TIMEOUT_S)
        finally:
            self._returning[key] -= 1
            if ready and not self._closed:
                self.recycled += 1
                self._put_ready(key, box)
            else:
                self._discard(box)
                # A run waiting for this box starts another instead (which joins the pool after its
                # run); only without one does the pool start a replacement.
                if not self._wake_one(key):
                    self._refill(key)

    def _wake_one(self, key: K) -> bool:
        """Tell the first run waiting for a box of `key` that none is coming for it; False if no run
        waits."""
        return hand_over(self._waiting.get(key, deque()), None)

    def _wake_all(self) -> None:
        """Tell every run still waiting for a box that none is coming (the backend is closing)."""
        for waiting in self._waiting.values():
            while hand_over(waiting, None):
                pass

    # -- one-shot runs -------------------------------------------------------------------------------

    async def run(self, request: ExecRequest) -> ExecResult:
        """Run one program in a clean sandbox (fresh, or reset after an earlier run) and report it."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        key = self._oneshot_key(request.limits)
        async with self._slots:
            began = time.monotonic()
            try:
                box = await self._take_for_run(key)
            except self._start_failures as error:
                return self._could_not_start(error, time.monotonic() - began)
            reusable = False
            try:
                result, reusable = await self._run_in(box, request)
                return result
            finally:
                self._end_run(key, box, reusable)

    async def _run_in(self, box: B, request: ExecRequest) -> tuple[ExecResult, bool]:
        """The run's result, and whether it ended by itself (its box may then be reset and reused)."""
        limits = request.limits
        frames = box.frames
        out, err = OutputCapture(limits.output_cap_bytes), OutputCapture(limits.output_cap_bytes)
        started = time.monotonic()
        deadline = started + limits.timeout_s
        failure: BaseException | None = None
        not_up: tuple[type[BaseException], ...] = (TimeoutError, SandboxProtocolError, *self._failures)
        try:  # a new box's zygote says it is ready once it has forked the run's process
            up = await asyncio.wait_for(box.read_frames(lambda: frames.ready), limits.timeout_s)
        except not_up as error:
            up, failure = False, error
        if not up:
            return await self._failed_start(box, failure), False
        wire = request.to_wire()
        wire["limits"]["max_processes"] += self._extra_processes
        job = json.dumps(wire).encode()
        marks = await self._run_marks(box, limits)
        if isinstance(marks, ExecResult):
            return marks, False
        cpu_start, oom_start = marks

        async def used() -> float:
            return await self._cpu_s(box) - cpu_start

        def over() -> bool:
            return out.total + err.total > limits.output_kill_bytes

        frames.begin(out, err)
        pump = asyncio.ensure_future(box.read_frames(lambda: frames.exit is not None or over()))
        cpu_spent = asyncio.ensure_future(
            cpu_budget(used, limits.effective_cpu_s, self._cpus, read_first=False)
        )
        with contextlib.suppress(TimeoutError, *self._failures):  # a broken stream: the pump sees its end
            await asyncio.wait_for(box.send(b"%d\n" % len(job) + job), limits.timeout_s)
        await asyncio.wait(
            {pump, cpu_spent}, timeout=max(0.0, deadline - time.monotonic()), return_when="FIRST_COMPLETED"
        )
        out_of_cpu = cpu_spent.done() and not pump.done()
        cpu_spent.cancel()
        if not pump.done():  # and wait until it has let go of the stream, which is read again below
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, SandboxProtocolError, *self._failures):
                await pump
        if not pump.cancelled():
            failure = pump.exception()
        ended = not pump.cancelled() and failure is None and not pump.result()
        if frames.exit is not None and not over():
            code, reached, resettable = frames.exit
            duration = time.monotonic() - started
            result, ended_itself = await self._exited(
                box, limits, code, reached, out, err, duration, oom_start
            )
            if ended_itself and not resettable:
                self.discards["litter"] += 1
            return result, ended_itself and resettable
        # Ended from here (or dead): the whole box goes.
        unkilled = await self._end(box)
        duration = time.monotonic() - started
        if over():
            reason = "output limit exceeded"
            return ExecResult.captured(ExecStatus.OUTPUT_LIMIT, None, out, err, duration, reason), False
        if isinstance(failure, SandboxProtocolError):
            return ExecResult.sandbox_error(f"{failure}; the sandbox was ended", duration), False
        if ended or failure is not None:  # the zygote's stream ended before the run's exit frame
            with contextlib.suppress(*self._failures):
                if await self._oom_since(box, oom_start, pid1_died=True):
                    reason = self._memory_reason(limits)
                    return ExecResult.captured(ExecStatus.MEMORY, None, out, err, duration, reason), False
            if unkilled is not None or not await self._answers():
                return self._lost(failure, duration), False
            detail = (frames.failure or box.stderr_text() or str(failure or ""))[-500:]
            return ExecResult.sandbox_error(f"the sandbox ended during the run: {detail}", duration), False
        if unkilled is not None:
            return self._lost(unkilled, duration), False
        if out_of_cpu:
            reason = cpu_reason(limits)
            return ExecResult.captured(ExecStatus.TIMEOUT, None, out, err, duration, reason), False
        reason = wall_clock_reason(limits)
        return ExecResult.captured(ExecStatus.TIMEOUT, None, out, err, duration, reason), False

    async def _exited(
        self,
        box: B,
        limits: Limits,
        code: int,
        reached: bool,
        out: OutputCapture,
        err: OutputCapture,
        duration: float,
        oom_start: int | None,
    ) -> tuple[ExecResult, bool]:
        """The result of a run whose process exited (the zygote's exit frame), and whether it ended by
        itself."""
        refused = self._exit_refused(code, err, duration)
        if refused is not None:
            return refused, False
        if not reached:  # the forked process failed before the user's code began
            detail = err.text().strip()[-500:]
            return ExecResult.sandbox_error(f"the sandbox failed to start: {detail}", duration), False
        status, reason = classify_exit(code, err.text())
        if status is not ExecStatus.OK:
            try:
                oom = await self._oom_since(box, oom_start, pid1_died=False, killed=code == -9)
            except self._failures as error:
                return self._lost(error, duration), False
            if oom:
                status, reason = ExecStatus.MEMORY, self._memory_reason(limits)
        return ExecResult.captured(status, code, out, err, duration, reason), True
