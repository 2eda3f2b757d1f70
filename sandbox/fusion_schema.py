"""SandboxFusion's `/run_code` wire schema, shared by the client (sandbox.remote) and the server
(sandbox.server).

Field names, types, defaults and status strings follow github.com/bytedance/SandboxFusion:
`sandbox/server/sandbox_api.py` (`RunCodeRequest`, `RunStatus`, `RunCodeResponse`) and
`sandbox/runners/types.py` (`CommandRunStatus`, `CommandRunResult`, the `Language` names).
"""

from __future__ import annotations

import enum
import re
from typing import Literal

from pydantic import BaseModel, Field

from pacerl.sandbox.result import ExecResult, ExecStatus

# ---------------------------------------------------------------------

SandboxFusionLanguage = Literal[
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
    "python2", "gtest", "react",
]  # fmt: skip
"""Every `language` SandboxFusion's server or its official client (`sandbox-fusion`) accepts; anything
else is a validation error (HTTP 422), as there. The last three are in the client's list only: the
server answers them 422, which the client retries; here they are refused once, as any language this
server does not run."""


class CommandRunStatus(enum.StrEnum):
    """How one command (compile or run) ended, in SandboxFusion's words."""

    FINISHED = "Finished"
    """The process exited by itself; `return_code` says how."""
    ERROR = "Error"
    """The sandbox could not run the command at all."""
    TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"
    """Killed at `run_timeout`; no return code."""


class RunStatus(enum.StrEnum):
    """The overall verdict of a `/run_code` request."""

    SUCCESS = "Success"
    """Every command finished with return code 0."""
    FAILED = "Failed"
    """A command exited non-zero or hit its time limit: the code's fault."""
    SANDBOX_ERROR = "SandboxError"
    """The service could not carry the request out; `message` says why."""


class CommandRunResult(BaseModel):
    """One command's outcome (`compile_result` or `run_result`)."""

    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeRequest(BaseModel):
    """The body of `POST /run_code`."""

    compile_timeout: float = Field(10, description="compile timeout for compiled languages (unused here)")
    run_timeout: float = Field(10, gt=0, allow_inf_nan=False, description="wall-clock seconds of the run")
    # SandboxFusion spells this field in mixed case; the JSON keeps theirs, Python gets snake case.
    memory_limit_mb: int = Field(-1, alias="memory_limit_MB", description="MiB; -1 means the default")
    code: str = Field(description="the code to run")
    stdin: str | None = Field(None, description="text passed to the program's standard input")
    language: SandboxFusionLanguage = Field(description="the language of `code`")
    files: dict[str, str | None] = Field({}, description="path -> base64 content; null entries skipped")
    fetch_files: list[str] = Field([], description="paths to return after the run (not supported here)")


class LimitCap(BaseModel):
    """A limit a request asked for above the server's maximum, and what it got instead."""

    limit: Literal["run_timeout", "memory_limit_MB"]
    """The request field, as SandboxFusion spells it."""
    requested: float
    applied: float


class RunCodeResponse(BaseModel):
    """The body of a `POST /run_code` answer (HTTP 200 whatever the verdict)."""

    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}
    capped: list[LimitCap] | None = None
    """pacerl's own field, present only when a requested limit was capped (SandboxFusion's clients
    ignore fields they do not know); absent otherwise, so the answer is SandboxFusion's exact shape."""


class RunJupyterResponse(BaseModel):
    """The body of a `POST /run_jupyter` answer (SandboxFusion's `RunJupyterResponse`)."""

    status: RunStatus
    message: str
    driver: CommandRunResult | None = None
    cells: list[dict[str, object]] = []
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


_TAG = re.compile(r"\[([a-z_]+)\] (.*)", re.DOTALL)


def status_message(result: ExecResult) -> str:
    """`message` for a result: empty when ok, else `[status] reason`.

    SandboxFusion has no words for a memory or output-limit kill (both are `Failed`); the tag keeps our
    status readable by a pacerl client while staying a plain message for any other client.
    """
    if result.ok:
        return ""
    return f"[{result.status.value}] {result.reason}"


def parse_status_message(message: str) -> tuple[ExecStatus | None, str]:
    """The inverse of `status_message`: (tagged status or None, the reason text)."""
    match = _TAG.fullmatch(message)
    if match is None:
        return None, message
    try:
        return ExecStatus(match[1]), match[2]
    except ValueError:  # a bracketed word that is not one of ours: an ordinary message
        return None, message
