"""DeepSeek-V3.2 and GLM-5 checkpoints in their publishers' FP8 layout (docs/formats/deepseek-fp8.md, DSA models):
every MLA / MLP / expert Linear and the DSA indexer's `wq_b` and `wk` as float8_e4m3fn with a float32
`weight_scale_inv` per 128x128 tile; the indexer's `weights_proj` in bf16, its `k_norm` in float (fp32 in
deepseek-ai/DeepSeek-V3.2, bf16 in zai-org/GLM-5-FP8), the routers, embeddings and LM head float. Loaded whole and
with `mesh=` on 8 fake CPU devices, every variable is bit-identical to the whole-tensor dequantisation, the logits
equal its logits (bitwise unsharded; ≤ 1e-5 relative through the sharded program) and transformers' on those
weights (≤ 1e-5); an fp8-block model we quantize is saved in that layout and in compressed-tensors (the indexer's
`weights_proj` float in both, as published and as transformers keeps it) and transformers loads both.

Tiny configs (tests/parity/test_deepseek_v32_parity.py's and test_glm_moe_dsa_parity.py's, widened where a
128x128 tile must be crossed): dense MLP 384 wide (three tiles, which the 8-device mesh's tensor axis splits
mid-tile), an indexer of 8 heads x 32 dims (wq_b: 256 rows, two tiles), top-6 keys of 20-token sequences (the
selection drops keys). No edge tiles (a width past 128 that 128 does not divide): transformers 5.25's CPU
dequantisation (`Fp8Dequantize`) derives the block from the grid (rows // scale rows) and misreads them (a 160-row
weight as two 80-row blocks), while ours follows `weight_block_size` (edge tiles: tests/unit/test_models_formats.py).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from parity_helpers import build_from_config, hf_reload_logits, rel_err
from safetensors.numpy import load_file, save_file

from models import jit_forward
from models.hf import from_pretrained, save_pretrained
from models.quant import parse_scheme, quantize_model
from models.quant.formats import dequant_fp8_block
from tests.devices import run_on_8_devices

pytestmark = pytest.mark.parity
V, TOPK = 128, 6
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=384, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
              first_k_dense_replace=1, max_position_embeddings=128, rms_norm_eps=1e-5, index_topk=TOPK,
              index_head_dim=32, index_n_heads=8)
CONFIGS = {
    "deepseek_v32": transformers.DeepseekV32Config(**COMMON, num_hidden_layers=3),
    "glm_moe_dsa": transformers.GlmMoeDsaConfig(**COMMON, num_hidden_layers=4,
                                                indexer_types=["full", "shared", "full", "shared"]),
}
IDS = np.random.default_rng(0).integers(0, V, (2, 20)).astype(np.int32)  # 20 > index_topk

# Float in the published files (every other 2-D `.weight` is FP8 with a `weight_scale_inv`): the embedding, the LM
# head, the MoE routers and the indexer's per-head weights.
FLOAT_2D = ("model.embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight", ".indexer.weights_proj.weight")
# quantization_config as published: deepseek-ai/DeepSeek-V3.2's verbatim (ue8m0: power-of-two scales, no
# modules_to_not_convert); zai-org/GLM-5-FP8's method and block with a modules_to_not_convert in its spelling
# (the indexer's weights_proj listed as `self_attn.indexers_proj`, a name no module has)
QUANT_CONFIGS = {
    "deepseek_v32": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                     "weight_block_size": [128, 128]},
    "glm_moe_dsa": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128],
                    "modules_to_not_convert": ["lm_head", "model.embed_tokens"] + [
                        f"model.layers.{i}.{m}" for i in range(4)
                        for m in ("self_attn.indexers_proj", "mlp.gate")]},
}


def quantize_tiles(w: np.ndarray, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    """w [M, N] float32 -> (float8_e4m3fn [M, N], weight_scale_inv float32 [ceil(M/128), ceil(N/128)]): each tile's
    amax / 448, rounded up to a power of two for a ue8m0 checkpoint (DeepSeek-V3.2's `scale_fmt`)."""
    M, N = w.shape
    sm, sn = -(-M // 128), -(-N // 128)
    padded = np.zeros((sm * 128, sn * 128), np.float32)
    padded[:M, :N] = w
    amax = np.abs(padded.reshape(sm, 128, sn, 128)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    if ue8m0:
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:M, :N]
    return np.clip(w / full, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn), scale


def published_layout(family: str, tensors: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """(FP8 tensors as the publisher ships them, their whole-tensor dequantisation in float32)."""
    fp8, dequant = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and name.endswith(".weight") and not name.endswith(FLOAT_2D):
            q, s = quantize_tiles(w, ue8m0=family == "deepseek_v32")
            fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
            dequant[name] = dequant_fp8_block(q, s)
            continue
        fp32 = name.endswith("e_score_correction_bias") or (family == "deepseek_v32" and w.ndim == 1)
        fp8[name] = w if fp32 else w.astype(ml_dtypes.bfloat16)  # DeepSeek's norms are fp32, GLM's bf16
        dequant[name] = fp8[name].astype(np.float32)
    return fp8, dequant


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> {"float", "fp8", "dequant"} checkpoint folders: transformers' save, the published FP8 layout of
    it, and that layout dequantised whole (float32, no quantization_config)."""
    out = {}
    for seed, (family, config) in enumerate(CONFIGS.items()):
        root = tmp_path_factory.mktemp(family)
        build_from_config(config, seed=seed).save_pretrained(root / "float")
        fp8, dequant = published_layout(family, load_file(root / "float" / "model.safetensors"))
        cfg = json.loads((root / "float" / "config.json").read_text())
        for name, tensors, extra in (("fp8", fp8, {"quantization_config": QUANT_CONFIGS[family]}),
                                     ("dequant", dequant, {})):
            (root / name).mkdir()
            save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
            (root / name / "config.json").write_text(json.dumps({**cfg, **extra}))
        out[family] = {k: str(root / k) for k in ("float", "fp8", "dequant")}
    return out


def torch_file(path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as torch reads them (numpy's reader has no float8)."""
    return safetensors.torch.load_file(str(path))


def flat_state(model) -> dict[str, np.ndarray]:
    from flax import nnx

    return {"/".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_published_fp8_layout_loads_bit_identical_to_the_whole_tensor_decode(folders, family):
    paths = folders[family]
    tensors = torch_file(f"{paths['fp8']}/model.safetensors")
    for layer in (0, 2):  # the indexer as published: wq_b / wk FP8 with scales, weights_proj bf16, k_norm float
        idx = f"model.layers.{layer}.self_attn.indexer"
        assert tensors[f"{idx}.wq_b.weight"].dtype == torch.float8_e4m3fn
        assert tensors[f"{idx}.wq_b.weight_scale_inv"].shape == (2, 1)  # 256 rows: two tiles
        assert tensors[f"{idx}.wk.weight_scale_inv"].shape == (1, 1)
        assert tensors[f"{idx}.weights_proj.weight"].dtype == torch.bfloat16
        assert f"{idx}.weights_proj.weight_scale_inv" not in tensors
        assert tensors[f"{idx}.k_norm.bias"].dtype == (torch.float32 if family == "deepseek_v32" else torch.bfloat16)
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 1)  # 384 rows: three tiles
    assert (family == "glm_moe_dsa") == ("model.layers.1.self_attn.indexer.wk.weight" not in tensors)  # shared

    fp8, whole = from_pretrained(paths["fp8"]), from_pretrained(paths["dequant"])
    a, b = flat_state(fp8), flat_state(whole)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
    got = np.asarray(jit_forward(fp8)(jnp.asarray(IDS)))
    assert np.array_equal(got, np.asarray(jit_forward(whole)(jnp.asarray(IDS))))
    ref = hf_reload_logits(paths["dequant"], IDS)
    # transformers reads the published layout itself (dequantising on a machine without a GPU) to the same model
    theirs_fp8 = hf_reload_logits(paths["fp8"], IDS)
    float_logits = np.asarray(jit_forward(from_pretrained(paths["float"]))(jnp.asarray(IDS)))
    err, err_theirs, moved = rel_err(got, ref), rel_err(theirs_fp8, ref), rel_err(got, float_logits)
    print(f"{family} FP8: ours vs transformers on the dequantised weights {err:.2e}, transformers' own FP8 load "
          f"{err_theirs:.2e}; FP8 moved the logits by {moved:.2e}")
    assert err <= 1e-5 and err_theirs <= 1e-5
    assert moved > 1e-3  # the checkpoint really is quantized


CHILD = """
import json, os
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from models import from_pretrained, jit_forward
from models.sharding import make_mesh

assert len(jax.devices()) == 8
paths, ids = json.loads(__PATHS__), np.asarray(json.loads(__IDS__), np.int32)
mesh = make_mesh(fsdp=2, tensor=2, expert=2)
report = {}
for family, p in paths.items():
    stats = {}
    sharded, whole = from_pretrained(p["fp8"], mesh=mesh, stats=stats), from_pretrained(p["dequant"])
    flat = lambda m: {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(m))}
    a, b = flat(sharded), flat(whole)
    assert a.keys() == b.keys()
    split = 0
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(np.asarray(a[key]), np.asarray(b[key])), (family, key)
        split += not a[key].sharding.is_fully_replicated
    got = np.asarray(jit_forward(sharded)(jnp.asarray(ids)))
    want = np.asarray(jit_forward(whole)(jnp.asarray(ids)))
    report[family] = {"split": split, "max_abs": float(np.max(np.abs(got - want))),
                      "scale": float(np.max(np.abs(want))), "bytes_read": stats["bytes_read"],
                      "file_bytes": os.path.getsize(os.path.join(p["fp8"], "model.safetensors"))}
print("REPORT" + json.dumps(report))
"""


def test_published_fp8_layout_loads_sharded_on_8_devices(folders):
    """`mesh=`: each device's slice of an FP8 weight is its codes times the tiles it overlaps (wq_b split on its
    heads at a tile boundary, the dense MLP's 384 columns split mid-tile): bit-identical to the whole decode."""
    code = CHILD.replace("__PATHS__", repr(json.dumps(folders))).replace("__IDS__", repr(json.dumps(IDS.tolist())))
    report = run_on_8_devices(code)
    print(report)
    for family, r in report.items():
        assert r["split"] > 0, family  # the mesh really shards the model
        assert r["max_abs"] <= 1e-5 * r["scale"], (family, r)  # the sharded forward: same logits
        tensors = torch_file(f"{folders[family]['fp8']}/model.safetensors")
        scale_bytes = sum(4 * t.numel() for name, t in tensors.items() if name.endswith("_scale_inv"))
        # one process holds all 8 devices: every byte is read once (headers included), but for a scale tile
        # that two devices' slices share, read by each of them
        assert 0 <= r["bytes_read"] - r["file_bytes"] <= 7 * scale_bytes, (family, r, scale_bytes)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_our_fp8_save_is_the_published_layout_and_transformers_loads_it(folders, tmp_path, family):
    """`fp8-block` calibrated on IDS (GLM-5's shared layers get the selection carried from layer 0), saved in
    DeepSeek's layout and in compressed-tensors (the default): the indexer's weights_proj stays float in both."""
    model = from_pretrained(folders[family]["float"])
    calib = [(IDS, np.ones_like(IDS))]
    quantize_model(model, parse_scheme("fp8-block"), calib)
    mine = np.asarray(jit_forward(model)(jnp.asarray(IDS)))
    save_pretrained(model, str(tmp_path / "ct"))
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert r"re:.*\.indexer\.weights_proj$" in qc["ignore"]
    ct = torch_file(tmp_path / "ct" / "model.safetensors")
    assert "model.layers.0.self_attn.indexer.wk.weight_scale" in ct
    assert "model.layers.0.self_attn.indexer.weights_proj.weight_scale" not in ct
    assert rel_err(hf_reload_logits(str(tmp_path / "ct"), IDS), mine) <= 1e-5

    save_pretrained(model, str(tmp_path), layout="deepseek-fp8")
    tensors = torch_file(tmp_path / "model.safetensors")
    idx = "model.layers.0.self_attn.indexer"
    assert tensors[f"{idx}.wq_b.weight"].dtype == tensors[f"{idx}.wk.weight"].dtype == torch.float8_e4m3fn
    assert {f"{idx}.wq_b.weight_scale_inv", f"{idx}.wk.weight_scale_inv"} <= tensors.keys()
    assert tensors[f"{idx}.weights_proj.weight"].dtype == torch.float32  # float, as published and as transformers
    assert f"{idx}.weights_proj.weight_scale_inv" not in tensors  # keeps it (_keep_in_fp32_modules)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert f"{idx}.weights_proj" in qc["modules_to_not_convert"]
    theirs = hf_reload_logits(str(tmp_path), IDS)
    err = rel_err(theirs, mine)
    print(f"{family}: our fp8-block save, transformers vs ours {err:.2e}")
    assert err <= 1e-5
    assert rel_err(np.asarray(jit_forward(from_pretrained(str(tmp_path)))(jnp.asarray(IDS))), mine) <= 1e-5
