"""The Docker sandbox image, built on this machine from the host's own interpreter (never pulled).

The image is a minimal root filesystem: the host's system CPython (/usr/bin/python3, its stdlib
with compiled bytecode, its extension modules), /bin/bash, /bin/sh, a handful of coreutils that
generated code commonly shells out to, every shared library those need (as `ldd` reports them), an
/etc/passwd, and empty /tmp and /work. It is tarred and `docker import`ed, which takes seconds and
needs no registry. The in-sandbox launcher is not baked in: the backend passes its source at exec
time, so a changed launcher never needs a rebuild.

    python -m sandbox.image [--tag TAG] [--rebuild] [--base-url unix:///var/run/docker.sock]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DEFAULT_IMAGE = "pacerl-sandbox:latest"
"""Tag of the image `ensure_image` builds and the docker backend uses by default."""
PYTHON = "/usr/bin/python3"
"""The interpreter inside the image (the host's system Python, copied with its stdlib)."""
SANDBOX_UID = 65534
"""The image's default non-root user (`sandbox`); the backend usually runs each container as its own uid."""
RECIPE_LABEL = "pacerl.image.recipe"
"""Image label holding a hash of how the image was made; a mismatch makes `ensure_image` rebuild."""

IDLE_SOURCE = """\
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    signal.sigwait({signal.SIGCHLD})
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
"""
"""PID 1 of every sandbox container: it waits forever and reaps the orphans that code run by `exec`
leaves behind (they are re-parented to it), so zombies never fill the container's pid limit."""
IDLE_COMMAND = (PYTHON, "-I", "-S", "-c", IDLE_SOURCE)

_COREUTILS = """
    basename cat chmod cp cut date dirname du echo env false find grep head id ls mkdir mv
    printf pwd rm sed seq sleep sort stat tail tee touch tr true uname uniq wc xargs
"""
_TOOLS = (
    "/bin/bash",
    "/bin/sh",
    *(f"/usr/bin/{name}" for name in _COREUTILS.split()),
)
"""Programs besides Python; a missing one on the host is skipped (the image is still usable)."""
_STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3"}
"""Top-level stdlib entries left out: tests and GUI/packaging tools sandboxed code has no use for."""
_ETC_PASSWD = (
    "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
    f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/work:/bin/bash\n"
)
_ETC_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n"


def ensure_image(tag: str = DEFAULT_IMAGE, *, rebuild: bool = False, base_url: str | None = None) -> str:
    """Return `tag`, building it first if the daemon lacks it, it is out of date, or `rebuild` is set.

    `base_url` is the daemon's address (e.g. "unix:///var/run/docker.sock"); None reads DOCKER_HOST.
    Raises `docker.errors.DockerException` when the daemon cannot be reached or refuses the import.
    """
    import docker

    client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
    try:
        recipe = _recipe_hash()
        try:
            previous = client.images.get(tag)
        except docker.errors.ImageNotFound:
            previous = None
        if previous is not None and not rebuild and (previous.labels or {}).get(RECIPE_LABEL) == recipe:
            return tag
        output = _build(client, tag, recipe)
        built = client.images.get(tag)
        if (built.labels or {}).get(RECIPE_LABEL) != recipe:
            raise RuntimeError(f"docker import did not produce {tag}: {output[-1000:]}")
        if previous is not None and previous.id != built.id:
            # The old image is now untagged; drop it unless a container still uses it.
            with contextlib.suppress(docker.errors.APIError):
                client.images.remove(previous.id)
    finally:
        client.close()
    return tag


def _build(client: Any, tag: str, recipe: str) -> str:
    """Import a fresh rootfs as `tag`; returns the daemon's output (errors may only show there)."""
    from docker.utils import parse_repository_tag

    repository, version = parse_repository_tag(tag)
    changes = [
        f"CMD {json.dumps(list(IDLE_COMMAND))}",
        "WORKDIR /work",
        "ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/work TMPDIR=/tmp LANG=C.UTF-8",
        f"USER {SANDBOX_UID}:{SANDBOX_UID}",
        f"LABEL {RECIPE_LABEL}={recipe} pacerl.sandbox.image=1",
    ]
    with tempfile.TemporaryDirectory(prefix="pacerl-image-") as scratch:
        tarball = Path(scratch) / "rootfs.tar"
        write_rootfs(tarball)
        output = client.api.import_image_from_file(
            str(tarball), repository=repository, tag=version or "latest", changes=changes
        )
    return str(output)


def _recipe_hash() -> str:
    """What the image depends on: this module's code and the exact host interpreter it copies."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    python = Path(PYTHON).resolve()
    stat = python.stat()
    digest.update(f"{python}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def write_rootfs(tarball: Path) -> None:
    """Write the image's root filesystem as an uncompressed tar (uncompressed imports fastest)."""
    python = Path(PYTHON).resolve()
    stdlib = Path(f"/usr/lib/python{python.name.removeprefix('python')}")
    if not stdlib.joinpath("os.py").is_file():
        raise RuntimeError(f"cannot find the standard library of {python} at {stdlib}")
    programs = [PYTHON, *(tool for tool in _TOOLS if Path(tool).exists())]
    stdlib_files = list(
        _stdlib_files(stdlib, "cpython-" + stdlib.name.removeprefix("python").replace(".", ""))
    )
    extensions = [path for path in stdlib_files if path.suffix == ".so"]
    with tarfile.open(tarball, "w", format=tarfile.PAX_FORMAT) as tar:
        root = _Rootfs(tar)
        for directory, mode in (("/tmp", 0o1777), ("/work", 0o1777), ("/etc", 0o755)):
            root.add_dir(directory, mode)
        for directory in ("/proc", "/dev", "/sys"):
            root.add_dir(directory, 0o555)
        root.add_bytes("/etc/passwd", _ETC_PASSWD.encode())
        root.add_bytes("/etc/group", _ETC_GROUP.encode())
        for path in [*programs, *_shared_libraries([*programs, *map(str, extensions)])]:
            root.add(path)
        for file in stdlib_files:
            root.add(str(file))


def _stdlib_files(stdlib: Path, cache_tag: str) -> Iterable[Path]:
    for directory, subdirs, files in os.walk(stdlib):
        here = Path(directory)
        if here == stdlib:
            subdirs[:] = [
                name for name in subdirs if name not in _STDLIB_SKIP and not name.startswith("config-")
            ]
        for name in files:
            # Bytecode compiled at install time saves every sandboxed import a compile; the
            # optimized variants (-O, -OO) are never used.
            if here.name == "__pycache__" and not name.endswith(f".{cache_tag}.pyc"):
                continue
            yield here / name


def _shared_libraries(binaries: list[str]) -> list[str]:
    """Absolute paths `ldd` resolves for `binaries`, the dynamic loader included."""
    output = subprocess.run(["ldd", *binaries], capture_output=True, text=True, check=False).stdout
    found: set[str] = set()
    for line in output.splitlines():
        fields = line.split()
        if "=>" in fields and len(fields) > fields.index("=>") + 1:
            candidate = fields[fields.index("=>") + 1]
        elif fields:
            candidate = fields[0]
        else:
            continue
        if candidate.startswith("/") and not candidate.endswith(":") and Path(candidate).exists():
            found.add(candidate)
    return sorted(found)


class _Rootfs:
    """Adds host paths to the tar at the same place, recreating every symlink along the way."""

    def __init__(self, tar: tarfile.TarFile) -> None:
        self._tar = tar
        self._seen: set[str] = set()

    def add(self, path: str) -> None:
        current = "/"
        parts = Path(path).parts[1:]
        for index, part in enumerate(parts):
            current = os.path.join(current, part)
            if os.path.islink(current):
                self._add_member(current)
                target = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
                self.add(os.path.join(target, *parts[index + 1 :]))
                return
            if index < len(parts) - 1:
                self.add_dir(current, 0o755)
        self._add_member(current)

    def add_dir(self, path: str, mode: int) -> None:
        if path in self._seen:
            return
        self._seen.add(path)
        info = tarfile.TarInfo(path.lstrip("/"))
        info.type, info.mode = tarfile.DIRTYPE, mode
        self._tar.addfile(info)

    def add_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._seen.add(path)
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size, info.mode = len(data), mode
        self._tar.addfile(info, io.BytesIO(data))

    def _add_member(self, path: str) -> None:
        if path in self._seen:
            return
        self._seen.add(path)
        info = self._tar.gettarinfo(path, path.lstrip("/"))
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        if info.isreg():
            with open(path, "rb") as handle:
                self._tar.addfile(info, handle)
        else:
            self._tar.addfile(info)


def main(argv: list[str] | None = None) -> None:
    """Command line: build (or confirm) the sandbox image and print its tag."""
    parser = argparse.ArgumentParser(prog="python -m sandbox.image", description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default=DEFAULT_IMAGE, help=f"image tag (default {DEFAULT_IMAGE})")
    parser.add_argument("--rebuild", action="store_true", help="build even if an up-to-date image exists")
    parser.add_argument("--base-url", default=None, help="Docker daemon address (default: DOCKER_HOST)")
    args = parser.parse_args(argv)
    print(ensure_image(args.tag, rebuild=args.rebuild, base_url=args.base_url))


if __name__ == "__main__":
    main()
