"""Run untrusted, model-generated Python (a function body plus the asserts of its doctest examples) in a
throwaway, kernel-confined child process, so that hostile or runaway code cannot harm the worker that scores it,
reach anything else on the machine, or outlive its run.

    result = run_python(code, limits=Limits(wall_s=10, cpu_s=5, memory_mb=512))
    result.status   # "ok" | "error" | "timeout" | "cpu_limit" | "memory_limit" | "file_limit" | "blocked"
    result.passed   # status == "ok": the code ran to its end (or exited 0)

`run_python` starts `unshare(1) --pid --fork --mount-proc --net --ipc --uts --mount [--user --map-root-user]
python -I -S -B -c <tasks/checkers/sandbox_child.py>` with the worker's own interpreter (-I isolated mode: no
user site, no PYTHON* variables, no script folder on sys.path; -S: no site-packages, the code gets the standard
library only; -B: no .pyc writes) in a new session, with an environment built from scratch (PATH, LANG, HOME
and TMPDIR = the throwaway folder: no proxies, no credentials), its working folder a fresh `tempfile.mkdtemp()`
that is removed afterwards whatever happens, stdin/stdout/stderr on pipes (each output kept up to
`max_output_bytes`, the rest read and dropped). The child program (our code) confines itself, then executes the
untrusted code from `main.py` in that folder as `__main__`.

What we chose, and why: util-linux's `unshare` for the namespaces (in every Debian/Ubuntu base system: it makes
the namespaces, mounts the new /proc, maps the user namespace, forks and forwards the exit) and libseccomp for
the system-call filter (the worker compiles the policy with it, through the `pyseccomp` ctypes binding, once per
process, and ships the compiled BPF to the child, which only loads it). Landlock has no such tool in the
standard library: its three system calls are made through ctypes, 60 lines. bubblewrap and nsjail would do the
namespaces and mounts too, but they are not on a base system (`apt-get install bubblewrap` needs root), and
bubblewrap does not set up Landlock. No fallback: where a layer cannot be set up (no user namespaces, no
Landlock, no libseccomp), `run_python` raises `SandboxUnavailable` rather than running the code with less.

The layers, and what each one defends against (the kernel-enforced ones first):

1. Namespaces. Its own PID namespace with a fresh /proc: the worker, the Prefect server, every other process
   on the machine is invisible and has no pid the code could name; PID 1 is our init (sandbox_child.main),
   which runs no untrusted code, caps the tasks in the namespace (`pid_max` of the namespace, Linux >= 6.14)
   and reports the child's status on a pipe only the worker reads; when it exits, the kernel kills everything
   left in the namespace. Its own network namespace (one loopback interface, down: no address is reachable,
   the worker's 127.0.0.1 services included), IPC and UTS namespaces, and a mount namespace. A worker that is
   not root gets a user namespace as well (its root is the worker's uid outside).
2. Resource limits (setrlimit(2), soft = hard, so the code cannot raise them): RLIMIT_CPU (SIGXCPU, SIGKILL
   a second later: "cpu_limit"), RLIMIT_AS (MemoryError: "memory_limit"), RLIMIT_FSIZE (writes past
   `file_mb` fail with EFBIG since Python ignores SIGXFSZ: "file_limit"), RLIMIT_CORE 0, RLIMIT_NOFILE 64,
   RLIMIT_NPROC (the user's current tasks + 64; the kernel never applies it to the machine's root, for which
   the namespace's pid_max is the thread-bomb limit).
3. Privileges. A root worker's child becomes `nobody` when the interpreter's library is readable by everyone;
   otherwise (a pyenv under /root, mode 700, as on the dev machines; or the user namespace's root) it keeps
   uid 0 with no capability at all (bounding set emptied, capset, securebits NOROOT locked). no_new_privs.
4. Landlock (Linux >= 5.13): the file system is read-only beneath the interpreter's prefix and library, the
   shared libraries, the zoneinfo and a few files of /etc and /dev, this namespace's /proc; writable only in
   the sandbox folder (and /dev/null), where devices, FIFOs and sockets cannot be created; links and renames
   across the boundary are refused (REFER). With Landlock ABI 4 no TCP bind or connect, with ABI 6 no signal
   and no abstract UNIX socket outside the child's own domain. Landlock also keeps the child from ptrace-like
   access (/proc/<pid>/mem, environ) to any process outside its domain.
5. seccomp (libseccomp, `_seccomp_program`): the process is killed (SIGSYS: "blocked") on execve/execveat,
   fork/vfork and clone without CLONE_THREAD (threads stay possible; clone3 answers ENOSYS so that glibc uses
   clone), kill/tgkill/rt_(tg)sigqueueinfo of any pid but its own, tkill, pidfd_open/pidfd_send_signal/
   pidfd_getfd, ptrace and process_vm_readv/writev, mknod/mknodat (mkfifo), socket (socketpair stays: asyncio
   uses it), every mount, namespace, module, BPF, perf, keyring, io_uring and clock-setting call. Other
   architectures' system-call ABIs (x32, i386 through int 0x80) kill the process too.
6. An audit hook (PEP 578, `sys.addaudithook`: it cannot be removed), installed last, refuses by name what
   layers 1-5 refuse anyway (os.fork, subprocess, sockets, ctypes, writes and reads outside the folder, ...),
   so that the usual attempt ends as "blocked" with "sandbox: blocked <what>" on stderr; and what the kernel
   cannot see: reaching the hook's own objects (gc.get_objects, sys._current_frames, changing its functions).
   It is policy, not the boundary: code that gets past it (`_imp.create_builtin`, crafted bytecode, ctypes)
   meets layers 1-5. Tests run every attack with the hook off too (`audit_hook=False`).

What it does NOT defend against: kernel bugs (this is a process sandbox, not gVisor or a VM); the code can use
its whole CPU, memory and wall-clock budget and fill the folder file by file (RLIMIT_FSIZE is per file; there is
no disk quota); listing directories and stat are allowed where reading is; concurrent runs as `nobody` share
that uid. Results can lie: `os._exit(0)` before the asserts run exits 0 like a pass, so checkers must judge
the code's output in the worker, not trust a verdict printed by the child (tasks/checkers/code.py does).

References (mirrored in spirit, not copied): OpenAI human-eval's `execution.py` (rlimits in a child process),
unshare(1), pid_namespaces(7), landlock(7) and https://docs.kernel.org/userspace-api/landlock.html,
seccomp(2) and libseccomp's seccomp_rule_add(3)/seccomp_export_bpf(3), capabilities(7), setrlimit(2), PEP 578
and the CPython audit events table (https://docs.python.org/3/library/audit_events.html).
"""

