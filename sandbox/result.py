"""The outcome of one sandboxed execution, and the capped output capture that feeds it."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class ExecStatus(enum.StrEnum):
    """How a run ended. Only `ok` means the code ran to a zero exit."""

    OK = "ok"
    ERROR = "error"
    """The code ran and failed: non-zero exit, uncaught exception, killed by a signal."""
    TIMEOUT = "timeout"
    """Wall-clock or CPU-time limit hit; the process tree was killed."""
    MEMORY = "memory"
    """The address-space limit was hit (MemoryError, failed allocation)."""
    OUTPUT_LIMIT = "output_limit"
    """The code printed more than `Limits.output_kill_bytes` and was killed."""
    SANDBOX_ERROR = "sandbox_error"
    """The sandbox itself failed (backend down, container gone); `reason` says why. Not the code's fault."""


TRUNCATION_MARKER = "\n[... {dropped} more bytes truncated by the sandbox ...]\n"
_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


@dataclass(frozen=True)
class ExecResult:
    """What happened when code ran in a sandbox."""

    status: ExecStatus
    """How the run ended."""
    exit_code: int | None
    """Process exit code; a negative number -N for death by signal N; None when killed by the sandbox."""
    stdout: str
    """Standard output, capped at `Limits.output_cap_bytes` with a visible truncation marker."""
    stderr: str
    """Standard error, capped the same way."""
    duration_s: float
    """Wall-clock seconds from dispatch to the end of the run."""
    reason: str = ""
    """Why the run did not end `ok`, in words a person or a model can read."""
    stdout_truncated: bool = False
    """True when stdout lost bytes to the cap."""
    stderr_truncated: bool = False
    """True when stderr lost bytes to the cap."""

    @property
    def ok(self) -> bool:
        """True when the code exited 0 within its limits."""
        return self.status is ExecStatus.OK

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (status as its string value)."""
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExecResult:
        """The inverse of `to_json`."""
        return cls(**{**data, "status": ExecStatus(data["status"])})

    @classmethod
    def captured(
        cls,
        status: ExecStatus,
        exit_code: int | None,
        stdout: OutputCapture,
        stderr: OutputCapture,
        duration_s: float,
        reason: str = "",
    ) -> ExecResult:
        """A result from the two capped output captures of a run."""
        return cls(
            status,
            exit_code,
            stdout.text(),
            stderr.text(),
            duration_s,
            reason,
            stdout_truncated=stdout.truncated,
            stderr_truncated=stderr.truncated,
        )

    @classmethod
    def sandbox_error(cls, reason: str, duration_s: float = 0.0) -> ExecResult:
        """A result for a run the sandbox could not carry out."""
        return cls(ExecStatus.SANDBOX_ERROR, None, "", "", duration_s, reason=reason)


class OutputCapture:
    """Keeps the first `cap` bytes of a stream and counts the rest, so a flood never fills memory."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.total = 0
        self._kept = bytearray()

    def feed(self, chunk: bytes) -> None:
        """Account for one chunk read from the stream."""
        room = self.cap - len(self._kept)
        if room > 0:
            self._kept += chunk[:room]
        self.total += len(chunk)

    @property
    def truncated(self) -> bool:
        """True once bytes were dropped."""
        return self.total > len(self._kept)

    def text(self) -> str:
        """The kept bytes as text (invalid UTF-8 replaced), with a marker when bytes were dropped."""
        text = bytes(self._kept).decode("utf-8", errors="replace")
        if self.truncated:
            text += TRUNCATION_MARKER.format(dropped=self.total - len(self._kept))
        return text


def classify_exit(exit_code: int, stderr: str) -> tuple[ExecStatus, str]:
    """Status and reason for a process that exited by itself (no sandbox kill)."""
    if exit_code == 0:
        return ExecStatus.OK, ""
    tail = stderr[-2000:]
    if any(sign in tail for sign in _MEMORY_SIGNS):
        return ExecStatus.MEMORY, "memory limit exceeded"
    if exit_code in (-24, 128 + 24):  # SIGXCPU: RLIMIT_CPU soft limit
        return ExecStatus.TIMEOUT, "CPU time limit exceeded"
    if exit_code < 0 or exit_code > 128:
        signum = -exit_code if exit_code < 0 else exit_code - 128
        return ExecStatus.ERROR, f"killed by signal {signum}"
    return ExecStatus.ERROR, f"exit code {exit_code}"
