"""Model-level quantization (models/quant/) and the quantize stage's inputs (tasks/quantize.py):
scheme names, calibration statistics (padding excluded, per expert on routed tokens), AWQ folding that
leaves the float model unchanged, GPTQ vs RTN on a model, MoE fallback and coverage, the quantized
forward, checkpoint round trips, and the clear errors (group size, ignore list, calibration data)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx

import models
from models import deepseek_v3, quant, qwen3_moe
from models.layers import dequantize
from tasks import quantize as stage

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")
RNG = np.random.default_rng(0)
IDS = RNG.integers(0, 256, (4, 48)).astype(np.int32)
SEG = np.ones_like(IDS)
SEG[0, 30:] = 0  # padding at the end of row 0
BATCHES = [(IDS, SEG), (IDS[::-1].copy(), np.ones_like(IDS))]
VALID = int(SEG.sum() + IDS.size)


def llama(seed=0):
    cfg = models.LlamaConfig.tiny(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return models.Llama(cfg, rngs=nnx.Rngs(seed))


def family(mod, seed=0, **kw):
    cfg_cls, model_cls = mod.FAMILY
    return model_cls(cfg_cls.tiny(**kw), rngs=nnx.Rngs(seed))


def logits(model, ids=IDS):
    return np.asarray(model(jnp.asarray(ids)))


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# -- schemes ---------------------------------------------------------------------------------------


def test_scheme_names():
    s = quant.parse_scheme("w4a16-gptq")
    assert (s.kind, s.bits, s.group_size, s.symmetric, s.method, s.actorder) == ("int", 4, 128, True, "gptq", False)
    s = quant.parse_scheme("w4a16-asym-gptq-actorder-g64")
    assert (s.group_size, s.symmetric, s.actorder) == (64, False, True)
    assert quant.parse_scheme("w8a16-rtn").group_size is None and quant.parse_scheme("int8").bits == 8
    assert quant.parse_scheme("fp8-block").kind == "fp8-block"
    s = quant.parse_scheme("nvfp4a16-gptq")
    assert (s.kind, s.bits, s.group_size, s.method, s.fp4) == ("fp4", 4, 16, "gptq", "nvfp4")
    s = quant.parse_scheme("mxfp4a16")
    assert (s.kind, s.group_size, s.method, s.fp4) == ("fp4", 32, "rtn", "mxfp4")
    for bad in ("nvfp4a16-awq", "nvfp4a16-g32", "int8-w8a8-awq", "fp8-dynamic-gptq"):  # no AWQ, fixed groups
        with pytest.raises(ValueError, match="unknown quantization scheme"):
            quant.parse_scheme(bad)
    # schemes that quantize activations too (compressed-tensors' FP8_DYNAMIC, W8A8, W4AFP8, NVFP4, MXFP4)
    s = quant.parse_scheme("fp8-dynamic")
    assert (s.kind, s.group_size, s.act, s.smooth, s.static_act) == ("fp8", None, "fp8", False, False)
    s = quant.parse_scheme("int8-w8a8-gptq")
    assert (s.kind, s.bits, s.group_size, s.method, s.act, s.smooth) == ("int", 8, None, "gptq", "int8", True)
    assert not quant.parse_scheme("int8-w8a8-nosmooth").smooth
    s = quant.parse_scheme("w4afp8-g64")
    assert (s.kind, s.bits, s.group_size, s.act) == ("int", 4, 64, "fp8")
    assert quant.parse_scheme("w4afp8").group_size == 128
    s = quant.parse_scheme("nvfp4-gptq")
    assert (s.kind, s.fp4, s.method, s.act, s.static_act) == ("fp4", "nvfp4", "gptq", "nvfp4", True)
    assert (quant.parse_scheme("mxfp4").act, quant.parse_scheme("mxfp4a16").act) == ("mxfp4", None)
    with pytest.raises(ValueError, match="-nosmooth applies to int8-w8a8 only"):
        quant.parse_scheme("w4afp8-nosmooth")
    with pytest.raises(ValueError, match="unknown quantization scheme 'w3a16-gptq'"):
        quant.parse_scheme("w3a16-gptq")
    with pytest.raises(ValueError, match="-actorder applies to GPTQ only"):
        quant.parse_scheme("w4a16-awq-actorder")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        stage.QuantizeConfig(schemes=("int4",))


# -- calibration statistics --------------------------------------------------------------------------


def test_statistics_exclude_padding_and_match_the_inputs():
    model = llama()
    units = [u for u in quant.quant_units(model) if u.layer == 0]
    xs = [model.embed_tokens(jnp.asarray(ids)) for ids, _ in BATCHES]
    stats = quant.collect_stats(model, xs, [jnp.asarray(s) for _, s in BATCHES], 0, units)
    q = stats["model.layers.0.self_attn.q_proj"]
    assert q.n == VALID
    normed = [np.asarray(model.layers[0].input_layernorm(x)).reshape(-1, 128)[np.asarray(s).reshape(-1) != 0]
              for x, (_, s) in zip(xs, BATCHES, strict=True)]
    x = np.concatenate(normed)  # the real tokens' q_proj inputs [N, D]
    np.testing.assert_allclose(q.H, x.T.astype(np.float64) @ x, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(q.absmean(), np.abs(x).mean(0), rtol=1e-4)
    assert set(stats) == {u.name for u in units}


def test_experts_are_calibrated_on_their_routed_tokens():
    model = family(qwen3_moe)
    cfg = model.config
    units = quant.quant_units(model)
    i = next(u.layer for u in units if isinstance(u.module, quant.Experts))
    x_in = model.embed_tokens(jnp.asarray(IDS))
    seg = jnp.asarray(SEG)
    for j in range(i):
        x_in = quant._layer_forward(model, x_in, seg, j)
    stats = quant.collect_stats(model, [x_in], [seg], i, [u for u in units if u.layer == i])
    st = stats[f"model.layers.{i}.mlp.experts.gate_up"]
    assert st.H.shape == (cfg.num_experts, cfg.hidden_size, cfg.hidden_size)
    assert st.n.sum() == SEG.sum() * cfg.num_experts_per_tok  # every real token, once per chosen expert
    # the routed tokens of expert 0, recomputed: the layer's normed MLP input through the router
    layer = model.layers[i]
    ctx = quant._layer_context(model, seg, i)
    h = x_in + layer.self_attn(layer.input_layernorm(x_in), ctx, None, i)[0]
    normed = np.asarray(layer.post_attention_layernorm(h)).reshape(-1, cfg.hidden_size)
    _, idx, _ = layer.mlp.gate(jnp.asarray(normed))
    mine = (np.asarray(idx) == 0).any(-1) & (SEG.reshape(-1) != 0)
    x0 = normed[mine].astype(np.float64)
    assert st.n[0] == mine.sum()
    np.testing.assert_allclose(st.H[0], x0.T @ x0, rtol=1e-4, atol=1e-3)


# -- AWQ folding is exact in float -------------------------------------------------------------------


@pytest.mark.parametrize("make, ignore", [(llama, ()), (llama, (r"re:.*\.(q_proj|up_proj)",)),
                                          (lambda: family(qwen3_moe), ()),
                                          pytest.param(lambda: family(deepseek_v3), (r"re:.*shared_experts.*",),
                                                       marks=pytest.mark.slow)],
                         ids=["llama", "llama-some-ignored", "qwen3_moe", "deepseek_v3-shared-ignored"])
def test_awq_folds_leave_the_float_model_unchanged(make, ignore):
    """The scales go into the norms, routers and up projections with their inverse in the weights: before
    rounding, the model computes the same function (so the folds are where the scales belong), also when
    some readers of a folded op are left in float by `ignore`."""
    model = make()
    ref = logits(model)
    scheme = quant.parse_scheme("w4a16-awq-g16")
    units = quant.quant_units(model, ignore)
    xs, segs = [model.embed_tokens(jnp.asarray(IDS))], [jnp.asarray(SEG)]
    folds = []
    for i in range(model.config.num_hidden_layers):
        lu = [u for u in units if u.layer == i]
        stats = quant.collect_stats(model, xs, segs, i, lu)
        folds += quant.awq_layer(model.layers[i], i, stats, lu, scheme, quant.Options(awq_grid=4))
        xs = [quant._layer_forward(model, xs[0], segs[0], i)]
    assert len(folds) >= 2 * model.config.num_hidden_layers
    assert all(f["loss"] <= f["rtn_loss"] * (1 + 1e-5) for f in folds)
    assert any(f["loss"] < f["rtn_loss"] for f in folds)  # a scale other than 1 was chosen somewhere
    assert rel(logits(model), ref) < 1e-4


# -- whole-model quantization --------------------------------------------------------------------------


def test_gptq_beats_rtn_and_every_module_is_reported():
    errors = {}
    for name in ("w4a16-rtn-g32", "w4a16-gptq-g32", "w4a16-awq-g32"):
        model = llama()
        report = quant.quantize_model(model, quant.parse_scheme(name), BATCHES)
        assert len(report["modules"]) == 2 * 7 and report["calibration_tokens"] == VALID
        assert all(r["tokens"] == VALID for r in report["modules"])
        errors[name] = np.mean([r["output_error"] for r in report["modules"]])
    assert errors["w4a16-gptq-g32"] < 0.8 * errors["w4a16-rtn-g32"], errors
    assert errors["w4a16-awq-g32"] <= errors["w4a16-rtn-g32"] * 1.001, errors


def test_moe_fallback_and_coverage():
    scheme = quant.parse_scheme("w4a16-gptq-g32")
    model = family(qwen3_moe)
    report = quant.quantize_model(model, scheme, [(IDS, SEG)], opts=quant.Options(expert_min_tokens=10**6))
    experts = [r for r in report["modules"] if ".experts." in r["module"]]
    moe_layers = sum(isinstance(u.module, quant.Experts) for u in quant.quant_units(family(qwen3_moe)))
    assert len(experts) == moe_layers * model.config.num_experts * 3
    assert all("pooled experts' H" in r["fallback"] and r["method"] == "gptq" for r in experts)
    _, tensors = quant.to_compressed_tensors(model, scheme)
    for _, node in nnx.iter_graph(model):  # coverage: every expert projection has its packed weights
        if isinstance(node, quant.Experts):
            assert node.quantized
    names = {n.rsplit(".", 1)[0] for n in tensors if n.endswith("weight_packed")}
    assert {r["module"] for r in report["modules"]} == names
    model = family(qwen3_moe)
    report = quant.quantize_model(model, scheme, [(IDS, SEG)], opts=quant.Options(expert_min_tokens=0))
    assert not any("fallback" in r for r in report["modules"])


def test_quantized_forward_dequantizes_on_the_fly():
    for name in ("w4a16-asym-gptq-g32", "fp8-block", "int8"):
        model = llama()
        quant.quantize_model(model, quant.parse_scheme(name), BATCHES if "gptq" in name else [])  # RTN/FP8: no data
        lin = model.layers[0].mlp.down_proj
        x = jnp.asarray(RNG.standard_normal((5, lin.in_features)), jnp.float32)
        np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(x @ lin.weight()), rtol=1e-5, atol=1e-5)
    model = family(qwen3_moe)
    quant.quantize_model(model, quant.parse_scheme("w4a16-asym-rtn-g32"), [])
    with pytest.raises(ValueError, match="GPTQ needs calibration data"):
        quant.quantize_model(llama(), quant.parse_scheme("w4a16-gptq"), [])
    path, ex = next((p, n) for p, n in nnx.iter_graph(model) if isinstance(n, quant.Experts))
    x = jnp.asarray(RNG.standard_normal((9, ex.hidden_size)), jnp.float32)
    w, idx, _ = model.layers[path[1]].mlp.gate(x)
    np.testing.assert_allclose(np.asarray(ex(x, idx, w)), np.asarray(ex(x, idx, w, impl="dense")), rtol=1e-4, atol=1e-5)
    gu = np.asarray(ex.base_weights()[0])  # int codes [E, D, 2I] dequantized per group along D
    q, s, z = (np.asarray(getattr(ex, f"gate_up_{p}")[...]).astype(np.float32) for p in ("q", "scale", "zero"))
    np.testing.assert_allclose(gu[:, :32], (q[:, :32] - z[:, :1]) * s[:, :1], rtol=1e-6)


def test_dequantize_fp8_tiles():
    q = jnp.asarray(RNG.standard_normal((200, 300)), jnp.float8_e4m3fn)
    s = jnp.asarray(RNG.uniform(0.5, 2, (2, 3)), jnp.float32)
    w = np.asarray(dequantize(q, s, None, 128))
    np.testing.assert_array_equal(w[127, 255], np.float32(q[127, 255]) * s[0, 1])
    np.testing.assert_array_equal(w[199, 299], np.float32(q[199, 299]) * s[1, 2])


@pytest.mark.parametrize("name", ["int8", "w4a16-asym-gptq-actorder-g32", "w4a16-awq-g64", "fp8-block"])
def test_checkpoint_round_trip(name, tmp_path, monkeypatch):
    model = llama()
    quant.quantize_model(model, quant.parse_scheme(name), BATCHES)
    out = logits(model)
    models.save_pretrained(model, str(tmp_path / name))
    config = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
    assert "lm_head" in config["ignore"] and r"re:.*mlp\.gate$" in config["ignore"]
    assert r"re:.*\.eh_proj$" in config["ignore"]  # MTP's eh_proj: a plain Linear in vLLM
    loaded = models.from_pretrained(str(tmp_path / name))
    assert quant.scheme_of(loaded).bits == quant.parse_scheme(name).bits
    np.testing.assert_array_equal(logits(loaded), out)
    if name == "fp8-block":  # DeepSeek's own layout: weight_scale_inv, dequantized on load
        models.save_pretrained(model, str(tmp_path / "ds"), layout="deepseek-fp8")
        qc = json.loads((tmp_path / "ds" / "config.json").read_text())["quantization_config"]
        assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
        assert rel(logits(models.from_pretrained(str(tmp_path / "ds"))), out) < 1e-5
    # the preflight check accepts what it wrote, from the headers alone (quantized modules are the load's)
    from tests.unit.test_models_hf import refuse_tensor_reads

    refuse_tensor_reads(monkeypatch)
    assert models.check_pretrained(str(tmp_path / name)).config == model.config
    if name == "fp8-block":  # the DeepSeek layout's weight_scale_inv tensors: matched through the dequantizing view
        assert models.check_pretrained(str(tmp_path / "ds")).config == model.config


# -- clear errors ----------------------------------------------------------------------------------------


def test_group_size_must_divide_every_input_width():
    with pytest.raises(ValueError, match=r"group size 96 does not divide model.layers.0.mlp.down_proj's "
                                         r"input width 256.*-g<N>.*quantize.ignore"):
        quant.quantize_model(llama(), quant.parse_scheme("w4a16-rtn-g96"), BATCHES)


def test_ignore_list():
    model = llama()
    report = quant.quantize_model(model, quant.parse_scheme("w4a16-rtn-g32"), BATCHES,
                                  ignore=(r"re:.*\.q_proj", "model.layers.1.mlp.down_proj"))
    assert model.layers[0].self_attn.q_proj.kernel is not None and model.layers[1].mlp.down_proj.qweight is None
    assert model.layers[0].mlp.down_proj.qweight is not None and len(report["modules"]) == 2 * 7 - 3
    config, _ = quant.to_compressed_tensors(model, quant.scheme_of(model), model.quant_ignore)
    assert config["ignore"][-2:] == [r"re:.*\.q_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(ValueError, match="matches only some of model.layers.0.mlp.experts's experts"):
        quant.quant_units(family(qwen3_moe), ignore=(r"re:.*experts\.0\..*",))
    with pytest.raises(ValueError, match="nothing to quantize"):
        quant.quantize_model(llama(), quant.parse_scheme("int8"), BATCHES, ignore=("re:.*",))
    lora = llama()
    models.apply_lora(lora, rank=4, alpha=8, targets=("q_proj",))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj has a LoRA adapter: merge it"):
        quant.quantize_model(lora, quant.parse_scheme("int8"), [])


def _data(tmp_path, rows: int, length: int = 64, split: str = "train"):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    col = lambda v: pa.array([np.full(length, v, np.int32).tolist()] * rows, pa.list_(pa.int32()))  # noqa: E731
    table = pa.table({c: col(1) for c in ("input_ids", "target_ids", "positions", "segment_ids", "loss_mask")})
    pq.write_table(table, d / f"{split}-00000.parquet")
    return d


def test_calibration_set_errors(tmp_path):
    with pytest.raises(ValueError, match=r"quantize.calibration: .* the train split is empty"):
        stage.calibration_batches(_data(tmp_path, 0), stage.CalibrationConfig())
    with pytest.raises(ValueError, match=r"has 128 calibration tokens in 2 train rows, fewer than "
                                         r"calibration.min_tokens = 2048"):
        stage.calibration_batches(_data(tmp_path, 2), stage.CalibrationConfig())
    batches = stage.calibration_batches(_data(tmp_path, 10), stage.CalibrationConfig(samples=64, batch_size=4,
                                                                                     min_tokens=64))
    assert [b[0].shape for b in batches] == [(4, 64), (4, 64), (2, 64)]  # capped at the rows there are


def test_stage_cli_fails_cleanly(tmp_path, capsys):
    model = llama()
    models.save_pretrained(model, str(tmp_path / "model"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        stage.main(["--model", str(tmp_path / "model"), "--data", str(_data(tmp_path, 2)), "--out", str(out)])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibration.min_tokens" in err[0]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow  # the default run covers spec decoding on a quantized target in the release flow (serve=int8)
def test_speculative_decoding_against_a_quantized_target():
    """Greedy speculative decoding is exact against an int4 target: DeepSeek-V3 quantized by GPTQ (its MTP
    layer, which the main stack never runs, by RTN and reported so) drafting with its own quantized MTP head."""
    from models import MTPDraft, generate, speculative_generate

    model = family(deepseek_v3, num_hidden_layers=2, num_mtp_layers=1)
    report = quant.quantize_model(model, quant.parse_scheme("w4a16-gptq-g16"), [(IDS, SEG)])
    L = model.config.num_hidden_layers
    mtp_rows = [r for r in report["modules"] if r["module"].startswith(f"model.layers.{L}.")]
    assert mtp_rows and all(r["method"] == "rtn" and "no calibration tokens" in r["fallback"] for r in mtp_rows)
    assert model.layers[L].eh_proj.qweight is None  # left float by default
    ids = jnp.asarray(IDS[:2, :6])
    ref = np.asarray(generate(model, ids, max_new_tokens=12).tokens)
    out = speculative_generate(model, MTPDraft(model), ids, max_new_tokens=12, k=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                                          "GptOssForCausalLM", "DeepseekV4ForCausalLM"])
def test_kv_cache_bytes_are_what_the_cache_allocates_per_token(architecture):
    """The report's KV bytes per token and layer (bf16) equal what `KVCache.init` allocates for a sequence, per
    token and layer: K and V heads, MLA's latent and RoPE key (with DSA's indexer key), and DeepSeek-V4's
    sliding key plus its compressed entries (not the open windows' ring: a constant per row)."""
    import types

    from models.families import family
    from models.generate import KVCache
    from models.quant import kv_cache_bytes

    config = family(architecture)[0].tiny()
    S = 256  # a multiple of every compression rate
    cache = KVCache.init(config, 1, S, jnp.bfloat16)
    extra = [a for layer in (cache.extra or {}).values() for name, a in layer.items() if name != "ring"]
    per_slot = [cache.k, cache.v, *extra]
    allocated = sum(a.nbytes for a in per_slot) / (S * config.num_hidden_layers)
    report = kv_cache_bytes(types.SimpleNamespace(config=config), None)
    assert report["bf16_kv_bytes_per_token_per_layer"] == pytest.approx(allocated, rel=1e-12), report
    assert report["kv_bytes_per_token_per_layer"] == report["bf16_kv_bytes_per_token_per_layer"]
