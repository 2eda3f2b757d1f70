"""Resource limits of one sandboxed execution, shared by every backend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    """What one run (or one session call) may consume. Every backend enforces every field."""

    timeout_s: float = 10.0
    """Wall-clock limit; past it the whole process tree is killed and the status is `timeout`."""
    cpu_s: float | None = None
    """CPU time of all the sandbox's processes together (its cgroup; RLIMIT_CPU per process too), past
    which the run ends with `timeout`; None means the wall-clock timeout, rounded up. In a session it is
    per call, counted from the previous call's end, plus a 2 s grace for the in-sandbox interrupt."""
    memory_mb: int = 512
    """Memory of all the sandbox's processes together, in MiB, shared memory and tmpfs pages included
    (its cgroup; past it the kernel kills a process), and each process's address space (RLIMIT_AS:
    allocations beyond it fail with MemoryError). Either way the status is `memory`."""
    max_processes: int = 64
    """Processes and threads the code may have at once (RLIMIT_NPROC and the cgroup's pids.max);
    contains fork bombs."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    work_dir_mb: int = 64
    """Size of the private tmpfs work directory (and of /tmp) in MiB."""
    output_cap_bytes: int = 16_384
    """Bytes of stdout and of stderr kept; the rest is dropped and a visible marker says how much."""
    output_kill_bytes: int = 8 * 1024 * 1024
    """Total output past which the run is killed with status `output_limit` (a flood never buffers)."""

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool]] = [
            ("timeout_s", 0 < self.timeout_s <= 3600),
            ("cpu_s", self.cpu_s is None or 0 < self.cpu_s <= 3600),
            ("memory_mb", 32 <= self.memory_mb <= 1_048_576),
            ("max_processes", 1 <= self.max_processes <= 65_536),
            ("max_file_mb", 1 <= self.max_file_mb <= 1_048_576),
            ("max_open_files", 16 <= self.max_open_files <= 1_048_576),
            ("work_dir_mb", 1 <= self.work_dir_mb <= 1_048_576),
            ("output_cap_bytes", 64 <= self.output_cap_bytes <= 1 << 30),
            ("output_kill_bytes", self.output_cap_bytes <= self.output_kill_bytes <= 1 << 34),
        ]
        for name, ok in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not ok:
                raise ValueError(f"Limits.{name}={value!r} is out of range")

    @property
    def effective_cpu_s(self) -> int:
        """CPU seconds for RLIMIT_CPU (whole seconds, at least 1)."""
        seconds = self.cpu_s if self.cpu_s is not None else self.timeout_s
        return max(1, int(seconds + 0.999))

    def replace(self, **changes: Any) -> Limits:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_wire(self) -> dict[str, int | float]:
        """The fields the in-sandbox launcher applies, as plain JSON values."""
        return {
            "cpu_s": self.effective_cpu_s,
            "timeout_s": self.timeout_s,
            "memory_bytes": self.memory_mb * 1024 * 1024,
            "max_processes": self.max_processes,
            "max_file_bytes": self.max_file_mb * 1024 * 1024,
            "max_open_files": self.max_open_files,
            "output_cap_bytes": self.output_cap_bytes,
        }


@dataclass(frozen=True)
class RequestMaxima:
    """The most one request to `pacerl serve sandbox` may ask for; past it the server caps the request
    and says so in the answer. What a request gets when it asks for nothing is the server's `Limits`."""

    timeout_s: float = 60.0
    """Largest `run_timeout` honoured, in seconds (`--max-timeout`)."""
    memory_mb: int = 2048
    """Largest `memory_limit_MB` honoured, in MiB (`--max-memory-mb`)."""

    def __post_init__(self) -> None:
        # The ranges of Limits: a maximum must itself be a limit the sandbox can apply.
        for name, value, ok in [
            ("timeout_s", self.timeout_s, 0 < self.timeout_s <= 3600),
            ("memory_mb", self.memory_mb, 32 <= self.memory_mb <= 1_048_576),
        ]:
            if isinstance(value, bool) or not ok:
                raise ValueError(f"RequestMaxima.{name}={value!r} is out of range")

    def check(self, defaults: Limits) -> None:
        """Raise ValueError when a default is above its maximum (a request asking nothing would exceed it)."""
        if defaults.timeout_s > self.timeout_s:
            raise ValueError(
                f"the default timeout ({defaults.timeout_s:g} s) is above the most a request may ask for "
                f"({self.timeout_s:g} s): raise the maximum (--max-timeout) or lower the default (--timeout)"
            )
        if defaults.memory_mb > self.memory_mb:
            raise ValueError(
                f"the default memory ({defaults.memory_mb} MiB) is above the most a request may ask for "
                f"({self.memory_mb} MiB): raise the maximum (--max-memory-mb) or lower the default "
                "(--memory-mb)"
            )
