"""Killing a fine-tune mid-run and re-running it resumes from the last committed checkpoint --
here from the store (a fresh local checkpoint folder forces the download path)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import storage

pytestmark = pytest.mark.integration


def _cmd(base: Path, data: Path, out: Path, ckpt: Path, store: str) -> list[str]:
    return [sys.executable, "-m", "tasks.finetune", "--base", str(base), "--data", str(data), "--out", str(out),
            "--checkpoints", str(ckpt), "--store", store,
            "--set", "mode=full", "train.steps=100000", "train.checkpoint_every=5", "train.batch_size=4",
            "train.log_every=5"]


def test_kill_during_finetune_then_resume(tiny_base, tmp_path):
    base, data = tiny_base
    store = f"file://{tmp_path}/store"
    latest = storage.join(store, "checkpoints/finetune/cli/latest.json")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(_cmd(base, data, tmp_path / "out1", tmp_path / "ckpt1", store), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while not storage.exists(latest):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint was committed in time"
            time.sleep(0.2)
        time.sleep(1.0)  # let it get past the first checkpoint
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = json.loads(storage.read_bytes(latest))["step"]
    assert killed_at >= 5
    assert not (tmp_path / "out1" / "model").exists()  # the killed run published nothing

    # Re-run with a fresh local folder and fewer total steps, so the test stays short: it must pick
    # the checkpoint up from the store, not start over.
    cmd = _cmd(base, data, tmp_path / "out2", tmp_path / "ckpt2", store)
    cmd[cmd.index("train.steps=100000")] = f"train.steps={killed_at + 10}"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout[done.stdout.index("{"):])
    resumed = stats["resumed_from_step"]
    assert resumed is not None and resumed >= killed_at, stats
    assert f"resumed from checkpoint at step {resumed}" in done.stderr
    assert stats["valid_loss_before"] is None  # it did not start from step 0
    assert (tmp_path / "out2" / "model" / "config.json").exists()
