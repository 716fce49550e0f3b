"""FP8 block dequantisation (models/quant/formats/, docs/formats/deepseek-fp8.md): `W · weight_scale_inv` per 128×128
tile, edge tiles included, bit for bit against torch's float8_e4m3fn and transformers' own dequantizer, and the
`DequantizingCheckpoint` view the loader reads FP8 checkpoints through."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from models.quant.formats import DequantizingCheckpoint, dequant_fp8_block

pytestmark = pytest.mark.unit

SHAPES = [(128, 128), (256, 384), (160, 64), (300, 200), (1, 129), (129, 1), (7, 5)]


def fp8_weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random e4m3 values spanning the format (subnormals to ±448), with exact zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-9, 8, shape, generator=g).float())
    w[torch.rand(shape, generator=g) < 0.05] = 0.0
    return w.clamp(-448, 448).to(torch.float8_e4m3fn)


def scales(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    sm, sn = -(-shape[0] // 128), -(-shape[1] // 128)
    return (torch.rand((sm, sn), generator=g) * 1e-3 + 1e-5).float()


def as_numpy_fp8(w: torch.Tensor) -> np.ndarray:
    """The bytes the safetensors reader hands over: uint8 viewed as ml_dtypes float8_e4m3fn."""
    return w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


def torch_dequant(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    M, N = w.shape
    return w.to(torch.float32) * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:M, :N]


@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_equals_torch_bit_for_bit(shape):
    w, s = fp8_weight(shape, sum(shape)), scales(shape, sum(shape))
    ours = dequant_fp8_block(as_numpy_fp8(w), s.numpy())
    assert ours.dtype == np.float32 and ours.shape == shape
    for ref in (torch_dequant(w, s), _dequantize_fp8_weight(w, s, [128, 128], torch.float32)):
        np.testing.assert_array_equal(ours.view(np.uint32), ref.numpy().view(np.uint32))


def test_edge_tiles_use_their_own_scale():
    """A 160 × 200 weight of ones: each of the 2 × 2 tiles (two of them partial) comes out as its scale."""
    w = torch.ones((160, 200)).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    out = dequant_fp8_block(as_numpy_fp8(w), s.numpy())
    assert (out[:128, :128] == 2).all() and (out[:128, 128:] == 3).all()
    assert (out[128:, :128] == 5).all() and (out[128:, 128:] == 7).all()


@pytest.mark.parametrize("bad", [(1, 2), (2, 1), (3, 2), (2,)])
def test_wrong_scale_shape_is_one_line_error(bad):
    w = as_numpy_fp8(fp8_weight((160, 200), 0))
    with pytest.raises(ValueError) as e:
        dequant_fp8_block(w, np.ones(bad, np.float32))
    msg = str(e.value)
    assert "\n" not in msg and "weight_scale_inv" in msg and str(list(bad)) in msg and "[2, 2]" in msg


def test_dequantizing_checkpoint_view():
    w, s = fp8_weight((160, 64), 3), scales((160, 64), 3)
    base = {
        "model.layers.0.mlp.gate_proj.weight": as_numpy_fp8(w),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": s.numpy(),
        "model.layers.0.input_layernorm.weight": np.ones(64, np.float32),
        "model.layers.1.mlp.gate.weight": np.zeros((8, 64), np.float32),
    }
    view = DequantizingCheckpoint(base)
    assert view.quantized
    assert sorted(view) == ["model.layers.0.input_layernorm.weight", "model.layers.0.mlp.gate_proj.weight",
                            "model.layers.1.mlp.gate.weight"]  # the scale is hidden
    np.testing.assert_array_equal(view["model.layers.0.mlp.gate_proj.weight"], torch_dequant(w, s).numpy())
    assert view.shape("model.layers.0.mlp.gate_proj.weight") == (160, 64)
    assert view["model.layers.1.mlp.gate.weight"] is base["model.layers.1.mlp.gate.weight"]  # passes through
    assert view.source_names("model.layers.0.mlp.gate_proj.weight") == (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight_scale_inv")
    assert not DequantizingCheckpoint({"a.weight": np.ones((2, 2), np.float32)}).quantized

    broken = DequantizingCheckpoint({**base, "model.layers.0.mlp.gate_proj.weight_scale_inv": np.ones((1, 1))})
    with pytest.raises(ValueError) as e:
        broken["model.layers.0.mlp.gate_proj.weight"]
    assert "model.layers.0.mlp.gate_proj.weight_scale_inv" in str(e.value) and "\n" not in str(e.value)


def test_sliced_reads_dequantize_only_their_tiles(tmp_path):
    """A sharded load's path: `view(name).read(slice)` of an FP8-block weight equals the whole dequantisation's
    slice, and reads the slice's codes plus the scale tiles it overlaps, not the whole weight."""
    import safetensors.numpy

    from models.hf import SafetensorsCheckpoint

    rng = np.random.default_rng(3)
    M, N = 300, 260  # edge tiles on both axes
    w = rng.normal(size=(M, N)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2.0, size=(3, 3)).astype(np.float32)
    name = "model.layers.0.mlp.gate_proj.weight"
    safetensors.numpy.save_file({name: w, name + "_scale_inv": s}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    view = DequantizingCheckpoint(ckpt).view(name)
    whole = dequant_fp8_block(w, s)
    for index in (((0, M), (0, N)), ((100, 200), (120, 260)), ((256, 300), (0, 1)), ((127, 129), (127, 129))):
        before = ckpt.bytes_read
        np.testing.assert_array_equal(view.read(index), whole[tuple(slice(a, b) for a, b in index)])
        (m0, m1), (n0, n1) = index
        assert ckpt.bytes_read - before <= (m1 - m0) * N + 9 * 4 + 4096, index  # whole rows of codes at most
    broken = tmp_path / "broken"
    broken.mkdir()
    safetensors.numpy.save_file({name: w, name + "_scale_inv": s[:2]}, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor .*weight_scale_inv: weight_scale_inv has shape"):
        DequantizingCheckpoint(SafetensorsCheckpoint(str(broken))).view(name)
