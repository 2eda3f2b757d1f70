"""The Docker backend's own connections to the daemon: the "hijacked" HTTP connection of a `docker
exec` or a container attach, read and written with asyncio on the event loop (the docker SDK's calls
block), and the daemon's address it connects to."""

from __future__ import annotations

import asyncio
import os
from urllib.parse import urlsplit

from docker.errors import DockerException

_STREAM_CHUNK = 65536


class ExecStream:
    """The hijacked connection of one `docker exec` or container attach: our bytes to its stdin, its
    stdout/stderr back.

    Docker multiplexes the two output streams with 8-byte headers (stream id, 3 zero bytes, size as
    big-endian uint32); `read_chunk` undoes that without ever holding more than one chunk.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._stream_id = 0
        self._remaining = 0

    @classmethod
    async def open(cls, address: tuple[str, str, int], path: str, body: bytes) -> ExecStream:
        """POST `body` to `path` (an exec's start, a container's attach) and keep the upgraded connection."""
        scheme, host, port = address
        if scheme == "unix":
            reader, writer = await asyncio.open_unix_connection(host)
        else:
            reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: docker\r\n"
                f"Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            status = (await reader.readline()).split(maxsplit=2)
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if len(status) < 2 or status[1] not in (b"101", b"200"):
                detail = await reader.read(int(headers.get("content-length", "0")) or 2000)
                raise DockerException(f"{path} failed: {b' '.join(status[1:]).decode()} {detail.decode()}")
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def read_chunk(self) -> tuple[int, bytes] | None:
        """(stream id, bytes) with 1 = stdout and 2 = stderr; None at the end of the stream."""
        while self._remaining == 0:
            try:
                header = await self._reader.readexactly(8)
            except asyncio.IncompleteReadError as error:
                if error.partial:
                    raise EOFError("the Docker stream ended inside a frame header") from error
                return None
            self._stream_id, self._remaining = header[0], int.from_bytes(header[4:8], "big")
        chunk = await self._reader.read(min(self._remaining, _STREAM_CHUNK))
        if not chunk:
            raise EOFError("the Docker stream ended inside a frame")
        self._remaining -= len(chunk)
        return self._stream_id, chunk

    @property
    def is_open(self) -> bool:
        """False once the daemon closed the connection (the exec ended or the daemon went away)."""
        return (
            not self._reader.at_eof() and self._reader.exception() is None and not self._writer.is_closing()
        )

    def close(self) -> None:
        self._writer.close()


def parse_address(url: str) -> tuple[str, str, int]:
    """("unix", path, 0) or ("tcp", host, port) for a daemon URL; other schemes are refused."""
    parts = urlsplit(url)
    if parts.scheme == "unix" and parts.path:
        return "unix", parts.path, 0
    if parts.scheme in ("tcp", "http") and parts.hostname:
        if os.environ.get("DOCKER_TLS_VERIFY") and not url.startswith("http:"):
            raise ValueError("the docker sandbox does not support TLS daemon connections (DOCKER_TLS_VERIFY)")
        return "tcp", parts.hostname, parts.port or 2375
    raise ValueError(f"unsupported Docker daemon address {url!r}; use unix:///path or tcp://host:port")
