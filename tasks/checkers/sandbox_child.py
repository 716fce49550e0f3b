"""The child side of the sandbox (tasks/checkers/sandbox.py): this whole file is the program the confined
interpreter runs (`unshare ... python -I -S -B -c <this file>` plus a call of `main(cfg)`), so it is standard
library only and reads nothing from the worker's modules.

Two processes run it, both inside the namespaces `unshare(1)` made (PID, mount with a fresh /proc, network,
IPC, UTS; and a user namespace when the worker is not root):

- `main`, PID 1 of the new PID namespace: an init that never runs untrusted code. It caps the number of tasks
  in the namespace (`/proc/sys/kernel/pid_max`, per PID namespace since Linux 6.14), forks PID 2, waits for it
  and reports on a pipe only the worker holds the other end of: whether PID 2 finished confining itself, its
  wait status and its CPU time. When PID 1 exits, the kernel kills whatever is left in the namespace.
- `_confined`, PID 2: applies the confinement in order (resource limits; `nobody` or no capabilities;
  no_new_privs; Landlock; the seccomp filter the worker compiled with libseccomp; the audit hook), says it is
  ready, and only then runs the untrusted code as `__main__`. A failure before "ready" is the sandbox's (the
  worker raises `SandboxUnavailable`); nothing the untrusted code does can produce it.

The kernel-enforced layers are the boundary; the audit hook (PEP 578) in front of them is policy: it refuses
by name, with a readable "sandbox: blocked <what>", what the kernel refuses anyway, plus a few things the
kernel layers cannot see (reaching the hook's own objects). References: landlock(7) and the kernel's Landlock
documentation (https://docs.kernel.org/userspace-api/landlock.html: ABI versions, rule structures),
seccomp(2) (SECCOMP_MODE_FILTER through prctl), pid_namespaces(7), capabilities(7), setrlimit(2), PEP 578."""

import os

# Landlock (include/uapi/linux/landlock.h): system calls (the same numbers on x86-64 and arm64), access rights.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_MAKE_CHAR, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK = 1 << 6, 1 << 9, 1 << 10, 1 << 11
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # what a rule on a file may grant


def main(cfg: dict) -> None:
    """PID 1 of the sandbox's PID namespace: fork the confined child, wait, report (see the module docstring)."""
    status_fd = cfg["status_fd"]
    if os.getpid() != 1:  # not in a fresh PID namespace: the filter's own-pid rules would be wrong
        os.write(2, b"sandbox: cannot confine the child: not PID 1 of a new PID namespace\n")
        os._exit(cfg["exit_setup"])
    try:  # a thread bomb stops here (the kernel refuses values below its minimum, 301: then RLIMIT_NPROC only)
        with open("/proc/sys/kernel/pid_max", "w") as f:
            f.write(f"{cfg['pid_max']}\n")
    except OSError:
        pass
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(ready_r)
            os.close(status_fd)
            _confined(cfg, ready_w)  # ends with os._exit; returning means its exit was bypassed (a tracer)
        finally:
            os._exit(cfg["exit_blocked"])  # before "ready": a setup failure all the same
    os.close(ready_w)
    for fd in (0, 1, 2):  # the pipes to the worker are the child's alone
        os.close(fd)
    ready = b""
    while chunk := os.read(ready_r, 1):
        ready += chunk
    status, cpu = -1, 0.0
    while True:
        try:
            pid, wstatus, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            status, cpu = wstatus, usage.ru_utime + usage.ru_stime
    os.write(status_fd, f"{int(ready == b'1')} {status} {cpu:.6f}\n".encode())
    os._exit(0)


def _landlock(ctypes, libc, *, read: list[str], write: list[str], read_write_files: list[str]) -> int:
    """Restrict this process's file system access to `read` (read and execute beneath each path), `write`
    (everything but creating devices, FIFOs and sockets) and `read_write_files`; with ABI 4 no TCP bind or
    connect, with ABI 6 no signal and no abstract UNIX socket outside this Landlock domain. Returns the ABI
    version. Raises OSError when Landlock is unavailable. Needs no_new_privs (or CAP_SYS_ADMIN)."""
    import stat
    import struct

    syscall = libc.syscall
    abi = syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        raise OSError(ctypes.get_errno(), "Landlock is not available (Linux >= 5.13 with landlock in lsm=)")
    handled = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    handled |= (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (FS_IOCTL_DEV if abi >= 5 else 0)
    net = 0b11 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, no rule grants them
    scoped = 0b11 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET | SIGNAL
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # struct landlock_ruleset_attr grew with the ABI
    attr = ctypes.create_string_buffer(struct.pack("=QQQ", handled, net, scoped), 24)
    ruleset = syscall(SYS_LANDLOCK_CREATE_RULESET, attr, size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    reading = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    writing = handled & ~(FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_MAKE_FIFO | FS_MAKE_SOCK | FS_IOCTL_DEV)
    try:
        rules = [(p, reading) for p in read] + [(p, writing) for p in write]
        rules += [(p, FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE) for p in read_write_files]
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:  # not on this machine
                continue
            try:
                rights &= handled if stat.S_ISDIR(os.fstat(fd).st_mode) else handled & FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)  # landlock_path_beneath_attr
                if syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0) != 0:  # LANDLOCK_RULE_PATH_BENEATH
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


