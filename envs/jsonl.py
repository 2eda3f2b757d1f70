"""JSON Lines, the project's one reader and writer: task sets, corpora, trajectory records and metrics
all go through these, so every malformed line is reported the same way (`path:line: what is wrong`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path, *, skip_partial_last: bool = False) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of `path`. ValueError `path:N: not JSON (...)`
    or `path:N: not UTF-8 text (...)` on a bad line; OSError if the file cannot be read.
    `skip_partial_last`: leave out a last line that has no newline yet (a live writer's half line)."""
    path = Path(path)
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if skip_partial_last and not raw.endswith(b"\n"):
                return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not UTF-8 text ({error.reason})") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> int:
    """Write `rows` one JSON value per line (creating the folder); the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
            count += 1
    return count
