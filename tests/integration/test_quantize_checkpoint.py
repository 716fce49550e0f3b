"""`forgeline quantize-checkpoint`: streaming quantization as a user runs it. The command line (one `error:`
line and an exit code for each bad input, nothing left at --out), a checkpoint read from and written to the
S3 server the tests start on 127.0.0.1, and (slow tier) the memory of quantizing a 1.9 GiB checkpoint built
here: peak RSS above the process's baseline stays a few tensors, not the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import models
import storage
from models import quant
from models.hf import SafetensorsCheckpoint, SafetensorsWriter
from models.quant.streaming import quantize_checkpoint
from tests.conftest import ROOT

pytestmark = pytest.mark.integration
IDS = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)


def forgeline(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "quantize-checkpoint", *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})


def error_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, done.stderr[-2000:]
    return lines[0]


def tensors(folder: str) -> dict[str, np.ndarray]:
    ck = SafetensorsCheckpoint(folder)
    try:
        return {n: np.array(ck[n]) for n in ck}
    finally:
        ck.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A sharded float checkpoint of a tiny Llama, with its tokenizer files beside it."""
    cfg = models.LlamaConfig.tiny(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    folder = tmp_path_factory.mktemp("src")
    models.save_pretrained(models.Llama(cfg, rngs=nnx.Rngs(0)), str(folder), max_shard_bytes=200_000)
    (folder / "tokenizer.json").write_text('{"model": "stand-in"}')
    return folder


def test_the_command_writes_a_checkpoint_our_models_load(source, tmp_path):
    out = tmp_path / "q"
    done = forgeline(str(source), "--scheme", "nvfp4a16", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"{out}: nvfp4a16, 14 weights quantized"), done.stdout
    assert (out / "tokenizer.json").read_text() == '{"model": "stand-in"}'
    model = models.from_pretrained(str(out))
    assert quant.scheme_of(model).name == "nvfp4a16"
    ref = models.from_pretrained(str(source))
    quant.quantize_model(ref, quant.parse_scheme("nvfp4a16"), [])
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(IDS))), np.asarray(ref(jnp.asarray(IDS))))


@pytest.mark.parametrize("args, code, expect", [
    (["--scheme", "int3"], 2, "error: --scheme: unknown quantization scheme 'int3'"),
    (["--scheme", "w4a16-gptq-g32"], 1, "error: scheme w4a16-gptq-g32: GPTQ needs calibration activations"),
    (["--scheme", "w4a16-rtn-g256"], 1, "error: scheme w4a16-rtn-g256: group size 256 does not divide"),
    (["--scheme", "int8", "--out", "gs://bucket/x"], 2, "error: --out: unsupported URL scheme 'gs'"),
])
def test_bad_input_is_one_line_and_leaves_nothing(source, tmp_path, args, code, expect):
    argv = [str(source), *args] + ([] if "--out" in args else ["--out", str(tmp_path / "q")])
    done = forgeline(*argv)
    assert done.returncode == code and error_line(done).startswith(expect), done.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_missing_source_and_taken_destination(source, tmp_path):
    done = forgeline(str(tmp_path / "nowhere"), "--scheme", "int8", "--out", str(tmp_path / "q"))
    assert done.returncode == 1 and error_line(done).startswith(f"error: {tmp_path}/nowhere/config.json: cannot "
                                                                "read config")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    done = forgeline(str(source), "--scheme", "int8", "--out", str(taken))
    assert done.returncode == 1 and error_line(done) == f"error: --out {taken}: exists and is not empty"
    assert os.listdir(taken) == ["keep.txt"]


def test_s3_to_s3_equals_local_and_a_failed_upload_leaves_nothing(source, tmp_path, s3_env, monkeypatch):
    """Read from and written to S3 (ranged reads, one shard uploaded at a time); the same tensors as a local run.
    A run that fails after uploading shards removes them: config.json, the commit point, never appears."""
    prefix = f"s3://forgeline/qc-{uuid.uuid4().hex[:8]}"
    storage.upload_dir(source, f"{prefix}/src")
    quantize_checkpoint(f"{prefix}/src", f"{prefix}/q", quant.parse_scheme("mxfp4a16"))
    quantize_checkpoint(str(source), str(tmp_path / "local"), quant.parse_scheme("mxfp4a16"))
    remote, local = tensors(f"{prefix}/q"), tensors(str(tmp_path / "local"))
    assert set(remote) == set(local) and all(np.array_equal(remote[n], local[n]) for n in local)
    loaded = models.from_pretrained(f"{prefix}/q")
    assert quant.scheme_of(loaded).name == "mxfp4a16"

    from models.quant import streaming

    real, uploads = streaming._Destination.done, []

    def fail_on_the_third_file(self, fn):
        uploads.append(fn)
        if len(uploads) == 3:
            raise OSError("connection reset")
        return real(self, fn)

    monkeypatch.setattr(streaming._Destination, "done", fail_on_the_third_file)
    with pytest.raises(OSError, match="connection reset"):
        quantize_checkpoint(f"{prefix}/src", f"{prefix}/failed", quant.parse_scheme("int8"))
    with pytest.raises(FileNotFoundError):
        storage.list_files(f"{prefix}/failed")


