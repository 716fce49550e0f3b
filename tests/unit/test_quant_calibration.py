"""MoE calibration statistics (models/quant/calibration.py): per-expert H = Σ x xᵀ, Σ |x| and token counts
against a plain numpy reference built from the routed rows, the expert-chunked Hessians and the pooled
statistics, `expert_chunk` leaving the quantized model unchanged, and a tiny Qwen3-MoE quantized on a mesh
of 8 fake CPU devices giving the report and weights the unsharded run gives."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import deepseek_v3, quant, qwen3_moe
from models.quant import calibration
from tests.devices import cpu_devices_env

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")
REPO = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(0)
IDS = RNG.integers(0, 256, (4, 48)).astype(np.int32)
SEG = np.ones_like(IDS)
SEG[0, 30:] = 0  # padding at the end of row 0
SEG[2, :5] = 0  # and at the start of row 2
BATCHES = [(IDS, SEG), (IDS[::-1].copy(), np.ones_like(IDS))]


def family(mod, seed=0, **kw):
    cfg_cls, model_cls = mod.FAMILY
    return model_cls(cfg_cls.tiny(**kw), rngs=nnx.Rngs(seed))


def moe_layer_inputs(model):
    """(i, [x [B, T, D] per batch], [seg [B, T] per batch]) at the first MoE layer."""
    units = quant.quant_units(model)
    i = next(u.layer for u in units if isinstance(u.module, quant.Experts))
    xs = [model.embed_tokens(jnp.asarray(ids)) for ids, _ in BATCHES]
    segs = [jnp.asarray(seg) for _, seg in BATCHES]
    for j in range(i):
        xs = [quant._layer_forward(model, x, s, j) for x, s in zip(xs, segs, strict=True)]
    return i, xs, segs, [u for u in units if u.layer == i]


def reference(model, i, xs, segs):
    """Per-expert (H [E, in, in], Σ|x| [E, in], n [E]) of gate_up's and down_proj's inputs, float64 numpy:
    every real token's normed MLP input, routed by the layer's own router, through each chosen expert."""
    layer = model.layers[i]
    ex = layer.mlp.experts
    E, D, I = ex.num_experts, ex.hidden_size, ex.intermediate_size
    gu_w = np.asarray(ex.gate_up[...], np.float64)  # [E, D, 2I]
    out = {"gate_up": [np.zeros((E, D, D)), np.zeros((E, D)), np.zeros(E)],
           "down_proj": [np.zeros((E, I, I)), np.zeros((E, I)), np.zeros(E)]}
    for x_in, seg in zip(xs, segs, strict=True):
        ctx = quant._layer_context(model, seg, i)
        h = x_in + layer.self_attn(layer.input_layernorm(x_in), ctx, None, i)[0]
        normed = np.asarray(layer.post_attention_layernorm(h)).reshape(-1, D)  # [T, D]
        _, idx, _ = layer.mlp.route(jnp.asarray(normed))
        real = np.asarray(seg).reshape(-1) != 0
        for e in range(E):
            x = normed[(np.asarray(idx) == e).any(-1) & real].astype(np.float64)  # [n_e, D]
            gu = x @ gu_w[e]  # [n_e, 2I]
            hid = gu[:, :I] / (1 + np.exp(-gu[:, :I])) * gu[:, I:]  # silu(gate) · up [n_e, I]
            for key, rows in (("gate_up", x), ("down_proj", hid)):
                out[key][0][e] += rows.T @ rows
                out[key][1][e] += np.abs(rows).sum(0)
                out[key][2][e] += len(rows)
    return out


@pytest.mark.parametrize("mod", [qwen3_moe, deepseek_v3], ids=["qwen3_moe", "deepseek_v3"])
def test_expert_statistics_match_a_numpy_reference(mod):
    model = family(mod)
    i, xs, segs, units = moe_layer_inputs(model)
    stats = quant.collect_stats(model, xs, segs, i, units)
    ref = reference(model, i, xs, segs)
    real = sum(int((np.asarray(s) != 0).sum()) for s in segs)
    for key, (H, A, n) in ref.items():
        st = stats[f"model.layers.{i}.mlp.experts.{key}"]
        np.testing.assert_array_equal(np.asarray(st.n), n, err_msg=key)
        assert n.sum() == real * model.config.num_experts_per_tok  # every real token once per chosen expert
        assert (n > 0).sum() >= 2, n  # more than one expert is exercised
        scale = np.abs(H).max()
        np.testing.assert_allclose(np.asarray(st.H), H, rtol=1e-4, atol=1e-5 * scale, err_msg=key)
        np.testing.assert_allclose(np.asarray(st.abs_sum), A, rtol=1e-4, atol=1e-5 * np.abs(A).max(), err_msg=key)
        pooled = st.pooled()
        np.testing.assert_allclose(pooled.H, H.sum(0), rtol=1e-4, atol=1e-5 * scale, err_msg=key)
        assert pooled.n == n.sum()


def synthetic(rng, E=6, d=16, batches=3, dtype=np.float32):
    """ExpertStats from random routed rows (imbalanced: one big expert, one empty, unsorted in one batch,
    gate_up-style token indices in another) and the per-expert float64 reference (H, Σ|x|, n)."""
    H, A, n = np.zeros((E, d, d)), np.zeros((E, d)), np.zeros(E)
    routed = []
    for b in range(batches):
        R = int(rng.integers(40, 300))
        expert = rng.choice(E, R, p=[0.5, 0.2, 0.1, 0.1, 0.1, 0.0])
        rows = rng.standard_normal((R, d)).astype(dtype)
        if b == 1:  # rows given as a source + index, as gate_up's [B*T, D] input and its token per row
            src = rng.standard_normal((64, d)).astype(dtype)
            token = rng.integers(0, 64, R).astype(np.int32)
            rows = src[token]
        for e in range(E):
            x = rows[expert == e].astype(np.float64)
            H[e] += x.T @ x
            A[e] += np.abs(x).sum(0)
            n[e] += len(x)
        w = np.ones(R, np.float32)
        if b == 0:  # unsorted: _routed sorts
            routed.append(calibration._routed(rows, None, expert, w))
        else:
            order = np.argsort(expert, kind="stable")
            routed.append(calibration._routed(src, token[order], expert[order], w) if b == 1
                          else calibration._routed(rows[order], None, expert[order], w))
    st = calibration.ExpertStats(routed, A, n, H.sum(0), chunk=4)
    return st, (H, A, n)


@pytest.mark.parametrize("chunk", [1, 4, 6])
def test_chunked_hessians_match_a_numpy_reference(chunk):
    st, (H, A, n) = synthetic(np.random.default_rng(1))
    got = list(st.chunks(chunk))
    assert [(c0, c1) for c0, c1, _ in got] == [(c, min(c + chunk, 6)) for c in range(0, 6, chunk)]
    for c0, c1, h in got:
        assert h.shape == (c1 - c0, 16, 16) and h.dtype == np.float32
        np.testing.assert_allclose(h, H[c0:c1], rtol=1e-5, atol=1e-4)
    assert not got[-1][2][-1].any()  # expert 5 has no rows: H = 0
    np.testing.assert_allclose(st.H, H, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(st.pooled().H, H.sum(0), rtol=1e-6)
    assert st.pooled().n == n.sum()


def test_padding_rows_are_dropped_and_bf16_rows_are_exact():
    rng = np.random.default_rng(2)
    import ml_dtypes

    rows = rng.standard_normal((50, 8)).astype(ml_dtypes.bfloat16)
    expert = np.sort(rng.integers(0, 3, 50)).astype(np.int32)
    w = np.ones(50, np.float32)
    w[::5] = 0  # padding tokens' rows
    r = calibration._routed(rows, None, expert, w)
    assert len(r.expert) == 40 and r.source.dtype == rows.dtype
    st = calibration.ExpertStats([r], np.zeros((3, 8)), np.bincount(r.expert, minlength=3).astype(float),
                                 np.zeros((8, 8)), chunk=2)
    x = rows.astype(np.float64)[w > 0]
    for e in range(3):
        xe = x[expert[w > 0] == e]
        np.testing.assert_allclose(st.H[e], xe.T @ xe, rtol=1e-5, atol=1e-5)


def test_scaled_statistics_and_the_pooled_h_under_per_expert_scales():
    st, (H, A, n) = synthetic(np.random.default_rng(3))
    rng = np.random.default_rng(4)
    s = rng.uniform(0.5, 2.0, 16).astype(np.float32)
    one = st.scaled(s)  # one scale for every expert (the gate_up fold): the pooled H is rescaled directly
    np.testing.assert_allclose(one.pooled().H, H.sum(0) / np.outer(s, s), rtol=1e-5)
    np.testing.assert_allclose(one.abs_sum, A / s, rtol=1e-6)
    per = rng.uniform(0.5, 2.0, (6, 16)).astype(np.float32)  # one per expert (the down_proj folds)
    two = one.scaled(per)
    want = H / (s * per)[:, :, None] / (s * per)[:, None, :]
    np.testing.assert_allclose(two.H, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(two.pooled().H, want.sum(0), rtol=1e-5, atol=1e-4)  # summed chunk by chunk
    np.testing.assert_allclose(two.absmean(), A / (s * per) / np.maximum(n, 1)[:, None], rtol=1e-5)
    assert st.scale is None  # scaling returns new statistics


def test_expert_chunk_must_be_positive():
    with pytest.raises(ValueError, match="expert_chunk must be >= 1"):
        quant.Options(expert_chunk=0)
    from tasks.configs import QuantizeConfig

    assert QuantizeConfig(calibration={"expert_chunk": 3}).calibration.expert_chunk == 3
    with pytest.raises(ValueError, match="expert_chunk"):
        QuantizeConfig(calibration={"expert_chunk": 0})


def test_the_driver_holds_at_most_expert_chunk_hessians(monkeypatch):
    """quantize_model builds every expert Hessian in chunks of `expert_chunk` (never all E at once, never
    through `ExpertStats.H`), and the chunk size does not change the result."""
    seen = []
    gram = calibration._grouped_gram

    def spy(xb, block_expert, nb, experts):
        seen.append(experts)
        return gram(xb, block_expert, nb, experts)

    def no_full(self):
        raise AssertionError("the driver asked for all experts' Hessians at once")

    monkeypatch.setattr(calibration, "_grouped_gram", spy)
    monkeypatch.setattr(calibration.ExpertStats, "H", property(no_full))
    scheme = quant.parse_scheme("w4a16-gptq-g32")
    codes = {}
    for chunk in (3, 8):
        seen.clear()
        model = family(qwen3_moe)
        report = quant.quantize_model(model, scheme, BATCHES, opts=quant.Options(expert_min_tokens=40,
                                                                                 expert_chunk=chunk))
        assert seen and max(seen) <= chunk, seen
        codes[chunk] = ([r for r in report["modules"]],
                        {"/".join(map(str, p)): np.asarray(v.get_value())
                         for p, v in nnx.to_flat_state(nnx.state(model)) if "_q" in str(p[-1])})
    assert any("pooled experts' H" in r.get("fallback", "") for r in codes[3][0])  # the fallback ran too
    assert [r["module"] for r in codes[3][0]] == [r["module"] for r in codes[8][0]]
    for a, b in zip(codes[3][0], codes[8][0], strict=True):
        assert a.keys() == b.keys() and a["tokens"] == b["tokens"] and a.get("fallback") == b.get("fallback")
        np.testing.assert_allclose(a["output_error"], b["output_error"], rtol=1e-5)
    for k, v in codes[3][1].items():
        np.testing.assert_array_equal(v, codes[8][1][k], err_msg=k)


def test_chunked_awq_search_is_awq_search():
    from models.quant import quantizers as Q
    from models.quant.awq import _grid_search_chunked

    rng = np.random.default_rng(5)
    args = quant.parse_scheme("w4a16-awq-g16").args
    pairs = []
    for _ in range(5):
        x = rng.standard_normal((40, 32)) * rng.uniform(0.1, 3.0, 32)
        pairs.append((rng.standard_normal((24, 32)).astype(np.float32), (x.T @ x).astype(np.float32)))
    absmean = rng.uniform(0.1, 3.0, 32).astype(np.float32)
    s_ref, loss_ref = Q.awq_search(pairs, absmean, args, grid=8)
    for split in ([pairs], [pairs[:2], pairs[2:4], pairs[4:], []]):
        s, loss, rtn = _grid_search_chunked(split, absmean, args, 8)
        np.testing.assert_array_equal(s, s_ref)
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
        np.testing.assert_allclose(rtn, Q.awq_loss(pairs, np.ones(32), args), rtol=1e-5)


SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from models import quant, qwen3_moe
    from models.quant.calibration import ExpertStats
    from models.sharding import make_mesh, shard_model

    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (8, 64)).astype(np.int32)
    seg = np.ones_like(ids)
    seg[0, 40:] = 0
    batches = [(ids, seg), (ids[::-1].copy(), np.ones_like(ids))]
    opts = quant.Options(expert_chunk=3, expert_min_tokens=200)  # some experts fall back to the pooled H
    mesh = make_mesh(fsdp=2, tensor=2, expert=2)

    def pair(**kw):
        cfg_cls, model_cls = qwen3_moe.FAMILY
        plain, sharded = (model_cls(cfg_cls.tiny(**kw), rngs=nnx.Rngs(0)) for _ in range(2))
        shard_model(sharded, mesh)
        gu = sharded.layers[0].mlp.experts.gate_up[...]
        assert not gu.sharding.is_fully_replicated and len(gu.addressable_shards) == 8, gu.sharding
        return plain, sharded

    def codes(model):
        return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}

    def same_rows(ra, rb, rtol):
        assert len(ra["modules"]) == len(rb["modules"])
        for x, y in zip(ra["modules"], rb["modules"]):
            assert (x["module"], x["method"], x["tokens"], x.get("fallback")) == \\
                (y["module"], y["method"], y["tokens"], y.get("fallback")), (x, y)
            np.testing.assert_allclose(y["output_error"], x["output_error"], rtol=rtol, err_msg=x["module"])
            np.testing.assert_allclose(y["weight_error"], x["weight_error"], rtol=rtol, err_msg=x["module"])

    # 1. layer 0's statistics (Linears' and the experts' chunked Hessians) on the mesh
    plain, sharded = pair()
    stats = []
    for model in (plain, sharded):
        units = [u for u in quant.quant_units(model) if u.layer == 0]
        xs = [model.embed_tokens(jnp.asarray(i)) for i, _ in batches]
        stats.append(quant.collect_stats(model, xs, [jnp.asarray(s) for _, s in batches], 0, units, expert_chunk=3))
    a, b = stats
    assert a.keys() == b.keys() and any(isinstance(v, ExpertStats) for v in a.values())
    for k in a:
        np.testing.assert_array_equal(a[k].n, b[k].n, err_msg=k)
        np.testing.assert_allclose(b[k].H, a[k].H, rtol=1e-5, atol=1e-5 * np.abs(a[k].H).max(), err_msg=k)
        np.testing.assert_allclose(b[k].abs_sum, a[k].abs_sum, rtol=1e-5, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(b[k].pooled().H, a[k].pooled().H, rtol=1e-5, atol=1e-5 * np.abs(a[k].H).max())

    # 2. the whole 3-layer model with RTN codes (data-independent): every layer's calibration on the mesh gives
    #    the same report (tokens, fallbacks, output errors from the statistics) and identical codes
    scheme = quant.parse_scheme("w4a16-rtn-g32")
    ra, rb = (quant.quantize_model(m, scheme, batches, opts=opts) for m in (plain, sharded))
    same_rows(ra, rb, 1e-4)
    ca, cb = codes(plain), codes(sharded)
    assert ca.keys() == cb.keys()
    for k in ca:
        np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)

    # 3. GPTQ on a one-layer MoE: the same report; codes equal but for rare float-level rounding ties (the
    #    mesh sums in another order), one step at most
    plain, sharded = pair(num_hidden_layers=1)
    scheme = quant.parse_scheme("w4a16-gptq-g32")
    ra, rb = (quant.quantize_model(m, scheme, batches, opts=opts) for m in (plain, sharded))
    assert any("pooled experts' H" in r.get("fallback", "") for r in ra["modules"])
    same_rows(ra, rb, 3e-2)
    ca, cb = codes(plain), codes(sharded)
    flips = total = 0
    for k in ca:
        if ca[k].dtype == np.int8:
            flips, total = flips + int((ca[k] != cb[k]).sum()), total + ca[k].size
            assert np.abs(ca[k].astype(int) - cb[k]).max() <= 1, k
        else:
            np.testing.assert_allclose(cb[k], ca[k], rtol=1e-2, atol=1e-6, err_msg=k)
    assert flips <= 2e-3 * total, (flips, total)
    print("GPTQ codes differing:", flips, "of", total)
    print("OK")
""")


def test_quantizing_a_sharded_moe_matches_unsharded():
    """A tiny Qwen3-MoE sharded over (fsdp 2, tensor 2, expert 2) on 8 fake CPU devices (a child process:
    the device count is fixed when jax initialises) gets the unsharded run's statistics, report and codes."""
    env = cpu_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", SHARDED], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-3000:]