from __future__ import annotations

import errno
import functools
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
from pathlib import Path

STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "file_limit", "blocked")

# Exit codes the child program uses (untrusted code can exit with them too: that only turns a result into a
# failure; EXIT_SETUP counts only before the child said it was confined, which no untrusted code can fake).
EXIT_SETUP = 96  # the child could not confine itself: SandboxUnavailable
EXIT_BLOCKED = 97  # the audit hook refused an operation
EXIT_MEMORY = 98  # uncaught MemoryError (RLIMIT_AS)
EXIT_FILE_SIZE = 99  # uncaught OSError EFBIG (RLIMIT_FSIZE)

_PYTHON = sys.executable  # the interpreter the child runs (a test points it at another one)
_DROP_TO_NOBODY = True  # a root worker's child becomes `nobody` where it can (a test keeps uid 0 to try that)
_CHILD = Path(__file__).with_name("sandbox_child.py")  # the child program, shipped as source
_NOFILE = 64
_NPROC_HEADROOM = 64
_PID_MAX = 301  # tasks in the namespace (the kernel's minimum for pid_max, PID_MAX_MIN)
_OWN_PID = 2  # the confined child's pid in its namespace: PID 1 (our init) forks it first
_READ_CHUNK = 65536
_DRAIN_S = 1.0  # after the group is killed, how long to wait for the pipes to close


class SandboxUnavailable(OSError):
    """The sandbox could not be set up on this machine (no unshare(1), user namespaces refused, no Landlock,
    no libseccomp): the worker's failure, never the code's. The message says which layer."""


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


