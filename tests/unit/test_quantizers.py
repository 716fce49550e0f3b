"""Post-training quantization math (models/quant/quantizers.py): min-max params, RTN, GPTQ, AWQ search, FP8 block.

Integer params and codes are checked bit for bit against compressed-tensors 0.20
(`calculate_qparams`, `lifecycle.forward.quantize` / `dequantize`); GPTQ against an unbatched float64
transcription of the algorithm and against RTN on correlated Hessians; FP8 block against a plain numpy loop.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from models.quant.quantizers import (
    IntArgs,
    QTensor,
    awq_search,
    dequantize,
    dequantize_fp4,
    dequantize_fp8_block,
    fp8_block,
    gptq,
    gptq_fp4,
    minmax_params,
    mx_scale,
    mx_scale_value,
    mxfp4,
    nvfp4,
    output_error,
    quantize_with,
    round_e2m1,
    rtn,
)

pytestmark = pytest.mark.unit


def hquad(dw: np.ndarray, h: np.ndarray) -> float:
    """tr(ΔW H ΔWᵀ) in float64."""
    dw = np.asarray(dw, np.float64)
    return float(np.sum((dw @ np.asarray(h, np.float64)) * dw))


def correlated_hessian(rng: np.random.Generator, n: int, tokens: int = 2048, outliers: int = 4) -> np.ndarray:
    """H = XᵀX for X [tokens, n] ~ N(0, C) with a random correlated C and a few large outlier channels."""
    a = rng.standard_normal((n, n)).astype(np.float32) / np.sqrt(n)
    mix = np.eye(n, dtype=np.float32) + 0.8 * a  # C = mix mixᵀ
    x = rng.standard_normal((tokens, n)).astype(np.float32) @ mix.T  # [tokens, n]
    x[:, rng.choice(n, outliers, replace=False)] *= 10.0
    return (x.T @ x).astype(np.float32)


def rtn_error(w: np.ndarray, h: np.ndarray, args: IntArgs) -> float:
    return output_error(w, dequantize(rtn(w, args), args), h)


# ----------------------------------------------------------------------------- min-max vs compressed-tensors

CT_CASES = [(4, 32, True), (4, 32, False), (4, 64, False), (8, None, True), (8, None, False), (4, None, True)]


@pytest.mark.parametrize("bits,group,sym", CT_CASES)
def test_params_and_codes_match_compressed_tensors(bits: int, group: int | None, sym: bool):
    rng = np.random.default_rng(bits * 100 + (group or 0) + sym)
    w = rng.standard_normal((48, 256)).astype(np.float32) * rng.uniform(0.01, 3.0, (48, 1)).astype(np.float32)
    w[:4] = np.abs(w[:4]) + 0.5  # all-positive rows: exercises widening min to 0
    w[4:8] = -np.abs(w[4:8])  # all-negative rows
    args = IntArgs(bits, group, sym)
    ct_args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group" if group else "channel",
                               group_size=group)
    t = torch.from_numpy(w)
    g = t.reshape(48, -1, group or 256)  # [out, G, width]
    ct_scale, ct_zero = calculate_qparams(g.amin(-1), g.amax(-1), ct_args)  # [out, G]
    ct_q = ct_quantize(t, ct_scale, ct_zero, ct_args, dtype=torch.int8)
    ct_w = ct_dequantize(ct_q, ct_scale, ct_zero, ct_args)

    scale, zero = minmax_params(w, args)
    assert scale.dtype == np.float32 and scale.shape == (48, args.groups(256))
    np.testing.assert_array_equal(scale, ct_scale.numpy())
    if sym:
        assert zero is None
        assert not ct_zero.numpy().any()
    else:
        assert zero.dtype == np.int8
        np.testing.assert_array_equal(zero, ct_zero.numpy())
    q = quantize_with(w, scale, zero, args)
    assert q.dtype == np.int8
    np.testing.assert_array_equal(q, ct_q.numpy())
    qt = rtn(w, args)
    np.testing.assert_array_equal(qt.q, q)
    np.testing.assert_array_equal(dequantize(qt, args), ct_w.numpy())


def test_int_args():
    assert IntArgs(4, 128).qrange() == (-8, 7)
    assert IntArgs(8, None).qrange() == (-128, 127)
    assert IntArgs(4, 64).groups(256) == 4
    assert IntArgs(8, None).groups(192) == 1
    with pytest.raises(ValueError, match="group_size 128 does not divide in_features 192"):
        IntArgs(4, 128).groups(192)
    w = np.zeros((8, 192), np.float32)
    h = np.eye(192, dtype=np.float32)
    with pytest.raises(ValueError, match="does not divide"):
        rtn(w, IntArgs(4, 128))
    with pytest.raises(ValueError, match="does not divide"):
        gptq(w, h, IntArgs(4, 128))


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_error_bounded_by_half_scale(sym: bool):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 128)).astype(np.float32) + (0.0 if sym else 0.7)
    args = IntArgs(4, 32, sym)
    qt = rtn(w, args)
    qmin, qmax = args.qrange()
    assert qt.q.min() >= qmin and qt.q.max() <= qmax
    if not sym:
        assert qt.zero.min() >= qmin and qt.zero.max() <= qmax
    err = np.abs(dequantize(qt, args) - w)  # [out, in]
    half = np.repeat(qt.scale, 32, axis=1) / 2
    assert np.all(err <= half * (1 + 1e-5) + 1e-7), float((err / half).max())
    assert np.all(err <= np.abs(w) + half)  # sanity: the bound is not vacuous
    assert err.max() > 0.3 * half.max()  # and it is nearly attained


def test_all_zero_group_is_finite():
    w = np.zeros((4, 64), np.float32)
    w[:, 32:] = 1.0
    for sym in (True, False):
        args = IntArgs(4, 32, sym)
        qt = rtn(w, args)
        deq = dequantize(qt, args)
        assert np.all(np.isfinite(qt.scale)) and np.all(qt.scale > 0)
        np.testing.assert_array_equal(deq[:, :32], 0.0)
        assert np.all(np.abs(deq[:, 32:] - 1.0) <= qt.scale[:, 1:] / 2 * (1 + 1e-6))


# ----------------------------------------------------------------------------- GPTQ


def reference_gptq(w, h, args: IntArgs, actorder: bool, damp: float = 0.01) -> np.ndarray:
    """Unbatched float64 GPTQ, column by column (no lazy batches); returns codes [out, in] in original order."""
    w = np.asarray(w, np.float64).copy()
    h = np.asarray(h, np.float64).copy()
    out, n = w.shape
    qmin, qmax = args.qrange()
    width = n // args.groups(n)

    def params(block):  # [out, width] -> scale, zero [out]
        mn, mx = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
        if args.symmetric:
            return np.maximum(-mn, mx) / ((qmax - qmin) / 2), np.zeros(out)
        s = (mx - mn) / (qmax - qmin)
        return s, np.round(np.clip(qmin - mn / s, qmin, qmax))

    dynamic = args.group_size is not None and not actorder
    static = [params(w[:, j : j + width]) for j in range(0, n, width)]
    perm = np.argsort(-np.diag(h), kind="stable") if actorder else np.arange(n)
    w, h = w[:, perm], h[perm][:, perm]
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * np.mean(np.diag(h)) * np.eye(n)
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper
    codes = np.zeros((out, n))
    for i in range(n):
        if dynamic:
            if i % width == 0:
                s, z = params(w[:, i : i + width])
        else:
            s, z = static[perm[i] // width]
        q = np.round(np.clip(w[:, i] / s + z, qmin, qmax))
        e = (w[:, i] - (q - z) * s) / hinv[i, i]
        w[:, i:] -= np.outer(e, hinv[i, i:])
        codes[:, perm[i]] = q
    return codes


GPTQ_CASES = [(sym, group, act) for sym in (True, False) for group in (32, 64, None) for act in (False, True)]


@pytest.mark.parametrize("sym,group,actorder", GPTQ_CASES)
def test_gptq_beats_rtn_on_correlated_hessian(sym: bool, group: int | None, actorder: bool):
    rng = np.random.default_rng(11)
    n = 128
    h = correlated_hessian(rng, n)
    w = rng.standard_normal((48, n)).astype(np.float32)
    args = IntArgs(4, group, sym)
    qt = gptq(w, h, args, actorder=actorder, block_size=64)
    assert isinstance(qt, QTensor) and qt.q.dtype == np.int8 and qt.q.shape == w.shape
    assert qt.scale.shape == (48, args.groups(n)) and qt.scale.dtype == np.float32
    assert (qt.zero is None) == sym
    e_gptq, e_rtn = output_error(w, dequantize(qt, args), h), rtn_error(w, h, args)
    assert e_gptq < 0.85 * e_rtn, (e_gptq, e_rtn)


@pytest.mark.parametrize("group,actorder", [(32, False), (32, True), (None, False)])
def test_gptq_matches_unbatched_reference(group: int | None, actorder: bool):
    """Lazy batches (block_size 32 < in) and blocks rounded to groups give the plain column-by-column result."""
    rng = np.random.default_rng(5)
    n = 96
    h = correlated_hessian(rng, n, tokens=1024)
    w = rng.standard_normal((32, n)).astype(np.float32)
    args = IntArgs(4, group, False)
    ref = reference_gptq(w, h, args, actorder)
    for bs in (32, 128):
        qt = gptq(w, h, args, actorder=actorder, block_size=bs)
        agree = float(np.mean(qt.q == ref))
        assert agree > 0.99, (bs, agree)
        assert np.abs(qt.q.astype(np.int64) - ref).max() <= 1


@pytest.mark.parametrize("group", [32, None])
def test_gptq_identity_hessian_is_rtn(group: int | None):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    h = np.eye(128, dtype=np.float32) * 2048.0
    args = IntArgs(4, group, True)
    qt, ref = gptq(w, h, args), rtn(w, args)
    e_gptq, e_rtn = output_error(w, dequantize(qt, args), h), output_error(w, dequantize(ref, args), h)
    assert abs(e_gptq - e_rtn) <= 0.02 * e_rtn
    assert np.mean(qt.q == ref.q) > 0.999


FP4_RTN = {"nvfp4": nvfp4, "mxfp4": mxfp4}


def reference_gptq_fp4(w: np.ndarray, h: np.ndarray, fmt: str, damp: float = 0.01) -> np.ndarray:
    """Column-by-column GPTQ with FP4 groups (no lazy batches), numpy: each group's scale from the updated
    weights at its first column (MXFP4 code at least 1, as in the jitted loop)."""
    n = w.shape[1]
    w = w.astype(np.float32).copy()
    h = h.astype(np.float64) + damp * np.mean(np.diag(h)) * np.eye(n)
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper
    g = nvfp4(w).global_scale[0] if fmt == "nvfp4" else None
    width = 16 if fmt == "nvfp4" else 32
    codes = np.zeros_like(w)
    for i in range(n):
        if i % width == 0:
            amax = np.abs(w[:, i:i + width]).max(axis=1)
            if fmt == "nvfp4":
                s = (g * (amax / np.float32(6))).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
                eff = np.where(s == 0, np.float32(0.125), s) / g
            else:
                eff = mx_scale_value(np.maximum(mx_scale(amax), 1))
        q = round_e2m1(w[:, i] / eff)
        e = (w[:, i] - q * eff) / hinv[i, i]
        w[:, i:] -= np.outer(e, hinv[i, i:]).astype(np.float32)
        codes[:, i] = q
    return codes


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gptq_fp4_beats_rtn_matches_reference_and_is_rtn_on_identity(fmt: str):
    rng = np.random.default_rng(12)
    n = 128
    h = correlated_hessian(rng, n)
    w = rng.standard_normal((48, n)).astype(np.float32)
    rtn_t = FP4_RTN[fmt](w)
    qt = gptq_fp4(w, h, fmt, block_size=64)
    assert qt.q.shape == w.shape and qt.scale.shape == rtn_t.scale.shape
    assert set(np.unique(np.abs(qt.q)).tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    if fmt == "nvfp4":  # FP8 group scales under the tensor's global scale
        assert np.array_equal(qt.global_scale, rtn_t.global_scale)
        assert np.array_equal(qt.scale.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), qt.scale)
    else:  # powers of two
        assert np.array_equal(mx_scale_value(mx_scale(qt.scale * 4)), qt.scale)
    e_gptq = output_error(w, dequantize_fp4(qt.q, qt.scale, qt.global_scale), h)
    e_rtn = output_error(w, dequantize_fp4(rtn_t.q, rtn_t.scale, rtn_t.global_scale), h)
    assert e_gptq < 0.85 * e_rtn, (e_gptq, e_rtn)  # the int4 tests' margin
    ref = reference_gptq_fp4(w, h, fmt)
    assert np.mean(qt.q == ref) > 0.99  # lazy batches of 64 vs column by column: float rounding only
    # an identity Hessian spreads no error: GPTQ is round-to-nearest, code for code
    ident = gptq_fp4(w, np.eye(n, dtype=np.float32), fmt)
    np.testing.assert_array_equal(ident.q, rtn_t.q)
    np.testing.assert_array_equal(ident.scale, rtn_t.scale)


@pytest.mark.parametrize("sym,actorder", [(True, False), (False, False), (False, True)])
def test_gptq_dead_columns(sym: bool, actorder: bool):
    rng = np.random.default_rng(4)
    n = 128
    h = correlated_hessian(rng, n)
    dead = np.array([3, 40, 41, 127])
    h[dead, :] = 0
    h[:, dead] = 0
    w = rng.standard_normal((32, n)).astype(np.float32)
    args = IntArgs(4, 32, sym)
    qt = gptq(w, h, args, actorder=actorder)
    deq = dequantize(qt, args)
    assert np.all(np.isfinite(deq))
    np.testing.assert_array_equal(deq[:, dead], 0.0)  # dead inputs are zeroed before quantization
    assert output_error(w, deq, h) < rtn_error(w, h, args)


def test_gptq_rejects_non_positive_definite_hessian():
    w = np.ones((8, 64), np.float32)
    with pytest.raises(ValueError, match="positive definite"):
        gptq(w, -np.eye(64, dtype=np.float32), IntArgs(4, 32))
    with pytest.raises(ValueError, match="H must be"):
        gptq(w, np.eye(32, dtype=np.float32), IntArgs(4, 32))


def test_actorder_helps_on_skewed_diagonal_and_keeps_original_layout():
    rng = np.random.default_rng(21)
    n = 256
    std = np.exp(rng.uniform(np.log(0.05), np.log(20.0), n)).astype(np.float32)  # strongly skewed diag(H)
    a = rng.standard_normal((n, n)).astype(np.float32) / np.sqrt(n)
    x = (rng.standard_normal((2048, n)).astype(np.float32) @ (np.eye(n, dtype=np.float32) + 0.5 * a).T) * std
    h = (x.T @ x).astype(np.float32)
    w = rng.standard_normal((64, n)).astype(np.float32)
    args = IntArgs(4, 64, True)
    plain, ordered = gptq(w, h, args), gptq(w, h, args, actorder=True)
    e_plain = output_error(w, dequantize(plain, args), h)
    deq = dequantize(ordered, args)
    e_ordered = output_error(w, deq, h)
    assert e_ordered <= 1.02 * e_plain, (e_ordered, e_plain)
    # static groups: the params are the original weights' min-max, in the original group layout ...
    np.testing.assert_array_equal(ordered.scale, minmax_params(w, args)[0])
    # ... and the codes are un-permuted: the dequantized weight is close to w column by column
    assert np.linalg.norm(deq - w) / np.linalg.norm(w) < 0.25
    shuffled = QTensor(ordered.q[:, np.argsort(-np.diag(h), kind="stable")], ordered.scale, None)
    assert np.linalg.norm(dequantize(shuffled, args) - w) / np.linalg.norm(w) > 1.0


# ----------------------------------------------------------------------------- AWQ


def test_awq_never_worse_than_rtn():
    rng = np.random.default_rng(8)
    n = 128
    x = rng.standard_normal((1024, n)).astype(np.float32)
    h = x.T @ x
    ws = [rng.standard_normal((32, n)).astype(np.float32), rng.standard_normal((16, n)).astype(np.float32)]
    for args in (IntArgs(4, 32, True), IntArgs(4, None, False)):
        s, loss = awq_search([(w, h) for w in ws], np.abs(x).mean(0), args, grid=10)
        assert s.dtype == np.float32 and s.shape == (n,)
        rtn_loss = sum(hquad(w - dequantize(rtn(w, args), args), h) for w in ws)
        assert loss <= rtn_loss * (1 + 1e-5)
        again = sum(hquad(w - dequantize(rtn(w * s, args), args) / s, h) for w in ws)
        assert abs(again - loss) <= 1e-3 * loss


def test_awq_wins_with_outlier_activations():
    rng = np.random.default_rng(9)
    n = 128
    x = rng.standard_normal((1024, n)).astype(np.float32)
    x[:, [5, 17, 90]] *= 40.0  # salient input channels
    h = x.T @ x
    ws = [rng.uniform(-1, 1, (64, n)).astype(np.float32), rng.uniform(-1, 1, (32, n)).astype(np.float32)]
    # asymmetric group 64 (AutoAWQ's zero_point=True) gains a lot; symmetric group 32 only a little, because
    # scaling a salient column past its group's max grows the group scale with it
    for args, ratio in ((IntArgs(4, 64, False), 0.5), (IntArgs(4, 32, True), 0.995)):
        s, loss = awq_search([(w, h) for w in ws], np.abs(x).mean(0), args)
        rtn_loss = sum(hquad(w - dequantize(rtn(w, args), args), h) for w in ws)
        assert loss < ratio * rtn_loss, (args, loss, rtn_loss)
        assert s[[5, 17, 90]].min() > np.delete(s, [5, 17, 90]).max()  # salient channels scaled up
        np.testing.assert_allclose(s.max() * s.min(), 1.0, rtol=1e-5)  # AutoAWQ's s / sqrt(max(s) min(s))


# ----------------------------------------------------------------------------- FP8 block


def reference_fp8_block(w: np.ndarray, block=(128, 128)):
    out, n = w.shape
    rows, cols = -(-out // block[0]), -(-n // block[1])
    q = np.zeros((out, n), ml_dtypes.float8_e4m3fn)
    scale = np.zeros((rows, cols), np.float32)
    for r in range(rows):
        for c in range(cols):
            sl = np.s_[r * block[0] : (r + 1) * block[0], c * block[1] : (c + 1) * block[1]]
            s = np.float32(np.abs(w[sl]).max()) / np.float32(448.0)
            s = s if s > 0 else np.finfo(np.float32).eps
            scale[r, c] = s
            q[sl] = np.clip(w[sl] / s, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def test_fp8_block_matches_reference_and_round_trips():
    rng = np.random.default_rng(12)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    w *= np.exp(rng.uniform(-4, 4, (3, 2))).repeat(128, 0).repeat(128, 1)[:300, :200].astype(np.float32)
    w[128:256, 128:] = 0.0  # an all-zero (edge) tile
    q, scale = fp8_block(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (300, 200)
    assert scale.dtype == np.float32 and scale.shape == (3, 2)
    ref_q, ref_scale = reference_fp8_block(w)
    np.testing.assert_array_equal(scale, ref_scale)
    np.testing.assert_array_equal(q.view(np.uint8), ref_q.view(np.uint8))

    deq = dequantize_fp8_block(q, scale)
    full = scale.repeat(128, 0).repeat(128, 1)[:300, :200]
    np.testing.assert_array_equal(deq, q.astype(np.float32) * full)
    np.testing.assert_array_equal(deq[128:256, 128:], 0.0)
    normal = np.abs(w) >= full * 2.0**-6  # e4m3 normal range: 3 mantissa bits, rel. error <= 2^-4
    rel = np.abs(deq - w)[normal] / np.abs(w)[normal]
    assert rel.max() < 0.07 and normal[w != 0].mean() > 0.99
    assert np.all(np.abs(deq - w)[~normal] <= full[~normal] * 2.0**-10 * (1 + 1e-6))  # subnormal spacing / 2

    qf = q.astype(np.float32)
    for r, c in [(0, 0), (1, 0), (2, 1), (0, 1)]:
        tile = np.s_[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128]
        at = np.abs(w[tile]) == np.abs(w[tile]).max()
        np.testing.assert_array_equal(np.abs(qf[tile][at]), 448.0)
        np.testing.assert_array_equal(np.sign(qf[tile][at]), np.sign(w[tile][at]))
