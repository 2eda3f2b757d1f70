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

from pacerl.sandbox.limits import Limits
from pacerl.sandbox.request import ExecRequest
from pacerl.sandbox.result import ExecResult, ExecStatus, OutputCapture

LAUNCHER_SOURCE = "".join(
    resources.files("pacerl.sandbox").joinpath(part).read_text()
    for part in ("_launcher.py", "_launcher_session.py", "_launcher_oneshot.py")
)
"""The launcher's source, passed with `python3 -I -c` so no sandbox needs a copy of it: its parts
joined in this order (the last ends with the entry point; see sandbox/_launcher.py)."""
PRELOAD = (
    "bisect",
    "collections",
    "datetime",
    "decimal",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "random",
    "re",
    "statistics",
    "string",
)
"""Standard-library modules a one-shot sandbox's zygote imports by default, so that the runs forked
from it find them loaded (`LocalOptions.preload`, `DockerOptions.preload`)."""
MASKED_FILES = (
    *(
        f"/proc/1/{name}"
        for name in ("stat", "statm", "status", "sched", "schedstat", "wchan", "oom_score", "io")
    ),
    "/proc/partitions",
    "/proc/diskstats",
    "/proc/swaps",
)
"""Files of /proc covered in every sandbox (by /dev/null, which a sandbox cannot open). PID 1 is the
zygote that served every earlier run of the sandbox: these show its CPU time and page faults, and
those of every run it reaped, its wake-ups and memory; the others name the host's block devices."""
MASKED_DIRS = ("/proc/1/task", "/proc/fs")
"""Folders of /proc covered by an empty read-only tmpfs: PID 1's thread (the same files again), and
the file systems' folders named after the host's block devices (/proc/fs/ext4/vda)."""
WORK_DIR = "/work"
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
"""The whole environment of sandboxed code."""
SESSION_GRACE_S = 2.0
"""Extra wall time the host gives a session cell after its in-sandbox alarm should have fired."""
RESTART_NOTICE = (
    "[sandbox] the session was restarted after its last call was killed; earlier variables are gone\n"
)
DIED_NOTICE = "[sandbox] the interpreter died; the session will restart on the next call\n"


RESET_MESSAGE = b"reset\n"
"""Asks a session zygote to end the episode and make the sandbox clean for the next one."""
READY_CAP = 64
"""Bytes a session interpreter's ready frame may take."""
_REPLY_KINDS = ("ok", "error", "timeout", "memory")


class SandboxProtocolError(Exception):
    """A sandbox answered with something that is not a well-formed reply: the sandbox is ended (never
    reused) and the call reports `sandbox_error`. Everything from a sandbox is untrusted input."""


def oneshot_config(preload: tuple[str, ...], fresh: bool) -> str:
    """A one-shot zygote's configuration: the modules it imports, and whether each run's forked
    process execs a fresh interpreter (which imports them again)."""
    return json.dumps({"preload": list(preload), "fresh": fresh})


def session_config(limits: Limits, fresh: bool) -> str:
    """A session zygote's configuration: its episodes' limits, and whether each episode's forked
    process execs a fresh interpreter."""
    return json.dumps({"limits": limits.to_wire(), "fresh": fresh})


