"""The `remote` backend: a client of any SandboxFusion-compatible `/run_code` service.

The service is bytedance/SandboxFusion itself or `pacerl serve sandbox` (sandbox.server). The wire
schema below follows SandboxFusion's own models field for field (names, types, defaults and status
strings), written from these files of github.com/bytedance/SandboxFusion:

- `sandbox/server/sandbox_api.py`: `RunCodeRequest`, `RunStatus`, `RunCodeResponse`, and
  `parse_run_status` (a time-limit hit or a non-zero exit is `Failed`; a run the sandbox could not
  carry out is `SandboxError`).
- `sandbox/runners/types.py`: `CommandRunStatus`, `CommandRunResult`, the `Language` names.
- `sandbox/runners/base.py`: a run past `run_timeout` is `TimeLimitExceeded` without a return code;
  `memory_limit_MB <= 0` means no memory limit; `files` entries whose content is null are skipped.

How verl calls such a service (verl's `verl/utils/reward_score/sandbox_fusion/utils.py`: POST the full
request with `files: {}` and `fetch_files: []`, retry on HTTP 504) is what this client stays
compatible with, not a model for its code.

What crosses the wire: code, language, stdin (text: SandboxFusion's `stdin` is a string, so binary
stdin is refused), files, `Limits.timeout_s` as `run_timeout` and `Limits.memory_mb` as
`memory_limit_MB`. The service enforces its own process, file and output limits; the client caps
stdout and stderr again at `Limits.output_cap_bytes`, but cannot recover bytes the service dropped.

Sessions: SandboxFusion keeps no interpreter between requests, so a remote session replays, in one
request, every earlier cell that ended `ok` (their output discarded) before the new cell. See
`RemoteSession` for what that costs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pydantic

from pacerl.sandbox._protocol import cell_verdict
from pacerl.sandbox.fusion_schema import (
    CommandRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    parse_status_message,
)
from pacerl.sandbox.limits import Limits
from pacerl.sandbox.request import MAX_CODE_BYTES, ExecRequest, SandboxUsageError
from pacerl.sandbox.result import TRUNCATION_MARKER, ExecResult, ExecStatus, OutputCapture, classify_exit

_MAX_REASON = 2000
"""Characters of a service's error text kept in `ExecResult.reason`."""

# -- from a response back to an ExecResult -------------------------------------------------------------

_SERVER_MARKER = re.compile(re.escape(TRUNCATION_MARKER).replace(re.escape("{dropped}"), r"(\d+)") + r"\Z")


def _capped(text: str, cap: int, total: int | None = None) -> tuple[str, bool]:
    """`text` capped at `cap` bytes with our marker; a pacerl server's own marker is folded into the count.

    `total`, when known, is how many bytes the program really wrote (the session driver reports it).
    """
    dropped = 0
    marker = _SERVER_MARKER.search(text)
    if marker is not None:
        text, dropped = text[: marker.start()], int(marker[1])
    head = text.encode("utf-8", errors="replace")
    capture = OutputCapture(cap)
    capture.feed(head)
    capture.total = max(capture.total + dropped, total or 0)
    return capture.text(), capture.truncated


def result_from_response(response: RunCodeResponse, limits: Limits, duration_s: float) -> ExecResult:
    """Map a SandboxFusion answer onto an ExecResult, output capped at `limits.output_cap_bytes`."""
    tagged, text = parse_status_message(response.message)
    run = response.run_result
    broken = run is not None and run.status is CommandRunStatus.ERROR
    if response.status is RunStatus.SANDBOX_ERROR or broken:
        detail = text or (run.stderr if run is not None else None) or "no message"
        # SandboxFusion's exception messages quote the whole program; the gist fits in a reason.
        return ExecResult.sandbox_error(f"the sandbox service failed: {detail[:_MAX_REASON]}", duration_s)
    if run is None:
        built = response.compile_result
        if built is None or response.status is RunStatus.SUCCESS:
            return ExecResult.sandbox_error("the sandbox service answered without a run_result", duration_s)
        # Only compiled languages get here: the build failed, so nothing ran.
        stdout, out_cut = _capped(built.stdout or "", limits.output_cap_bytes)
        stderr, err_cut = _capped(built.stderr or "", limits.output_cap_bytes)
        return ExecResult(
            ExecStatus.ERROR, built.return_code, stdout, stderr, duration_s, "compilation failed",
            out_cut, err_cut,
        )  # fmt: skip
    stdout, out_cut = _capped(run.stdout or "", limits.output_cap_bytes)
    stderr, err_cut = _capped(run.stderr or "", limits.output_cap_bytes)
    if run.status is CommandRunStatus.TIME_LIMIT_EXCEEDED:
        status, reason = ExecStatus.TIMEOUT, f"wall-clock limit of {limits.timeout_s:g} s exceeded"
        if tagged is ExecStatus.TIMEOUT:
            reason = text
    elif tagged is not None and tagged is not ExecStatus.OK:
        status, reason = tagged, text
    elif run.return_code is None:
        reason = "the sandbox service reported a finished run without a return code"
        return ExecResult.sandbox_error(reason, duration_s)
    else:
        status, reason = classify_exit(run.return_code, run.stderr or "")
    fields = {"stdout_truncated": out_cut, "stderr_truncated": err_cut}
    return ExecResult(status, run.return_code, stdout, stderr, duration_s, reason, **fields)


