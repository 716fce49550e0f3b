"""tasks.checkers.sandbox: untrusted code runs, fails, is stopped or is refused, and leaves nothing behind (no
process in its group, no folder). Tests address nothing but 127.0.0.1. `-s` shows the release-note table."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tasks.checkers import sandbox
from tasks.checkers.sandbox import Limits, Result, run_python

pytestmark = pytest.mark.unit

LIMITS = Limits(wall_s=10.0, cpu_s=5)


def _processes() -> list[tuple[int, list[str]]]:
    """(pid, the fields after `(comm)` of /proc/<pid>/stat: state ppid pgrp ...) of every live process."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        out.append((int(entry), stat[stat.rindex(")") + 2 :].split()))
    return out


def _group_members(pgid: int) -> list[int]:
    """pids of the live (non-zombie) processes whose process group is `pgid`."""
    return [pid for pid, f in _processes() if int(f[2]) == pgid and f[0] != "Z"]


def _our_children() -> list[int]:
    """pids of the processes (zombies included) whose parent is this test process."""
    return [pid for pid, f in _processes() if int(f[1]) == os.getpid()]


def _clean(result: Result) -> Result:
    """Every run leaves no process in its group, no child of ours and no folder."""
    assert result.pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(result.pid, 0)
    assert _group_members(result.pid) == []
    assert result.pid not in _our_children()
    assert result.workdir and not os.path.exists(result.workdir), result.workdir
    assert result.status in sandbox.STATUSES
    return result


def run(code: str, limits: Limits = LIMITS, **kw) -> Result:
    return _clean(run_python(code, limits=limits, **kw))


# ---- ordinary outcomes -------------------------------------------------------------------------------------


def test_correct_code_is_ok_with_its_stdout():
    code = "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\nprint('sum', add(2, 3))\n"
    r = run(code)
    assert (r.status, r.returncode, r.stdout, r.passed) == ("ok", 0, "sum 5\n", True)
    assert r.wall_s < 5


def test_a_failing_assert_is_an_error_with_its_traceback():
    r = run("def add(a, b):\n    return a - b\n\nassert add(2, 3) == 5, 'wrong sum'\n")
    assert (r.status, r.returncode, r.passed) == ("error", 1, False)
    assert "AssertionError: wrong sum" in r.stderr
    assert "_child_main" not in r.stderr  # the traceback starts at the code, not at the prelude


def test_exit_codes_syntax_errors_and_stdin():
    assert run("import sys\nsys.exit(3)").returncode == 3
    assert run("import sys\nsys.exit(3)").status == "error"
    assert run("import sys\nsys.exit(0)").status == "ok"
    r = run("def f(:\n    pass\n")
    assert r.status == "error" and "SyntaxError" in r.stderr
    r = run("print(input()[::-1])", stdin="olleh\n")
    assert (r.status, r.stdout) == ("ok", "hello\n")
    r = run("try:\n    import readline\nexcept ImportError:\n    print('no readline')\n")  # optional: no refusal
    assert (r.status, r.stdout) == ("ok", "no readline\n")


def test_doctest_examples_and_the_usual_standard_library_run():
    code = '''
import asyncio, collections, concurrent.futures, csv, dataclasses, datetime, decimal, doctest, fractions, functools
import hashlib, heapq, inspect, io, itertools, json, math, pathlib, pprint, random, re, statistics, string
import subprocess, tempfile, textwrap, threading, typing, unittest, uuid

def median(xs):
    """
    >>> median([3, 1, 2])
    2
    >>> median([4, 1, 3, 2])
    2.5
    """
    return statistics.median(xs)

assert doctest.testmod().failed == 0
with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert sorted(pool.map(abs, [-2, 1])) == [1, 2]
Point = collections.namedtuple("Point", "x y", defaults=[0])
assert Point(1) == (1, 0)
with tempfile.TemporaryDirectory() as d:
    (pathlib.Path(d) / "x.json").write_text(json.dumps({"a": 1}))
    assert json.loads((pathlib.Path(d) / "x.json").read_text()) == {"a": 1}
assert asyncio.run(asyncio.sleep(0, result=7)) == 7
open("/dev/null", "w").write("discarded")
print("fine")
'''
    r = run(code)
    assert (r.status, r.stdout) == ("ok", "fine\n"), r.stderr


