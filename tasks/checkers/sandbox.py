"""Run untrusted, model-generated Python (a function body plus the asserts of its doctest examples) in a
throwaway child process, so that hostile or runaway code cannot harm the worker that scores it.

    result = run_python(code, limits=Limits(wall_s=10, cpu_s=5, memory_mb=512))
    result.status   # "ok" | "error" | "timeout" | "cpu_limit" | "memory_limit" | "file_limit" | "blocked"
    result.passed   # status == "ok": the code ran to its end (or exited 0)

`run_python` starts `python -I -S -B -c <prelude>` with the worker's own interpreter (-I isolated mode: no
user site, no PYTHON* variables, no script folder on sys.path; -S: no site-packages, the code gets the
standard library only; -B: no .pyc writes) in a new session, with an environment built from scratch (PATH,
LANG, HOME and TMPDIR = the throwaway folder: no proxies, no credentials), its working folder a fresh
`tempfile.mkdtemp()` that is removed afterwards whatever happens, stdin/stdout/stderr on pipes (each output
kept up to `max_output_bytes`, the rest read and dropped). The prelude (`_child_main`, our code, shipped as
source) runs first in the child, confines it, then executes the untrusted code from `main.py` in that
folder as `__main__`.

The layers, and what each one defends against:

1. Process and session. Separate process, own process group; on the wall-clock limit the whole group gets
   SIGKILL ("timeout"), and so it does after every exit (stray grandchildren). The worker's memory, threads
   and state are out of reach, and no process outlives the run.
2. Resource limits (setrlimit(2), soft = hard, so the code cannot raise them): RLIMIT_CPU (SIGXCPU, SIGKILL
   a second later: "cpu_limit"), RLIMIT_AS (MemoryError: "memory_limit"), RLIMIT_FSIZE (writes past
   `file_mb` fail with EFBIG since Python ignores SIGXFSZ: "file_limit", a status of its own rather than
   "error"), RLIMIT_CORE 0, RLIMIT_NOFILE 64, RLIMIT_NPROC (the user's current tasks + 64; the kernel never
   applies it to uid 0, so for a root child it is no fork-bomb defence: layers 1 and 5 are).
3. Network namespace: unshare(2) through libc (3.11 has no os.unshare), CLONE_NEWNET as root,
   CLONE_NEWUSER | CLONE_NEWNET otherwise. The child sees one loopback interface, down: no address is
   reachable, the worker's 127.0.0.1 services included. Best effort: where unshare is refused (seccomp,
   user namespaces disabled) the child goes on with layer 5 alone against the network.
4. Privileges. The capability bounding set is emptied and PR_SET_NO_NEW_PRIVS set (no setuid binary or file
   capability gives anything back). A root child becomes `nobody` (setgroups/setresgid/setresuid; the folder
   is handed over) when the interpreter's library is readable by everyone; otherwise (a pyenv under /root,
   mode 700, as on the dev machines) it stays uid 0 with no capability at all (capset, securebits NOROOT
   locked): it cannot override file permissions, signal other users' processes, mknod, mount or raise hard
   limits, but root-owned files stay its own, so layer 5 is what keeps it off them. A non-root child drops
   the capabilities its new user namespace gave it.
5. An audit hook (PEP 578, `sys.addaudithook`: it cannot be removed), installed by the prelude before the
   untrusted code runs, refuses by event (https://docs.python.org/3/library/audit_events.html):
   - network: every socket operation (socket.connect/bind/sendto/sendmsg, name lookups, non-AF_UNIX
     sockets; an AF_UNIX socket may be created, as asyncio's socketpair needs, but never connected) and the
     network clients (http.client.connect, ...);
   - processes: os.fork, os.forkpty, os.posix_spawn, os.exec, os.system, subprocess.Popen, pty.spawn,
     os.kill of another pid, os.killpg; `_posixsubprocess.fork_exec`, which raises no event, is a stub;
   - native code: ctypes.* and importing ctypes (it could write memory and undo the hook), sqlite3 extension
     loading, sub-interpreters (they have no hook), test modules (_testcapi, _testinternalcapi, ...);
   - files: writing (mode w/a/x/+ or O_WRONLY/O_RDWR/O_CREAT/O_TRUNC/O_APPEND), creating, removing, renaming,
     chmod/chown/utime/truncate/xattr outside the sandbox folder (/dev/null excepted), device nodes;
     reading outside the folder, the interpreter's library and a few system files (/proc/<worker>/environ
     holds the worker's secrets); os.open of a directory outside the folder (so every dir_fd the code
     holds is inside it: os.open's event does not carry its dir_fd); chdir out of the folder; symlinks and
     hard links (no path in the folder may lead out of it); any path with a `..` component;
   - the hook itself: resource.setrlimit/prlimit, fcntl.ioctl (TIOCSTI), gc.get_objects/get_referrers/
     get_referents and sys._current_frames (the ways to reach the hook's objects), any attribute change on
     the hook's functions, interpreter finalization (see below).
   A refusal prints "sandbox: blocked <what>" on stderr and ends the process at once with `os._exit(97)`
   from the hook: code that catches the exception cannot go on, the status is "blocked". readline and the
   dbm backends, which write files without events, just fail to import (pdb and dbm do without them). The
   prelude runs the code inside a `try` and ends with `os._exit` after joining threads and running atexit
   handlers under the hook; interpreter finalization, where hooks are cleared, is never reached, and if it
   is (a tracer can rebind the prelude's locals), its audit event ends the run as "blocked".

What it does NOT defend against: it is not a security boundary like gVisor, a VM or a seccomp-confined
container. An audit hook is a policy inside the same interpreter: crafted bytecode or marshal data,
interpreter bugs or `_imp.create_builtin` can corrupt memory or rebuild a module and get past it, and then
only layers 1-4 remain (as root without the drop to `nobody`: uid 0 without capabilities, in its own
network namespace). Listing directories and stat are allowed anywhere (names and metadata leak). The code
can use its whole CPU, memory and wall-clock budget, and fill the folder file by file (RLIMIT_FSIZE is per
file; there is no disk quota). Results can lie: `os._exit(0)` before the asserts run exits 0 like a pass, so
checkers should require evidence that the asserts ran. Concurrent runs as `nobody` share that uid (one run
could write into another's folder if its hook were bypassed). Production should run these workers in
containers without network access and without credentials on disk, as a non-root user or with an
interpreter readable by `nobody`.

References (mirrored in spirit, not copied): OpenAI human-eval's `execution.py` (`reliability_guard`:
rlimits and disabled destructive functions in a child process, with the same "not a security sandbox"
warning), PEP 578 and the CPython audit events table, setrlimit(2), unshare(2), capabilities(7), prctl(2).
"""

