"""Runs *inside* a Docker sandbox, ahead of the launcher: the code can open no file under /proc.

Why: a container's root is an overlay whose mount options name the daemon's data root and layer ids
(`lowerdir=/var/lib/docker/overlay2/l/...`), and /etc/hostname, /etc/hosts and /etc/resolv.conf are
bind mounts of `/var/lib/docker/containers/<id>/...`; /proc/<pid>/mountinfo, mounts and mountstats
show both to every process, and /proc/self/cgroup names the container. Stock Docker cannot hide
them: a masked path covers one path, and /proc/self resolves to PID 1 when runc masks it, so every
other process still reads its own; runc refuses other mounts below /proc and masking all of /proc
(it needs /proc/self/fd to start); the code, without capabilities and under Docker's seccomp
profile, cannot make a mount namespace of its own. What a process can do unprivileged is Landlock
(Linux 5.13+, allowed by that seccomp profile): give up, for itself and every descendant, the right
to read files anywhere but below the entries of / other than /proc. Landlock grants by path alone,
so /proc goes whole (/proc/cpuinfo and /proc/self/status too); listing directories, writing and
executing stay as they were, and /dev/stdin, pipes and memfds still open (their files are elsewhere).

The launcher is a zygote in both modes: each process it forks (a run's process, an episode's
interpreter) restricts itself first thing; the zygote, which runs no code of the user's, keeps /proc
for its own checks. A fresh interpreter such a process execs (`fresh_interpreter`) keeps the
restriction, and so do the processes it forks.

Where Landlock is unavailable no code runs: the zygote writes `HIDE_PROC_FAILED` and the reason on
stderr and exits with `HIDE_PROC_EXIT` before it says it is ready (a forked process that fails to
restrict itself does the same, before it reads its job). `DockerOptions.hide_proc=False` leaves this
module out.

Standard library only; it must not import the project. Its names land in the launcher's namespace.
"""

import ctypes
import os
import sys

HIDE_PROC_FAILED = "[sandbox] cannot hide /proc from the code (Landlock):"
"""First words on stderr when the restriction failed; the host reports a sandbox error."""
HIDE_PROC_EXIT = 125
"""Exit status of a launcher whose restriction failed."""


def hide_proc() -> None:
    """Restrict every process forked from this one (checking first that the kernel can)."""
    libc = ctypes.CDLL(None, use_errno=True)
    read_file = 1 << 2  # LANDLOCK_ACCESS_FS_READ_FILE
    # Landlock's syscalls have the same numbers on every architecture.
    create_ruleset, add_rule, restrict_self, rule_path_beneath = 444, 445, 446, 1
    pr_set_no_new_privs = 38

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("handled_access_fs", ctypes.c_uint64)]

    class PathBeneathAttr(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    def check(result: int, what: str) -> int:
        if result < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"{what}: {os.strerror(error)}")
        return result

    def new_ruleset() -> int:
        attr = RulesetAttr(read_file)
        size = ctypes.c_size_t(ctypes.sizeof(attr))
        return check(libc.syscall(create_ruleset, ctypes.byref(attr), size, ctypes.c_uint32(0)), "ruleset")

    def build() -> int:
        """The ruleset: files may be read below every entry of / but /proc (and links into it)."""
        ruleset = new_ruleset()
        try:
            proc = os.stat("/proc").st_dev
            for name in os.listdir("/"):
                try:
                    fd = os.open(f"/{name}", os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # a dangling link: nothing to read there
                try:
                    if name == "proc" or os.fstat(fd).st_dev == proc:  # /proc, or a link into it
                        continue
                    rule = PathBeneathAttr(read_file, fd)
                    kind, flags = ctypes.c_int(rule_path_beneath), ctypes.c_uint32(0)
                    added = libc.syscall(add_rule, ctypes.c_int(ruleset), kind, ctypes.byref(rule), flags)
                    check(added, f"rule for /{name}")
                finally:
                    os.close(fd)
        except BaseException:
            os.close(ruleset)
            raise
        return ruleset

    def fail(error: OSError) -> None:
        print(f"{HIDE_PROC_FAILED} {error}", file=sys.stderr, flush=True)
        os._exit(HIDE_PROC_EXIT)

    try:
        os.close(new_ruleset())  # Landlock missing: fail now, not in every run
    except OSError as error:
        fail(error)
    restricted: list[bool] = []
    ruleset: list[int] = []
    """Built once, at the zygote's first fork (the launcher closes inherited descriptors when it
    starts), and applied by each process it forks, which closes its copy at once."""

    def before_fork() -> None:
        if not restricted and not ruleset:
            ruleset.append(build())  # should this fail, the child finds no ruleset and exits

    def in_child() -> None:
        if restricted:  # a fork of an already restricted process (the user's own os.fork)
            return
        restricted.append(True)
        try:
            if not ruleset:
                raise OSError("no Landlock ruleset could be built")
            check(libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0), "no_new_privs")
            check(libc.syscall(restrict_self, ctypes.c_int(ruleset[0]), ctypes.c_uint32(0)), "restrict_self")
        except OSError as error:
            fail(error)
        finally:
            for fd in ruleset:
                os.close(fd)
            ruleset.clear()

    os.register_at_fork(before=before_fork, after_in_child=in_child)


if __name__ == "__main__" and sys.argv[1] not in ("run", "repl"):
    # An exec'd run or episode interpreter (modes run, repl) is restricted already: Landlock's
    # restriction outlives exec, and its forks need no second one.
    hide_proc()
