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


def run_on_8_devices(code: str, timeout: int = 600) -> Any:
    """Run `code` (which prints `REPORT<json>` last) on 8 CPU devices, the repository importable; its report.
    A failing child fails the test with the end of its stderr."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("REPORT", 1)[1])
