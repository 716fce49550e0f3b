"""Streaming quantization of a safetensors checkpoint (models/quant/streaming.py) against the in-model quantizer:
the same tensors, bit for bit, for every round-to-nearest scheme, from sharded dense and MoE checkpoints and
from a published-format FP8 (DeepSeek) source; the output loads in our models; what it refuses."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import deepseek_v3, quant, qwen3_moe
from models.hf import SafetensorsCheckpoint
from models.quant.streaming import quantize_checkpoint

pytestmark = pytest.mark.unit
IDS = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)


def read_all(folder) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder (FP8 ones too, through ml_dtypes)."""
    ck = SafetensorsCheckpoint(str(folder))
    try:
        return {n: np.array(ck[n]) for n in ck}
    finally:
        ck.close()


def llama():
    cfg = models.LlamaConfig.tiny(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return models.Llama(cfg, rngs=nnx.Rngs(0))


def family(mod, **kw):
    cfg_cls, model_cls = mod.FAMILY
    return model_cls(cfg_cls.tiny(**kw), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> a float32 checkpoint folder, sharded into several files (the streamer keeps the shards)."""
    made = {}

    def make(name: str):
        if name not in made:
            model = {"llama": llama, "qwen3_moe": lambda: family(qwen3_moe, vocab_size=256)}[name]()
            folder = tmp_path_factory.mktemp(name)
            models.save_pretrained(model, str(folder), max_shard_bytes=200_000)
            made[name] = folder
        return made[name]

    return make


def in_model(src, scheme: str, out):
    model = models.from_pretrained(str(src))
    quant.quantize_model(model, quant.parse_scheme(scheme), [])
    models.save_pretrained(model, str(out))
    return model


@pytest.mark.parametrize("arch,scheme", [("llama", "int8"), ("llama", "w4a16-rtn-g32"), ("llama", "fp8-block"),
                                         ("llama", "nvfp4a16"), ("llama", "mxfp4a16"), ("qwen3_moe", "nvfp4a16"),
                                         ("qwen3_moe", "w4a16-asym-rtn-g32"), ("llama", "fp8-dynamic"),
                                         ("llama", "w4afp8-g32"), ("qwen3_moe", "mxfp4")])
def test_streaming_equals_the_in_model_quantizer(sources, tmp_path, arch, scheme):
    src = sources(arch)
    assert len([f for f in os.listdir(src) if f.endswith(".safetensors")]) > 1  # a sharded source
    model = in_model(src, scheme, tmp_path / "in-model")
    # chunks of 128 rows: the 256-row weights are quantized in two pieces, which must not change a bit
    report = quantize_checkpoint(str(src), str(tmp_path / "streamed"), quant.parse_scheme(scheme), chunk_bytes=1)
    ref, got = read_all(tmp_path / "in-model"), read_all(tmp_path / "streamed")
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and np.array_equal(got[name].view(np.uint8), t.view(np.uint8)), name
    assert report["quantized"] == sum(1 for n in ref if n.endswith(".weight_scale")) > 0
    # the same shards as the source, an index naming every tensor, the quantization config
    assert sorted(f for f in os.listdir(tmp_path / "streamed") if f.endswith(".safetensors")) == \
        sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    cfg = json.loads((tmp_path / "streamed" / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((tmp_path / "in-model" / "config.json").read_text())[
        "quantization_config"]
    loaded = models.from_pretrained(str(tmp_path / "streamed"))
    np.testing.assert_array_equal(np.asarray(loaded(jnp.asarray(IDS))), np.asarray(model(jnp.asarray(IDS))))


def test_a_deepseek_fp8_source_is_read_dequantized(tmp_path):
    """The published DeepSeek-V3 layout (FP8 weights + weight_scale_inv) streams to NVFP4 exactly as the model
    loaded from it (dequantized on load) and quantized in memory."""
    model = family(deepseek_v3, vocab_size=256)
    quant.quantize_model(model, quant.parse_scheme("fp8-block"), [])
    src = tmp_path / "ds-fp8"
    models.save_pretrained(model, str(src), layout="deepseek-fp8")
    assert any(n.endswith("weight_scale_inv") for n in read_all(src))
    in_model(src, "nvfp4a16", tmp_path / "in-model")
    quantize_checkpoint(str(src), str(tmp_path / "streamed"), quant.parse_scheme("nvfp4a16"), chunk_bytes=1)
    ref, got = read_all(tmp_path / "in-model"), read_all(tmp_path / "streamed")
    assert not any(n.endswith("weight_scale_inv") for n in got)
    quantized = [n for n in ref if n.endswith(".weight_packed")]
    assert quantized and all(np.array_equal(got[n], ref[n]) for n in quantized)
    for n in quantized:
        scale = n.replace("weight_packed", "weight_scale")
        assert np.array_equal(got[scale].view(np.uint8), ref[scale].view(np.uint8))


def test_refusals_leave_nothing_behind(sources, tmp_path):
    src = sources("llama")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="GPTQ needs calibration activations"):
        quantize_checkpoint(str(src), str(out), quant.parse_scheme("w4a16-gptq-g32"))
    with pytest.raises(ValueError, match="group size 256 does not divide"):
        quantize_checkpoint(str(src), str(out), quant.parse_scheme("w4a16-rtn-g256"))
    with pytest.raises(ValueError, match="SmoothQuant need calibration activations"):
        quantize_checkpoint(str(src), str(out), quant.parse_scheme("int8-w8a8"))
    with pytest.raises(ValueError, match="static activation scales .* need calibration activations"):
        quantize_checkpoint(str(src), str(out), quant.parse_scheme("nvfp4"))
    streamed = tmp_path / "streamed"
    quantize_checkpoint(str(src), str(streamed), quant.parse_scheme("int8"))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(str(streamed), str(out), quant.parse_scheme("int8"))
    with pytest.raises(ValueError, match="exists and is not empty"):
        quantize_checkpoint(str(src), str(streamed), quant.parse_scheme("int8"))
    # a truncated shard: refused up front, naming the file
    broken = tmp_path / "broken"
    broken.mkdir()
    for fn in os.listdir(src):
        (broken / fn).write_bytes((src / fn).read_bytes())
    last = sorted(f for f in os.listdir(broken) if f.endswith(".safetensors"))[-1]
    with open(broken / last, "r+b") as f:
        f.truncate(os.path.getsize(broken / last) - 64)
    with pytest.raises(ValueError, match=last):
        quantize_checkpoint(str(broken), str(out), quant.parse_scheme("int8"))
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_a_failure_mid_run_leaves_nothing_at_the_destination(sources, tmp_path, monkeypatch):
    from models.quant import streaming

    real, calls = streaming.quantize_matrix, []

    def fails_on_the_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # after the first shards were written
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(streaming, "quantize_matrix", fails_on_the_fifth)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        quantize_checkpoint(str(sources("llama")), str(out), quant.parse_scheme("int8"))
    assert len(calls) == 5 and not out.exists() and os.listdir(tmp_path) == []
