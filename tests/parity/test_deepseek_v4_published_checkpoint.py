"""DeepSeek-V4 checkpoints in the publisher's layout (docs/formats/deepseek-fp8.md, DeepSeek-V4): the reference's names
(`embed.weight`, `layers.{i}.…`, `hc_head_fn`, `head.weight`, an `mtp.0.…` layer), the attention projections, the
indexer's wq_b and the shared expert in 128x128 block FP8 with E8M0 (`F8_E8M0`) `.scale` tiles, the routed experts
in FP4 (int8 [out, in/2], two E2M1 codes a byte) with one E8M0 `.scale` per 32 values of a row. Loaded whole and with
`mesh=` on 8 fake CPU devices, every variable is bit-identical to the whole-tensor decode and the logits equal its
logits; transformers 5.25 reads both the decoded and the published folder to the same logits (≤ 1e-5).

Tiny config: tests/parity/test_deepseek_v4_parity.py's with 8 heads (wq_b 256 rows: two FP8 tiles, which the mesh's
tensor axis splits at the tile boundary), so every quantized width is ≤ 128 or a multiple of it (the layout's own
constraint for transformers' CPU decode, which takes the block from the scale grid).
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from parity_helpers import hf_reload_logits, rel_err
from safetensors.numpy import load_file, save_file
from test_deepseek_v4_parity import IDS, TINY, build
from test_dsa_fp8_checkpoints import flat_state, quantize_tiles

from models import jit_forward
from models.deepseek_v4 import DeepseekV4
from models.hf import from_pretrained
from models.quant.formats import dequant_fp8_block
from models.quant.formats.deepseek_v4 import dequant_fp4_rows
from models.quant.formats.mxfp4 import FP4_VALUES
from tests.devices import run_on_8_devices

pytestmark = pytest.mark.parity
FP8 = re.compile(r"^(layers\.\d+\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                 r"|layers\.\d+\.ffn\.shared_experts\.w[123]|mtp\.0\.e_proj)\.weight$")
FP4 = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
# deepseek-ai/DeepSeek-V4-Flash config.json's (models/presets/deepseek-v4-flash.json)
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
         "weight_block_size": [128, 128]}


def published_name(name: str) -> str:
    """transformers' save name -> the reference's (the inverse of `DeepseekV4.hf_published_name`)."""
    special = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    if name in special:
        return special[name]
    if name.startswith("model.hc_head.hc_"):
        return "hc_head_" + name.removeprefix("model.hc_head.hc_")
    return name.removeprefix("model.")


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float32 -> (int8 [out, in/2]: E2M1 codes, the even element in the low nibble; E8M0 scales
    [out, in/32]): each 32-value group's amax / 6 rounded up to a power of two, values rounded to the nearest E2M1."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    scale = np.exp2(np.ceil(np.log2(np.where(amax > 0, amax / 6.0, 1.0)))).astype(np.float32)  # [out, G, 1]
    mags = FP4_VALUES[:8]
    index = np.abs(np.abs(groups / scale)[..., None] - mags).argmin(-1).astype(np.uint8)  # [out, G, 32]
    codes = (index | (np.signbit(groups).astype(np.uint8) << 3)).reshape(rows, cols // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8).view(np.int8)
    return packed, scale[..., 0].astype(ml_dtypes.float8_e8m0fnu)


def published_layout(tensors: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """(the publisher's tensors, their whole-tensor decode in float32 under transformers' names). An MTP layer is
    added: a quantized projection, an FP4 expert and a norm, which the loaders must skip."""
    rng = np.random.default_rng(1)
    tensors = {**tensors, "mtp.0.e_proj.weight": rng.standard_normal((64, 64), np.float32),
               "mtp.0.ffn.experts.0.w1.weight": rng.standard_normal((32, 64), np.float32),
               "mtp.0.norm.weight": np.ones(64, np.float32)}
    out, decoded = {}, {}
    for name, w in tensors.items():
        ref = published_name(name)
        if FP8.match(ref):
            q, s = quantize_tiles(w, ue8m0=True)
            out[ref], out[ref.removesuffix(".weight") + ".scale"] = q, s.astype(ml_dtypes.float8_e8m0fnu)
            decoded[name] = dequant_fp8_block(q, s)
        elif FP4.match(ref):
            q, s = quantize_fp4(w)
            out[ref], out[ref.removesuffix(".weight") + ".scale"] = q, s
            decoded[name] = dequant_fp4_rows(q, s)
        else:
            out[ref], decoded[name] = w, w
    return out, {k: v for k, v in decoded.items() if not k.startswith("mtp.")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"float", "published", "decoded"}: transformers' save, the publisher's layout of it, its whole decode."""
    root = tmp_path_factory.mktemp("dsv4_published")
    build(transformers.DeepseekV4Config(**dict(TINY, num_attention_heads=8))).save_pretrained(root / "float")
    published, decoded = published_layout(load_file(root / "float" / "model.safetensors"))
    cfg = json.loads((root / "float" / "config.json").read_text())
    for name, tensors, extra in (("published", published, {"quantization_config": QUANT, "expert_dtype": "fp4"}),
                                 ("decoded", decoded, {})):
        (root / name).mkdir()
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps({**cfg, **extra}))
    return {k: str(root / k) for k in ("float", "published", "decoded")}


