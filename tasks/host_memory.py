"""Host memory for XLA:CPU programs: glibc's malloc asked to back its large blocks with transparent huge pages.

XLA:CPU allocates a program's temporaries with the C library's `malloc` on every execution, and glibc serves
each block over 32 MiB (the most its mmap threshold can be raised to) with a fresh `mmap` that it unmaps on
`free`. A training step therefore touches hundreds of MB of new pages every time: each 4 KiB page costs a
page fault and zeroing: 2.2 M faults in 14 s of an EAGLE-3 training-step benchmark, and the default release
spent 3m11s of system time in a 7m58s run. With the blocks on 2 MiB pages the faults drop
~12x and the base pretraining runs 1.35x faster (9.6k -> 13.0k tokens/s) with bit-identical losses: only where
the memory sits changes.

glibc >= 2.35 does this on request: with the tunable `glibc.malloc.hugetlb=1` malloc issues
madvise(MADV_HUGEPAGE) on the memory it gets from mmap and sbrk (glibc 2.35 NEWS; the glibc manual,
"Memory Allocation Tunables"; libc-alpha, "malloc: Add madvise support for Transparent Huge Pages"), when
the kernel's transparent huge pages are in `madvise` or `always` mode (/sys/kernel/mm/transparent_hugepage/enabled;
kernel docs, admin-guide/mm/transhuge). Tunables are read once, when the process starts, so the
`forgeline` command re-executes itself once with `GLIBC_TUNABLES` extended (`reexec_tuned`); the
processes it starts (stage gangs, workers) inherit the variable. Container images set it in their
environment instead (infra/Dockerfile). Another allocator (tcmalloc or jemalloc through `LD_PRELOAD`, as
PyTorch's performance tuning guide suggests for CPU) is left alone, as is an explicit
`glibc.malloc.hugetlb` setting; `FORGELINE_HOST_MALLOC=system` turns the re-execution off.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from types import EllipsisType

TUNABLE = "glibc.malloc.hugetlb=1"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def _glibc_version() -> tuple[int, int] | None:
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return None
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def _thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), the bracketed word; None when
    the kernel has none (not Linux, or built without it)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def tuned_environ(environ: Mapping[str, str], *, glibc: tuple[int, int] | None | EllipsisType = ...,
                  thp: str | None | EllipsisType = ...) -> dict[str, str] | None:
    """`environ` with `glibc.malloc.hugetlb=1` added to GLIBC_TUNABLES, or None when nothing is to change: not
    glibc >= 2.35, transparent huge pages off or absent, another allocator preloaded, the tunable already
    set (either value), or FORGELINE_HOST_MALLOC=system. `glibc` (version, None: another C library) and `thp`
    (mode, None: none) default (`...`) to this machine's."""
    if environ.get("FORGELINE_HOST_MALLOC", "") == "system":
        return None
    glibc = _glibc_version() if glibc is ... else glibc
    thp = _thp_mode() if thp is ... else thp
    if glibc is None or glibc < (2, 35) or thp not in ("always", "madvise"):
        return None
    if any(name in environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(t for t in (tunables, TUNABLE) if t)}


def reexec_tuned() -> None:
    """Replace this process with the same command line under `tuned_environ` (same PID, same open files),
    before anything has been computed; return without doing anything when nothing is to change. Only for a
    program's entry point (`forgeline`'s `main`), never in a library call."""
    env = tuned_environ(os.environ)
    if env is None or not sys.orig_argv:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
