"""A fine-tune killed with SIGKILL and restarted -- twice, once resuming from the local checkpoint
folder and once from the store (a fresh local folder forces the download path) -- ends with weights
and adapter bit-identical to a run that was never interrupted. LoRA with dropout, so the restored
RNG state matters as much as the parameters, the optimizer state and the data position."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import storage

pytestmark = pytest.mark.integration

STEPS = 24  # the second kill comes at step 8: 16 steps of slack for a slow or contended test process


def _cmd(base: Path, data: Path, out: Path, ckpt: Path, store: str) -> list[str]:
    return [sys.executable, "-m", "tasks.finetune", "--base", str(base), "--data", str(data), "--out", str(out),
            "--checkpoints", str(ckpt), "--store", store,
            "--set", "mode=lora", "lora_rank=4", "lora_dropout=0.2", f"train.steps={STEPS}",
            "train.checkpoint_every=2", "train.keep_checkpoints=2", "train.batch_size=4", "train.log_every=1",
            "train.eval_batches=1", "train.warmup_steps=2"]


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _kill_after(cmd: list[str], marker: str, delay: float, committed: str | None = None) -> str:
    """Start `cmd`, SIGKILL it `delay` seconds after `marker` appears in its log (and, with `committed`,
    once that URL exists); returns the log."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(240), "".join(lines)[-3000:]
        deadline = time.monotonic() + 120
        while committed is not None and not storage.exists(committed):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.02)
        time.sleep(delay)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(10)
    return "".join(lines)


def _tensors(out: Path) -> dict[str, np.ndarray]:
    found = {}
    for f in sorted((out / "model").glob("*.safetensors")) + [out / "adapter" / "adapter_model.safetensors"]:
        found.update({f"{f.parent.name}/{k}": v for k, v in safetensors.numpy.load_file(str(f)).items()})
    return found


# in `pytest -m slow` (keeps the default run near 15 min on 2 cores)
@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tiny_base, tmp_path):
    base, data = tiny_base
    ref = subprocess.run(_cmd(base, data, tmp_path / "ref", tmp_path / "ref-ckpt", f"file://{tmp_path}/ref-store"),
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]

    store = f"file://{tmp_path}/store"
    latest = storage.join(store, "checkpoints/finetune/cli/latest.json")
    # 1. killed mid-run as soon as the first checkpoint is committed; resumes from the local folder
    _kill_after(_cmd(base, data, tmp_path / "out", tmp_path / "ckpt", store), f"step 2/{STEPS}", 0.0, latest)
    assert not (tmp_path / "out" / "model").exists()  # the killed run published nothing
    # 2. killed again later, right after a checkpoint save started
    log = _kill_after(_cmd(base, data, tmp_path / "out", tmp_path / "ckpt", store), f"step 8/{STEPS}", 0.0)
    assert "resumed from checkpoint at step" in log, log[-3000:]
    killed_at = json.loads(storage.read_bytes(latest))["step"]
    assert 2 <= killed_at < STEPS
    # 3. a fresh local folder: the newest checkpoint must come from the store
    done = subprocess.run(_cmd(base, data, tmp_path / "out", tmp_path / "ckpt-fresh", store), env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout[done.stdout.index("{"):])
    assert stats["resumed_from_step"] is not None and stats["resumed_from_step"] >= killed_at, stats
    assert stats["valid_loss_before"] is None  # it did not start from step 0
    assert len(storage.list_files(storage.join(store, "checkpoints/finetune/cli"))) > 0

    want, got = _tensors(tmp_path / "ref"), _tensors(tmp_path / "out")
    assert want.keys() == got.keys() and any(k.startswith("adapter/") for k in want)
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(want[k], got[k]), f"{k} differs after resume"
    # and the adapter actually learned something (B starts at zero)
    assert any(np.abs(v).max() > 0 for k, v in want.items() if "lora_B" in k)