def _seccomp(ctypes, libc, program: bytes) -> None:
    """Load a classic-BPF seccomp filter (the worker compiled it with libseccomp): from here on the kernel
    checks every system call of this process and of the threads it starts. Needs no_new_privs."""
    if not program or len(program) % 8:
        raise OSError(0, "no seccomp program")

    class SockFprog(ctypes.Structure):  # struct sock_fprog
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(code, ctypes.c_void_p))
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _confined(cfg: dict, ready_fd: int) -> None:
    """PID 2: confine this process, write "1" on `ready_fd`, then run the untrusted code as `__main__`.

    Once that code runs, it can rebind any name in `builtins` and any module attribute, so everything this
    function uses afterwards is bound to a local name first, and the hook's helpers get theirs as default
    arguments: no closures, no globals, no mutable state, and no call into an object the code made. (A
    tracer can still rebind this frame's locals, `_exit` included; if the final `_exit` is bypassed that way,
    interpreter finalization raises cpython._PySys_ClearAuditHooks, which the hook answers with the
    "blocked" exit.)"""
    import atexit
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

    def fail(what):  # before the code runs: the sandbox's failure, never the code's
        os.write(2, ("sandbox: cannot confine the child: " + what + "\n").encode("utf-8", "backslashreplace"))
        _exit(cfg["exit_setup"])

    def readable_by_others(path):
        here = "/"
        for part in [p for p in os.path.realpath(path).split("/") if p]:
            here = os.path.join(here, part)
            if not os.stat(here).st_mode & 0o001:
                return False
        return bool(os.stat(here).st_mode & 0o004)

    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        # `nobody` when the worker is root (uid 0 here is the machine's root) and the interpreter's library stays
        # readable afterwards; otherwise uid 0 without any capability: the machine's root (a pyenv under /root,
        # mode 700, as on the dev machines) or, for a worker that is not root, the user namespace's root, which
        # is the worker's own uid outside it.
        drop = cfg["worker_root"] and cfg["may_drop"]
        drop = drop and all(readable_by_others(p) for p in sys.path if os.path.isdir(p))
        uid, gid = (cfg["drop_uid"], cfg["drop_gid"]) if drop else (os.getuid(), os.getgid())
        nproc = cfg["nproc_nobody"] if drop else cfg["nproc_worker"]
        resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
        for which, value in (
            (resource.RLIMIT_AS, cfg["memory_bytes"]),
            (resource.RLIMIT_FSIZE, cfg["file_bytes"]),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_NOFILE, cfg["nofile"]),
            (resource.RLIMIT_NPROC, nproc),  # the kernel never applies it to the machine's root
        ):
            resource.setrlimit(which, (value, value))
        for cap in range(64):  # PR_CAPBSET_DROP (EINVAL past the last capability)
            libc.prctl(24, cap, 0, 0, 0)
        if drop:
            os.chown(workdir, uid, gid)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)  # clears the capabilities
            libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/fd stays ours (the hook reads it)
        else:  # securebits NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, locked; then no capability at all
            libc.prctl(28, 0x2F, 0, 0, 0)
            header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
            if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # effective, permitted, inheritable: empty
                raise OSError(ctypes.get_errno(), "capset")
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: no setuid binary or file capability helps
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        real = os.path.realpath
        library = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, real(sys.executable)]
        library += [p for p in sys.path if p.startswith("/")]
        # /proc: this PID namespace's own (unshare --mount-proc), the sandbox's two processes
        system = ["/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/usr/share/zoneinfo",
                  "/etc/ld.so.cache", "/etc/localtime", "/etc/timezone", "/etc/os-release", "/etc/mime.types",
                  "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/dev/urandom", "/dev/random", "/dev/zero",
                  "/proc"]  # fmt: skip
        _landlock(ctypes, libc, read=library + system, write=[workdir], read_write_files=["/dev/null"])
        os.chdir(workdir)
        os.umask(0o077)
        if os.getpid() != cfg["own_pid"]:
            raise OSError(0, f"PID {os.getpid()}, the filter expects {cfg['own_pid']}")
        _seccomp(ctypes, libc, cfg["seccomp"])
    except BaseException as e:  # noqa: BLE001 - whatever it is, the code must not run
        fail(f"{type(e).__name__}: {e}")
    for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
        del sys.modules[name]
    del ctypes, libc

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

    hook = None
    if cfg["audit_hook"]:  # off only in the tests that show the kernel layers hold on their own
        hook, no_fork_exec = make_hook()
        # No event covers _posixsubprocess.fork_exec (what subprocess and multiprocessing call): swap it for a
        # stub, and refuse any fresh import of the module (deny_modules).
        import _posixsubprocess

        _posixsubprocess.fork_exec = no_fork_exec
        del no_fork_exec

    # -- run the code as __main__ --------------------------------------------------------------------------------
    excepthook, stdout, stderr = sys.__excepthook__, sys.stdout, sys.stderr
    module = _type(sys)("__main__")
    module.__file__ = script
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = [script]
    exit_code = 1
    if hook is not None:
        sys.addaudithook(hook)
    del hook, make_hook
    os.write(ready_fd, b"1")  # confined: from here on, how the process ends is the code's doing
    os.close(ready_fd)
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