from __future__ import annotations

import functools
import inspect
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "file_limit", "blocked")

# Exit codes the prelude uses (untrusted code can exit with them too: that only turns a result into a failure).
EXIT_BLOCKED = 97  # the audit hook refused an operation
EXIT_MEMORY = 98  # uncaught MemoryError (RLIMIT_AS)
EXIT_FILE_SIZE = 99  # uncaught OSError EFBIG (RLIMIT_FSIZE)

_PYTHON = sys.executable  # the interpreter the child runs (a test points it at another one)
_NOFILE = 64
_NPROC_HEADROOM = 64
_READ_CHUNK = 65536
_DRAIN_S = 1.0  # after the group is killed, how long to wait for the pipes to close


@dataclass(frozen=True)
class Limits:
    """What one run may use. The child cannot raise them (soft limit = hard limit)."""

    wall_s: float = 10.0  # wall clock, from start to exit; then the process group is killed ("timeout")
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU); SIGXCPU at cpu_s, SIGKILL one second later ("cpu_limit")
    memory_mb: int = 512  # address space (RLIMIT_AS), interpreter included ("memory_limit")
    file_mb: int = 1  # the largest file the child may write (RLIMIT_FSIZE, "file_limit")
    max_output_bytes: int = 65536  # stdout and stderr kept, each; the rest is read and dropped

    def __post_init__(self) -> None:
        if not self.wall_s > 0:
            raise ValueError(f"wall_s must be > 0, got {self.wall_s}")
        for name in ("cpu_s", "memory_mb", "file_mb"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be >= 0, got {self.max_output_bytes}")


@dataclass(frozen=True)
class Result:
    """The outcome of one `run_python`.

    status: "ok" (exit 0), "error" (non-zero exit, uncaught exception, killed by another signal), "timeout"
    (wall clock; the group was killed), "cpu_limit", "memory_limit" (MemoryError, or SIGKILL from the kernel
    below the CPU limit: the OOM killer), "file_limit" (a write past `file_mb`), "blocked" (the sandbox
    refused an operation: stderr says which). `returncode` is the child's (negative: killed by that signal;
    None if it could not be collected), `pid` its pid (= its process group id), `workdir` the folder it ran
    in (removed by now)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    pid: int | None = None
    workdir: str = ""

    @property
    def passed(self) -> bool:
        """True when the code ran to the end, or exited 0."""
        return self.status == "ok"


def run_python(code: str, *, limits: Limits = Limits(), stdin: str = "") -> Result:
    """Run `code` as `__main__` in a fresh, confined Python process (see the module docstring) and report
    how it ended. Never raises for anything the code does; raises OSError if the child cannot be started."""
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="forgeline-sandbox-"))
    proc: subprocess.Popen[bytes] | None = None
    reaped = False
    start = time.monotonic()
    try:
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8", errors="surrogatepass") as f:  # lone surrogates: a SyntaxError
            f.write(code)
        os.chmod(script, 0o644)
        config = {
            "workdir": workdir,
            "script": script,
            "cpu_s": int(limits.cpu_s),
            "memory_bytes": int(limits.memory_mb) * 1024 * 1024,
            "file_bytes": int(limits.file_mb) * 1024 * 1024,
            "nofile": _NOFILE,
            "nproc_headroom": _NPROC_HEADROOM,
            "drop_uid": _nobody()[0],
            "drop_gid": _nobody()[1],
            "exit_blocked": EXIT_BLOCKED,
            "exit_memory": EXIT_MEMORY,
            "exit_file_size": EXIT_FILE_SIZE,
        }
        argv = [_PYTHON, "-I", "-S", "-B", "-c", f"{_prelude_source()}\n_child_main({config!r})\n"]
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": workdir,
            "TMPDIR": workdir,
            "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MiB of address space per arena: RLIMIT_AS counts it
        }
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            close_fds=True,
            start_new_session=True,
        )
        out, err, timed_out = _communicate(
            proc, stdin.encode("utf-8", "surrogatepass"), limits, start + float(limits.wall_s)
        )
        returncode, cpu_used = _kill_and_reap(proc)
        reaped = True
        out2, err2 = _drain(proc, limits, len(out), len(err))
        out, err = out + out2, err + err2
        return Result(
            status=_classify(returncode, timed_out, cpu_used, limits),
            returncode=returncode,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            wall_s=time.monotonic() - start,
            pid=proc.pid,
            workdir=workdir,
        )
    finally:
        if proc is not None:
            if not reaped:
                _kill_and_reap(proc)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass
        _remove_tree(workdir)


def _classify(returncode: int | None, timed_out: bool, cpu_used: float, limits: Limits) -> str:
    """The status of a finished child (see `Result`)."""
    if timed_out:
        return "timeout"
    if returncode is None:
        return "error"
    if returncode == 0:
        return "ok"
    if returncode == EXIT_BLOCKED:
        return "blocked"
    if returncode == EXIT_MEMORY:
        return "memory_limit"
    if returncode == EXIT_FILE_SIZE or returncode == -signal.SIGXFSZ:
        return "file_limit"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit"
    if returncode == -signal.SIGKILL:
        # We did not send it (no timeout): the hard CPU limit, or the kernel's OOM killer.
        return "cpu_limit" if cpu_used >= limits.cpu_s - 0.05 else "memory_limit"
    return "error"


def _communicate(
    proc: subprocess.Popen[bytes], data: bytes, limits: Limits, deadline: float
) -> tuple[bytes, bytes, bool]:
    """Feed stdin and collect stdout/stderr (each capped) until the child exits or the deadline passes.
    Returns (stdout, stderr, timed_out); the child is left unreaped (a zombie keeps its pid and group id)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    cap = limits.max_output_bytes
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    try:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        stdin_fd = proc.stdin.fileno()
        if data:
            os.set_blocking(stdin_fd, False)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        view, sent = memoryview(data), 0
        pause = 0.001
        while True:
            if _exited(proc.pid):
                return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), False
            now = time.monotonic()
            if now >= deadline:
                return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), True
            wait = min(deadline - now, 0.05)
            if not sel.get_map():  # every pipe closed, the child still running: poll, backing off
                time.sleep(min(wait, pause))
                pause = min(pause * 2, 0.05)
                continue
            for key, _ in sel.select(wait):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        sent += os.write(fd, view[sent : sent + 65536])
                    except BlockingIOError:
                        continue
                    except OSError:  # BrokenPipeError: the child closed stdin or exited
                        sent = len(data)
                    if sent >= len(data):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = _read(fd)
                if chunk is None:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                if len(buf) < cap:
                    buf += chunk[: cap - len(buf)]
    finally:
        sel.close()


