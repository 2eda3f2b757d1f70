"""Ends every sandbox of a host process once that process is gone: a small process of its own, one per
local backend, started as `python3 -I -c SOURCE HOST_PID FOLDERS_JSON`.

Why: a sandbox dies with its host through kernel signals that leave gaps. Bubblewrap's outer process
dies with the thread that started it (parent-death signal), but its child waits for that process's
word before it sets up the sandbox and sets its own parent-death signal only after; killed in between,
the outer process leaves the child waiting forever, with its namespaces and cgroup, parent PID 1. And
a session's sandbox frozen between calls (freezer cgroup) holds every signal, SIGKILL included, until
someone thaws it: a host that dies then leaves it frozen for good. No signal of the kernel's covers
either; this process does.

Its stdin is a pipe whose write end only the host holds, so it reads end-of-file when the host closes
the backend or dies (the kernel closes the descriptors of a dead process). Until then it reads lines
`+PGID` and `-PGID`: process groups of sandboxes the host started and released (what it ends where no
cgroup holds them). At end-of-file it thaws every sandbox cgroup below FOLDERS (the host's cgroup
folders, one per controller), kills every process in them and every process of the groups still
registered, waits until the cgroups are empty (a hang guard ends the wait), removes them, and exits.

It runs in a session of its own (a signal to the host's process group does not reach it) and never
kills HOST_PID, whose spawning thread may sit in a sandbox's cgroup while it closes the backend.

Standard library only; it must not import the project.
"""

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

GRACE_S = 10.0
"""How long the cgroups may take to empty (exiting processes) before they are left to the next sweep."""


def cgroups_below(folders: list[str]) -> list[Path]:
    """The sandbox cgroups under the host's folders (one per controller)."""
    found = []
    for folder in folders:
        with contextlib.suppress(OSError):
            found += [child for child in Path(folder).iterdir() if child.is_dir()]
    return found


def end_cgroup(cgroup: Path, spare: int) -> bool:
    """Thaw `cgroup` if it is a freezer's and SIGKILL every process in it but `spare`; True if it still
    held a process other than `spare`."""
    state = cgroup / "freezer.state"
    if state.exists():
        # A frozen process keeps SIGKILL pending until it is thawed (cgroup v1).
        with contextlib.suppress(OSError), open(state, "w") as handle:
            handle.write("THAWED")
    try:
        pids = [int(pid) for pid in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return False
    held = False
    for pid in pids:
        if pid != spare:
            held = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return held


def end_groups(groups: set[int]) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def end_all(folders: list[str], groups: set[int], spare: int) -> None:
    """Kill every process of the sandboxes (cgroups and groups), wait for them, remove the cgroups."""
    end_groups(groups)
    deadline = time.monotonic() + GRACE_S
    while True:
        held = [end_cgroup(cgroup, spare) for cgroup in cgroups_below(folders)]  # each one, every pass
        if not any(held) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for cgroup in cgroups_below(folders):
        with contextlib.suppress(OSError):
            cgroup.rmdir()
    if not os.path.exists(f"/proc/{spare}"):  # the host is gone: nobody else removes its folders
        for folder in folders:
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def watch(host: int, folders: list[str]) -> None:
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    groups: set[int] = set()
    for line in sys.stdin.buffer:
        text = line.strip()
        if text[:1] == b"+":
            groups.add(int(text[1:]))
        elif text[:1] == b"-":
            groups.discard(int(text[1:]))
    end_all(folders, groups, host)


if __name__ == "__main__":
    watch(int(sys.argv[1]), json.loads(sys.argv[2]))
