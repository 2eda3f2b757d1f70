"""The launcher's `oneshot` mode: the zygote that serves runs one after another, each in a process
forked from it (`oneshot_zygote`), and what that process does to become the user's program.

The last part of the launcher (see sandbox/_launcher.py): it runs after the other two, in the same
source, uses their names as globals, and ends with the entry point of every mode.
"""

import atexit
import base64
import contextlib
import json
import os
import resource
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # defined by the parts before this one in the launcher's source
    from sandbox._launcher import (
        HEADER_DIGITS,
        PR_SET_DUMPABLE,
        Job,
        announce_start,
        apply_limits,
        close_inherited_fds,
        exec_fresh,
        exit_status,
        kill_all,
        libc,
        new_main_module,
        over_budget,
        own_command,
        pass_on,
        print_exception,
        read_frame,
        read_header,
        register_source,
        replace_fd,
        reset,
        setup_root,
        splice_exactly,
        start_fresh,
        stdin_fd,
        take_host_pipes,
        write_all,
        write_files,
    )
    from sandbox._launcher_session import repl, session


# -- the one-shot zygote: one sandbox serves many runs, each in a freshly forked process ----------------
#
# As the session zygote, it is PID 1, non-dumpable and the only process holding the host's pipes, and
# it never reads what a run sends or writes: the job and the output move with splice(2). The next run's
# process is forked ahead of time (the modules snippets use already imported), so a run costs a fork's
# copy-on-write pages, not an interpreter start. A run's stdout and stderr are pipes of the zygote,
# relayed as typed frames; once the run's process has exited the zygote kills every other process of
# the sandbox, relays what is left in the pipes and only then sends the exit frame, so a run's output
# is complete and nothing of it can follow. Then it resets the sandbox (`reset`, as between sessions:
# processes, files, IPC, keyrings, and its own limits and the network namespace checked) and forks the
# next process; a sandbox it cannot reset ends with a `!reason` line.
#
# Host -> zygote: `SIZE\n` + SIZE bytes (a job, relayed unread to the waiting process).
# Zygote -> host: `r\n` (ready for a job); `1 SIZE\n` or `2 SIZE\n` + SIZE bytes (the run's stdout or
# stderr); `x CODE STARTED RESET\n` (the run is over: its exit code or minus the signal that killed it,
# 1 if it reached the user's code, and 1 if the zygote resets the sandbox now, 0 if the run left more
# than a reset undoes and the zygote ends instead); `!reason\n` (the zygote gives up and the sandbox
# ends).


class Run:
    """A forked run process waiting for its job, and the zygote's ends of its pipes."""

    def __init__(self, pid: int, job: int, out: int, err: int, status: int) -> None:
        self.pid, self.job, self.out, self.err, self.status = pid, job, out, err, status


def fork_run(lib: Any, fresh: list[str] | None, preload: tuple[str, ...]) -> Run:
    """Fork the next run's process; it waits for its job (the modules it needs are loaded), or first
    execs `fresh`, a new interpreter that loads them itself."""
    job_read, job_write = os.pipe()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    status_read, status_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            replace_fd(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out_write, 1)
            os.dup2(err_write, 2)
            # Nothing of the zygote's (the host's pipes, the other runs' ends) may reach the code.
            low, high = sorted((job_read, status_write))
            os.closerange(3, low)
            os.closerange(low + 1, high)
            os.closerange(high + 1, 1 << 20)
            start_fresh(lib)
            # POSIX message queues outlive the run in the IPC namespace and cannot be listed: none.
            resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
            if fresh is not None:  # a new interpreter: a hash secret and an address layout of its own
                exec_fresh(fresh, "run", json.dumps(preload), job_read, status_write)
            serve_job(job_read, status_write)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)
    for fd in (job_read, out_write, err_write, status_write):
        os.close(fd)
    os.set_blocking(status_read, False)
    return Run(pid, job_write, out_read, err_read, status_read)


def serve_job(job_read: int, status_write: int) -> None:
    """Wait for the run's job and become its program; exit quietly if the zygote ends first."""
    job = read_frame(job_read)
    if job is None:
        os._exit(0)
    os.close(job_read)
    run_job(job, status_write)


def run_job(job: Job, status_fd: int) -> None:
    """Become the user's program (a run's forked process; it never returns)."""
    write_files(job["files"], status_fd)
    replace_fd(stdin_fd(base64.b64decode(job["stdin"])), 0)
    apply_limits(job["limits"])
    announce_start(status_fd)
    if job["language"] == "bash":
        os.execv("/bin/bash", ["bash", "-c", job["code"]])
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    module = new_main_module()
    filename = str(module.__file__)
    register_source(filename, job["code"])
    try:
        exec(compile(job["code"], filename, "exec"), module.__dict__)
    except SystemExit as error:
        finish(exit_status(error))
    except BaseException as error:
        print_exception(error)
        finish(1)
    finish(0)


def finish(status: int) -> None:
    """Exit as CPython would (threads joined, atexit run, streams flushed) but skip the module
    teardown, which costs a third of a one-shot run and nothing the user can observe."""
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def pending_bytes(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD)."""
    import fcntl
    import termios

    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder, signed=True)


def relay_output(source: int, tag: bytes, target: int) -> bool:
    """Pass what waits in a run's output pipe to the host as one frame; False if nothing waits."""
    size = pending_bytes(source)
    if size <= 0:
        return False
    write_all(target, b"%s %d\n" % (tag, size))
    splice_exactly(source, target, size)
    return True


