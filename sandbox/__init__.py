"""Isolated code execution with enforced limits: local namespaces, Docker, or a remote service.

    from pacerl.sandbox import Sandbox, Limits
    with Sandbox("local") as box:
        result = box.run("print(6 * 7)", limits=Limits(timeout_s=2))
        result.status, result.stdout      # (ExecStatus.OK, '42\\n')

This package imports nothing else of the project.
"""

from pacerl.sandbox.core import BACKENDS, Sandbox, Session
from pacerl.sandbox.limits import Limits
from pacerl.sandbox.request import LANGUAGES, ExecRequest, SandboxUsageError
from pacerl.sandbox.result import ExecResult, ExecStatus

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
