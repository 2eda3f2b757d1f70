"""The program that runs *inside* every sandbox (local namespaces and Docker alike).

It is started before any job is known (so a pool of warm sandboxes can wait for work), reads its job
as one length-prefixed JSON frame on stdin, writes the job's files into the work directory, applies
the rlimits, and then becomes the user's program: Python code runs in this very interpreter (saving
an interpreter start), bash replaces it by exec.

In `session` mode it is instead a small REPL: one frame in, one frame out per call, globals kept
between calls, each call's stdout/stderr captured in files on the private tmpfs (so the host reads
only the capped head), a per-call SIGALRM that interrupts runaway cells without losing the session.

Standard library only; runs under `python3 -I`. It must not import the project.
"""

import base64
import json
import linecache
import os
import resource
import signal
import sys
import traceback
import types

MEMORY_SIGNS = (MemoryError,)


def read_frame(fd):
    header = b""
    while not header.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            return None
        header += byte
    size = int(header)
    payload = bytearray()
    while len(payload) < size:
        chunk = os.read(fd, min(size - len(payload), 1 << 20))
        if not chunk:
            return None
        payload += chunk
    return json.loads(payload)


def write_frame(fd, obj):
    payload = json.dumps(obj).encode()
    data = b"%d\n" % len(payload) + payload
    while data:
        written = os.write(fd, data)
        data = data[written:]


def write_files(files):
    for path, content in files.items():
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(content))


def stdin_fd(data):
    """A file descriptor positioned at the start of `data` (an in-memory file: no pipe to fill)."""
    fd = os.memfd_create("stdin", 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def replace_fd(fd, target):
    os.dup2(fd, target)
    os.close(fd)


def apply_limits(limits, cpu_hard=None):
    def set_limit(kind, soft, hard=None):
        resource.setrlimit(kind, (soft, soft if hard is None else hard))

    set_limit(resource.RLIMIT_AS, limits["memory_bytes"])
    set_limit(resource.RLIMIT_CPU, limits["cpu_s"], cpu_hard or limits["cpu_s"] + 1)
    set_limit(resource.RLIMIT_NPROC, limits["max_processes"])
    set_limit(resource.RLIMIT_FSIZE, limits["max_file_bytes"])
    set_limit(resource.RLIMIT_NOFILE, limits["max_open_files"])
    set_limit(resource.RLIMIT_CORE, 0)
    # A write past RLIMIT_FSIZE should fail with EFBIG (readable), not kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def new_main_module():
    module = types.ModuleType("__main__")
    module.__file__ = os.path.join(os.getcwd(), "main.py")
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    return module


def print_exception(error):
    # Skip this launcher's own frames (it runs as "<string>") so the traceback reads like the user's.
    trace = error.__traceback__
    while trace is not None and trace.tb_frame.f_code.co_filename == "<string>":
        trace = trace.tb_next
    traceback.print_exception(type(error), error, trace)


def register_source(filename, code):
    """Let tracebacks show the user's source lines although no such file exists."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)


def announce_start(status_fd):
    """Tell the host the sandbox is up and the user's code starts now (then hide the channel)."""
    if status_fd >= 0:
        os.write(status_fd, b"R")
        os.close(status_fd)


def oneshot(status_fd):
    job = read_frame(0)
    if job is None:
        return  # the host discarded this warm sandbox
    write_files(job["files"])
    replace_fd(stdin_fd(base64.b64decode(job["stdin"])), 0)
    apply_limits(job["limits"])
    announce_start(status_fd)
    if job["language"] == "bash":
        os.execv("/bin/bash", ["bash", "-c", job["code"]])
    sys.stdout.reconfigure(line_buffering=True)
    module = new_main_module()
    register_source(module.__file__, job["code"])
    try:
        exec(compile(job["code"], module.__file__, "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as error:
        print_exception(error)
        sys.exit(1)


class CellTimeout(BaseException):
    """Raised into a running cell by SIGALRM; a BaseException so `except Exception` cannot swallow it."""


def on_alarm(signum, frame):
    raise CellTimeout()


def run_cell(code, module, number):
    """Run one cell; print the value of a trailing expression, as a notebook does."""
    filename = f"<cell {number}>"
    register_source(filename, code)
    tree = compile(code, filename, "exec", flags=0x400, dont_inherit=True)  # ast.PyCF_ONLY_AST
    last = None
    if tree.body and type(tree.body[-1]).__name__ == "Expr":
        import ast

        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), module.__dict__)
    if last is not None:
        value = eval(compile(last, filename, "eval"), module.__dict__)
        if value is not None:
            print(repr(value))


def capped_read(path, cap):
    with open(path, "rb") as handle:
        head = handle.read(cap)
        total = os.fstat(handle.fileno()).st_size
    os.unlink(path)
    return base64.b64encode(head).decode(), total


def session(limits, status_fd):
    announce_start(status_fd)
    control_in, control_out = os.dup(0), os.dup(1)
    replace_fd(os.open(os.devnull, os.O_RDONLY), 0)
    io_dir = "/tmp/.pacerl-io"
    os.makedirs(io_dir, exist_ok=True)
    apply_limits(limits, cpu_hard=resource.RLIM_INFINITY)
    signal.signal(signal.SIGALRM, on_alarm)
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
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu_now = int(used.ru_utime + used.ru_stime)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_now + request["cpu_s"], resource.RLIM_INFINITY))
        kind, exit_code = "ok", 0
        try:
            signal.setitimer(signal.ITIMER_REAL, request["timeout_s"])
            run_cell(request["code"], module, number)
        except CellTimeout:
            kind, exit_code = "timeout", None
        except SystemExit as error:
            code = error.code
            exit_code = code if isinstance(code, int) else (0 if code is None else 1)
            kind = "ok" if exit_code == 0 else "error"
        except MemoryError as error:
            print_exception(error)
            kind, exit_code = "memory", 1
        except BaseException as error:
            print_exception(error)
            kind, exit_code = "error", 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            sys.stdout.flush()
        except OSError:
            pass  # the cell filled its output file; what it wrote is on disk
        try:
            sys.stderr.flush()
        except OSError:
            pass
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


if __name__ == "__main__":
    # argv: MODE STATUS_FD [LIMITS_JSON]; STATUS_FD is -1 where the host needs no start signal.
    if sys.argv[1] == "session":
        session(json.loads(sys.argv[3]), int(sys.argv[2]))
    else:
        oneshot(int(sys.argv[2]))