def test_output_is_capped():
    r = run(
        "import sys\nsys.stdout.write('x' * 1_000_000)\nsys.stderr.write('y' * 1_000_000)",
        Limits(max_output_bytes=1000),
    )
    assert r.status == "ok"
    assert r.stdout == "x" * 1000 and r.stderr == "y" * 1000


# ---- runaway code ------------------------------------------------------------------------------------------


def test_a_busy_loop_hits_the_cpu_limit_and_its_group_is_gone():
    # wall_s leaves room for a loaded 2-core machine: one CPU second can take more than one wall second there.
    r = run("while True:\n    pass\n", Limits(wall_s=5.0, cpu_s=1))
    assert r.status == "cpu_limit", (r.returncode, r.stderr)
    assert r.returncode == -signal.SIGXCPU
    assert 0.9 < r.wall_s < 5.0


def test_a_sleeping_loop_hits_the_wall_clock_and_its_group_is_gone():
    r = run("import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.1)\n", Limits(wall_s=2.0))
    assert r.status == "timeout"
    assert r.returncode == -9
    assert r.stdout == "started\n"  # what it printed before is kept
    assert 2.0 <= r.wall_s < 6.0


def test_a_large_allocation_hits_the_memory_limit():
    r = run("x = bytearray(4 * 1024**3)\n", Limits(memory_mb=256))
    assert r.status == "memory_limit", (r.returncode, r.stderr)
    assert "MemoryError" in r.stderr


def test_a_large_file_hits_the_file_size_limit():
    r = run("with open('big.bin', 'wb') as f:\n    f.write(b'x' * (10 * 1024 * 1024))\n", Limits(file_mb=1))
    assert r.status == "file_limit", (r.returncode, r.stderr)
    assert "File too large" in r.stderr


# ---- refused operations ------------------------------------------------------------------------------------


def test_a_fork_bomb_is_blocked_and_no_process_is_left():
    before = _our_children()
    r = run("import os\nwhile True:\n    os.fork()\n")
    assert r.status == "blocked" and r.returncode == sandbox.EXIT_BLOCKED
    assert "sandbox: blocked os.fork" in r.stderr
    assert _our_children() == before


def test_subprocess_and_other_process_creation_is_blocked():
    r = run("import subprocess\nsubprocess.run(['echo', 'hi'])\n")
    assert r.status == "blocked" and "subprocess.Popen" in r.stderr
    assert "hi" not in r.stdout
    for code in (
        "import os\nos.system('echo hi')",
        "import os\nos.execv('/bin/echo', ['echo', 'hi'])",
        "import os\nos.posix_spawn('/bin/echo', ['echo', 'hi'], {})",
        "import _posixsubprocess\n_posixsubprocess.fork_exec()",  # no audit event covers it: a stub
        "import multiprocessing\np = multiprocessing.Process(target=print)\np.start()\np.join()",
        "import os\nos.kill(os.getppid(), 0)",  # signal 0: harmless if the sandbox ever let it through
    ):
        r = run(code)
        assert r.status == "blocked", (code, r.returncode, r.stderr)
        assert "hi" not in r.stdout


def test_catching_the_refusal_does_not_help():
    r = run("import os\ntry:\n    os.fork()\nexcept BaseException:\n    pass\nprint('survived')\n")
    assert r.status == "blocked"
    assert "survived" not in r.stdout
    r = run("import atexit, os\natexit.register(os.system, 'echo hi')\nprint('registered')\n")
    assert r.status == "blocked" and r.stdout == "registered\n"  # atexit handlers run under the hook


