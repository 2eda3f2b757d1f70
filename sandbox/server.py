"""A SandboxFusion-compatible HTTP server in front of any `Sandbox` (`pacerl serve sandbox`).

Clients written for bytedance/SandboxFusion (verl's sandbox_fusion reward and tool, SandboxFusion's
own SDK, plain `curl`) work unchanged. The request and response shapes, field names, defaults and
status strings follow these files of github.com/bytedance/SandboxFusion (the models themselves live
in sandbox.remote, shared with the client):

- `sandbox/server/sandbox_api.py`: `POST /run_code`, `RunCodeRequest`, `RunCodeResponse`, `RunStatus`
  and `parse_run_status`, whose verdicts are mapped here as follows.
- `sandbox/runners/types.py`: `CommandRunStatus`, `CommandRunResult`, `Language`.
- `sandbox/runners/base.py`: time-limit results carry no return code; `memory_limit_MB <= 0` means the
  default; file entries with null content are skipped.
- `sandbox/server/server.py`: `GET /v1/ping` answers "pong"; any other path FastAPI's HTTP 404
  `{"detail": "Not Found"}` (405 for a wrong method), as here.

ExecStatus -> SandboxFusion (`status` / `run_result.status` / `return_code`; `message` is empty for
`ok`, else `[our status] our reason`, which sandbox.remote reads back):

    ok             Success / Finished / 0
    error          Failed / Finished / the exit code (-N: killed by signal N)
    timeout        Failed / TimeLimitExceeded / null
    memory         Failed / Finished / the exit code    (SandboxFusion has no memory verdict)
    output_limit   Failed / Finished / null             (nor an output cap; the process was killed)
    sandbox_error  SandboxError / Error / null

Requests:

- `run_timeout` becomes `Limits.timeout_s` and `memory_limit_MB` `Limits.memory_mb`, each honoured up
  to the server's `RequestMaxima` (`--max-timeout`, `--max-memory-mb`). A request that leaves a field
  out (or sends `memory_limit_MB` <= 0, SandboxFusion's "default") gets the server's own `Limits`
  (`--timeout`, `--memory-mb`). Above the maximum the request is capped and the answer carries
  `capped: [{"limit", "requested", "applied"}]`, a field present only then (SandboxFusion's clients
  ignore fields they do not know). The other limits are the server's. `compile_timeout` is accepted
  and unused (python and bash compile nothing).
- A language outside SandboxFusion's list is invalid: HTTP 422, as SandboxFusion answers (its official
  client refuses such a request before sending it). A language on the list that this server does not
  run (cpp, java, ...) is answered as SandboxFusion answers a language whose toolchain its image lacks:
  HTTP 200, status `Failed`, here with no `run_result` (nothing ran) and a `message` naming the
  supported languages. Not `SandboxError` and not a 4xx: the official client (`sandbox-fusion`) raises
  on both and retries whatever it raised, five times with exponential backoff for `run_code`, so a
  request that can never succeed would take half a minute to fail. Non-empty `fetch_files` are
  answered the same way: the sandbox returns no files. `POST /run_jupyter` (which the client retries
  three times) likewise answers 200 `Failed` with a message: this server runs no Jupyter kernel.
- Anything malformed (not JSON, missing or mistyped fields, NUL bytes, code over the size cap, bad
  base64, paths leaving the work directory, text with lone surrogates) is HTTP 422 with `detail`
  (FastAPI's 400 for a body its JSON parser gives up on, e.g. nested too deep). Never a 500: an
  unexpected failure while running is a `SandboxError` answer, as SandboxFusion gives.

At most `max_concurrency` runs execute at once; more wait in arrival order. With `max_queue` set, a
request that would make the queue longer is answered HTTP 503 with `Retry-After` at once.

Hostile clients meet the limits of `pacerl.sandbox.http_guard` (`GUARD` by default, `pacerl serve sandbox
--help` lists them): a body over `max_body_bytes` is HTTP 413 (at once when its Content-Length says
so), a malformed Content-Length 400, a body not in within the body timeout 408; bodies wait for room
in a shared byte budget before they are read and hold it until answered (503 past the wait queue);
connections that do not finish their headers in time are closed, headers over the cap are 431, and
past the connection cap the connection waiting longest for a request is closed.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pacerl.sandbox.core import Sandbox
from pacerl.sandbox.fusion_schema import (
    CommandRunResult,
    CommandRunStatus,
    LimitCap,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterResponse,
    RunStatus,
    status_message,
)
from pacerl.sandbox.http_guard import MIB, Gate, HttpGuardConfig, budget_report, guard_app, run_server
from pacerl.sandbox.limits import Limits, RequestMaxima
from pacerl.sandbox.request import (
    LANGUAGES,
    MAX_CODE_BYTES,
    MAX_FILES_BYTES,
    MAX_STDIN_BYTES,
    ExecRequest,
    SandboxUsageError,
)
from pacerl.sandbox.result import ExecResult, ExecStatus

logger = logging.getLogger(__name__)
_uvicorn_log = logging.getLogger("uvicorn.error")
"""Lifecycle lines go where uvicorn writes its own, which `serve` configures to show."""

MAX_BODY_BYTES = 2 * MAX_CODE_BYTES + 2 * MAX_STDIN_BYTES + 2 * MAX_FILES_BYTES
"""Largest request body read: room for every input at its cap, base64 and JSON escaping included."""
GUARD = HttpGuardConfig(max_body_bytes=MAX_BODY_BYTES, body_budget_bytes=128 * MIB)
"""The server's HTTP limits by default. The budget holds one body at the cap with room to spare for
small requests beside it; measured, the server holds about 7 times the bytes of the bodies it is
answering (JSON parsing, base64 decoding, the copies handed to the sandbox), so about 0.9 GB at most."""
MAXIMA = RequestMaxima()
"""The most a request may ask for by default (`--max-timeout`, `--max-memory-mb`)."""


def _validation_detail(error: RequestValidationError) -> list[dict[str, Any]]:
    # FastAPI's default echoes each bad input back, which for a megabyte of code is a megabyte of error.
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in error.errors()]


def _refusal(message: str) -> RunCodeResponse:
    """A valid SandboxFusion request this server can never carry out: `Failed`, which no client retries."""
    return RunCodeResponse(status=RunStatus.FAILED, message=message)


def _sandbox_failure(message: str) -> RunCodeResponse:
    """A run the sandbox failed to carry out this time; clients may retry it."""
    return RunCodeResponse(status=RunStatus.SANDBOX_ERROR, message=message)


def fusion_response(result: ExecResult) -> RunCodeResponse:
    """Our ExecResult in SandboxFusion's terms (the table in the module docstring)."""
    run_status = CommandRunStatus.FINISHED
    return_code = result.exit_code
    verdict = RunStatus.FAILED
    if result.status is ExecStatus.OK:
        verdict = RunStatus.SUCCESS
    elif result.status is ExecStatus.TIMEOUT:
        run_status, return_code = CommandRunStatus.TIME_LIMIT_EXCEEDED, None
    elif result.status is ExecStatus.SANDBOX_ERROR:
        verdict, run_status, return_code = RunStatus.SANDBOX_ERROR, CommandRunStatus.ERROR, None
    run = CommandRunResult(
        status=run_status,
        execution_time=result.duration_s,
        return_code=return_code,
        stdout=result.stdout,
        stderr=result.stderr,
    )
    return RunCodeResponse(status=verdict, message=status_message(result), run_result=run)


