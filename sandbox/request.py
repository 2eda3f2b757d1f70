"""One validated execution request: misuse of the API fails here, before any process starts."""

from __future__ import annotations

import base64
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sandbox.limits import Limits

LANGUAGES = ("python", "bash")
"""Languages every backend runs. `python` is CPython 3 from the sandbox's root; `bash` is /bin/bash."""

MAX_CODE_BYTES = 1024 * 1024
MAX_STDIN_BYTES = 16 * 1024 * 1024
MAX_FILES_BYTES = 32 * 1024 * 1024
MAX_FILES = 256


class SandboxUsageError(ValueError):
    """The caller passed something the sandbox refuses (wrong type, NUL byte, too large, unknown language)."""


@dataclass(frozen=True)
class ExecRequest:
    """Code plus everything it runs with. Build it with `ExecRequest.build`, which validates."""

    code: str
    """Source text of the program."""
    language: str
    """One of `LANGUAGES`."""
    stdin: bytes = b""
    """Bytes the program reads from standard input."""
    files: Mapping[str, bytes] = field(default_factory=dict)
    """Files written into the work directory before the code runs: relative path -> content."""
    limits: Limits = field(default_factory=Limits)
    """Resource limits of this run."""

    @classmethod
    def build(
        cls,
        code: object,
        language: object = "python",
        stdin: object = None,
        files: object = None,
        limits: object = None,
    ) -> ExecRequest:
        """Validate loosely typed input (from users, servers or models' tool calls) into a request."""
        if not isinstance(code, str):
            raise SandboxUsageError(f"code must be str, got {type(code).__name__}")
        if "\x00" in code:
            raise SandboxUsageError("code contains a NUL byte")
        if len(code.encode("utf-8", errors="surrogatepass")) > MAX_CODE_BYTES:
            raise SandboxUsageError(f"code is larger than the {MAX_CODE_BYTES}-byte cap")
        if not isinstance(language, str) or language not in LANGUAGES:
            raise SandboxUsageError(f"unknown language {language!r}; supported: {', '.join(LANGUAGES)}")
        if limits is None:
            limits = Limits()
        if not isinstance(limits, Limits):
            raise SandboxUsageError(f"limits must be a sandbox.Limits, got {type(limits).__name__}")
        return cls(code, language, _as_bytes("stdin", stdin, MAX_STDIN_BYTES), _check_files(files), limits)

    def to_wire(self) -> dict[str, Any]:
        """The job the in-sandbox launcher reads (JSON-ready)."""
        return {
            "language": self.language,
            "code": self.code,
            "stdin": base64.b64encode(self.stdin).decode(),
            "files": {path: base64.b64encode(data).decode() for path, data in self.files.items()},
            "limits": self.limits.to_wire(),
        }


def _as_bytes(what: str, value: object, cap: int) -> bytes:
    if value is None:
        return b""
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, bytes | bytearray):
        raise SandboxUsageError(f"{what} must be str or bytes, got {type(value).__name__}")
    if len(value) > cap:
        raise SandboxUsageError(f"{what} is larger than the {cap}-byte cap")
    return bytes(value)


def _check_files(files: object) -> dict[str, bytes]:
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise SandboxUsageError(f"files must be a mapping of path -> content, got {type(files).__name__}")
    if len(files) > MAX_FILES:
        raise SandboxUsageError(f"at most {MAX_FILES} files")
    checked: dict[str, bytes] = {}
    for path, content in files.items():
        if not isinstance(path, str) or not path or "\x00" in path:
            raise SandboxUsageError(f"file path {path!r} must be a non-empty str without NUL bytes")
        normal = posixpath.normpath(path)
        if normal.startswith(("/", "..")) or normal == ".":
            raise SandboxUsageError(f"file path {path!r} must stay inside the work directory")
        checked[normal] = _as_bytes(f"file {path!r}", content, MAX_FILES_BYTES)
    if sum(len(data) for data in checked.values()) > MAX_FILES_BYTES:
        raise SandboxUsageError(f"files add up to more than {MAX_FILES_BYTES} bytes")
    return checked
