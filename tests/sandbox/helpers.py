"""Helpers shared by the sandbox tests (imported from here, never from another test module)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_for_ping(url: str, process: subprocess.Popen[bytes], log: Path, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"{url}/v1/ping", timeout=1).json() == "pong":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no server answered at {url} within {within_s} s")