def _read(fd: int) -> bytes | None:
    """One non-blocking read: bytes, b"" at end of file, None if nothing is there yet."""
    try:
        return os.read(fd, _READ_CHUNK)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _drain(proc: subprocess.Popen[bytes], limits: Limits, have_out: int, have_err: int) -> tuple[bytes, bytes]:
    """What is left in the pipes once the group is dead (up to the caps, for at most `_DRAIN_S`)."""
    assert proc.stdout is not None and proc.stderr is not None
    pending = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    room = {
        proc.stdout.fileno(): limits.max_output_bytes - have_out,
        proc.stderr.fileno(): limits.max_output_bytes - have_err,
    }
    open_fds = set(pending)
    end = time.monotonic() + _DRAIN_S
    with selectors.DefaultSelector() as sel:
        for fd in open_fds:
            sel.register(fd, selectors.EVENT_READ)
        while open_fds and time.monotonic() < end:
            for key, _ in sel.select(max(0.0, end - time.monotonic())):
                chunk = _read(key.fd)
                if chunk is None:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    open_fds.discard(key.fd)
                    continue
                keep = max(0, room[key.fd] - len(pending[key.fd]))
                pending[key.fd] += chunk[:keep]
    return bytes(pending[proc.stdout.fileno()]), bytes(pending[proc.stderr.fileno()])


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid, and so its group id, stay taken)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped behind our back (someone's waitpid(-1)): nothing left to wait for
        return True


def _kill_and_reap(proc: subprocess.Popen[bytes]) -> tuple[int | None, float]:
    """SIGKILL the child's whole process group (it may be a zombie by now: its group id is still its own),
    then reap it. Returns (returncode, CPU seconds it used)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        proc.returncode = proc.returncode if proc.returncode is not None else -1
        return None, 0.0
    returncode = os.waitstatus_to_exitcode(status)
    proc.returncode = returncode  # so that Popen never waits for this pid again
    return returncode, usage.ru_utime + usage.ru_stime


def _remove_tree(path: str) -> None:
    """Remove the sandbox folder, whatever permissions the code left on it."""
    if not os.path.lexists(path):
        return
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
    shutil.rmtree(path, ignore_errors=True)


@functools.cache
def _nobody() -> tuple[int, int]:
    """uid and gid of `nobody` (65534 where there is no such user)."""
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


@functools.cache
def _prelude_source() -> str:
    return inspect.getsource(_child_main)


# ---------------------------------------------------------------------------------------------------------
# The child side. Shipped to the child as source (`python -c`), so it must be self-contained: standard
# library only, imports inside, nothing from this module's globals. It runs as the first thing in the child.


def _child_main(cfg: dict) -> None:
    """Confine this process (limits, namespace, privileges, audit hook), then run the untrusted code.

    Once that code runs, it can rebind any name in `builtins` and any module attribute, so everything this
    function uses afterwards is bound to a local name first, and the hook's helpers get theirs as default
    arguments: no closures, no globals, no mutable state, and no call into an object the code made. (A
    tracer can still rebind this frame's locals, `_exit` included; if the final `_exit` is bypassed that way,
    interpreter finalization raises cpython._PySys_ClearAuditHooks, which the hook answers with the
    "blocked" exit.)"""
    import atexit
    import os
    import resource
    import sys

    _exit, _BaseException, _SystemExit, _MemoryError = os._exit, BaseException, SystemExit, MemoryError
    _OSError, _isinstance, _int, _str, _type, _compile, _exec = OSError, isinstance, int, str, type, compile, exec
    workdir, script, exit_memory, exit_file_size = (
        cfg["workdir"],
        cfg["script"],
        cfg["exit_memory"],
        cfg["exit_file_size"],
    )
    with open(script, "rb") as f:
        source = f.read()

    # -- resource limits (soft = hard: they cannot be raised again) --------------------------------------------
    def tasks_of(uid):  # RLIMIT_NPROC counts the user's tasks (threads too) on the whole machine
        count = 0
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat("/proc/" + entry).st_uid == uid:
                        count += max(1, os.stat("/proc/" + entry + "/task").st_nlink - 2)
                except OSError:
                    pass
        return count

    def readable_by_others(path):
        here = "/"
        for part in [p for p in os.path.realpath(path).split("/") if p]:
            here = os.path.join(here, part)
            if not os.stat(here).st_mode & 0o001:
                return False
        return bool(os.stat(here).st_mode & 0o004)

    is_root = os.geteuid() == 0
    drop = False  # to `nobody`: only if the interpreter's library stays readable afterwards
    if is_root:
        try:
            drop = all(readable_by_others(p) for p in sys.path if os.path.isdir(p))
        except OSError:
            drop = False
    uid, gid = (cfg["drop_uid"], cfg["drop_gid"]) if drop else (os.getuid(), os.getgid())
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
    for which, value in (
        (resource.RLIMIT_AS, cfg["memory_bytes"]),
        (resource.RLIMIT_FSIZE, cfg["file_bytes"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, cfg["nofile"]),
        (resource.RLIMIT_NPROC, cfg["nproc_headroom"] + (tasks_of(uid) if uid != 0 else 0)),
    ):
        resource.setrlimit(which, (value, value))

    # -- network namespace, privileges (libc through ctypes: 3.11 has no os.unshare) -------------------------
    def confine(drop):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
        except Exception:
            libc = None
        if libc is not None:
            clone_newnet, clone_newuser = 0x40000000, 0x10000000
            libc.unshare(clone_newnet if is_root else clone_newuser | clone_newnet)  # best effort
            for cap in range(64):  # PR_CAPBSET_DROP: needs CAP_SETPCAP (root, or a new user namespace); EINVAL
                libc.prctl(24, cap, 0, 0, 0)  # past the last capability; EPERM without it: nothing to drop
        if drop:
            try:
                os.chown(workdir, uid, gid)
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)  # clears the capabilities
            except OSError:  # e.g. a user namespace that does not map `nobody`: stay root, without capabilities
                os.setresgid(0, 0, 0)
                os.chown(workdir, 0, 0)
                drop = False
        if libc is not None:
            if not drop:  # uid 0, or the namespace's full set: none left (securebits: NOROOT, NO_SETUID_FIXUP,
                libc.prctl(28, 0x2F, 0, 0, 0)  # KEEP_CAPS, locked: exec would not give them back)
                header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
                libc.capset(header, (ctypes.c_uint32 * 6)())  # effective, permitted, inheritable: empty
            else:
                libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/fd stays ours (the hook reads it)
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS

    confine(drop)
    for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
        del sys.modules[name]
    os.chdir(workdir)
    os.umask(0o077)

    # -- the audit hook -----------------------------------------------------------------------------------------
    def make_hook():
        def violation(
            what, _stdout=sys.stdout, _write=os.write, _exit=_exit, _code=cfg["exit_blocked"], _B=_BaseException
        ):
            try:
                _stdout.flush()  # the original stdout: what the code printed so far
            except _B:
                pass
            try:
                _write(2, ("\nsandbox: blocked " + what + "\n").encode("utf-8", "backslashreplace"))
            except _B:
                pass
            _exit(_code)

        def where(
            path, dir_fd, _readlink=os.readlink, _getcwd=os.getcwd, _type=type, _int=int, _str=str, _bytes=bytes,
            _OSError=OSError,
        ):  # fmt: skip
            # The absolute, normalized path that an operation on (path, dir_fd) acts on, or None when that cannot
            # be told: not a plain str/bytes/int, a `..` component (lexical `..` is unsound past a symlink), a
            # descriptor that is not a file.
            t = _type(path)
            if t is _int:
                if path < 0:
                    return None
                try:
                    target = _readlink(f"/proc/self/fd/{path}")
                except _OSError:
                    return None
                return target if target.startswith("/") else None
            if t is _bytes:
                path = path.decode("utf-8", "surrogateescape")
            elif t is not _str:
                return None
            if not path or "\x00" in path:
                return None
            parts = path.split("/")
            if ".." in parts:
                return None
            if not path.startswith("/"):
                if dir_fd is None or (_type(dir_fd) is _int and dir_fd in (-1, -100)):  # -100: AT_FDCWD
                    try:
                        base = _getcwd()
                    except _OSError:
                        return None
                elif _type(dir_fd) is _int and dir_fd >= 0:
                    try:
                        base = _readlink(f"/proc/self/fd/{dir_fd}")
                    except _OSError:
                        return None
                    if not base.startswith("/"):
                        return None
                else:
                    return None
                parts = base.split("/") + parts
            return "/" + "/".join([p for p in parts if p and p != "."])

        def under(path, roots):
            for root in roots:
                if path == root or path.startswith(root + "/"):
                    return True
            return False

        def shown(path, _type=type, _repr=repr, _plain=(str, bytes, int)):
            return _repr(path)[:300] if _type(path) in _plain else "<not a plain path>"

        real = os.path.realpath
        read_roots = [workdir, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
        read_roots += [p for p in sys.path if p.startswith("/")]
        read_roots += ["/usr/share/zoneinfo", "/usr/lib/zoneinfo", "/usr/share/lib/zoneinfo", "/etc/zoneinfo"]
        read_roots = tuple(sorted({r.rstrip("/") for r in read_roots + [real(r) for r in read_roots] if r.strip("/")}))
        read_files = frozenset(
            {"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/etc/localtime", "/etc/timezone",
             "/etc/os-release", "/usr/lib/os-release", "/etc/mime.types", "/proc/self/status",
             sys.executable, real(sys.executable)}
        )  # fmt: skip
        deny = frozenset(
            {
                # processes and signals
                "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "os.startfile",
                "os.killpg", "pty.spawn", "subprocess.Popen", "webbrowser.open", "ensurepip.bootstrap",
                # links (a link in the folder could lead out of it)
                "os.link", "os.symlink",
                # limits, terminals, sub-interpreters (no hook there), the ways to reach the hook's objects
                "resource.setrlimit", "resource.prlimit", "fcntl.ioctl", "cpython.PyInterpreterState_New",
                "sys._current_frames", "sys._current_exceptions", "gc.get_objects", "gc.get_referrers",
                "gc.get_referents",
                # interpreter finalization: the prelude ends with os._exit, so getting here means its exit was
                # bypassed (a tracer can rebind a frame's locals); finalization would clear the hooks
                "cpython._PySys_ClearAuditHooks", "cpython.PyInterpreterState_Clear",
                # native code, syslog's unix socket, network clients (sockets are refused anyway)
                "sqlite3.enable_load_extension", "sqlite3.load_extension", "syslog.openlog", "syslog.syslog",
                "urllib.Request", "http.client.connect", "ftplib.connect", "smtplib.connect", "imaplib.open",
                "poplib.connect", "nntplib.connect", "telnetlib.Telnet.open",
            }
        )  # fmt: skip
        deny_prefixes = ("ctypes.", "_winapi.", "winreg.", "msvcrt.")
        deny_modules = frozenset(
            {"ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_xxsubinterpreters",
             "_xxinterpchannels", "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase",
             "_testimportmultiple", "_testsinglephase", "_testclinic", "_xxtestfuzz"}
        )  # fmt: skip
        fast = frozenset(
            {"object.__getattr__", "sys._getframe", "builtins.id", "compile", "exec", "marshal.loads", "marshal.load",
             "marshal.dumps", "code.__new__", "function.__new__", "os.listdir", "os.scandir", "glob.glob",
             "glob.glob/2", "os.walk", "os.fwalk", "sys.addaudithook", "array.__new__", "_thread.start_new_thread",
             "os.putenv", "os.unsetenv", "time.sleep"}
        )  # fmt: skip
        # events on a path (argument 0) that change the file system, with the index of their dir_fd (-1: none)
        path_events = (
            ("os.mkdir", 2), ("os.rmdir", 1), ("os.remove", 1), ("os.chmod", 2), ("os.chown", 3), ("os.utime", 3),
            ("os.truncate", -1), ("os.setxattr", -1), ("os.removexattr", -1), ("os.chflags", -1),
            ("os.lchflags", -1), ("os.lchmod", -1), ("shutil.rmtree", 1),
        )  # fmt: skip

        def check(
            event, args, _fast=fast, _deny=deny, _deny_prefixes=deny_prefixes, _deny_modules=deny_modules,
            _path_events=path_events, _where=where, _under=under, _shown=shown, _read_roots=read_roots,
            _read_files=read_files, _write_roots=(workdir,), _lstat=os.lstat, _stat=os.stat, _getpid=os.getpid,
            _write_flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
            _type=type, _len=len, _int=int, _str=str, _bytes=bytes, _OSError=OSError, _id=id, _ours=frozenset(),
        ):  # fmt: skip
            # None when `event` may go ahead, else what to report.
            if event in _fast:
                return None
            if event in _deny or event.startswith(_deny_prefixes):
                return event
            n = _len(args)
            if event.startswith("socket."):
                # Creating an AF_UNIX socket is fine (asyncio's loop makes a socketpair); connect, bind, sendto,
                # sendmsg, name lookups are not, for any socket: nothing outside the process is reachable.
                if event == "socket.__new__" and n >= 2 and _type(args[1]) is _int and args[1] == 1:  # AF_UNIX
                    return None
                return event
            if event == "open":
                if n < 3:
                    return "open"
                path, mode, flags = args[0], args[1], args[2]
                if _type(path) is _int:  # an existing descriptor: opening it grants no new access
                    return None
                writing = (_type(flags) is _int and (flags & _write_flags) != 0) or (
                    _type(mode) is _str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
                )
                # A relative path is checked against the working folder. os.open's event does not carry its
                # dir_fd, but every directory descriptor the code can hold is in the folder: os.open of a
                # directory outside it is refused below (builtin open cannot open directories).
                target = _where(path, None)
                if not writing:
                    if target is None or not (target in _read_files or _under(target, _read_roots)):
                        return "open for reading " + _shown(path) + " (outside the sandbox folder and the library)"
                    if mode is None and not _under(target, _write_roots):
                        try:
                            kind = _stat(target).st_mode & 0o170000
                        except _OSError:
                            kind = 0
                        if kind == 0o040000:
                            return "os.open of the directory " + _shown(path) + " (outside the sandbox folder)"
                    return None
                if target == "/dev/null":
                    return None
                if target is None or not _under(target, _write_roots):
                    return "open for writing " + _shown(path) + " (outside the sandbox folder)"
                try:
                    kind = _lstat(target).st_mode & 0o170000
                except _OSError:
                    return None
                if kind == 0o020000 or kind == 0o060000:
                    return "open for writing of the device " + _shown(path)
                return None
            for name, dir_fd_at in _path_events:
                if event == name:
                    if n < 1:
                        return event
                    target = _where(args[0], args[dir_fd_at] if 0 <= dir_fd_at < n else None)
                    if target is None or not _under(target, _write_roots):
                        return event + " " + _shown(args[0]) + " (outside the sandbox folder)"
                    return None
            if event == "os.rename":  # os.rename and os.replace
                if n < 4:
                    return event
                for path, dir_fd in ((args[0], args[2]), (args[1], args[3])):
                    target = _where(path, dir_fd)
                    if target is None or not _under(target, _write_roots):
                        return event + " " + _shown(path) + " (outside the sandbox folder)"
                return None
            if event == "os.chdir":  # relative paths stay in the folder only while the working folder does
                target = _where(args[0], None) if n else None
                if target is None or not _under(target, _write_roots):
                    return "os.chdir " + (_shown(args[0]) if n else "") + " (outside the sandbox folder)"
                return None
            if event == "os.kill":
                if n >= 1 and _type(args[0]) is _int and args[0] == _getpid():
                    return None
                return "os.kill of another process " + (_shown(args[0]) if n else "")
            if event == "import":
                name = args[0] if n else None
                if _type(name) is not _str or name.partition(".")[0] in _deny_modules:
                    return "import " + _shown(name)
                return None
            if event == "object.__setattr__" or event == "object.__delattr__":
                if n >= 1 and _id(args[0]) in _ours:
                    return event + " on the sandbox's own functions"
                return None
            if event == "sqlite3.connect":
                db = args[0] if n else None
                if _type(db) is _str and (db == ":memory:" or db == ""):
                    return None
                if _type(db) is _str and db.startswith("file:"):
                    return "sqlite3.connect " + _shown(db) + " (a URI)"
                target = _where(db, None)
                if target is None or not _under(target, _write_roots):
                    return "sqlite3.connect " + _shown(db) + " (outside the sandbox folder)"
                return None
            return None

        def hook(
            event, args, _check=check, _violation=violation, _B=_BaseException, _PermissionError=PermissionError,
            _ImportError=ImportError, _optional=frozenset({"readline", "_gdbm", "_dbm"}), _type=type, _str=str,
        ):  # fmt: skip
            # Optional modules that write files behind the hook's back fail to import, as if not built (pdb, that
            # doctest uses, tries readline): the run goes on.
            if event == "import" and args and _type(args[0]) is _str and args[0] in _optional:
                raise _ImportError("sandbox: no " + args[0])
            try:
                reason = _check(event, args)
            except _B:  # a bug of ours, or MemoryError: fail closed
                reason = event + " (the sandbox policy could not decide)"
            if reason is not None:
                _violation(reason)
                raise _PermissionError("sandbox: blocked " + reason)  # not reached: _violation exits

        def no_fork_exec(*args, _violation=violation):
            _violation("_posixsubprocess.fork_exec")

        # The hook's own functions may not be changed at all (by id: `check` gets the set as its last default).
        ours = frozenset(id(f) for f in (violation, where, under, shown, check, hook, no_fork_exec))
        check.__defaults__ = check.__defaults__[:-1] + (ours,)
        return hook, no_fork_exec

    hook, no_fork_exec = make_hook()
    # No event covers _posixsubprocess.fork_exec (what subprocess and multiprocessing call): swap it for a
    # stub, and refuse any fresh import of the module (deny_modules).
    import _posixsubprocess

    _posixsubprocess.fork_exec = no_fork_exec

    # -- run the code as __main__ --------------------------------------------------------------------------------
    excepthook, stdout, stderr = sys.__excepthook__, sys.stdout, sys.stderr
    module = _type(sys)("__main__")
    module.__file__ = script
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = [script]
    exit_code = 1
    sys.addaudithook(hook)
    del hook, no_fork_exec, make_hook, confine
    try:
        try:
            _exec(_compile(source, script, "exec"), module.__dict__)
            exit_code = 0
        except _SystemExit as e:
            code = e.code
            if code is None:
                exit_code = 0
            elif _isinstance(code, _int):
                exit_code = _int(code) & 0xFF
            else:
                stderr.write(_str(code) + "\n")
        except _BaseException as e:
            exit_code = exit_memory if _isinstance(e, _MemoryError) else 1
            if _isinstance(e, _OSError) and e.errno == 27:  # EFBIG: past RLIMIT_FSIZE
                exit_code = exit_file_size
            e.__traceback__ = e.__traceback__.tb_next  # from the code's frame on, not ours
            excepthook(_type(e), e, e.__traceback__)
    except _BaseException:
        pass
    # What interpreter shutdown does, still under the hook (finalization would clear it before tearing the
    # modules down, __del__ methods included): join the threads, run the atexit handlers, flush.
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
    except _BaseException:
        pass
    try:
        atexit._run_exitfuncs()
    except _BaseException:
        pass
    for stream in (stdout, stderr):
        try:
            stream.flush()
        except _BaseException:
            pass
    try:
        _exit(exit_code)
    finally:
        _exit(1)