def test_ctypes_is_blocked():
    r = run("import ctypes\nctypes.CDLL(None)\n")
    assert r.status == "blocked" and "ctypes" in r.stderr


def test_writes_outside_the_folder_are_blocked_and_inside_work(tmp_path):
    target = tmp_path / "target.txt"
    r = run(f"open({str(target)!r}, 'w').write('x')\n")
    assert r.status == "blocked" and "open for writing" in r.stderr
    assert not target.exists()
    for code in (
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os\nos.mkdir({str(tmp_path / 'sub')!r})",
        f"import os\nos.rename('main.py', {str(target)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        "import os\nos.symlink('/etc', 'etc')",
        "import os\nos.chdir('/tmp')",
        "open('../escape.txt', 'w')",
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\nos.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        "import sqlite3\nsqlite3.connect('/tmp/sandbox-escape.db')",
    ):
        r = run(code)
        assert r.status == "blocked", (code, r.returncode, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert not os.path.exists("/tmp/sandbox-escape.db")
    inside = """
import os, pathlib, shutil
open("out.txt", "w").write("hello")
os.mkdir("d")
os.rename("out.txt", "d/o.txt")
pathlib.Path("d/touched").touch()
fd = os.open("d", os.O_RDONLY)
os.close(os.open("x", os.O_CREAT, dir_fd=fd))  # relative to the descriptor: d/x
print(open("d/o.txt").read(), os.getcwd() == os.environ["HOME"], sorted(os.listdir("d")))
shutil.rmtree("d")
"""
    r = run(inside)
    assert (r.status, r.stdout) == ("ok", "hello True ['o.txt', 'touched', 'x']\n"), r.stderr


def test_the_workers_secrets_cannot_be_read():
    # The parent's environment (/proc/<pid>/environ) is where a worker's credentials live.
    r = run("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())\n")
    assert r.status == "blocked" and "open for reading" in r.stderr
    assert r.stdout == ""
    r = run("import os\nprint(sorted(os.environ))\n")
    assert r.stdout == "['HOME', 'LANG', 'LC_ALL', 'MALLOC_ARENA_MAX', 'PATH', 'TMPDIR']\n"


def test_a_connection_to_our_own_server_is_blocked():
    accepted: list[socket.socket] = []
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:  # timeout
                continue
            accepted.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'exfil')\n"
        r = run(code)
        assert r.status == "blocked" and "socket" in r.stderr
        time.sleep(0.3)  # a connection that got through would have been accepted by now
        assert accepted == []
        for code in (
            "import socket\nsocket.socket(socket.AF_UNIX).connect('/tmp/no-such-sandbox-test.sock')",
            "import socket\nsocket.socket(socket.AF_INET6)",
            "import socket\nsocket.getaddrinfo('127.0.0.1', 80)",
        ):
            r = run(code)
            assert r.status == "blocked", (code, r.returncode, r.stderr)
    finally:
        stop.set()
        thread.join(5)
        server.close()
        for conn in accepted:
            conn.close()


def test_the_hook_cannot_be_reached_or_unhooked():
    for code in (
        "import gc\ngc.get_objects()",
        "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
        "import _xxsubinterpreters as x\nx.create()",
        "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",
        "import _posixsubprocess\n_posixsubprocess.fork_exec.__defaults__ = (print,)",
    ):
        r = run(code)
        assert r.status == "blocked", (code, r.returncode, r.stderr)


def test_bypassing_the_preludes_exit_still_ends_blocked():
    # A tracer rebinds the prelude's `_exit` to a no-op, hoping for interpreter finalization (hooks cleared, a
    # __del__ running free): finalization's own audit event ends the run instead.
    code = """
import sys

def tracer(frame, event, arg):
    if frame.f_code.co_name == "_confined":
        frame.f_locals["_exit"] = lambda code: None
    return tracer

class Bomb:
    def __del__(self):
        import os
        os.system("echo escaped")

bomb = Bomb()
sys._getframe(1).f_trace = tracer
sys.settrace(tracer)
print("armed", flush=True)
"""
    r = run(code)
    assert r.status == "blocked", (r.returncode, r.stderr)
    assert r.stdout == "armed\n"


