"""One validated execution request: misuse of the API fails here, before any process starts."""

from __future__ import annotations

import base64
import bisect
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pacerl.sandbox.limits import Limits

LANGUAGES = ("python", "bash")
"""Languages every backend runs. `python` is CPython 3 from the sandbox's root; `bash` is /bin/bash."""

MAX_CODE_BYTES = 1024 * 1024
MAX_STDIN_BYTES = 16 * 1024 * 1024
MAX_FILES_BYTES = 32 * 1024 * 1024
MAX_FILES = 256
NAME_MAX = 255
"""Bytes of one file or directory name (Linux's NAME_MAX)."""
PATH_MAX = 4095
"""Bytes of a file's path below the work directory (Linux's PATH_MAX, 4096, less the NUL)."""


class SandboxUsageError(ValueError):
    """The caller passed something the sandbox refuses (wrong type, NUL byte, too large, unknown language,
    file paths it cannot write)."""


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
        stdin_bytes = _as_bytes("stdin", stdin, MAX_STDIN_BYTES)
        return cls(code, language, stdin_bytes, _check_files(files, limits), limits)

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


def _check_files(files: object, limits: Limits) -> dict[str, bytes]:
    """The files keyed by their normal paths, or `SandboxUsageError` for anything no backend could
    write into a fresh work directory of `limits.work_dir_mb` (so every backend refuses the same way)."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise SandboxUsageError(f"files must be a mapping of path -> content, got {type(files).__name__}")
    if len(files) > MAX_FILES:
        raise SandboxUsageError(f"at most {MAX_FILES} files")
    checked: dict[str, bytes] = {}
    given: dict[str, str] = {}
    for path, content in files.items():
        normal = _normal_path(path)
        if normal in checked:
            raise SandboxUsageError(
                f"file paths {_brief(given[normal])} and {_brief(path)} name the same file"
            )
        checked[normal] = _as_bytes(f"file {path!r}", content, MAX_FILES_BYTES)
        given[normal] = path
    ordered = sorted(checked)
    for normal in ordered:
        # The paths below `normal` + "/" sort next to each other: the first at or after it tells.
        after = ordered[bisect.bisect_left(ordered, normal + "/") :][:1]
        if after and after[0].startswith(normal + "/"):
            raise SandboxUsageError(
                f"file path {_brief(given[normal])} is also the directory of file {_brief(given[after[0]])}"
            )
    if sum(len(data) for data in checked.values()) > MAX_FILES_BYTES:
        raise SandboxUsageError(f"files add up to more than {MAX_FILES_BYTES} bytes")
    # tmpfs charges whole pages per file; the work directory is empty before the files are written.
    needed = sum(-(-len(data) // mmap.PAGESIZE) * mmap.PAGESIZE for data in checked.values())
    capacity = limits.work_dir_mb * 1024 * 1024
    if needed > capacity:
        raise SandboxUsageError(
            f"files need {needed} bytes of the work directory (whole {mmap.PAGESIZE}-byte pages per file), "
            f"more than Limits.work_dir_mb={limits.work_dir_mb} holds"
        )
    return checked


def _normal_path(path: object) -> str:
    """`path` with empty and "." components dropped and ".." resolved, or why it cannot be a file below
    the work directory (every other name is legal: "..foo", "a/..b", spaces, newlines)."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SandboxUsageError(f"file path {path!r} must be a non-empty str without NUL bytes")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates: no file system name is made of them
        raise SandboxUsageError(f"file path {path!r} is not valid Unicode text: {error.reason}") from None
    if path.startswith("/"):
        raise SandboxUsageError(f"file path {path!r} must be relative: files stay inside the work directory")
    raw = path.split("/")
    if raw[-1] in ("", ".", ".."):
        raise SandboxUsageError(f"file path {path!r} names a directory, not a file")
    parts: list[str] = []
    for part in raw:
        if part == "..":
            if not parts:
                raise SandboxUsageError(f"file path {path!r} must stay inside the work directory")
            parts.pop()
        elif part not in ("", "."):
            size = len(part.encode("utf-8"))
            if size > NAME_MAX:
                raise SandboxUsageError(
                    f"file path {_brief(path)} has a {size}-byte name; the limit is {NAME_MAX} (NAME_MAX)"
                )
            parts.append(part)
    normal = "/".join(parts)
    size = len(normal.encode("utf-8"))
    if size > PATH_MAX:
        raise SandboxUsageError(
            f"file path {_brief(path)} is {size} bytes; the limit is {PATH_MAX} (PATH_MAX)"
        )
    return normal


def _brief(path: str) -> str:
    return repr(path) if len(path) <= 60 else f"{path[:40]!r}... ({len(path)} characters)"
