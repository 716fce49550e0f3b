"""The host-memory setting (tasks/host_memory.py): when `forgeline` asks glibc for huge pages, and that the
re-executed process really gets them from the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tasks.host_memory import TUNABLE, tuned_environ

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
NEW = dict(glibc=(2, 36), thp="madvise")


def test_the_tunable_is_added_once_beside_the_users_own():
    assert tuned_environ({"PATH": "/bin"}, **NEW) == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLE}
    mine = "glibc.malloc.arena_max=2"
    assert tuned_environ({"GLIBC_TUNABLES": mine}, **NEW)["GLIBC_TUNABLES"] == f"{mine}:{TUNABLE}"
    assert tuned_environ({"GLIBC_TUNABLES": mine}, glibc=(2, 39), thp="always")["GLIBC_TUNABLES"] == f"{mine}:{TUNABLE}"
    # already there (the re-executed process, a child, or the user's own choice of either value): nothing to do
    assert tuned_environ(tuned_environ({}, **NEW), **NEW) is None
    assert tuned_environ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, **NEW) is None


@pytest.mark.parametrize("environ,machine", [
    ({}, dict(glibc=(2, 34), thp="madvise")),  # glibc before 2.35 has no hugetlb tunable
    ({}, dict(glibc=None, thp="madvise")),  # musl, macOS
    ({}, dict(glibc=(2, 36), thp="never")),  # transparent huge pages off: the madvise would do nothing
    ({}, dict(glibc=(2, 36), thp=None)),  # no THP in this kernel
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}, NEW),  # another allocator's choice
    ({"LD_PRELOAD": "libjemalloc.so.2"}, NEW),
    ({"FORGELINE_HOST_MALLOC": "system"}, NEW),  # turned off
], ids=["old-glibc", "not-glibc", "thp-never", "no-thp", "tcmalloc", "jemalloc", "off"])
def test_nothing_changes_where_the_setting_cannot_help_or_is_not_wanted(environ, machine):
    assert tuned_environ(environ, **machine) is None


CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ.setdefault("FIRST_PID", str(os.getpid()))  # before the re-execution; kept across it
    from tasks.host_memory import reexec_tuned
    reexec_tuned()
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    n = 64 << 20  # 64 MiB from malloc, as XLA:CPU takes its temporaries (numpy would madvise on its own)
    block = libc.malloc(ctypes.c_size_t(n))
    ctypes.memset(block, 1, n)  # touch every page
    rollup = open("/proc/self/smaps_rollup").read().splitlines()
    touched = sum(ctypes.string_at(block, n)[::4096])
    huge = sum(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:"))
    print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES"), "first_pid": int(os.environ["FIRST_PID"]),
                      "pid": os.getpid(), "huge_kib": huge, "argv": sys.argv, "sum": touched}))
""")


def _child(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}  # as a shell would start `forgeline`
    env.update(PYTHONPATH=str(ROOT), **extra)
    done = subprocess.run([sys.executable, "-c", CHILD, "an-argument"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads Linux's /proc/self/smaps_rollup")
def test_the_reexecuted_process_gets_huge_pages_from_the_kernel():
    """The same process (PID, arguments) runs again with the tunable, and a 64 MiB malloc block sits on 2 MiB pages;
    with the setting off it does not (in the kernel's `madvise` mode). Where this machine cannot have it
    (`tuned_environ` says so), the command line runs once, unchanged."""
    tuned = _child()
    plain = _child(FORGELINE_HOST_MALLOC="system")
    assert tuned["pid"] == tuned["first_pid"] and tuned["argv"] == ["-c", "an-argument"]
    assert tuned["sum"] == plain["sum"] == (64 << 20) // 4096
    assert plain["tunables"] is None
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tuned_environ(env) is None:
        assert tuned["tunables"] is None
        return
    assert tuned["tunables"] == TUNABLE
    assert tuned["huge_kib"] >= 32 << 10, tuned  # most of the 64 MiB (the block's ends need not be 2 MiB-aligned)
    if "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert plain["huge_kib"] < 8 << 10, plain  # without the tunable nobody asks for them