def run_python(code: str, *, limits: Limits = Limits(), stdin: str = "", audit_hook: bool = True) -> Result:
    """Run `code` as `__main__` in a fresh, confined Python process (see the module docstring) and report
    how it ended. Never raises for anything the code does; raises `SandboxUnavailable` (an OSError) when the
    confinement cannot be set up here, OSError if no child can be started. `audit_hook=False` leaves out the
    policy layer (only the tests that show the kernel layers hold on their own use it)."""
    argv_unshare = _unshare_argv()
    program = _seccomp_program(_OWN_PID)
    parent, traversable = _workdir_parent()
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="forgeline-sandbox-", dir=parent))
    proc: subprocess.Popen[bytes] | None = None
    reaped = False
    status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8", errors="surrogatepass") as f:  # lone surrogates: a SyntaxError
            f.write(code)
        os.chmod(script, 0o644)
        nobody_uid, nobody_gid = _nobody()
        config = {
            "workdir": workdir,
            "script": script,
            "cpu_s": int(limits.cpu_s),
            "memory_bytes": int(limits.memory_mb) * 1024 * 1024,
            "file_bytes": int(limits.file_mb) * 1024 * 1024,
            "nofile": _NOFILE,
            "nproc_nobody": _NPROC_HEADROOM + _tasks_of(nobody_uid),
            "nproc_worker": _NPROC_HEADROOM + _tasks_of(os.getuid()),
            "pid_max": _PID_MAX,
            "own_pid": _OWN_PID,
            "worker_root": os.geteuid() == 0,
            "may_drop": _DROP_TO_NOBODY and traversable,
            "drop_uid": nobody_uid,
            "drop_gid": nobody_gid,
            "status_fd": status_w,
            "seccomp": program,
            "audit_hook": bool(audit_hook),
            "exit_setup": EXIT_SETUP,
            "exit_blocked": EXIT_BLOCKED,
            "exit_memory": EXIT_MEMORY,
            "exit_file_size": EXIT_FILE_SIZE,
        }
        argv = [*argv_unshare, _PYTHON, "-I", "-S", "-B", "-c", f"{_child_source()}\nmain({config!r})\n"]
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
            pass_fds=(status_w,),
            start_new_session=True,
        )
        os.close(status_w)
        status_w = -1
        out, err, timed_out = _communicate(
            proc, stdin.encode("utf-8", "surrogatepass"), limits, start + float(limits.wall_s)
        )
        outer_code, outer_cpu = _kill_and_reap(proc)
        reaped = True
        out2, err2 = _drain(proc, limits, len(out), len(err))
        out, err = out + out2, err + err2
        report = _read_status(status_r)
        stderr = err.decode("utf-8", errors="replace")
        if report is None:  # init never reported: killed with the group (timeout), or nothing started
            if not timed_out:
                raise SandboxUnavailable(f"the sandbox did not start (exit {outer_code}): {stderr.strip()[-500:]}")
            returncode, cpu_used = -signal.SIGKILL, outer_cpu  # ours
            stderr = stderr.replace("unshare: sigprocmask unblock failed: Invalid argument\n", "")  # its SIGKILL
        else:
            ready, wait_status, cpu_used = report
            if not ready and not timed_out:
                how = f"wait status {wait_status}" if wait_status < 0 else describe_exit(wait_status)
                raise SandboxUnavailable(stderr.strip()[-500:] or f"the child ended before it was confined ({how})")
            returncode = os.waitstatus_to_exitcode(wait_status) if wait_status >= 0 else None
        if returncode == -signal.SIGSYS and not timed_out:
            stderr += "\nsandbox: blocked a system call the seccomp filter forbids (the kernel sent SIGSYS)\n"
        return Result(
            status=_classify(returncode, timed_out, cpu_used, limits),
            returncode=returncode,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=stderr,
            wall_s=time.monotonic() - start,
            pid=proc.pid,
            workdir=workdir,
        )
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
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


