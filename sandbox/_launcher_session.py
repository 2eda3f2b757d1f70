"""The launcher's `session` mode: the REPL that serves one episode (`repl`) and the zygote that forks
one per episode and resets the sandbox between them (`session`).

The second part of the launcher (see sandbox/_launcher.py): it runs after that part, in the same
source, and uses its names as globals.
"""

import ast
import base64
import contextlib
import json
import os
import resource
import signal
import sys
import traceback
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # defined by the part before this one in the launcher's source
    from sandbox._launcher import (
        HEADER_DIGITS,
        PR_SET_DUMPABLE,
        Job,
        ProtocolViolationError,
        apply_limits,
        exec_fresh,
        exit_status,
        libc,
        new_main_module,
        own_command,
        pass_on,
        print_exception,
        read_frame,
        read_header,
        register_source,
        replace_fd,
        reset,
        start_fresh,
        stdin_fd,
        take_host_pipes,
        write_all,
        write_frame,
    )


class CellTimeout(BaseException):
    """Raised into a running cell by SIGALRM; a BaseException so `except Exception` cannot swallow it."""


def on_alarm(signum: int, frame: object) -> None:
    raise CellTimeout()


def run_cell(code: str, module: types.ModuleType, number: int) -> None:
    """Run one cell; print the value of a trailing expression, as a notebook does."""
    filename = f"<cell {number}>"
    register_source(filename, code)
    tree = ast.parse(code, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    exec(compile(tree, filename, "exec"), module.__dict__)
    if last is not None:
        value = eval(compile(last, filename, "eval"), module.__dict__)
        if value is not None:
            print(repr(value))


def capped_read(path: str, cap: int) -> tuple[str, int]:
    with open(path, "rb") as handle:
        head = handle.read(cap)
        total = os.fstat(handle.fileno()).st_size
    os.unlink(path)
    return base64.b64encode(head).decode(), total


def repl(limits: Job, control_in: int, control_out: int) -> None:
    """One episode's interpreter: a forked child of the zygote, talking to it over `control_*`."""
    replace_fd(os.open(os.devnull, os.O_RDONLY), 0)
    for fd in (1, 2):
        replace_fd(os.open(os.devnull, os.O_WRONLY), fd)
    io_dir = "/tmp/.pacerl-io"
    os.makedirs(io_dir, exist_ok=True)
    # The zygote's RLIMIT_NPROC count includes the zygote itself: one more keeps the user's budget.
    apply_limits(limits | {"max_processes": limits["max_processes"] + 1}, cpu_hard=resource.RLIM_INFINITY)
    # POSIX message queues live in the IPC namespace, which outlives an episode, and cannot be listed
    # without an mqueue mount: forbid creating them, so none can carry state to the next episode.
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
    # Both the per-cell wall alarm and the per-cell CPU budget interrupt the cell, not the session.
    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGXCPU, on_alarm)
    module = new_main_module()
    write_frame(control_out, {"ready": True})
    number = 0
    while True:
        request = read_frame(control_in)
        if request is None:
            return
        number += 1
        out_path, err_path = f"{io_dir}/out-{number}", f"{io_dir}/err-{number}"
        sys.stdout.flush()
        sys.stderr.flush()
        replace_fd(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
        replace_fd(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        replace_fd(stdin_fd(base64.b64decode(request.get("stdin", ""))), 0)
        exit_code: int | None
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu_now = int(used.ru_utime + used.ru_stime) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_now + request["cpu_s"], resource.RLIM_INFINITY))
        kind, exit_code = "ok", 0
        try:
            signal.setitimer(signal.ITIMER_REAL, request["timeout_s"])
            run_cell(request["code"], module, number)
        except CellTimeout:
            kind, exit_code = "timeout", None
        except SystemExit as error:
            exit_code = exit_status(error)
            kind = "ok" if exit_code == 0 else "error"
        except MemoryError as error:
            print_exception(error)
            kind, exit_code = "memory", 1
        except BaseException as error:
            print_exception(error)
            kind, exit_code = "error", 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for stream in (sys.stdout, sys.stderr):
            # A cell that filled its output file (RLIMIT_FSIZE) cannot flush; what it wrote is on disk.
            with contextlib.suppress(OSError):
                stream.flush()
        cap = request["output_cap_bytes"]
        stdout, stdout_total = capped_read(out_path, cap)
        stderr, stderr_total = capped_read(err_path, cap)
        write_frame(
            control_out,
            {
                "kind": kind,
                "exit_code": exit_code,
                "stdout": stdout,
                "stdout_total": stdout_total,
                "stderr": stderr,
                "stderr_total": stderr_total,
            },
        )


