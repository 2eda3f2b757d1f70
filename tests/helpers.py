"""Helpers shared by test modules: free loopback ports and uvicorn servers on a thread."""

from __future__ import annotations

import socket
import threading
import time

import fastapi
import uvicorn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ThreadServer:
    """uvicorn serving `app` on 127.0.0.1 on a daemon thread of this process."""

    def __init__(self, app: fastapi.FastAPI, port: int | None = None, lifespan: str = "auto") -> None:
        port = port or free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan)
        self.server = uvicorn.Server(config)
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
