"""Isolated code execution with enforced limits: local namespaces, Docker, or a remote service.

    from sandbox import Sandbox, Limits
    with Sandbox("local") as box:
        result = box.run("print(6 * 7)", limits=Limits(timeout_s=2))
        result.status, result.stdout      # (ExecStatus.OK, '42\\n')

This package imports nothing else of the project.
"""

from sandbox.core import BACKENDS, Sandbox, Session
from sandbox.limits import Limits
from sandbox.request import LANGUAGES, ExecRequest, SandboxUsageError
from sandbox.result import ExecResult, ExecStatus

__all__ = [
    "BACKENDS",
    "LANGUAGES",
    "ExecRequest",
    "ExecResult",
    "ExecStatus",
    "Limits",
    "Sandbox",
    "SandboxUsageError",
    "Session",
]