# -- the session zygote: one sandbox serves many episodes, each in a fresh forked interpreter ---------
#
# The zygote is the only process that holds the host's pipes. It is PID 1 of the sandbox (bubblewrap
# runs it with --as-pid-1; `unshare --fork` makes it PID 1 anyway), so no other process in the sandbox
# inherits or holds those pipes, and it is non-dumpable, so same-uid code can neither ptrace it nor
# take its descriptors with pidfd_getfd nor read its memory. It never parses what an episode writes:
# payloads move between pipes with splice(2), so nothing of one episode (code, stdin, output) ever
# enters the zygote's memory and reaches the next episode's forked interpreter. It reads only the
# episode's frame headers, which must be plain decimal sizes within the cap the host sent with the
# call; anything else ends the sandbox with a `!reason` line the host reports as a sandbox error.
#
# Host -> zygote: `SIZE CAP\n` + SIZE bytes (a cell, relayed to the interpreter; its reply may be at
# most CAP bytes), or `reset\n`. Zygote -> host: `SIZE\n` + SIZE bytes (the interpreter's reply), or
# `!reason\n` just before the sandbox ends because the episode broke the protocol.

READY_FRAME_CAP = 64


def reap_children(signum: int, frame: object) -> None:
    """As PID 1 the zygote inherits every orphan of the episode: reap them, or zombies would pile up
    against the process limit."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def fork_repl(
    limits: Job, host_fds: tuple[int, int], lib: Any, fresh: list[str] | None
) -> tuple[int, int, int]:
    """Fork one episode's interpreter (which execs `fresh`, a new one, when given); returns the
    zygote's ends of its pipes (to it, from it) and a pidfd of it."""
    request_read, request_write = os.pipe()
    reply_read, reply_write = os.pipe()
    # Until the pidfd is open, the child must not be reaped by `reap_children` (its pid could be reused).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            for fd in (*host_fds, request_write, reply_read):
                os.close(fd)
            start_fresh(lib)
            if fresh is not None:  # a new interpreter: a hash secret and an address layout of its own
                exec_fresh(fresh, "repl", json.dumps(limits), request_read, reply_write)
            repl(limits, request_read, reply_write)
            status = 0
        finally:
            os._exit(status)
    try:
        pidfd = os.pidfd_open(pid)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    os.close(request_read)
    os.close(reply_write)
    return request_write, reply_read, pidfd


def relay_reply(source: int, target: int, pidfd: int, cap: int) -> None:
    """Pass one reply frame from the episode's interpreter to the host: the header is checked (a
    decimal size within `cap`), the payload passed on unread. Raise EOFError if the interpreter died,
    ProtocolViolationError if the episode wrote something else."""
    header, start, extra = read_header(source, pidfd)
    if not header.isdigit() or len(header) > HEADER_DIGITS:
        raise ProtocolViolationError("a malformed reply header")
    size = int(header)
    if size > cap:
        raise ProtocolViolationError(f"a reply of {size} bytes, over the {cap}-byte cap of this call")
    pass_on(target, header, start, extra, size, source, pidfd)


def session(config: Job, status_fd: int) -> None:
    """The zygote: runs no user code itself, forks one interpreter per episode, relays its frames,
    and on `reset` kills the episode's processes and wipes what it could have changed. Any failure to
    restore a clean state exits: a sandbox is reused only when the reset fully succeeded.
    `config`: the episodes' `limits`, and whether each gets a `fresh` interpreter (exec'd)."""
    limits = config["limits"]
    fresh = own_command() if config["fresh"] else None
    lib = libc()
    if lib.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_DUMPABLE) failed")
    # Only as PID 1 is the zygote the sole holder of the host's pipes, so only then may it hand the
    # sandbox to another episode (Docker runs one container per session and never asks to reset).
    recyclable = os.getpid() == 1
    signal.signal(signal.SIGCHLD, reap_children)
    host_in, host_out, clean = take_host_pipes(status_fd, lib)
    status = 0
    try:
        to_repl, from_repl, pidfd = fork_repl(limits, (host_in, host_out), lib, fresh)
        relay_reply(from_repl, host_out, pidfd, READY_FRAME_CAP)
        while True:
            try:
                header, start, extra = read_header(host_in, None)
            except EOFError:
                break
            if header == b"reset":
                if not recyclable:
                    raise RuntimeError("a zygote that is not PID 1 cannot reset its sandbox")
                for fd in (to_repl, from_repl, pidfd):
                    os.close(fd)
                reset(clean, lib)
                to_repl, from_repl, pidfd = fork_repl(limits, (host_in, host_out), lib, fresh)
                relay_reply(from_repl, host_out, pidfd, READY_FRAME_CAP)
                continue
            size, cap = (int(field) for field in header.split())
            pass_on(to_repl, b"%d" % size, start, extra, size, host_in, None)
            relay_reply(from_repl, host_out, pidfd, cap)
    except ProtocolViolationError as violation:
        with contextlib.suppress(OSError):
            write_all(host_out, b"!%s\n" % str(violation).encode())
        status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    # Take the episode's processes down with us (the host sees EOF once every holder of the pipes is
    # gone; as PID 1, our exit alone ends the namespace).
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    os._exit(status)
