"""Helpers shared by test modules: free loopback ports, uvicorn servers on a thread, records of the
HTTP requests a client sends and of the runs that reach a sandbox's backend, and the short training
runs on Math-v0 sums (tests/pacerl/test_train.py, tests/ray_runtime/test_ray.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import fastapi
import httpx
import pytest
import torch
import uvicorn

from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.envs import load_tasks
from pacerl.sandbox import ExecRequest, ExecResult, Sandbox
from pacerl.trainer.metrics import read_metrics
from pacerl.trainer.sft import SFTConfig, demonstrations, sft


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ThreadServer:
    """uvicorn serving `app` on 127.0.0.1 on a daemon thread of this process."""

    def __init__(
        self,
        app: fastapi.FastAPI,
        port: int | None = None,
        lifespan: str = "auto",
        config: uvicorn.Config | None = None,
    ) -> None:
        port = config.port if config is not None else port or free_port()
        if config is None:
            config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan)
        self.port = port
        self.server = uvicorn.Server(config)
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + 30  # a hang guard: uvicorn starts in well under a second
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


def record_http_requests(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    """Every request an httpx async client sends from now on (until the test ends), recorded as it
    leaves: what a test asserts instead of how long a call took (one attempt, no retry, none at all)."""
    sent: list[httpx.Request] = []
    send = httpx.AsyncHTTPTransport.handle_async_request

    async def recording(transport: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return await send(transport, request)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", recording)
    return sent


class BackendRuns:
    """What reaches `sandbox`'s backend from now on (until the test ends): each run's request as it
    arrives, how many are in flight and the most at once, how many finished. While `proceed` is clear,
    arriving runs wait before they start, so a test can hold work in flight for as long as it needs to
    look at the state around it, whatever the machine's speed."""

    def __init__(self, sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
        self.requests: list[ExecRequest] = []
        self.in_flight = self.peak = self.finished = 0
        self.proceed = threading.Event()
        self.proceed.set()
        backend = sandbox._backend
        run = backend.run

        async def recorded(request: ExecRequest) -> ExecResult:
            self.requests.append(request)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                if not self.proceed.is_set():
                    held = await asyncio.to_thread(self.proceed.wait, 60)
                    assert held, "the test never let the held runs proceed"
                return await run(request)
            finally:
                self.in_flight -= 1
                self.finished += 1

        monkeypatch.setattr(backend, "run", recorded)


SUMS = [(3, 3), (2, 5), (7, 1), (4, 4), (6, 2), (1, 8), (5, 3), (9, 0)]
"""The loop tests' tasks: eight one-digit sums on pacerl/Math-v0. Episodes are one short turn with no
tool, so a step takes about half a second and the tests measure the loops, not the sandbox (the tool-
using CodeMath run is `make demo`'s). Learning 100 sums from sparse reward takes far longer than a
test; eight are learned within 20 steps."""


def build_warm_model(root: Path) -> tuple[Path, Path]:
    """(model dir, task file) under `root`: the tiny MoE after a short SFT on Math-v0 sums, so that
    sampling finds the right sum now and then (about 5% of the time) and RL has something to reinforce.
    Shared by the tests through conftest's session fixture `warm_model`."""
    rows = [
        {"id": f"add-{a}-{b}", "question": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(10)
        for b in range(10)
    ]
    every = root / "sums.jsonl"
    every.write_text("".join(json.dumps(row) + "\n" for row in rows))
    eight = root / "eight.jsonl"
    eight.write_text(
        "".join(
            json.dumps(row) + "\n"
            for row in rows
            if (int(row["id"].split("-")[1]), int(row["id"].split("-")[2])) in SUMS
        )
    )
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    demos = demonstrations("pacerl/Math-v0", load_tasks(str(every)), tokenizer=tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sft(model, demos, SFTConfig(steps=30, batch_size=32, warmup_steps=10))
    finally:
        torch.set_num_threads(threads)
    return save_model(model, tokenizer, root / "model"), eight


def small_run(warm: tuple[Path, Path], run_dir: Path, **sections: Any) -> dict[str, Any]:
    model, tasks = warm
    base: dict[str, Any] = {
        "run_dir": str(run_dir),
        "model": {"path": str(model)},
        "env": {"id": "pacerl/Math-v0", "tasks": str(tasks)},
        "rollout": {"group_size": 8},
        "learner": {"lr": 1e-3},
        "loop": {"batch_groups": 4, "steps": 24},
        "filter": {"pace": {"target_groups": 4}, "max_concurrent_groups": 4},
        "evaluation": {"at_start": False, "at_end": False},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
    return base


def rewards(run_dir: Path) -> list[float]:
    return [row["reward"] for row in read_metrics(run_dir / "metrics.jsonl") if "reward" in row]


# Code that leaves behind what a sandbox's reset must undo before the sandbox serves anyone else: files
# (some in folders it locked itself out of), a child, a setsid daemon orphaned to PID 1, a System V
# segment (it outlives every process). Shared by the session and one-shot recycling suites.
LITTER = r"""
import ctypes, os, subprocess, sys, time
open('/work/left.txt', 'w').write('x')
os.makedirs('/work/locked/deeper')
open('/work/locked/deeper/f', 'w').write('y')
os.chmod('/work/locked/deeper', 0)
os.chmod('/work/locked', 0)
open('/tmp/left.txt', 'w').write('x')
if os.access('/dev/shm', os.W_OK):
    open('/dev/shm/left', 'w').write('x')
subprocess.Popen(['sleep', '1000'])
if os.fork() == 0:  # a daemon: double fork, new session, orphaned to PID 1
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)
    os._exit(0)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(4242, 4096, 0o1600) >= 0  # IPC_CREAT | 0600: a System V segment outlives processes
"""

# Changes inside a sandbox that its reset cannot put back, so it must not be reused (the session and
# one-shot recycling suites).
CHANGE_WHAT_A_RESET_CANNOT_UNDO = {
    # PID 1's I/O priority class set to idle (3 << 13)
    "init-ioprio": "import ctypes\nctypes.CDLL(None).syscall(251, 1, 1, 3 << 13)",
    "init-nice": "import os\nos.setpriority(os.PRIO_PROCESS, 1, 5)",
    "init-rlimit": "import resource\nresource.prlimit(1, resource.RLIMIT_NOFILE, (32, 32))",
    "time-wait": (
        "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n"
        "c = socket.create_connection(s.getsockname())\na, _ = s.accept()\nc.close()\na.close()\ns.close()"
    ),
}


# Hostile code shared by the sandbox and env suites: an episode that tries to attach to, or take the
# descriptors of, every other process it can see (the zygote, the host's pipes, later episodes).
TAKEOVER = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
canary = 'left by the first episode'
me, report = os.getpid(), {}
for pid in [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != me]:
    attached = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
    report[f'ptrace {pid}'] = attached if attached < 0 else 'ATTACHED'
    try:
        pidfd = os.pidfd_open(pid)
        taken = [fd for fd in range(256) if libc.syscall(438, pidfd, fd, 0) >= 0]  # pidfd_getfd
        report[f'getfd {pid}'] = taken
    except OSError as error:
        report[f'getfd {pid}'] = []
    try:
        report[f'fds {pid}'] = os.listdir(f'/proc/{pid}/fd')
    except OSError:
        report[f'fds {pid}'] = 'denied'
print(json.dumps(report))
"""


def assert_taken_over_nothing(report: dict[str, object]) -> None:
    """`TAKEOVER`'s report: every attach was refused, no descriptor taken, no descriptor table listed."""
    for key, value in report.items():
        if key.startswith("ptrace"):
            assert value == -1, (key, report)
        elif key.startswith("getfd"):
            assert value == [], (key, report)
        else:
            assert value == "denied", (key, report)


class ServedBy:
    """Which sandbox (local) or container (docker) of `sandbox`'s backend served each one-shot run from
    now on (until the test ends), in order: tests compare them with `is` to tell a sandbox reset and
    reused from a new one, without asking the sandboxed code (which cannot see its zygote's start)."""

    def __init__(self, sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
        self.boxes: list[object] = []
        backend = sandbox._backend
        run_in = backend._run_in  # type: ignore[attr-defined]

        async def recorded(box: object, request: ExecRequest) -> object:
            self.boxes.append(box)
            return await run_in(box, request)

        monkeypatch.setattr(backend, "_run_in", recorded)


def session_box(session: object) -> object:
    """The sandbox (local) or container (docker) a live `pacerl.sandbox.Session` runs in."""
    live = session._backend_session  # type: ignore[attr-defined]
    assert live is not None and live._box is not None, "the session has not started"
    return live._box


def settle_pools(sandbox: Sandbox) -> None:
    """Wait until the one-shot runs of `sandbox` left no reset, start or removal in flight (a hang guard
    ends the wait)."""
    backend = sandbox._backend
    deadline = time.monotonic() + 60  # a hang guard: a reset takes milliseconds, a start well under 60 s
    while time.monotonic() < deadline:
        if hasattr(backend, "_filling"):  # the local backend
            busy = backend._resets or backend._filling or backend._closing
        else:
            busy = backend._resets or backend._starting or backend._removing  # type: ignore[attr-defined]
        if not busy:
            return
        time.sleep(0.01)
    raise AssertionError("the one-shot pool never settled")
