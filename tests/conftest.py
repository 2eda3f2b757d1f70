"""Shared fixtures. Docker tests skip without a daemon, except where PACERL_REQUIRE_DOCKER=1 (CI),
where a missing daemon fails them: they cannot silently vanish."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pacerl.sandbox import Sandbox
from tests.helpers import build_warm_model


def docker_daemon_error() -> str | None:
    """None when a Docker daemon answers, else why not."""
    try:
        import docker

        docker.from_env(timeout=5).ping()
    except Exception as error:  # any failure to reach the daemon means "no docker" here
        return f"{type(error).__name__}: {error}"
    return None


def require_docker() -> None:
    """Skip (developer machine) or fail (CI) when no Docker daemon is reachable."""
    error = docker_daemon_error()
    if error is None:
        return
    message = f"no Docker daemon: {error}"
    if os.environ.get("PACERL_REQUIRE_DOCKER") == "1":
        pytest.fail(message + " (PACERL_REQUIRE_DOCKER=1)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def docker_image() -> str:
    """The sandbox image, built locally from a rootfs (never pulled) once per test session."""
    require_docker()
    from pacerl.sandbox.image import ensure_image

    return ensure_image()


@pytest.fixture(scope="module")
def local_sandbox() -> Iterator[Sandbox]:
    with Sandbox("local") as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def unshare_sandbox() -> Iterator[Sandbox]:
    """The fallback isolation (root hosts without bubblewrap), forced so it is tested here too."""
    with Sandbox("local", isolation="unshare") as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def docker_sandbox(docker_image: str) -> Iterator[Sandbox]:
    with Sandbox("docker", image=docker_image) as sandbox:
        yield sandbox


@pytest.fixture(scope="module", params=["local", "local-unshare", "docker"])
def any_sandbox(request: pytest.FixtureRequest) -> Sandbox:
    """The hostile-code suite runs on every backend (and isolation) that runs code on this machine."""
    fixture = {"local": "local_sandbox", "local-unshare": "unshare_sandbox", "docker": "docker_sandbox"}
    sandbox: Sandbox = request.getfixturevalue(fixture[request.param])
    return sandbox


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, task file): the tiny MoE after a short SFT on Math-v0 sums (`helpers.build_warm_model`)."""
    return build_warm_model(tmp_path_factory.mktemp("warm"))
