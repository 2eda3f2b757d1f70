"""Hostile input through the files API, and what code can learn of the host's storage, on every
backend that runs code here: the same answer everywhere, and the caller's mistakes stay the caller's."""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Iterator

import pytest

from pacerl.sandbox import ExecRequest, ExecStatus, Limits, Sandbox, SandboxUsageError
from pacerl.sandbox.result import ExecResult
from tests.helpers import BackendRuns

MIB = 1024 * 1024
DEEP = "/".join(["d"] * 2047) + "/f"
"""A legal path of 4,095 bytes, 2,048 levels deep (deeper than Python's recursion limit)."""
LONG = "/".join(["l" * 255] * 15) + "/" + "m" * 255
"""A legal path of 4,095 bytes made of 255-byte names (NAME_MAX each, PATH_MAX in all)."""


def run_unchecked(sandbox: Sandbox, request: ExecRequest) -> ExecResult:
    """Run a request the API would refuse (built without `ExecRequest.build`): what the sandbox does
    when writing the files fails anyway."""
    return sandbox._submit(sandbox._backend.run(request)).result()


def test_every_legal_name_is_written(any_sandbox: Sandbox) -> None:
    files = {
        "..foo": "1",
        "a/..b": "2",
        "a/../c": "3",
        "./x//y": "4",
        "sp ace/new\nline": "5",
        "n" * 255: "6",
        DEEP: "7",
        LONG: "8",
    }
    code = """
import json, os
found, folders = {}, [""]
while folders:  # not os.walk: it recurses, and DEEP is deeper than the recursion limit
    folder = folders.pop()
    for entry in os.scandir(folder or "."):
        path = folder + entry.name
        if entry.is_dir():
            folders.append(path + "/")
        else:
            found[path] = open(path).read()
print(json.dumps(found))
"""
    result = any_sandbox.run(code, files=files, limits=Limits(timeout_s=10))
    assert result.status is ExecStatus.OK, result
    written = {"..foo": "1", "a/..b": "2", "c": "3", "x/y": "4", "sp ace/new\nline": "5", "n" * 255: "6"}
    assert json.loads(result.stdout) == written | {DEEP: "7", LONG: "8"}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"a": "x", "a/b": "y"}, r"file path 'a' is also the directory of file 'a/b'"),
        ({"a/b": "x", "a//b": "y"}, r"file paths 'a/b' and 'a//b' name the same file"),
        ({"n" * 256: "x"}, r"has a 256-byte name; the limit is 255 \(NAME_MAX\)"),
        ({"d/" * 2048 + "f": "x"}, r"is 4097 bytes; the limit is 4095 \(PATH_MAX\)"),
        (
            {"big": b"0" * (MIB + 1)},
            r"files need \d+ bytes of the work directory .*Limits.work_dir_mb=1 holds",
        ),
        ({"..": "x"}, r"names a directory, not a file"),
        ({"a/../..": "x"}, r"names a directory, not a file"),
        ({"/work/a": "x"}, r"must be relative"),
    ],
)
def test_unwritable_files_are_refused_before_anything_runs(
    any_sandbox: Sandbox, files: dict[str, str | bytes], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reached = BackendRuns(any_sandbox, monkeypatch)
    with pytest.raises(SandboxUsageError, match=message):
        any_sandbox.run("print('ran')", files=files, limits=Limits(work_dir_mb=1))
    assert reached.requests == []  # refused before the backend was asked for anything


def test_files_that_fill_the_work_dir_exactly_fit_and_not_a_page_more(any_sandbox: Sandbox) -> None:
    # 1 MiB is 256 pages of 4 KiB; a file one byte past a page takes two: whole pages are what counts.
    page = mmap.PAGESIZE
    files = {f"f{i}": b"0" * (page + 1) for i in range(MIB // page // 2 - 1)} | {"last": b"0" * 2 * page}
    code = "import os\nprint(sum(os.path.getsize(name) for name in os.listdir('.')))"
    result = any_sandbox.run(code, files=files, limits=Limits(work_dir_mb=1))
    assert (result.status, result.stdout) == (ExecStatus.OK, f"{sum(map(len, files.values()))}\n"), result
    with pytest.raises(SandboxUsageError, match=f"files need {MIB + page} bytes of the work directory"):
        any_sandbox.run(code, files=files | {"last": b"0" * (2 * page + 1)}, limits=Limits(work_dir_mb=1))


@pytest.mark.parametrize(
    ("files", "failure"),
    [
        ({"a": b"x", "a/b": b"y"}, "could not write the file 'a/b': Not a directory"),
        ({"big": b"0" * (MIB + 1)}, "could not write the file 'big': No space left on device"),
    ],
)
def test_a_write_that_fails_inside_is_the_callers_error_on_every_backend(
    any_sandbox: Sandbox, files: dict[str, bytes], failure: str
) -> None:
    request = ExecRequest("print('ran')", "python", b"", files, Limits(work_dir_mb=1))
    result = run_unchecked(any_sandbox, request)
    assert (result.status, result.exit_code, result.reason) == (ExecStatus.ERROR, 1, "exit code 1"), result
    assert (result.stdout, result.stderr) == ("", f"[sandbox] {failure}\n")


MOUNT_PROBE = """
import json, os
paths = ["/proc/self/mountinfo", "/proc/self/mounts", "/proc/self/mountstats", "/proc/mounts",
         "/proc/thread-self/mountinfo", "/proc/self/cgroup"]
pids = [pid for pid in os.listdir("/proc") if pid.isdigit()]
paths += [f"/proc/{pid}/{name}" for pid in pids for name in ("mountinfo", "mounts")]
def probe():
    found = {}
    for path in paths:
        try:
            with open(path, "rb") as handle:
                found[path] = handle.read().decode(errors="replace")
        except OSError as error:
            found[path] = error.strerror
    return found
found = probe()
child = os.fork()
if child == 0:
    with open("child.json", "w") as handle:
        json.dump(probe(), handle)
    os._exit(0)
os.waitpid(child, 0)
found.update({f"child {path}": text for path, text in json.load(open("child.json")).items()})
print(json.dumps({"stdin": open("/dev/fd/0").read(), "found": found}))
"""
"""Code that reads every mount table and cgroup file it can (its own, PID 1's, a child's) and its stdin
(through /proc/self/fd, which must keep working)."""

WIDE = Limits(output_cap_bytes=1 << 20)
"""Room for every mount table in full."""
HOST_STORAGE = re.compile(r"/var/lib/docker|overlay2|lowerdir=|containers/|[0-9a-f]{64}")
"""What names the Docker daemon's data root, its layers or a container."""


def assert_no_host_storage(result: ExecResult) -> None:
    assert result.status is ExecStatus.OK, result
    report = json.loads(result.stdout)
    assert report["stdin"] == "still readable"
    leaks = {path: HOST_STORAGE.findall(text) for path, text in report["found"].items()}
    assert not {path: found for path, found in leaks.items() if found}


@pytest.mark.slow
def test_mount_tables_name_no_host_storage(any_sandbox: Sandbox) -> None:
    assert_no_host_storage(any_sandbox.run(MOUNT_PROBE, stdin="still readable", limits=WIDE))


def test_mount_tables_name_no_host_storage_in_a_session(any_sandbox: Sandbox) -> None:
    with any_sandbox.session() as session:
        assert_no_host_storage(session.run(MOUNT_PROBE, stdin="still readable", limits=WIDE))


@pytest.fixture
def docker_without_landlock(docker_image: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    """A docker sandbox whose Landlock calls fail (ENOSYS), as on a kernel without Landlock."""
    import pacerl.sandbox.docker_backend as docker_backend

    source = docker_backend._HIDE_PROC_SOURCE
    numbers = "create_ruleset, add_rule, restrict_self, rule_path_beneath = 444, 445, 446, 1"
    assert numbers in source
    broken = source.replace(numbers, numbers.replace("444, 445, 446", "-1, -1, -1"))
    monkeypatch.setattr(docker_backend, "_HIDE_PROC_SOURCE", broken)
    with Sandbox("docker", image=docker_image, warm_pool=0) as sandbox:
        yield sandbox


@pytest.mark.docker
def test_docker_without_landlock_runs_no_code(docker_without_landlock: Sandbox) -> None:
    result = docker_without_landlock.run("print('ran')")
    assert result.status is ExecStatus.SANDBOX_ERROR and result.stdout == "", result
    assert result.reason.startswith("[sandbox] cannot hide /proc from the code (Landlock):")
    assert result.reason.endswith("(see DockerOptions.hide_proc)")
    with docker_without_landlock.session() as session:
        cell = session.run("print('ran')")
    assert cell.status is ExecStatus.SANDBOX_ERROR and "cannot hide /proc" in cell.reason, cell
