"""Adding a quantization format is one registered class (docs/adding-a-quantization-format.md, whose steps
this test performs on a throwaway format): `ToyU8`, 8-bit uniform codes in [-127, 127] with one scale per
output channel, written as offset-binary uint8 `weight_u8`, is registered, parsed as the scheme "toy-u8",
quantizes a tiny Llama through `quantize_model`, is written by `save_pretrained` and read back by
`from_pretrained` with nothing else changed; and the built-in formats are what the schemes name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import models
from models import quant
from models.quant.formats.registry import (
    WeightFormat,
    register_weight_format,
    unregister_weight_format,
    weight_format,
)

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")


DOC = Path(__file__).resolve().parents[2] / "docs" / "adding-a-quantization-format.md"


def _toy_from_the_doc() -> type[WeightFormat]:
    """The page's toy format, executed from its code block: the steps the page describes are the code run here."""
    text = DOC.read_text()
    start = text.index("```python\n", text.index("<!-- toy format:")) + len("```python\n")
    namespace: dict[str, Any] = {}
    exec(compile(text[start:text.index("```", start)], str(DOC), "exec"), namespace)  # noqa: S102 (our own doc)
    return namespace["ToyU8"]


ToyU8 = _toy_from_the_doc()


@pytest.fixture
def toy():
    register_weight_format(ToyU8)
    yield weight_format("toy-u8")
    unregister_weight_format("toy-u8")


def llama():
    cfg = models.LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    return models.Llama(cfg, rngs=nnx.Rngs(0))


def test_a_registered_format_is_parsed_quantized_written_and_read(toy, tmp_path):
    scheme = quant.parse_scheme("toy-u8")
    assert scheme.format is toy and scheme.kind == "int"
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    model = llama()
    float_logits = np.asarray(model(ids))
    report = quant.quantize_model(model, scheme, [])
    assert {r["method"] for r in report["modules"]} == {"rtn"} and len(report["modules"]) == 7
    name, qm, _ = next(iter(quant.iter_qmatrices(model)))
    assert np.abs(qm.q).max() <= 127 and np.abs(qm.q).max() == 127  # the toy's grid, not int8's -128
    logits = np.asarray(model(ids))
    assert 0 < np.abs(logits - float_logits).max() < 0.05 * np.abs(float_logits).max()

    models.save_pretrained(model, str(tmp_path))
    qc = models.hf.load_config(str(tmp_path))["quantization_config"]
    assert qc["format"] == "naive-quantized" and qc["config_groups"]["group_0"]["weights"]["observer"] == "toy-u8"
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        written = {k: (f.get_tensor(k).shape, f.get_tensor(k).dtype) for k in f.keys() if k.startswith(name + ".")}
    out, n_in = qm.q.shape
    assert written == {n: (shape, dtype) for n, shape, dtype in toy.specs(name, out, n_in, scheme, np.float32)}

    back = models.from_pretrained(str(tmp_path))
    assert back.quant_scheme.weight == "toy-u8"
    np.testing.assert_array_equal(next(iter(quant.iter_qmatrices(back)))[1].q, qm.q)
    np.testing.assert_array_equal(np.asarray(back(ids)), logits)


def test_an_unregistered_format_is_unknown_and_names_are_taken_once(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_weight_format(ToyU8)
    unregister_weight_format("toy-u8")
    with pytest.raises(ValueError, match="unknown quantization scheme 'toy-u8'"):
        quant.parse_scheme("toy-u8")
    with pytest.raises(ValueError, match="unknown weight format 'toy-u8'"):
        weight_format("toy-u8")
    register_weight_format(ToyU8)  # the fixture removes it again


@pytest.mark.parametrize("name,weight,ct_format", [
    ("int8", "packed-int", "pack-quantized"), ("w4a16-asym-gptq-g64", "packed-int", "pack-quantized"),
    ("int8-w8a8", "int8-channel", "int-quantized"), ("w4afp8", "packed-int", "pack-quantized"),
    ("fp8-block", "fp8-block", "float-quantized"), ("fp8-dynamic", "fp8-channel", "float-quantized"),
    ("nvfp4a16", "nvfp4", "nvfp4-pack-quantized"), ("mxfp4", "mxfp4", "mxfp4-pack-quantized")])
def test_the_built_in_schemes_name_their_registered_formats(name, weight, ct_format):
    scheme = quant.parse_scheme(name)
    assert scheme.weight == weight and scheme.format is weight_format(weight)
    assert scheme.format.compressed_tensors_format(scheme) == ct_format
