"""Two processes on 127.0.0.1 (gloo CPU collectives, one device each, parameters FSDP-sharded across
the processes) fine-tune exactly like one process with two devices, and like one device within fp32
tolerance: same loss trajectory, same weights written (by process 0 only)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from tests.devices import cpu_devices_env

pytestmark = pytest.mark.integration

REPO = str(Path(__file__).resolve().parents[2])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(base: Path, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "tasks.finetune", "--base", str(base), "--data", str(data), "--out", str(out),
            "--set", "mode=full", "train.steps=4", "train.batch_size=4", "train.log_every=1", "train.eval_batches=1",
            "train.warmup_steps=0"]


def _env(devices: int, **extra: str) -> dict[str, str]:
    return cpu_devices_env(None, JAX_NUM_CPU_DEVICES=str(devices), **extra)


def _stats(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"):])


def _weights(out: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(next((out / "model").glob("*.safetensors"))))


# in `pytest -m slow` (keeps the default run near 15 min on 2 cores)
@pytest.mark.slow
def test_two_processes_train_like_one(tiny_base, tmp_path):
    base, data = tiny_base
    port = _free_port()
    procs = [subprocess.Popen(_cmd(base, data, tmp_path / "multi"), cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i), JAX_INIT_TIMEOUT="60"))
             for i in range(2)]
    deadline = time.monotonic() + 300
    try:
        while any(p.poll() is None for p in procs):  # one failing must not leave the other waiting
            assert not any(p.poll() not in (None, 0) for p in procs), [p.communicate()[1][-2000:] for p in procs]
            assert time.monotonic() < deadline, "the 2-process run did not finish"
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert "2 global devices" in outs[0][1] or "joined" in outs[0][1], outs[0][1][-2000:]
    multi = [_stats(o) for o, _ in outs]

    two_dev = subprocess.run(_cmd(base, data, tmp_path / "two"), cwd=REPO, env=_env(2), capture_output=True,
                             text=True, timeout=300)
    one_dev = subprocess.run(_cmd(base, data, tmp_path / "one"), cwd=REPO, env=_env(1), capture_output=True,
                             text=True, timeout=300)
    assert two_dev.returncode == 0 and one_dev.returncode == 0, (two_dev.stderr[-2000:], one_dev.stderr[-2000:])
    two, one = _stats(two_dev.stdout), _stats(one_dev.stdout)

    assert multi[0]["devices"] == 2 and two["devices"] == 2 and one["devices"] == 1
    assert len(multi[0]["train_losses"]) == 4
    assert multi[0]["train_losses"] == multi[1]["train_losses"]  # both processes saw the same global loss
    np.testing.assert_allclose(multi[0]["train_losses"], two["train_losses"], rtol=1e-6)
    np.testing.assert_allclose(multi[0]["train_losses"], one["train_losses"], rtol=1e-5)

    w_multi, w_two = _weights(tmp_path / "multi"), _weights(tmp_path / "two")
    assert w_multi.keys() == w_two.keys()
    for k in w_two:
        np.testing.assert_allclose(w_multi[k], w_two[k], rtol=1e-5, atol=1e-6, err_msg=k)
