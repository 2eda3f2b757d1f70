"""The host side of the in-sandbox launcher's protocol, shared by the local and Docker backends.

Frames are `b"%d\n" % len(payload) + payload` with a JSON payload. A one-shot job is
`ExecRequest.to_wire()`; a session call is `session_message(request)` and its reply is read back with
`session_result`.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from importlib import resources
from typing import Any

from sandbox.limits import Limits
from sandbox.request import ExecRequest
from sandbox.result import ExecResult, ExecStatus, OutputCapture

LAUNCHER_SOURCE = resources.files("sandbox").joinpath("_launcher.py").read_text()
"""The launcher's source, passed with `python3 -I -c` so no sandbox needs a copy of it."""
WORK_DIR = "/work"
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
"""The whole environment of sandboxed code."""
SESSION_GRACE_S = 2.0
"""Extra wall time the host gives a session cell after its in-sandbox alarm should have fired."""
RESTART_NOTICE = (
    "[sandbox] the session was restarted after its last call was killed; earlier variables are gone\n"
)
DIED_NOTICE = "[sandbox] the interpreter died; the session will restart on the next call\n"


def frame(payload: dict[str, Any]) -> bytes:
    """One length-prefixed JSON frame."""
    data = json.dumps(payload).encode()
    return b"%d\n" % len(data) + data


def session_message(request: ExecRequest) -> bytes:
    """The frame that asks a session launcher to run one cell."""
    limits = request.limits
    return frame(
        {
            "code": request.code,
            "stdin": base64.b64encode(request.stdin).decode(),
            "timeout_s": limits.timeout_s,
            "cpu_s": limits.effective_cpu_s,
            "output_cap_bytes": limits.output_cap_bytes,
        }
    )


class UidPool:
    """Hands out distinct unprivileged uids so that no two live sandboxes share an RLIMIT_NPROC count."""

    def __init__(self, base: int, count: int) -> None:
        # Several host processes may use the pool at once; starting at a pid-derived offset makes a
        # collision unlikely (and harmless beyond a shared process cap).
        self._free = [base + (os.getpid() + i) % count for i in range(count)]
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError("no free sandbox uid; raise LocalOptions.uid_count")
            return self._free.pop(0)

    def give(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


def session_result(reply: dict[str, object], limits: Limits, notice: str, duration: float) -> ExecResult:
    def text(key: str) -> tuple[str, bool]:
        capture = OutputCapture(limits.output_cap_bytes)
        head = base64.b64decode(str(reply[key]))
        capture.feed(head)
        capture.total = int(str(reply[f"{key}_total"]))
        return capture.text(), capture.truncated

    stdout, out_cut = text("stdout")
    stderr, err_cut = text("stderr")
    stderr = notice + stderr
    total = int(str(reply["stdout_total"])) + int(str(reply["stderr_total"]))
    exit_code = reply["exit_code"] if isinstance(reply["exit_code"], int) else None
    status, reason = cell_verdict(str(reply["kind"]), exit_code, total, limits)
    fields = {"stdout_truncated": out_cut, "stderr_truncated": err_cut}
    return ExecResult(status, exit_code, stdout, stderr, duration, reason, **fields)


def cell_verdict(
    kind: str, exit_code: int | None, total_output: int, limits: Limits
) -> tuple[ExecStatus, str]:
    """Status and reason of a session cell from the launcher's `kind` and the output it produced."""
    if total_output > limits.output_kill_bytes:
        return ExecStatus.OUTPUT_LIMIT, "output limit exceeded"
    if kind == "timeout":
        return ExecStatus.TIMEOUT, f"wall-clock limit of {limits.timeout_s:g} s exceeded"
    if kind == "memory":
        return ExecStatus.MEMORY, "memory limit exceeded"
    if kind == "error":
        return ExecStatus.ERROR, f"exit code {exit_code}"
    return ExecStatus.OK, ""