# ---- the layers under the hook -----------------------------------------------------------------------------

PROBE = """
import os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(os.getuid(), status["CapEff"].strip(), status["NoNewPrivs"].strip(), os.readlink("/proc/self/ns/net"))
"""


def _can_unshare() -> bool:
    """Whether a process of ours may enter a new network namespace (not in a default Docker container)."""
    flags = 0x40000000 if os.geteuid() == 0 else 0x50000000  # CLONE_NEWNET (| CLONE_NEWUSER)
    code = f"import ctypes; print(ctypes.CDLL(None, use_errno=True).unshare({flags}))"
    probe = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    return probe.stdout.strip() == "0"


def test_the_child_runs_in_its_own_network_namespace_without_privileges():
    r = run(PROBE)
    assert r.status == "ok", r.stderr
    uid, cap_eff, no_new_privs, netns = r.stdout.split()
    assert no_new_privs == "1"
    assert int(cap_eff, 16) == 0  # uid 0 (here), nobody, or a user namespace's root: no capability
    if _can_unshare():
        assert netns != os.readlink("/proc/self/ns/net")


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/usr/bin/python3.11", os.X_OK), reason="needs root and a system Python"
)
def test_a_root_worker_with_a_world_readable_python_drops_to_nobody(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "_PYTHON", "/usr/bin/python3.11")
    probe = subprocess.run(
        ["/usr/bin/python3.11", "-I", "-S", "-c", "import sys; print(sys.path)"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip("the system Python does not start")
    code = "import shutil\nopen('w.txt', 'w')\nos.makedirs('a/b')\nshutil.rmtree('a')\nprint(sorted(os.listdir()))\n"
    r = run(PROBE + code)  # the folder is handed to `nobody`; rmtree's dir_fd walk still resolves
    assert r.status == "ok", r.stderr
    first, second = r.stdout.splitlines()
    assert second == "['main.py', 'w.txt']"
    uid, cap_eff, no_new_privs, netns = first.split()
    assert (int(uid), int(cap_eff, 16), no_new_privs) == (sandbox._nobody()[0], 0, "1")
    assert netns != os.readlink("/proc/self/ns/net") or not _can_unshare()
    target = tmp_path / "t"
    r = run(f"import os\nos.fork()\nopen({str(target)!r}, 'w')")
    assert r.status == "blocked" and not target.exists()


def test_a_temporary_folder_closed_to_others_still_runs(monkeypatch, tmp_path):
    """TMPDIR under a private folder (pytest's own, mode 700): the throwaway folder goes to /tmp, where the
    child can still reach it after it drops to `nobody`."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    r = run("import os\nprint(os.getcwd())\nopen('w.txt', 'w').write('x')\n")
    assert r.status == "ok", r.stderr
    assert not r.stdout.startswith(str(private)) or sandbox._traversable_by_others(str(private))


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Limits(wall_s=0)
    with pytest.raises(ValueError):
        Limits(memory_mb=0)


# ---- the boundary: every attack, in each setup, with the audit hook on and off ----------------------------------
#
# Each attack prints ESCAPED if its operation went through; the test also looks from outside (the victim process
# lives, no file appeared, the server accepted nothing, the secret was not printed). With the hook off only the
# kernel layers (namespaces, Landlock, seccomp, privileges) stand between the code and the machine.

_SYSCALLS = {"x86_64": {"kill": 62}, "aarch64": {"kill": 129}}[os.uname().machine]
_FORK_EXEC = (  # what subprocess passes to _posixsubprocess.fork_exec on 3.11 (23 arguments)
    "r, w = os.pipe()\n"
    "pid = m.fork_exec([b'/bin/sh', b'-c', b'echo x > {outside}/sh'], [b'/bin/sh'], True, (w,), None, None,"
    " -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)\n"
)
ATTACKS = {
    "pidfd_send_signal to a worker process": "import signal\nsignal.pidfd_send_signal(os.pidfd_open({victim}), 15)",
    "os.kill of a worker process": "os.kill({victim}, 15)",
    "os.kill of the namespace's init": "os.kill(1, 9)",
    "_imp rebuilds _posixsubprocess, /bin/sh": "import _imp, importlib.machinery as im, importlib.util as iu\n"
    "m = _imp.create_builtin(im.ModuleSpec('_posixsubprocess', None))\n"
    "if m is None:  # not built in: an extension module of lib-dynload\n"
    "    m = iu.module_from_spec(im.PathFinder.find_spec('_posixsubprocess'))\n" + _FORK_EXEC,
    "subprocess.run(['/bin/sh', ...])": "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'echo x > {outside}/sh'])",
    "os.execv('/bin/sh')": "os.execv('/bin/sh', ['sh', '-c', 'echo x > {outside}/sh'])",
    "os.mkfifo outside the folder": "os.mkfifo('{outside}/fifo')",
    "os.mknod outside the folder": "import stat\nos.mknod('{outside}/node', stat.S_IFREG | 0o644)",
    "os.mkfifo in the folder": "os.mkfifo('fifo')",
    "ctypes: kill(2) of a worker process": "import ctypes\nassert ctypes.CDLL(None).syscall({kill}, {victim}, 15) == 0",
    "ctypes: fork()": "import ctypes\nassert ctypes.CDLL(None).fork() >= 0",
    "ctypes: unshare(CLONE_NEWUSER)": "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0",
    "/proc of other processes": "print(sorted(p for p in os.listdir('/proc') if p.isdigit()), flush=True)\n"
    "print(open('/proc/{victim}/environ').read())",
    "/proc/1/environ (the namespace's init)": "print(open('/proc/1/environ').read())",
    "threads until the namespace is full": "import threading, time\nthreading.stack_size(1 << 16)\nn = 0\ntry:\n"
    "    while n < 2000:\n"
    "        threading.Thread(target=time.sleep, args=(3,), daemon=True).start()\n        n += 1\n"
    "except RuntimeError:\n    print('threads', n)\n    raise\nprint('threads', n)",
    "connect to the worker's 127.0.0.1 server": "import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)",
    "write a file outside the folder": "open('{outside}/w', 'w').write('x')",
    "read a file outside the folder": "print(open('{secret}').read())",
    "hard link a file outside into the folder": "os.link('{secret}', 'l')\nprint(open('l').read())",
    "symlink out of the folder, read through it": "os.symlink('{secret}', 's')\nprint(open('s').read())",
}


def _attack_program(body: str, **values) -> str:
    return "import os\n" + body.format(**values) + "\nprint('ESCAPED')\n"


_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import sandbox
jobs = json.loads(open(sys.argv[2]).read())
out = []
for code in jobs:
    r = sandbox.run_python(code, limits=sandbox.Limits(wall_s=10.0, cpu_s=5), audit_hook=False)
    out.append([r.status, r.stdout, r.stderr])
print(json.dumps(out))
"""


def _unprivileged_worker(programs: list[str], python: str, shared: Path) -> list[tuple[str, str, str]]:
    """Run `programs` through run_python in a worker that is `nobody` (a copy of the sandbox and its libseccomp
    binding in a folder `nobody` can read, the system Python): the unprivileged setup."""
    import pyseccomp

    for src in (Path(sandbox.__file__), sandbox._CHILD, Path(pyseccomp.__file__)):
        (shared / src.name).write_text(src.read_text())
    jobs = shared / "jobs.json"
    jobs.write_text(json.dumps(programs))
    for p in shared.iterdir():
        p.chmod(0o644)
    uid, gid = sandbox._nobody()
    done = subprocess.run(
        [python, "-I", "-c", _DRIVER, str(shared), str(jobs)], capture_output=True, text=True, user=uid,
        group=gid, extra_groups=[], cwd=shared, env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"}, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [tuple(r) for r in json.loads(done.stdout)]


def test_the_boundary_holds_in_every_setup(monkeypatch):
    """Every attack of the table is refused: by the audit hook and kernel as root (the product's default),
    and by the kernel alone (hook off) with the child as root without capabilities, as `nobody`, and in a
    worker that is itself unprivileged (user namespace). Run by a user other than root, the test is that
    unprivileged worker itself, hook on and off. `-s` prints the table."""
    root = os.geteuid() == 0
    candidates = [sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"]
    usable = [p for p in candidates if os.access(p, os.X_OK) and sandbox._traversable_by_others(p, readable=True)]
    if root and not usable:
        pytest.fail(f"the unprivileged setups need a Python of this version that `nobody` can run: {candidates}")
    python_nobody = usable[0] if usable else sys.executable
    base = Path(tempfile.mkdtemp(prefix="forgeline-boundary-", dir="/tmp"))
    victim = server = None
    try:
        base.chmod(0o755)
        outside, shared = base / "outside", base / "shared"
        outside.mkdir(mode=0o777)
        outside.chmod(0o777)  # writable by anyone: only the sandbox can keep the code out
        shared.mkdir()
        secret = base / "secret.txt"
        secret.write_text("forgeline-secret-token\n")
        secret.chmod(0o644)  # readable by anyone
        uid, gid = sandbox._nobody()
        as_nobody = {"user": uid, "group": gid, "extra_groups": []} if root else {}
        victim = subprocess.Popen(["sleep", "300"], env={"FORGELINE_VICTIM_SECRET": "forgeline-secret-token"},
                                  **as_nobody)  # fmt: skip
        server = socket.create_server(("127.0.0.1", 0))
        server.setblocking(False)
        values = {"victim": victim.pid, "outside": outside, "secret": secret, "port": server.getsockname()[1],
                  "kill": _SYSCALLS["kill"]}  # fmt: skip
        programs = {name: _attack_program(body, **values) for name, body in ATTACKS.items()}

        def runs(**kw) -> dict[str, tuple[str, str, str]]:
            out = {}
            for name, program in programs.items():
                r = _clean(run_python(program, limits=LIMITS, **kw))
                out[name] = (r.status, r.stdout, r.stderr)
            return out

        columns: dict[str, dict[str, tuple[str, str, str]]] = {}
        if root:
            monkeypatch.setattr(sandbox, "_DROP_TO_NOBODY", False)
            probe = run(PROBE)
            assert probe.stdout.split()[:2] == ["0", "0000000000000000"], probe  # uid 0, no capability
            columns["root, hook on"] = runs()
            columns["root, hook off"] = runs(audit_hook=False)
            monkeypatch.setattr(sandbox, "_DROP_TO_NOBODY", True)
            monkeypatch.setattr(sandbox, "_PYTHON", python_nobody)
            probe = run(PROBE)
            assert int(probe.stdout.split()[0]) == uid, probe
            columns["nobody, hook off"] = runs(audit_hook=False)
            results = _unprivileged_worker(list(programs.values()), python_nobody, shared)
            columns["unprivileged worker, hook off"] = dict(zip(programs, results, strict=True))
        else:
            columns["unprivileged worker, hook on"] = runs()
            columns["unprivileged worker, hook off"] = runs(audit_hook=False)

        rows, escapes = [], []
        for name in ATTACKS:
            cells = []
            for column, found in columns.items():
                status, stdout, stderr = found[name]
                refused = "ESCAPED" not in stdout and "forgeline-secret-token" not in stdout
                if name.startswith("/proc of"):  # only the sandbox's own two processes are there to see
                    refused = refused and stdout.splitlines()[:1] == ["['1', '2']"]
                if name.startswith("threads"):  # refused past the namespace's limit, well before 2000
                    counted = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("threads")]
                    refused = refused and counted != [] and counted[0] < sandbox._PID_MAX
                if not refused:
                    escapes.append((column, name, status, stdout[-300:], stderr[-300:]))
                how = "SIGSYS" if "seccomp" in stderr else "hook" if "sandbox: blocked" in stderr else "errno"
                if name.startswith("threads"):
                    how = f"{counted[0] if counted else '?'} threads"
                cells.append(f"{'refused' if refused else 'ESCAPED'} ({status}, {how})")
            rows.append((name, cells))
        assert victim.poll() is None, "the victim process was signalled"
        assert sorted(p.name for p in outside.iterdir()) == [], "a file appeared outside the folder"
        with pytest.raises(BlockingIOError):
            server.accept()
        assert escapes == [], escapes
        width = max(len(name) for name in ATTACKS)
        header = f"{'attack':<{width}} | " + " | ".join(f"{c:<30}" for c in columns)
        lines = [header, "-" * len(header)]
        lines += [f"{name:<{width}} | " + " | ".join(f"{c:<30}" for c in cells) for name, cells in rows]
        print("\n" + "\n".join(lines) + f"\n(python {sys.version.split()[0]}, kernel {os.uname().release})")
    finally:
        if victim is not None:
            victim.kill()
            victim.wait()
        if server is not None:
            server.close()
        shutil.rmtree(base, ignore_errors=True)


# ---- the release-note table --------------------------------------------------------------------------------


def test_release_note_table(tmp_path):
    """One run per case, printed as case | status | wall seconds (pytest -s shows it)."""
    target = tmp_path / "outside.txt"
    cases = [
        ("correct function + asserts", "def f(x):\n    return x * 2\nassert f(2) == 4\n", LIMITS, "ok"),
        ("failing assert", "assert 1 + 1 == 3\n", LIMITS, "error"),
        ("busy loop (cpu_s=1)", "while True:\n    pass\n", Limits(wall_s=5.0, cpu_s=1), "cpu_limit"),
        ("sleep loop (wall_s=2)", "import time\nwhile True:\n    time.sleep(0.1)\n", Limits(wall_s=2.0), "timeout"),
        ("4 GiB bytearray (memory_mb=256)", "x = bytearray(4 * 1024**3)\n", Limits(memory_mb=256), "memory_limit"),
        ("10 MB file (file_mb=1)", "open('f', 'wb').write(b'x' * 10**7)\n", Limits(file_mb=1), "file_limit"),
        ("fork bomb", "import os\nwhile True:\n    os.fork()\n", LIMITS, "blocked"),
        ("subprocess.run(['echo'])", "import subprocess\nsubprocess.run(['echo', 'hi'])\n", LIMITS, "blocked"),
        ("write outside the folder", f"open({str(target)!r}, 'w').write('x')\n", LIMITS, "blocked"),
        ("read the worker's environ", "import os\nopen(f'/proc/{os.getppid()}/environ').read()\n", LIMITS, "blocked"),
        ("connect to 127.0.0.1", "import socket\nsocket.create_connection(('127.0.0.1', 9), 1)\n", LIMITS, "blocked"),
        (
            "fork caught by the code",
            "import os\ntry:\n    os.fork()\nexcept BaseException:\n    pass\n",
            LIMITS,
            "blocked",
        ),
        ("ctypes.CDLL(None)", "import ctypes\nctypes.CDLL(None)\n", LIMITS, "blocked"),
    ]
    rows = []
    for name, code, limits, expected in cases:
        r = run(code, limits)
        rows.append((name, r.status, r.wall_s))
        assert r.status == expected, (name, r.returncode, r.stderr)
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'case':<{width}} | {'status':<12} | wall s", f"{'-' * width}-+-{'-' * 12}-+-------"]
    lines += [f"{name:<{width}} | {status:<12} | {wall:6.2f}" for name, status, wall in rows]
    print("\n" + "\n".join(lines) + f"\n(python {sys.version.split()[0]}, euid {os.geteuid()})")
