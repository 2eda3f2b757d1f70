"""Child processes driven from an asyncio loop without a waiter thread per child.

asyncio's own subprocess support on Python 3.11 waits for each child in a thread of its own (the
ThreadedChildWatcher), and swapping the process-wide watcher would be a side effect on the user's
program. Here a child is a plain `subprocess.Popen`; its exit is signalled through a pidfd watched
by the loop, and its pipes are non-blocking file descriptors read with `loop.add_reader`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any

from pacerl.sandbox.result import OutputCapture

_CHUNK = 65536


def spawn(argv: Sequence[str], *, pass_fds: Sequence[int] = (), **popen: Any) -> subprocess.Popen[bytes]:
    """Start a process with stdin/stdout/stderr pipes in a session of its own (any thread may call
    this; hand the result to `Child` on the loop's thread)."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        close_fds=True,
        start_new_session=True,
        **popen,
    )


class Child:
    """One spawned process (see `spawn`) with stdin/stdout/stderr pipes, owned by the running loop."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.loop = asyncio.get_running_loop()
        self.popen = popen
        assert self.popen.stdin and self.popen.stdout and self.popen.stderr
        self.stdin_fd = self.popen.stdin.fileno()
        self.stdout_fd = self.popen.stdout.fileno()
        self.stderr_fd = self.popen.stderr.fileno()
        for fd in (self.stdin_fd, self.stdout_fd, self.stderr_fd):
            os.set_blocking(fd, False)
        self._pidfd = os.pidfd_open(self.popen.pid)
        self._exited: asyncio.Future[int] = self.loop.create_future()
        self.loop.add_reader(self._pidfd, self._on_exit)
        self._closed = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return not self._exited.done() and self.popen.poll() is None

    def _on_exit(self) -> None:
        code = self.popen.poll()
        if code is not None:
            self.loop.remove_reader(self._pidfd)
            if not self._exited.done():
                self._exited.set_result(code)

    async def wait(self) -> int:
        """Exit code (negative signal number for death by signal)."""
        return await asyncio.shield(self._exited)

    async def write(self, data: bytes) -> None:
        """Write all of `data` to the child's stdin without blocking the loop."""
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.stdin_fd, view)
            except BlockingIOError:
                written = 0
            view = view[written:]
            if view:
                ready = self.loop.create_future()
                self.loop.add_writer(self.stdin_fd, ready.set_result, None)
                try:
                    await ready
                finally:
                    self.loop.remove_writer(self.stdin_fd)

    async def read_exactly(self, fd: int, size: int) -> bytes:
        """Read exactly `size` bytes from one of the child's pipes; EOFError if it closes first."""
        data = bytearray()
        while len(data) < size:
            chunk = await self.read_chunk(fd, size - len(data))
            if not chunk:
                raise EOFError("the sandbox closed its pipe")
            data += chunk
        return bytes(data)

    async def read_line(self, fd: int, limit: int = 32) -> bytes:
        """Read up to and including a newline, byte by byte (only for short frame headers)."""
        line = bytearray()
        while not line.endswith(b"\n"):
            if len(line) > limit:
                raise EOFError("malformed frame header from the sandbox")
            line += await self.read_exactly(fd, 1)
        return bytes(line)

    async def drain(self, fd: int, capture: OutputCapture, kill_after: int | None = None) -> bool:
        """Read a pipe to EOF into `capture`; True if more than `kill_after` bytes arrived (flood)."""
        while True:
            chunk = await self.read_chunk(fd, _CHUNK)
            if not chunk:
                return False
            capture.feed(chunk)
            if kill_after is not None and capture.total > kill_after:
                return True

    async def read_chunk(self, fd: int, size: int = _CHUNK) -> bytes:
        """Up to `size` bytes from one of the child's pipes, once some arrive; b"" at its end."""
        while True:
            try:
                return os.read(fd, size)
            except BlockingIOError:
                pass
            ready = self.loop.create_future()
            self.loop.add_reader(fd, ready.set_result, None)
            try:
                await ready
            finally:
                self.loop.remove_reader(fd)

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Signal the process (no error if it has already exited)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signum)

    async def close(self) -> None:
        """Kill if still running, reap, and release every file descriptor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wait(), 5)
        self.loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self.popen.poll() is None:  # still running after SIGKILL and 5 s: reap it when it dies
            self.popen.wait()
