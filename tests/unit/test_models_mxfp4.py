"""MXFP4 expert weights (models/quant/formats/) bit for bit against transformers 5.24
`integrations.mxfp4.convert_moe_packed_tensors` (docs/formats/deepseek-fp8.md).

convert_moe_packed_tensors decodes blocks [E, out, G, 16] + scales [E, out, G] to [E, out, G·32] and
then transposes to transformers' [E, in, out]; `dequant_mxfp4` stops before the transpose and
`DequantizingCheckpoint` applies it.
"""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from models.hf import SafetensorsCheckpoint
from models.quant.formats import FP4_VALUES, DequantizingCheckpoint, dequant_mxfp4

pytestmark = pytest.mark.unit


def reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' decode, fp32, in its [E, in, out] layout."""
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    return out.numpy()


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def random_packed(rng, shape_out: tuple[int, ...], groups: int, scale_lo: int, scale_hi: int):
    blocks = rng.integers(0, 256, size=(*shape_out, groups, 16), dtype=np.uint8)
    scales = rng.integers(scale_lo, scale_hi + 1, size=(*shape_out, groups), dtype=np.uint8)
    return blocks, scales


@pytest.mark.parametrize("scale_lo,scale_hi", [(100, 140), (120, 134)])
def test_dequant_matches_transformers_bit_for_bit(scale_lo, scale_hi):
    rng = np.random.default_rng(scale_lo)
    blocks, scales = random_packed(rng, (3, 40), 4, scale_lo, scale_hi)  # E 3, out 40, in 128
    blocks[0, 0, :, :] = 0x88  # both nibbles code 8 = -0.0
    blocks[0, 1, :, :] = 0x00  # +0.0
    blocks[0, 2, :, :] = 0xF7  # low nibble +6, high nibble -6
    ours = dequant_mxfp4(blocks, scales)
    assert ours.shape == (3, 40, 128) and ours.dtype == np.float32
    ref = reference(blocks, scales)
    assert ref.shape == (3, 128, 40)
    np.testing.assert_array_equal(bits(np.swapaxes(ours, 1, 2)), bits(ref))
    # negative zero survives with its sign bit, and the nibble order is low -> even element
    assert np.all(np.signbit(ours[0, 0])) and not np.any(np.signbit(ours[0, 1]))
    assert np.all(ours[0, 0] == 0)
    exp = scales[0, 2].astype(np.int64)[:, None] - 127  # [G, 1]
    row = ours[0, 2].reshape(4, 32)
    np.testing.assert_array_equal(row[:, 0::2], np.ldexp(np.float32(6.0), exp) * np.ones((1, 16), np.float32))
    np.testing.assert_array_equal(row[:, 1::2], np.ldexp(np.float32(-6.0), exp) * np.ones((1, 16), np.float32))


@pytest.mark.filterwarnings("ignore:overflow encountered in ldexp")
def test_every_code_and_every_finite_scale_exponent():
    """All 16 codes × every E8M0 byte 0..254 (exponents -127..127: subnormals and fp32 overflow to inf).
    Byte 255 is E8M0 NaN; transformers turns 0 · 2^128 into NaN there, so it is left out."""
    codes = np.arange(256, dtype=np.uint8)  # every (low, high) nibble pair once
    blocks = np.broadcast_to(codes.reshape(16, 16), (255, 16, 16)).reshape(1, 255, 16, 16).copy()  # [1, 255, G16, 16]
    scales = np.broadcast_to(np.arange(255, dtype=np.uint8)[:, None], (255, 16)).reshape(1, 255, 16).copy()
    ours = dequant_mxfp4(blocks, scales)  # [1, 255, 512]
    np.testing.assert_array_equal(bits(np.swapaxes(ours, 1, 2)), bits(reference(blocks, scales)))
    unit = ours[0, 127].reshape(256, 2)  # exponent 0: the raw table
    np.testing.assert_array_equal(bits(unit[:, 0]), bits(FP4_VALUES[codes & 0x0F]))
    np.testing.assert_array_equal(bits(unit[:, 1]), bits(FP4_VALUES[codes >> 4]))