def reap_run(pid: int) -> int | None:
    """Reap every child that has exited; the run's exit code once its process is among them."""
    code = None
    with contextlib.suppress(ChildProcessError):
        while True:
            found, status = os.waitpid(-1, os.WNOHANG)
            if found == 0:
                break
            if found == pid:
                code = os.waitstatus_to_exitcode(status)
    return code


def serve_run(
    run: Run,
    job_header: tuple[bytes, int, int],
    host_in: int,
    host_out: int,
    wake: int,
    clean: Job | None,
    lib: Any,
) -> bool:
    """Hand the job to the run's process, relay its output until it exits, end every other process of
    the sandbox, relay what is left, and send the exit frame. True if the sandbox may then be reset
    (`clean`: its snapshot, None where it is never reset); False if the run left more than a reset
    may cost (the frame says so, and the host discards the sandbox)."""
    import select

    header, start, extra = job_header
    pass_on(run.job, header, start, extra, int(header), host_in, None)
    os.close(run.job)
    tags = {run.out: b"1", run.err: b"2"}
    poller = select.poll()
    for fd in (*tags, wake):
        poller.register(fd, select.POLLIN)
    code = None
    while code is None:
        for fd, events in poller.poll():
            if fd == wake:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake, 4096)
                code = reap_run(run.pid)
            elif not (events & select.POLLIN and relay_output(fd, tags[fd], host_out)):
                poller.unregister(fd)  # closed by every writer, and empty
    kill_all()  # nothing of the run may outlive it, or write after its exit frame
    for fd, tag in tags.items():
        while relay_output(fd, tag, host_out):
            pass
        os.close(fd)
    try:
        started = os.read(run.status, 1) == b"R"
    except BlockingIOError:
        started = False
    os.close(run.status)
    resettable = clean is not None and over_budget(clean, lib) is None
    write_all(host_out, b"x %d %d %d\n" % (code, started, resettable))
    return resettable


def oneshot_zygote(status_fd: int, config: Job) -> None:
    """The one-shot zygote: serves runs one after another, each in a fresh process forked from it, and
    resets the sandbox after each. Anything it cannot restore ends the sandbox (`!reason`, exit), and
    so does a run that left more than a reset may undo. `config`: the modules to `preload`, and
    whether each run gets a `fresh` interpreter (exec'd by its forked process)."""
    preload = tuple(config["preload"])
    fresh = own_command() if config["fresh"] else None
    lib = libc()
    if lib.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_DUMPABLE) failed")
    # Only as PID 1 is the zygote the sole holder of the host's pipes and the reaper of every process
    # of the sandbox; otherwise it serves one run and exits.
    recyclable = os.getpid() == 1
    for name in preload:
        __import__(name)
    import gc

    # What the zygote holds is shared with every run's process until written: keep the collector from
    # walking (and so copying) it in each of them.
    gc.freeze()
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)  # SIGCHLD wakes the relay loop's poll
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    host_in, host_out, clean = take_host_pipes(status_fd, lib)
    status = 0
    try:
        while True:
            run = fork_run(lib, fresh, preload)
            write_all(host_out, b"r\n")
            try:
                header = read_header(host_in, None)
            except EOFError:
                break  # the host discarded this sandbox
            if not header[0].isdigit() or len(header[0]) > HEADER_DIGITS:
                raise RuntimeError("a malformed job header from the host")
            if not serve_run(run, header, host_in, host_out, wake_read, clean if recyclable else None, lib):
                break
            reset(clean, lib)
    except BaseException as error:
        traceback.print_exc()
        reason = f"{type(error).__name__}: {error}".replace("\n", " ")[:200]
        with contextlib.suppress(OSError):
            write_all(host_out, b"!%s\n" % reason.encode())
        status = 1
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    os._exit(status)


def fresh_run(preload: list[str], job_read: int, status_write: int) -> None:
    """A run's fresh interpreter (exec'd by its forked process): load what a forked run would find
    loaded, then serve the job as a forked run does."""
    for name in preload:
        __import__(name)
    serve_job(job_read, status_write)


# -- the entry point of every mode: last in the launcher, once every part's names are defined

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "run":  # argv: run PRELOAD_JSON JOB_FD STATUS_FD (exec'd by a run's forked process)
        fresh_run(json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "repl":  # argv: repl LIMITS_JSON REQUEST_FD REPLY_FD (exec'd by an episode's process)
        repl(json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        os._exit(0)
    else:
        # argv: MODE STATUS_FD CONFIG_JSON [ROOT_SPEC_JSON]. STATUS_FD is -1 where the host needs no
        # start signal; CONFIG_JSON is the zygote's (a session's limits, or the modules a one-shot
        # zygote imports, and whether runs get fresh interpreters); ROOT_SPEC_JSON is given only by the
        # `unshare` fallback (bubblewrap builds the root itself).
        close_inherited_fds(int(sys.argv[2]))
        if len(sys.argv) > 4:
            setup_root(json.loads(sys.argv[4]))
        if mode == "session":
            session(json.loads(sys.argv[3]), int(sys.argv[2]))
        else:
            oneshot_zygote(int(sys.argv[2]), json.loads(sys.argv[3]))