def _read_status(fd: int) -> tuple[bool, int, float] | None:
    """The init's report (ready, wait status, CPU seconds of the child), None when it wrote none. Its writer is
    gone by now (init exited or was killed), so reading ends at end of file."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
        if len(data) > 4096:
            return None
    parts = data.decode("ascii", "replace").split()
    if len(parts) != 3:
        return None
    try:
        return parts[0] == "1", int(parts[1]), float(parts[2])
    except ValueError:
        return None


def _classify(returncode: int | None, timed_out: bool, cpu_used: float, limits: Limits) -> str:
    """The status of a finished child (see `Result`)."""
    if timed_out:
        return "timeout"
    if returncode is None:
        return "error"
    if returncode == 0:
        return "ok"
    if returncode == EXIT_BLOCKED or returncode == -signal.SIGSYS:  # the audit hook, or the seccomp filter
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
    """Kill whatever is left of a run and reap it: SIGKILL the namespace's init first (the kernel then kills
    every process in the namespace, and init's exit waits for them; unshare(1) reaps init and exits), then the
    whole process group (unshare itself, which may be a zombie by now: its group id is still its own), then
    reap unshare. Returns (unshare's returncode, CPU seconds of the whole tree that was reaped)."""
    for init in _children(proc.pid):
        try:
            os.kill(init, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + _DRAIN_S
    pause = 0.001
    while not _exited(proc.pid) and time.monotonic() < end:  # unshare reaps init, then exits
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
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


def _children(pid: int) -> list[int]:
    """The pids of `pid`'s live children (unshare has one: the namespace's init)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


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


def describe_exit(wait_status: int) -> str:
    """`exit 1`, `killed by SIGKILL`: a wait status in words."""
    code = os.waitstatus_to_exitcode(wait_status)
    return f"exit {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"


def _workdir_parent() -> tuple[str, bool]:
    """Where the throwaway folders go, and whether `nobody` can reach them there: the temporary folder, unless
    a folder above it is closed to others (a TMPDIR under a private folder), then /tmp. Where neither is
    open to others, the child keeps the worker's uid (without capabilities) rather than lose its folder."""
    for parent in (tempfile.gettempdir(), "/tmp"):
        try:
            if _traversable_by_others(parent):
                return parent, True
        except OSError:
            continue
    return tempfile.gettempdir(), False


def _traversable_by_others(path: str, *, readable: bool = False) -> bool:
    """Whether every folder down to `path` lets others through (and, with `readable`, others may read it)."""
    here = "/"
    for part in [p for p in os.path.realpath(path).split("/") if p]:
        here = os.path.join(here, part)
        if not os.stat(here).st_mode & 0o001:
            return False
    return not readable or bool(os.stat(here).st_mode & 0o004)


def _tasks_of(uid: int) -> int:
    """The tasks (threads included) `uid` runs on the machine now: RLIMIT_NPROC counts them all."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat("/proc/" + entry).st_uid == uid:
                    count += max(1, os.stat("/proc/" + entry + "/task").st_nlink - 2)
            except OSError:
                pass
    return count


@functools.cache
def _unshare_argv() -> tuple[str, ...]:
    """The unshare(1) command line that puts the child in its namespaces (a user namespace too, mapping its
    root to the worker's uid, when the worker is not root)."""
    path = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise SandboxUnavailable("unshare(1) (util-linux) is not installed")
    argv = [path, "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--ipc", "--uts", "--mount"]
    if os.geteuid() != 0:
        argv += ["--user", "--map-root-user"]
    return tuple(argv)


# System calls that kill the process (SIGSYS) whatever their arguments: process creation and execution, other
# processes, devices and FIFOs, sockets, mounts and namespaces, kernel modules and keys, clocks, tracing.
_DENIED_SYSCALLS = (
    "execve", "execveat", "fork", "vfork", "tkill", "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "ptrace",
    "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "mknod", "mknodat", "socket",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "syslog", "acct",
    "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "iopl", "ioperm", "personality", "name_to_handle_at", "open_by_handle_at", "lookup_dcookie", "vhangup",
    "uselib", "fanotify_init",
)  # fmt: skip
_SIGNALS_TO_OWN_PID = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")  # argument 0 is the target pid
_CLONE_THREAD = 0x00010000


@functools.cache
def _seccomp_program(own_pid: int) -> bytes:
    """The child's seccomp filter as classic BPF, compiled by libseccomp for this machine's architecture
    (the layer 5 list of the module docstring). Compiled once per process; the child loads it with prctl."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # the binding, or libseccomp.so.2 itself, is missing
        raise SandboxUnavailable(f"libseccomp is not available: {e}") from None
    kill = sc.KILL_PROCESS
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, kill)  # x32 or i386 system calls on x86-64
    for name in _DENIED_SYSCALLS:
        try:
            f.add_rule(kill, name)
        except (ValueError, RuntimeError, OSError):  # no such system call on this architecture (e.g. arm64 fork)
            continue
    f.add_rule(kill, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))  # a process, not a thread
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags are in memory the filter cannot read
    for name in _SIGNALS_TO_OWN_PID:
        f.add_rule(kill, name, sc.Arg(0, sc.NE, own_pid))
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        return fh.read()


@functools.cache
def _child_source() -> str:
    return _CHILD.read_text(encoding="utf-8")