def test_checkpoint_view_gives_transformers_layout(tmp_path):
    """The loader's path: safetensors on disk -> SafetensorsCheckpoint -> DequantizingCheckpoint."""
    rng = np.random.default_rng(1)
    E, D, I = 2, 64, 32
    gu_blocks, gu_scales = random_packed(rng, (E, 2 * I), D // 32, 118, 130)  # [E, 2I (out), D/32, 16]
    dn_blocks, dn_scales = random_packed(rng, (E, D), I // 32, 118, 130)  # [E, D (out), I/32, 16]
    bias = rng.normal(size=(E, 2 * I)).astype(np.float32)
    p = "model.layers.0.mlp.experts."
    base = {p + "gate_up_proj_blocks": gu_blocks, p + "gate_up_proj_scales": gu_scales,
            p + "down_proj_blocks": dn_blocks, p + "down_proj_scales": dn_scales, p + "gate_up_proj_bias": bias}
    safetensors.numpy.save_file(base, str(tmp_path / "model.safetensors"))
    view = DequantizingCheckpoint(SafetensorsCheckpoint(str(tmp_path)))
    assert view.quantized
    assert sorted(view) == sorted([p + "gate_up_proj", p + "down_proj", p + "gate_up_proj_bias"])
    assert view.shape(p + "gate_up_proj") == (E, D, 2 * I)  # [E, in, out] like the bf16 checkpoints
    assert view.shape(p + "down_proj") == (E, I, D)
    assert view.source_names(p + "down_proj") == (p + "down_proj_blocks", p + "down_proj_scales")
    np.testing.assert_array_equal(bits(view[p + "gate_up_proj"]), bits(reference(gu_blocks, gu_scales)))
    np.testing.assert_array_equal(bits(view[p + "down_proj"]), bits(reference(dn_blocks, dn_scales)))
    np.testing.assert_array_equal(view[p + "gate_up_proj_bias"], bias)


@pytest.mark.parametrize("scales_shape", [(2, 8, 3), (2, 8), (2, 7, 4), (8, 4)])
def test_blocks_scales_shape_mismatch_raises(scales_shape):
    blocks = np.zeros((2, 8, 4, 16), np.uint8)
    with pytest.raises(ValueError, match="do not match"):
        dequant_mxfp4(blocks, np.zeros(scales_shape, np.uint8))
    with pytest.raises(AssertionError):  # transformers rejects the same pairs
        reference(blocks, np.zeros(scales_shape, np.uint8))


def test_sliced_reads_decode_only_their_groups(tmp_path):
    """A sharded load's path: `view(name).read(slice)` equals the whole decode's slice, bit for bit, and reads
    only the bytes of the 32-value groups the slice overlaps (counted by the checkpoint)."""
    rng = np.random.default_rng(2)
    E, D, I = 4, 128, 64
    blocks, scales = random_packed(rng, (E, 2 * I), D // 32, 110, 135)  # [E, 2I (out), D/32, 16]
    name = "model.layers.0.mlp.experts.gate_up_proj"
    safetensors.numpy.save_file({name + "_blocks": blocks, name + "_scales": scales},
                                str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    view = DequantizingCheckpoint(ckpt).view(name)
    whole = reference(blocks, scales)  # [E, D, 2I]
    assert view.shape == whole.shape and view.dtype == np.float32
    for index in (((1, 3), (40, 100), (8, 72)), ((0, 4), (0, 128), (0, 128)), ((2, 3), (31, 33), (0, 1))):
        before = ckpt.bytes_read
        got = view.read(index)
        np.testing.assert_array_equal(bits(got), bits(whole[tuple(slice(a, b) for a, b in index)]))
        (e0, e1), (i0, i1), (o0, o1) = index
        groups = -(-i1 // 32) - i0 // 32
        assert ckpt.bytes_read - before <= (e1 - e0) * (o1 - o0) * groups * 17 + 4096, index  # 16 + 1 bytes a group
