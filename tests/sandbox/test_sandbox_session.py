"""Persistent sessions: a live interpreter per episode, with the same limits as one-shot runs."""

from __future__ import annotations

import asyncio

import pytest

from pacerl.sandbox import ExecStatus, Limits, Sandbox


def test_variables_survive_between_calls(any_sandbox: Sandbox) -> None:
    with any_sandbox.session() as session:
        assert not session.started
        first = session.run("import math\nx = 6 * 7\nprint('set')")
        assert first.status is ExecStatus.OK and first.stdout == "set\n", first
        assert session.started
        second = session.run("x + math.floor(0.5)")  # a trailing expression is printed, notebook-style
        assert second.stdout == "42\n", second
        third = session.run("def f(n):\n    return n * x\nf(2)")
        assert third.stdout == "84\n"


def test_errors_keep_the_session(any_sandbox: Sandbox) -> None:
    with any_sandbox.session() as session:
        session.run("total = 10")
        failed = session.run("1 / 0")
        assert failed.status is ExecStatus.ERROR
        assert "ZeroDivisionError" in failed.stderr and "<cell" in failed.stderr
        assert "run_cell" not in failed.stderr  # the launcher's frames are hidden
        assert session.run("total").stdout == "10\n"


@pytest.mark.slow
def test_timeout_interrupts_the_cell_not_the_session(any_sandbox: Sandbox) -> None:
    with any_sandbox.session(Limits(timeout_s=1)) as session:
        session.run("kept = 'yes'")
        slow = session.run("import time\nprint('before', flush=True)\ntime.sleep(30)")
        assert slow.status is ExecStatus.TIMEOUT, slow
        assert "before" in slow.stdout  # partial output survives
        loop = session.run("while True:\n    pass")
        assert loop.status is ExecStatus.TIMEOUT
        assert session.run("kept").stdout == "'yes'\n"


def test_unstoppable_cell_restarts_the_session_with_a_notice(any_sandbox: Sandbox) -> None:
    with any_sandbox.session(Limits(timeout_s=1)) as session:
        session.run("lost = 1")
        code = (
            "import signal, time\n"
            "signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "signal.setitimer(signal.ITIMER_REAL, 0)\n"
            "time.sleep(30)"
        )
        stuck = session.run(code)
        assert stuck.status is ExecStatus.TIMEOUT, stuck
        after = session.run("print('fresh')\nprint('lost' in globals())")
        assert after.stdout == "fresh\nFalse\n", after
        assert "session was restarted" in after.stderr


def test_memory_error_keeps_the_session(any_sandbox: Sandbox) -> None:
    with any_sandbox.session(Limits(memory_mb=256)) as session:
        session.run("small = list(range(10))")
        bomb = session.run("big = bytearray(1_000_000_000)")
        assert bomb.status is ExecStatus.MEMORY, bomb
        assert session.run("len(small)").stdout == "10\n"


def test_output_is_capped_per_call(any_sandbox: Sandbox) -> None:
    with any_sandbox.session(Limits(output_cap_bytes=100)) as session:
        result = session.run("print('z' * 10_000)")
        assert result.status is ExecStatus.OK
        assert result.stdout_truncated and "more bytes truncated" in result.stdout
        assert session.run("print('next')").stdout == "next\n"  # no leftovers from the flood


def test_stdin_per_call(any_sandbox: Sandbox) -> None:
    with any_sandbox.session() as session:
        assert session.run("import sys\nsys.stdin.read().upper()", stdin="abc").stdout == "'ABC'\n"


def test_reset_forgets_everything(any_sandbox: Sandbox) -> None:
    with any_sandbox.session() as session:
        session.run("secret = 1")
        session.reset()
        result = session.run("print('secret' in globals())")
        assert result.stdout == "False\n"


def test_close_is_idempotent_and_final(any_sandbox: Sandbox) -> None:
    session = any_sandbox.session()
    session.run("a = 1")
    session.close()
    session.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.run("a")


async def test_async_sessions_run_concurrently(any_sandbox: Sandbox) -> None:
    sessions = [any_sandbox.session() for _ in range(4)]
    try:
        await asyncio.gather(*(s.arun(f"n = {i}") for i, s in enumerate(sessions)))
        results = await asyncio.gather(*(s.arun("n * 10") for s in sessions))
        assert [r.stdout for r in results] == ["0\n", "10\n", "20\n", "30\n"]
    finally:
        await asyncio.gather(*(s.aclose() for s in sessions))
