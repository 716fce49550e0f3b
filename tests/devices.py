"""Run a test's child program on 8 fake CPU devices (`--xla_force_host_platform_device_count=8`): the device count
is fixed when JAX starts, so sharded-equals-single-device checks run in a child process of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parents[1])


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def cpu_devices_env(devices: int | None = 8, **extra: str) -> dict[str, str]:
    """This process's environment for a child JAX process on `devices` fake CPU devices (None: the default one):
    the device count replaces any in XLA_FLAGS and the other flags stay (the test run's compile level), as do the
    run's compilation cache variables; JAX_PLATFORMS=cpu, the repository importable, plus `extra`. Variables that
    would make the child a member of another JAX job (`JAX_NUM_CPU_DEVICES`, coordinator settings) are dropped."""
    keep = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_COMPILATION_CACHE_MAX_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k in keep}
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if devices is not None:
        flags.append(f"{DEVICE_COUNT_FLAG}={devices}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, **extra}


def run_on_8_devices(code: str, timeout: int = 600) -> Any:
    """Run `code` (which prints `REPORT<json>` last) on 8 CPU devices, the repository importable; its report.
    A failing child fails the test with the end of its stderr."""
    env = cpu_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("REPORT", 1)[1])