# -- the backend -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteOptions:
    """Options of the `remote` backend."""

    url: str = "http://127.0.0.1:8080"
    """Base URL of the service; requests go to `{url}/run_code`. A URL already ending in /run_code is
    taken as the endpoint itself (the form verl's `sandbox_fusion_url` uses)."""
    request_timeout_slack_s: float = 10.0
    """Seconds an HTTP request may take beyond the run's own timeout (queueing at the service, transfer);
    past `run timeout + slack` the run is reported as a sandbox error, not retried."""
    connect_timeout_s: float = 5.0
    """Seconds to establish a connection before the attempt counts as failed."""
    retries: int = 2
    """Further attempts after a connection failure or an HTTP 429/5xx answer (0: try once)."""
    backoff_s: float = 0.5
    """Wait before the first retry; it doubles for each further retry."""
    max_connections: int = 64
    """HTTP connections open at once; more runs wait for a free one (their timeouts start after)."""
    max_response_bytes: int = 128 * 1024 * 1024
    """Largest answer read; a bigger one is a sandbox error rather than a memory blow-up."""

    def __post_init__(self) -> None:
        try:
            parsed = httpx.URL(self.url)
        except httpx.InvalidURL as error:
            raise ValueError(f"RemoteOptions.url={self.url!r} is not a URL: {error}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"RemoteOptions.url must be http(s)://host[:port][/path], got {self.url!r}")
        checks = [
            ("request_timeout_slack_s", 0 <= self.request_timeout_slack_s <= 3600),
            ("connect_timeout_s", 0 < self.connect_timeout_s <= 600),
            ("retries", 0 <= self.retries <= 100),
            ("backoff_s", 0 <= self.backoff_s <= 600),
            ("max_connections", 1 <= self.max_connections <= 100_000),
            ("max_response_bytes", self.max_response_bytes >= 1024),
        ]
        for name, ok in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not ok or not math.isfinite(value):
                raise ValueError(f"RemoteOptions.{name}={value!r} is out of range")

    @property
    def endpoint(self) -> str:
        """The full URL of `/run_code`."""
        base = self.url.rstrip("/")
        return base if base.endswith("/run_code") else f"{base}/run_code"


_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


def _stdin_text(stdin: bytes) -> str:
    try:
        return stdin.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SandboxUsageError(
            f"the remote backend sends stdin as text (SandboxFusion's `stdin` is a string): {error}"
        ) from None


class RemoteBackend:
    """Runs code on a SandboxFusion-compatible service over HTTP.

    Every failure of the service or the network (refused connection, timeout, HTTP error, an answer
    that is not a SandboxFusion response) comes back as an `ExecResult` with status `sandbox_error`
    and a reason; nothing waits longer than the run's timeout plus the slack, per attempt.
    """

    name = "remote"

    def __init__(self, options: RemoteOptions | None = None) -> None:
        self.options = options or RemoteOptions()
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None
        self._closed = False

    def _connection(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        # Built on first use so that the client's sockets belong to the loop that runs the requests.
        if self._client is None or self._slots is None:
            limit = self.options.max_connections
            pool = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
            self._client = httpx.AsyncClient(limits=pool)
            self._slots = asyncio.Semaphore(limit)
        return self._client, self._slots

    async def run(self, request: ExecRequest) -> ExecResult:
        """POST one run to the service and map its answer."""
        started = time.monotonic()
        body = _wire_request(request, request.code, request.limits.timeout_s)
        answer = await self.call(body, request.limits.timeout_s)
        duration = time.monotonic() - started
        if isinstance(answer, str):
            return ExecResult.sandbox_error(answer, duration)
        return result_from_response(answer, request.limits, duration)

    async def call(self, body: dict[str, Any], run_timeout_s: float) -> RunCodeResponse | str:
        """POST `body` to /run_code with retries; the parsed answer, or why there is none."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        client, slots = self._connection()
        options = self.options
        deadline = options.connect_timeout_s + run_timeout_s + options.request_timeout_slack_s
        per_read = run_timeout_s + options.request_timeout_slack_s
        budget = httpx.Timeout(per_read, connect=options.connect_timeout_s)
        failure = ""
        for attempt in range(options.retries + 1):
            if attempt:
                await asyncio.sleep(options.backoff_s * 2 ** (attempt - 1))
            async with slots:
                try:
                    async with asyncio.timeout(deadline):
                        status, content = await self._post(client, body, budget)
                except (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as error:
                    failure = f"cannot reach the sandbox service at {options.endpoint}: {_describe(error)}"
                    continue
                except (TimeoutError, httpx.TimeoutException):
                    return f"the sandbox service at {options.endpoint} gave no answer within {deadline:g} s"
                except httpx.HTTPError as error:
                    return f"request to the sandbox service at {options.endpoint} failed: {_describe(error)}"
            if content is None:
                return f"the sandbox service answered more than {options.max_response_bytes} bytes"
            snippet = content[:500].decode("utf-8", errors="replace")
            if status in _RETRY_STATUS:
                failure = f"the sandbox service at {options.endpoint} answered HTTP {status}: {snippet}"
                continue
            if status != 200:
                return f"the sandbox service refused the request (HTTP {status}): {snippet}"
            try:
                return RunCodeResponse.model_validate_json(content)
            except pydantic.ValidationError as error:
                return f"the sandbox service's answer is not a SandboxFusion response: {_brief(error)}"
        return f"{failure} (gave up after {options.retries + 1} attempts)"

    async def _post(
        self, client: httpx.AsyncClient, body: dict[str, Any], budget: httpx.Timeout
    ) -> tuple[int, bytes | None]:
        """Status and body of one POST; body None when it exceeded `max_response_bytes`."""
        cap = self.options.max_response_bytes
        async with client.stream("POST", self.options.endpoint, json=body, timeout=budget) as response:
            content = bytearray()
            async for chunk in response.aiter_bytes():
                content += chunk
                if len(content) > cap:
                    return response.status_code, None
            return response.status_code, bytes(content)

    async def open_session(self, limits: Limits) -> RemoteSession:
        """A replaying session (see `RemoteSession`); it opens no connection of its own."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        return RemoteSession(self, limits)

    async def aclose(self) -> None:
        """Close the HTTP client. Idempotent."""
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


def _wire_request(request: ExecRequest, code: str, run_timeout_s: float) -> dict[str, Any]:
    for what, text in [("code", code), *((f"file path {path!r}", path) for path in request.files)]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # lone surrogates: JSON could carry them, no program can
            raise SandboxUsageError(f"{what} is not valid Unicode text: {error}") from None
    wire = {
        "code": code,
        "language": request.language,
        "run_timeout": run_timeout_s,
        "compile_timeout": run_timeout_s,
        "memory_limit_MB": request.limits.memory_mb,
        "stdin": _stdin_text(request.stdin),
        "files": {path: base64.b64encode(data).decode() for path, data in request.files.items()},
        "fetch_files": [],
    }
    # Validating our own body catches a drift from the schema here rather than as an HTTP 422 there.
    return RunCodeRequest.model_validate(wire).model_dump(mode="json", by_alias=True)


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _brief(error: pydantic.ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors()[:5])


# -- sessions by replay ----------------------------------------------------------------------------------

_DRIVER_GRACE_S = 5.0
"""Seconds the replaying program gets beyond its cells' alarms (interpreter start, reading results)."""

# The program that one session call runs on the service. Standard library only (any CPython 3.8+);
# it must not import the project. JOB is a base64 JSON object filled in per call.
_DRIVER = r"""
import ast, base64, io, json, linecache, os, signal, sys, tempfile, time, traceback, types

JOB = "@JOB@"


class CellTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise CellTimeout()


def run_cell(code, module, number):
    filename = "<cell %d>" % number
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec", dont_inherit=True), module.__dict__)
    if last is not None:
        value = eval(compile(last, filename, "eval", dont_inherit=True), module.__dict__)
        if value is not None:
            print(repr(value))


def attempt(code, module, number, seconds):
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        run_cell(code, module, number)
        return "ok", 0, None
    except CellTimeout:
        return "timeout", None, None
    except SystemExit as error:
        if error.code is None or isinstance(error.code, int):
            exit_code = error.code or 0
        else:
            print(error.code, file=sys.stderr)
            exit_code = 1
        return ("ok" if exit_code == 0 else "error"), exit_code, None
    except MemoryError as error:
        return "memory", 1, error
    except BaseException as error:
        return "error", 1, error
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def guarded(code, module, number, seconds):
    try:
        return attempt(code, module, number, seconds)
    except CellTimeout:  # the alarm fired between the cell's end and disarming it
        return "timeout", None, None


def print_cell_exception(error):
    trace = error.__traceback__
    while trace is not None and not trace.tb_frame.f_code.co_filename.startswith("<cell "):
        trace = trace.tb_next
    traceback.print_exception(type(error), error, trace)


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass


def point(out_fd, err_fd):
    flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def head(path, cap):
    with open(path, "rb") as handle:
        return handle.read(cap), os.fstat(handle.fileno()).st_size


def main():
    job = json.loads(base64.b64decode(JOB))
    module = types.ModuleType("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    signal.signal(signal.SIGALRM, on_alarm)
    real_out, real_err = os.dup(1), os.dup(2)
    real_stdin = sys.stdin
    devnull = os.open(os.devnull, os.O_WRONLY)

    def report(status, out=b"", err=b""):
        point(real_out, real_err)
        write_all(1, (job["nonce"] + " " + json.dumps(status) + "\n").encode() + out)
        write_all(2, err)

    for number, cell in enumerate(job["history"], 1):
        point(devnull, devnull)
        sys.stdin = io.TextIOWrapper(io.BytesIO(base64.b64decode(cell["stdin"])))
        kind, exit_code, error = guarded(cell["code"], module, number, cell["alarm_s"])
        if kind != "ok":
            detail = kind if error is None else "%s: %s" % (type(error).__name__, error)
            report({"kind": "replay_failed", "cell": number, "detail": detail[:500]})
            return
    sys.stdin = real_stdin
    work = tempfile.mkdtemp(prefix="pacerl-cell-")
    out_path, err_path = os.path.join(work, "out"), os.path.join(work, "err")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    point(os.open(out_path, flags, 0o600), os.open(err_path, flags, 0o600))
    started = time.monotonic()
    kind, exit_code, error = guarded(job["code"], module, len(job["history"]) + 1, job["timeout_s"])
    if error is not None:
        print_cell_exception(error)
    elapsed = time.monotonic() - started
    flush()
    out, out_total = head(out_path, job["cap"])
    err, err_total = head(err_path, job["cap"])
    status = {"kind": kind, "exit_code": exit_code, "elapsed": elapsed}
    status.update(stdout_total=out_total, stderr_total=err_total)
    report(status, out, err)


main()
"""


@dataclass(frozen=True)
class _Cell:
    code: str
    stdin: bytes
    alarm_s: float
    """The cell's timeout for its replays: a little above what it took, at most its original limit."""


class RemoteSession:
    """A notebook-like session emulated over a stateless service by replay.

    Each call sends one program that re-runs, in order and with their output discarded, every earlier
    cell of this session that ended `ok`, and then runs the new cell (its trailing expression printed,
    as in a notebook). So:

    - cost: call N re-executes the N-1 successful cells before it; time and CPU grow with history.
      The whole program runs under the service's `run_timeout` (capped by the service), so a long
      history can push a cell past it. Each replayed cell gets an alarm a little above its first
      run time; a replay that takes much longer is reported rather than waited for.
    - side effects repeat: files written, stdin read, randomness drawn and time measured happen again
      on every later call. A replayed cell that raises (it behaved differently this time) ends the
      call with `sandbox_error`, and that cell and all after it are dropped from the history.
    - only cells that ended `ok` are kept: the partial effects of a failed or timed-out cell are lost,
      unlike a live interpreter.
    """

    def __init__(self, backend: RemoteBackend, limits: Limits) -> None:
        self._backend = backend
        self.limits = limits
        self._history: list[_Cell] = []
        self._lock = asyncio.Lock()

    async def run(self, request: ExecRequest) -> ExecResult:
        """Replay the history, then run `request.code` as the next cell."""
        if request.language != "python":
            raise ValueError("sessions run python only")
        if request.files:
            raise ValueError("sessions take no files; write them from the code")
        async with self._lock:
            return await self._run(request)

    async def _run(self, request: ExecRequest) -> ExecResult:
        limits = request.limits
        started = time.monotonic()
        nonce = secrets.token_hex(16)
        job = {
            "nonce": nonce,
            "code": request.code,
            "timeout_s": limits.timeout_s,
            "cap": limits.output_cap_bytes,
            "history": [
                {"code": c.code, "stdin": base64.b64encode(c.stdin).decode(), "alarm_s": c.alarm_s}
                for c in self._history
            ],
        }
        program = _DRIVER.replace("@JOB@", base64.b64encode(json.dumps(job).encode()).decode())
        if len(program.encode("utf-8", errors="surrogatepass")) > MAX_CODE_BYTES:
            return ExecResult.sandbox_error(
                f"the session's history no longer fits one {MAX_CODE_BYTES}-byte request; reset the session"
            )
        run_timeout = _DRIVER_GRACE_S + sum(c.alarm_s for c in self._history) + limits.timeout_s
        answer = await self._backend.call(_wire_request(request, program, run_timeout), run_timeout)
        duration = time.monotonic() - started
        if isinstance(answer, str):
            return ExecResult.sandbox_error(answer, duration)
        report = _driver_report(answer, nonce)
        if report is None:
            return _unreported(answer, limits, duration)
        status, stdout, stderr = report
        if status["kind"] == "replay_failed":
            number = int(status["cell"])
            dropped = len(self._history) - number + 1
            del self._history[number - 1 :]
            return ExecResult.sandbox_error(
                f"the session could not be rebuilt: replaying cell {number} failed ({status['detail']}); "
                f"it and the {dropped - 1} cell(s) after it were dropped from the session, so what they "
                "defined is gone; the new cell did not run",
                duration,
            )
        result = _cell_result(status, stdout, stderr, limits, duration)
        if result.ok:
            alarm = min(limits.timeout_s, 2 * float(status["elapsed"]) + 1.0)
            self._history.append(_Cell(request.code, request.stdin, alarm))
        return result

    async def reset(self) -> None:
        """Forget every cell: the next call starts from an empty namespace."""
        async with self._lock:
            self._history.clear()

    async def aclose(self) -> None:
        """Drop the history. Idempotent (there is nothing remote to release)."""
        await self.reset()


def _driver_report(answer: RunCodeResponse, nonce: str) -> tuple[dict[str, Any], str, str] | None:
    """The driver's status line and the cell's output, or None when the driver never reported."""
    run = answer.run_result
    if answer.status is RunStatus.SANDBOX_ERROR or run is None:
        return None
    first, newline, stdout = (run.stdout or "").partition("\n")
    prefix = nonce + " "
    if not newline or not first.startswith(prefix):
        return None
    try:
        status = json.loads(first[len(prefix) :])
    except json.JSONDecodeError:
        return None
    return (status, stdout, run.stderr or "") if isinstance(status, dict) else None


def _unreported(answer: RunCodeResponse, limits: Limits, duration: float) -> ExecResult:
    """The program died before its report (killed at the service's limit, or the service failed)."""
    result = result_from_response(answer, limits, duration)
    if result.status is ExecStatus.SANDBOX_ERROR:
        return result
    if result.status is ExecStatus.OK:
        return ExecResult.sandbox_error("the session program ended without reporting its cell", duration)
    note = "; the whole replay was stopped, so the cell was not kept"
    return ExecResult(
        result.status, result.exit_code, result.stdout, result.stderr, duration, result.reason + note,
        result.stdout_truncated, result.stderr_truncated,
    )  # fmt: skip


def _cell_result(
    status: dict[str, Any], stdout: str, stderr: str, limits: Limits, duration: float
) -> ExecResult:
    out, out_cut = _capped(stdout, limits.output_cap_bytes, int(status["stdout_total"]))
    err, err_cut = _capped(stderr, limits.output_cap_bytes, int(status["stderr_total"]))
    exit_code = status["exit_code"] if isinstance(status["exit_code"], int) else None
    total = int(status["stdout_total"]) + int(status["stderr_total"])
    verdict, reason = cell_verdict(str(status["kind"]), exit_code, total, limits)
    return ExecResult(verdict, exit_code, out, err, duration, reason, out_cut, err_cut)