def _decode_files(files: dict[str, str | None]) -> dict[str, bytes]:
    decoded: dict[str, bytes] = {}
    for path, content in files.items():
        if content is None:
            continue
        try:
            decoded[path] = base64.b64decode(content, validate=True)
        except binascii.Error as error:
            raise fastapi.HTTPException(422, f"files[{path!r}] is not valid base64: {error}") from None
    return decoded


def _check_text(what: str, text: str) -> bytes:
    # JSON may carry lone surrogates ("\\ud800"); no program, path or pipe can take them.
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise fastapi.HTTPException(422, f"{what} is not valid Unicode text: {error}") from None


def request_limits(
    body: RunCodeRequest, defaults: Limits, maxima: RequestMaxima
) -> tuple[Limits, list[LimitCap]]:
    """The limits a request runs under, and the caps applied to what it asked for (in the answer)."""
    caps: list[LimitCap] = []
    timeout = defaults.timeout_s
    if "run_timeout" in body.model_fields_set:
        timeout = min(body.run_timeout, maxima.timeout_s)
        if body.run_timeout > maxima.timeout_s:
            caps.append(LimitCap(limit="run_timeout", requested=body.run_timeout, applied=timeout))
    memory = defaults.memory_mb
    if body.memory_limit_mb > 0:
        memory = min(body.memory_limit_mb, maxima.memory_mb)
        if body.memory_limit_mb > maxima.memory_mb:
            caps.append(LimitCap(limit="memory_limit_MB", requested=body.memory_limit_mb, applied=memory))
    try:
        return defaults.replace(timeout_s=timeout, memory_mb=memory), caps
    except ValueError as error:
        raise fastapi.HTTPException(422, f"{error} (memory_limit_MB must be -1 or >= 32)") from None


def _answer(response: RunCodeResponse) -> JSONResponse:
    # `capped` only when set, so an uncapped answer has exactly SandboxFusion's keys.
    exclude = {"capped"} if response.capped is None else None
    return JSONResponse(response.model_dump(mode="json", exclude=exclude))