# -- memory: a 1.9 GiB checkpoint -------------------------------------------------------------------------------

BIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=15, num_attention_heads=16,
           num_key_value_heads=16, head_dim=128, vocab_size=512)

MEASURE = r"""
import json, os, resource, sys, time
import numpy as np
from models import quant
from models.quant import quantizers as Q
from models.quant.streaming import quantize_checkpoint

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

scheme = quant.parse_scheme(sys.argv[3])
Q.rtn(np.ones((8, 32), np.float32), quant.parse_scheme("int8").args)  # JAX's runtime up before the baseline
base = rss("VmRSS")
t = time.perf_counter()
report = quantize_checkpoint(sys.argv[1], sys.argv[2], scheme)
print(json.dumps({"baseline": base, "peak": rss("VmHWM"), "seconds": time.perf_counter() - t, **report}))
"""


def write_big_checkpoint(folder) -> tuple[int, int]:
    """A bf16 Llama checkpoint of BIG's shapes, written one tensor at a time (this process never holds it);
    returns (checkpoint bytes, the largest tensor's float32 bytes)."""
    cfg = models.LlamaConfig.tiny(**BIG)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_hf("bfloat16")))
    D, F, V = BIG["hidden_size"], BIG["intermediate_size"], BIG["vocab_size"]
    shapes = [("model.embed_tokens.weight", (V, D)), ("model.norm.weight", (D,)), ("lm_head.weight", (V, D))]
    for i in range(BIG["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (D,)), (f"{p}.post_attention_layernorm.weight", (D,))]
        shapes += [(f"{p}.self_attn.{x}_proj.weight", (D, D)) for x in "qkvo"]
        shapes += [(f"{p}.mlp.gate_proj.weight", (F, D)), (f"{p}.mlp.up_proj.weight", (F, D)),
                   (f"{p}.mlp.down_proj.weight", (D, F))]
    half = len(shapes) // 2
    files = {"model-00001-of-00002.safetensors": shapes[:half], "model-00002-of-00002.safetensors": shapes[half:]}
    rng = np.random.default_rng(0)
    for fn, entries in files.items():
        writer = SafetensorsWriter(str(folder / fn), [(n, s, np.dtype(ml_dtypes.bfloat16)) for n, s in entries],
                                   {"format": "pt"})
        for name, shape in entries:
            writer.write(name, (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16))
        writer.close()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: fn for fn, entries in files.items() for n, _ in entries}}))
    total = sum(os.path.getsize(folder / fn) for fn in files)
    return total, F * D * 4


@pytest.mark.slow
def test_a_2gb_checkpoint_streams_in_the_memory_of_a_few_tensors(tmp_path, measured):
    src = tmp_path / "big"
    total, largest = write_big_checkpoint(src)
    assert total > 2 * 10**9
    measured(f"quantize-checkpoint: a {total / 2**30:.2f} GiB bf16 Llama checkpoint (largest tensor "
             f"{largest / 2**20:.0f} MiB in float32)")
    for scheme in ("int8", "nvfp4a16"):
        done = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(tmp_path / scheme), scheme],
                              capture_output=True, text=True, timeout=1200, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        r = json.loads(done.stdout.strip().splitlines()[-1])
        above = r["peak"] - r["baseline"]
        measured(f"  {scheme}: {r['quantized']} weights in {r['seconds']:.0f}s, peak RSS {above / 2**20:.0f} MiB above "
                 f"the baseline ({above / largest:.1f}x the largest tensor, {above / total:.2f}x the checkpoint)")
        # chunks of 8 MiB of rows plus the runtime's own (JAX's compiled RTN programs: ~200 MiB for int8 here,
        # none for the numpy FP4 path): a few tensors' worth, whatever the size of the checkpoint
        assert above < 5 * largest, (scheme, above, largest)
        assert r["bytes_written"] < total
