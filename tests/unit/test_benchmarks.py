"""The benchmarks cannot rot unnoticed: every module imports and parses its command line here, in the
default tier; the slow tier runs the cheap ones end to end on the smoke release
(tests/integration/test_release_flow.py) and `benchmarks.gpu` at its toy sizes on CPU (below)."""

from __future__ import annotations

import importlib
import json
import math
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks

pytestmark = pytest.mark.unit

MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))


def test_every_benchmark_is_here():
    assert {"calibration", "gpu", "load", "moe", "parity", "quant", "run", "speculative", "train"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports_and_parses_its_command_line(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main) and module.__doc__
    if "argv" in module.main.__code__.co_varnames[: module.main.__code__.co_argcount]:
        with pytest.raises(SystemExit) as e:
            module.main(["--help"])
        assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_gpu_benchmark_published_peaks():
    from benchmarks.gpu import published_peaks

    assert published_peaks("NVIDIA H200") == (989e12, 4.8e12)
    assert published_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert published_peaks("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert published_peaks("NVIDIA A100-SXM4-40GB") == (312e12, 1.555e12)
    assert published_peaks("NVIDIA A100-SXM4-80GB") == (312e12, 2.0e12)
    assert published_peaks("cpu") is None


@pytest.mark.slow
def test_gpu_benchmark_runs_every_section_at_toy_sizes(tmp_path):
    """`python -m benchmarks.gpu --toy` (the command a lent GPU runs, at CPU sizes): every section prints
    a number, none an error, and the exit status says so (~60-80 s on 2 shared cores, compiles included)."""
    from benchmarks.gpu import SECTIONS

    out = tmp_path / "rows.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--toy", "--json", str(out)], env=env,
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())
    assert {r["section"] for r in rows} == set(SECTIONS)
    for r in rows:
        assert not r["error"] and isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] > 0, r
    for section in ("train_dense", "train_moe", "decode", "speculative", "attention", "moe_impl", "load"):
        assert all(r["ratio"] is not None and r["ratio"] > 0 for r in rows if r["section"] == section), section
    assert "| train_dense " in p.stdout and "ERROR" not in p.stdout
    assert all(f"{name}: done in" in p.stderr for name in SECTIONS)  # the per-section progress lines


def test_quant_rows_get_their_rtn_and_unrotated_peers():
    from benchmarks.quant import rot_peer, rtn_peer, scheme_names
    assert scheme_names("w4a16-gptq,nvfp4-gptq+rot,mxfp4+brot,int8-w8a8-gptq", 64) == [
        "w4a16-rtn-g64", "w4a16-gptq-g64", "nvfp4+rot", "nvfp4-gptq", "nvfp4-gptq+rot", "mxfp4", "mxfp4+brot",
        "int8-w8a8", "int8-w8a8-gptq"]
    assert (rtn_peer("nvfp4-gptq+rot"), rot_peer("nvfp4-gptq+rot")) == ("nvfp4+rot", "nvfp4-gptq")
    assert rtn_peer("w4afp8-gptq-g64") == "w4afp8-g64" and rtn_peer("fp8-dynamic") is None
    with pytest.raises(SystemExit, match="unknown quantization scheme 'nvfp5'"):
        scheme_names("nvfp5+rot", 64)


def test_planted_outlier_channels_reach_every_layer_and_the_float_model_keeps_them_apart():
    """benchmarks.quant's outlier model: the planted channels are outliers at every layer's q/k/v input
    (what the activation quantizers see), not only at the embedding's; without planting they are not."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.quant import attention_input_outliers, plant_outlier_channels
    from models import llama

    cfg = llama.LlamaConfig.tiny(num_hidden_layers=3)
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 16)), jnp.int32),
             "positions": jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1)),
             "segment_ids": jnp.ones((2, 16), jnp.int32)}
    plain = llama.Llama(cfg, rngs=nnx.Rngs(0))
    planted = llama.Llama(cfg, rngs=nnx.Rngs(0))
    channels = plant_outlier_channels(planted, n=2, factor=20.0)
    before, after = attention_input_outliers(plain, batch, channels), attention_input_outliers(planted, batch, channels)
    print(f"q/k/v input, outlier channels over the median: plain {before}, planted {after}")
    assert len(after) == 3 and min(after) > 8 and max(before) < 2