def test_published_layout_loads_bit_identical_to_the_whole_tensor_decode(folders):
    tensors = safetensors.torch.load_file(f"{folders['published']}/model.safetensors")
    assert tensors["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.1.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.1.attn.wq_b.scale"].shape == (2, 1)  # 256 rows: two tiles
    assert tensors["layers.2.ffn.experts.3.w2.weight"].dtype == torch.int8
    assert tensors["layers.2.ffn.experts.3.w2.weight"].shape == (64, 16)  # [D, I / 2]
    assert tensors["layers.2.ffn.experts.3.w2.scale"].shape == (64, 1)  # one per 32 of I
    assert tensors["layers.1.attn.compressor.wkv.weight"].dtype == torch.float32  # the compressors stay float
    names = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "mtp.0.ffn.experts.0.w1.scale"}
    assert names <= tensors.keys()

    published, whole = from_pretrained(folders["published"]), from_pretrained(folders["decoded"])
    assert isinstance(published, DeepseekV4)
    a, b = flat_state(published), flat_state(whole)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
    got = np.asarray(jit_forward(published)(jnp.asarray(IDS)))
    assert np.array_equal(got, np.asarray(jit_forward(whole)(jnp.asarray(IDS))))
    ref = hf_reload_logits(folders["decoded"], IDS)  # transformers on the decoded weights
    moved = rel_err(got, np.asarray(jit_forward(from_pretrained(folders["float"]))(jnp.asarray(IDS))))
    # transformers reads the published folder itself (names, `.scale`, FP4 experts; decoding on a machine without a GPU)
    theirs = hf_reload_logits(folders["published"], IDS)
    err, err_theirs = rel_err(got, ref), rel_err(theirs, ref)
    print(f"DeepSeek-V4 published layout: ours vs transformers on the decoded weights {err:.2e}, transformers' own "
          f"load of the published folder {err_theirs:.2e}; FP8 / FP4 moved the logits by {moved:.2e}")
    assert err <= 1e-5 and err_theirs <= 1e-5 and rel_err(got, theirs) <= 1e-5
    assert moved > 1e-3  # the checkpoint really is quantized


def test_fp4_decode_is_transformers_unpack():
    """Every code and a range of scales: ours equals transformers' `Fp8Dequantize` (`_unpack_fp4`, E8M0 scales)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)  # every byte: every (low, high) pair of codes
    scale = np.array([[0, 1], [100, 126], [127, 128], [150, 250], [127, 127], [120, 130], [1, 0], [60, 200]],
                     np.uint8)  # [8, 2]: one per 32 values
    theirs = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(codes.view(np.int8)),
                                                 torch.from_numpy(scale).view(torch.float8_e8m0fnu),
                                                 output_dtype=torch.float32)
    ours = dequant_fp4_rows(codes.view(np.int8), scale.view(ml_dtypes.float8_e8m0fnu))
    assert ours.shape == (8, 64)
    assert np.array_equal(ours, theirs.numpy())


CHILD = """
import json, os
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from models import from_pretrained, jit_forward
from models.sharding import make_mesh

assert len(jax.devices()) == 8
p, ids = json.loads(__PATHS__), np.asarray(json.loads(__IDS__), np.int32)
mesh = make_mesh(fsdp=2, tensor=2, expert=2)
stats = {}
sharded, whole = from_pretrained(p["published"], mesh=mesh, stats=stats), from_pretrained(p["decoded"])
flat = lambda m: {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(m))}
a, b = flat(sharded), flat(whole)
assert a.keys() == b.keys()
split = []
for key in a:
    assert a[key].dtype == b[key].dtype and np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key
    if not a[key].sharding.is_fully_replicated:
        split.append(key)
got = np.asarray(jit_forward(sharded)(jnp.asarray(ids)))
want = np.asarray(jit_forward(whole)(jnp.asarray(ids)))
print("REPORT" + json.dumps({"split": split, "max_abs": float(np.max(np.abs(got - want))),
                             "scale": float(np.max(np.abs(want))), "bytes_read": stats["bytes_read"],
                             "file_bytes": os.path.getsize(os.path.join(p["published"], "model.safetensors"))}))
"""


def test_published_layout_loads_sharded_on_8_devices(folders):
    """`mesh=`: each device's slice of an FP8 weight is its codes times the tiles it overlaps, of an FP4 expert the
    32-value groups its columns overlap: bit-identical to the whole decode, the MTP layer never read whole."""
    code = CHILD.replace("__PATHS__", repr(json.dumps(folders))).replace("__IDS__", repr(json.dumps(IDS.tolist())))
    r = run_on_8_devices(code)
    print({k: v for k, v in r.items() if k != "split"}, len(r["split"]), "split variables")
    assert any("experts" in k for k in r["split"]) and any("wq_b" in k for k in r["split"])  # the mesh shards them
    assert r["max_abs"] <= 1e-5 * r["scale"], r
    assert r["bytes_read"] <= r["file_bytes"], r  # the MTP layer is skipped, scale tiles shared by slices re-read