def create_app(
    sandbox: Sandbox,
    max_concurrency: int,
    *,
    max_queue: int | None = None,
    guard: HttpGuardConfig = GUARD,
    close_on_shutdown: bool = False,
    maxima: RequestMaxima = MAXIMA,
) -> fastapi.FastAPI:
    """The ASGI app serving `sandbox`: `pacerl.sandbox.limits` are what a request gets when it asks for
    nothing, `maxima` the most it may ask for (ValueError when a default is above its maximum).

    With `close_on_shutdown` the app owns the sandbox and closes it when the server shuts down.
    """
    maxima.check(sandbox.limits)
    gate = Gate(max_concurrency, max_queue, "runs")

    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_on_shutdown:
                # Here and not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once
                # it has shut down, and the process ends before any code after it would run.
                await sandbox.aclose()
                _uvicorn_log.info("Closed the %s sandbox", sandbox.backend_name)

    app = fastapi.FastAPI(
        title="pacerl sandbox",
        summary="A SandboxFusion-compatible /run_code service",
        description=__doc__,
        lifespan=lifespan,
    )
    budget = guard_app(app, guard)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: fastapi.Request, error: RequestValidationError) -> JSONResponse:
        detail = _validation_detail(error)
        content_type = request.headers.get("content-type", "")
        if "json" not in content_type:
            # FastAPI reads a body of any other type as a string, and says only "not a dictionary".
            hint = f"the body must be JSON sent with Content-Type: application/json (got {content_type!r})"
            detail.insert(0, {"loc": ["header", "content-type"], "msg": hint, "type": "content_type"})
        return JSONResponse({"detail": detail}, status_code=422)

    @app.post("/run_code", response_model=RunCodeResponse, tags=["sandbox"])
    async def run_code(body: RunCodeRequest) -> JSONResponse:
        """Run one program; HTTP 200 whatever the program did (see the module docstring)."""
        if body.language not in LANGUAGES:
            supported = ", ".join(LANGUAGES)
            return _answer(
                _refusal(
                    f"language {body.language!r} is not supported by this server; supported: {supported}"
                )
            )
        if body.fetch_files:
            return _answer(
                _refusal("fetch_files is not supported by this server: the sandbox returns no files")
            )
        _check_text("code", body.code)
        for path in body.files:
            _check_text(f"file path {path!r}", path)
        files = _decode_files(body.files)
        stdin = _check_text("stdin", body.stdin or "")
        limits, caps = request_limits(body, sandbox.limits, maxima)
        try:
            # Validate now, so a request that can never run is refused without waiting for a slot.
            ExecRequest.build(body.code, body.language, stdin, files, limits)
        except SandboxUsageError as error:
            raise fastapi.HTTPException(422, str(error)) from None
        async with gate.slot():
            try:
                result = await sandbox.arun(body.code, body.language, stdin, files, limits)
            except Exception as error:  # the client gets SandboxError, as from SandboxFusion; logged here
                logger.exception("run failed inside the sandbox server")
                return _answer(_sandbox_failure(f"the sandbox failed: {type(error).__name__}: {error}"))
        response = fusion_response(result)
        if caps:
            response.capped = caps
        return _answer(response)

    @app.post("/run_jupyter", response_model=RunJupyterResponse, tags=["sandbox"])
    async def run_jupyter() -> RunJupyterResponse:
        """Not served: `Failed` at once with a message (see the module docstring); the body is not read."""
        return RunJupyterResponse(
            status=RunStatus.FAILED,
            message="run_jupyter is not supported by this server (no Jupyter kernel): use POST /run_code",
        )

    @app.get("/v1/ping", tags=["health"])
    async def ping() -> str:
        """Liveness, as SandboxFusion answers it."""
        return "pong"

    @app.get("/health", tags=["health"])
    async def health() -> dict[str, Any]:
        """Liveness plus what this server runs and how busy it is."""
        return {
            "status": "ok",
            "backend": sandbox.backend_name,
            "languages": list(LANGUAGES),
            "limits": {
                "run_timeout": {"default": sandbox.limits.timeout_s, "max": maxima.timeout_s},
                "memory_limit_MB": {"default": sandbox.limits.memory_mb, "max": maxima.memory_mb},
            },
            "max_concurrency": gate.limit,
            "running": gate.running,
            "waiting": gate.waiting,
            "bodies": budget_report(budget),
        }

    return app


def serve(
    backend: str,
    host: str,
    port: int,
    max_concurrency: int,
    limits: Limits,
    options: dict[str, object],
    max_queue: int | None = None,
    guard: HttpGuardConfig = GUARD,
    maxima: RequestMaxima = MAXIMA,
) -> None:
    """Run the server until SIGINT/SIGTERM, then close the sandbox (warm sandboxes and all).

    As uvicorn does, a SIGTERM is re-raised after the graceful shutdown, so the process ends by it.
    """
    maxima.check(limits)  # before any sandbox starts
    sandbox = Sandbox(backend, limits=limits, **options)
    try:
        app = create_app(
            sandbox, max_concurrency, max_queue=max_queue, guard=guard, close_on_shutdown=True, maxima=maxima
        )
        run_server(app, host, port, guard, log_level="info")
    finally:
        sandbox.close()  # when startup failed before the app's shutdown could run; idempotent