def reply_cap(limits: Limits) -> int:
    """The largest reply frame a session cell can honestly produce: both streams' capped heads in
    base64 plus the JSON around them. The zygote refuses anything larger, and so does the host."""
    return 2 * 4 * ((limits.output_cap_bytes + 2) // 3) + 512


def session_message(request: ExecRequest) -> bytes:
    """The message that asks a session zygote to run one cell (`SIZE CAP\n` + JSON payload)."""
    limits = request.limits
    payload = json.dumps(
        {
            "code": request.code,
            "stdin": base64.b64encode(request.stdin).decode(),
            "timeout_s": limits.timeout_s,
            "cpu_s": limits.effective_cpu_s,
            "output_cap_bytes": limits.output_cap_bytes,
        }
    ).encode()
    return b"%d %d\n" % (len(payload), reply_cap(limits)) + payload


def frame_size(header: bytes, cap: int) -> int:
    """The payload size a sandbox's frame header announces, checked against `cap`."""
    text = header.rstrip(b"\n")
    if text.startswith(b"!"):
        reason = text[1:200].decode("utf-8", "replace")
        raise SandboxProtocolError(f"the sandbox ended the session: the episode wrote {reason}")
    if not text.isdigit() or len(text) > 12:
        raise SandboxProtocolError(f"malformed frame header {text[:40]!r} from the sandbox")
    size = int(text)
    if size > cap:
        raise SandboxProtocolError(f"a frame of {size} bytes from the sandbox, over the {cap}-byte cap")
    return size


def decode_ready(payload: bytes) -> None:
    """Check a session interpreter's first frame, which must be exactly `{"ready": true}`."""
    try:
        value = json.loads(payload)
    except ValueError as error:
        raise SandboxProtocolError(f"a malformed ready frame: {error}") from None
    if value != {"ready": True}:
        raise SandboxProtocolError(f"unexpected first frame from the sandbox: {str(value)[:80]}")


def decode_reply(payload: bytes, limits: Limits) -> dict[str, Any]:
    """A session cell's reply, parsed and schema-checked: kinds, types, base64 and sizes."""
    try:
        reply = json.loads(payload)
    except ValueError as error:
        raise SandboxProtocolError(f"a malformed reply from the sandbox: {error}") from None
    expected = {"kind", "exit_code", "stdout", "stdout_total", "stderr", "stderr_total"}
    if not isinstance(reply, dict) or set(reply) != expected:
        raise SandboxProtocolError("a reply from the sandbox with the wrong fields")
    exit_code = reply["exit_code"]
    if reply["kind"] not in _REPLY_KINDS or not (exit_code is None or type(exit_code) is int):
        raise SandboxProtocolError("a reply from the sandbox with a bad kind or exit code")
    for stream in ("stdout", "stderr"):
        head, total = reply[stream], reply[f"{stream}_total"]
        if not isinstance(head, str) or type(total) is not int:
            raise SandboxProtocolError(f"a reply from the sandbox with a mistyped {stream}")
        try:
            data = base64.b64decode(head, validate=True)
        except ValueError:
            raise SandboxProtocolError(f"a reply from the sandbox with bad base64 in {stream}") from None
        if len(data) > limits.output_cap_bytes or not len(data) <= total <= 1 << 50:
            raise SandboxProtocolError(f"a reply from the sandbox with inconsistent {stream} sizes")
        reply[stream] = data
    return dict(reply)


class ZygoteFrames:
    """What a one-shot zygote writes on its stdout (see `oneshot_zygote` in sandbox/_launcher_oneshot.py),
    parsed as it arrives: a run's output goes into the captures of the run in flight, the control
    frames set `ready`, `exit` and `failure`. Anything malformed, or out of turn, raises
    SandboxProtocolError (the host then ends the sandbox)."""

    _HEADER_CAP = 64

    def __init__(self) -> None:
        self._header = bytearray()
        self._left = 0
        """Payload bytes of the output frame being read that are still to come."""
        self._target: OutputCapture | None = None
        self._run: tuple[OutputCapture, OutputCapture] | None = None
        self.ready = False
        """The zygote waits for a job (set by `r`, cleared by `begin`)."""
        self.exit: tuple[int, bool, bool] | None = None
        """(exit code or minus a signal, whether the run reached the user's code, whether the zygote
        resets the sandbox after it) once the run is over. A zygote that will not reset it (the run
        left more than a reset may undo) ends after the frame."""
        self.failure: str | None = None
        """Why the zygote gave up (its `!reason` line)."""

    def begin(self, out: OutputCapture, err: OutputCapture) -> None:
        """A job was sent: its output goes to `out` and `err` until its exit frame."""
        if not self.ready:
            raise RuntimeError("a job for a sandbox that is not ready")
        self.ready, self.exit, self._run = False, None, (out, err)

    def feed(self, data: bytes) -> None:
        position = 0
        while position < len(data):
            if self._left:
                chunk = data[position : position + self._left]
                assert self._target is not None
                self._target.feed(chunk)
                self._left -= len(chunk)
                position += len(chunk)
                continue
            end = data.find(b"\n", position)
            self._header += data[position : len(data) if end < 0 else end]
            if len(self._header) > self._HEADER_CAP:
                raise SandboxProtocolError("a malformed frame header from the sandbox")
            if end < 0:
                return
            position = end + 1
            header, self._header = bytes(self._header), bytearray()
            self._control(header)

    def _control(self, header: bytes) -> None:
        kind, _, rest = header.partition(b" ")
        running = self._run is not None and self.exit is None
        if header.startswith(b"!"):
            self.failure = header[1:200].decode("utf-8", "replace")
        elif header == b"r" and not self.ready and not running:
            self.ready, self._run = True, None
        elif kind in (b"1", b"2") and running and rest.isdigit() and len(rest) <= 12:
            assert self._run is not None
            self._target, self._left = self._run[int(kind) - 1], int(rest)
        elif kind == b"x" and running:
            fields = rest.split(b" ")
            if (
                len(fields) != 3
                or not fields[0].lstrip(b"-").isdigit()
                or len(fields[0]) > 12
                or not {fields[1], fields[2]} <= {b"0", b"1"}
            ):
                raise SandboxProtocolError(f"a malformed exit frame {header[:40]!r} from the sandbox")
            self.exit = (int(fields[0]), fields[1] == b"1", fields[2] == b"1")
        else:
            raise SandboxProtocolError(f"an unexpected frame {header[:40]!r} from the sandbox")


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


def session_result(reply: dict[str, Any], limits: Limits, notice: str, duration: float) -> ExecResult:
    """The result of a session cell from its `decode_reply`-checked reply."""

    def text(key: str) -> tuple[str, bool]:
        capture = OutputCapture(limits.output_cap_bytes)
        capture.feed(reply[key])
        capture.total = reply[f"{key}_total"]
        return capture.text(), capture.truncated

    stdout, out_cut = text("stdout")
    stderr, err_cut = text("stderr")
    stderr = notice + stderr
    total = reply["stdout_total"] + reply["stderr_total"]
    exit_code = reply["exit_code"]
    status, reason = cell_verdict(reply["kind"], exit_code, total, limits)
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
