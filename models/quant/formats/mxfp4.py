"""GPT-OSS's MXFP4 expert weights, read and written: `<name>_blocks` uint8 [..., G, 16] holding two E2M1
(FP4) codes a byte, low nibble first (the even element), and `<name>_scales` uint8 [..., G], one E8M0 scale
per 32 values (exponent = byte - 127). Mirrors transformers `integrations/mxfp4.py` (`FP4_VALUES`,
`convert_moe_packed_tensors`, `Mxfp4Config`) and openai/gpt-oss-20b's `model.safetensors` / config.json;
the element and scale encodings are the OCP Microscaling (MX) v1.0 spec's.

Read: `dequant_mxfp4` decodes to float32 as transformers does; the loader's view
(models/quant/formats/dequantizing.py) then transposes [E, out, in] to transformers' [E, in, out].

Written: `to_gpt_oss_mxfp4` for a GPT-OSS model whose experts `quantize_model` quantized with mxfp4a16
(models/quant/state.py holds them as E2M1 values in float8 `<w>_q` [E, in, out], gate columns first, and
power-of-two `<w>_scale` [E, in/32, out]). Per layer, as GPT-OSS ships them:

    mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, D/32, 16]   gate/up interleaved: gate rows even, up odd
    mlp.experts.gate_up_proj_scales  uint8 [E, 2I, D/32]
    mlp.experts.down_proj_blocks     uint8 [E, D, I/32, 16]
    mlp.experts.down_proj_scales     uint8 [E, D, I/32]
    mlp.experts.gate_up_proj_bias    float [E, 2I] (interleaved), down_proj_bias float [E, D]

with config.json's `quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`
(attention, router, embeddings, LM head: float). Each tensor is computed on its own from the module (one
per `save_pretrained` step), never the whole model on the host. See docs/formats/deepseek-fp8.md (MXFP4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models.layers import Linear, hf_name
from models.moe import Experts
from models.numerics import e2m1_index
from models.quant.state import scheme_of
from models.quant.targets import gpt_oss_mxfp4

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MX_BLOCK = 32  # values per E8M0 scale (OCP MX block size)
# openai/gpt-oss-20b config.json's list: what the published checkpoint keeps float (besides the norms,
# which transformers never converts)
GPT_OSS_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 (E8M0) -> float32 [..., G * 32].

    Each byte holds two FP4 codes: the low nibble is the even element, the high nibble the odd one.
    """
    blocks = np.asarray(blocks).view(np.uint8)
    scales = np.asarray(scales).view(np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    out = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)  # [..., G, 32]
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


def pack_e2m1(values: Any) -> jax.Array:
    """E2M1 values [..., n] (n a multiple of 32; any float dtype that holds them exactly: float8_e4m3fn codes,
    float32) -> uint8 [..., n/32, 16]: code = 8·signbit | magnitude index (-0 keeps its sign), the even
    element in the low nibble."""
    v = jnp.asarray(values).astype(jnp.float32)  # exact: E2M1 values
    *lead, n = v.shape
    if n % MX_BLOCK:
        raise ValueError(f"mxfp4: {n} values a row is not a multiple of the block size {MX_BLOCK}")
    codes = e2m1_index(v, jnp) | (jnp.signbit(v).astype(jnp.uint8) << 3)  # [..., n]
    codes = codes.reshape(*lead, n // MX_BLOCK, MX_BLOCK // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(jnp.uint8)  # [..., n/32, 16]


def e8m0_bytes(scale: Any) -> jax.Array:
    """Power-of-two scales float32 [...] -> their E8M0 bytes uint8 [...]: the float32 exponent bits, so
    2^(byte - 127), the subnormal 2^-127 included (byte 0). Bits only: no arithmetic, no flush to zero."""
    return (lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32), jnp.int32) >> 23).astype(jnp.uint8)


def encode_mxfp4(values: Any, scale: Any) -> tuple[jax.Array, jax.Array]:
    """E2M1 values [..., out, in] and power-of-two scales float32 [..., out, in/32] -> (blocks uint8
    [..., out, in/32, 16], scales uint8 E8M0 [..., out, in/32]): the inverse of `dequant_mxfp4`."""
    *lead, out, n = jnp.shape(values)
    if n % MX_BLOCK or tuple(jnp.shape(scale)) != (*lead, out, n // MX_BLOCK):
        raise ValueError(f"mxfp4: values {[*lead, out, n]} need scales {[*lead, out, n // MX_BLOCK]} (one per "
                         f"{MX_BLOCK}), got {list(jnp.shape(scale))}")
    return pack_e2m1(values), e8m0_bytes(scale)


def _interleave(a: jax.Array, I: int) -> jax.Array:
    """[..., 2I] with gate columns first, then up -> GPT-OSS's order, gate even, up odd."""
    return jnp.stack([a[..., :I], a[..., I:]], axis=-1).reshape(a.shape)


def _hf_oriented(ex: Experts, w: str, part: str) -> jax.Array:
    """Experts' stack `w_part` ("gate_up" | "down", "q" | "scale") [E, in or G, out] -> GPT-OSS's row order
    [E, out, in or G] (gate_up interleaved). The scales move as int32 bits (data movement only)."""
    a = getattr(ex, f"{w}_{part}")[...]
    if part == "scale":
        a = lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
    if w == "gate_up":
        a = _interleave(a, ex.intermediate_size)
    return jnp.swapaxes(a, -1, -2)


def _blocks(ex: Experts, w: str) -> jax.Array:
    return pack_e2m1(_hf_oriented(ex, w, "q"))  # [E, out, in] E2M1 values as float8 -> [E, out, in/32, 16]


def _scales(ex: Experts, w: str) -> jax.Array:
    return (_hf_oriented(ex, w, "scale") >> 23).astype(jnp.uint8)  # [E, out, in/32]: the exponent byte


# one named function per tensor (models/hf.py runs each on the devices, compiled once per module structure)
def gate_up_blocks(ex: Experts) -> jax.Array:
    return _blocks(ex, "gate_up")  # [E, 2I, D/32, 16]


def gate_up_scales(ex: Experts) -> jax.Array:
    return _scales(ex, "gate_up")  # [E, 2I, D/32]


def down_blocks(ex: Experts) -> jax.Array:
    return _blocks(ex, "down")  # [E, D, I/32, 16]


def down_scales(ex: Experts) -> jax.Array:
    return _scales(ex, "down")  # [E, D, I/32]


def gate_up_bias(ex: Experts) -> jax.Array:
    return _interleave(ex.gate_up_bias[...], ex.intermediate_size)  # [E, 2I]


def down_bias(ex: Experts) -> jax.Array:
    return ex.down_bias[...]  # [E, D]


TensorSpec = tuple[str, Experts, Callable[[Experts], jax.Array], jax.ShapeDtypeStruct]


def has_gpt_oss_mxfp4(model: nnx.Module) -> bool:
    """Whether `model` holds quantized GPT-OSS experts (whose one on-disk layout is this module's)."""
    return any(isinstance(n, Experts) and n.hf_layout == "gpt_oss" and n.quantized for _, n in nnx.iter_graph(model))


def to_gpt_oss_mxfp4(model: nnx.Module, dtype: Any = jnp.float32) -> tuple[dict[str, Any], list[TensorSpec]]:
    """(quantization_config, [(tensor name, experts module, function of the module computing the tensor, its
    shape and dtype)]) of every quantized GPT-OSS expert stack, in GPT-OSS's MXFP4 layout (module docstring);
    biases in `dtype`. Everything else (attention, router, norms, embeddings, head, and expert stacks left
    float by `ignore`) is the plain float checkpoint's and is listed in `modules_to_not_convert`."""
    specs: list[TensorSpec] = []
    float_experts: list[str] = []
    scheme = scheme_of(model)  # the one quantize_model recorded (activation quantization included)
    for path, node in nnx.iter_graph(model):
        name = hf_name(path)
        if isinstance(node, Linear) and node.qweight is not None:
            raise ValueError(f"gpt-oss-mxfp4: {name} is quantized; GPT-OSS's MXFP4 layout keeps every Linear "
                             "float (quantize_model with mxfp4a16 quantizes only a GPT-OSS model's experts)")
        if not isinstance(node, Experts):
            continue
        if node.hf_layout != "gpt_oss":
            raise ValueError(f"gpt-oss-mxfp4: {name} is not a GPT-OSS expert stack (hf_layout "
                             f"{node.hf_layout!r}); write it with layout='compressed-tensors'")
        if not node.quantized:
            float_experts.append(name)
            continue
        E, D, I = node.num_experts, node.hidden_size, node.intermediate_size
        G = (D // MX_BLOCK, I // MX_BLOCK)
        if node.qblock is not None or node.gate_up_zero is not None or node.gate_up_global is not None \
                or not gpt_oss_mxfp4(scheme) or D % MX_BLOCK or I % MX_BLOCK \
                or tuple(node.gate_up_scale[...].shape) != (E, G[0], 2 * I) \
                or node.gate_up_q[...].dtype != jnp.float8_e4m3fn:
            raise ValueError(f"gpt-oss-mxfp4: {name} is not quantized mxfp4a16 (E2M1 codes, one power-of-two "
                             f"scale per {MX_BLOCK} inputs, weights only; scheme {scheme.name}): only mxfp4a16 "
                             "has GPT-OSS's layout")
        u8 = jnp.dtype(jnp.uint8)
        specs += [
            (f"{name}.gate_up_proj_blocks", node, gate_up_blocks, jax.ShapeDtypeStruct((E, 2 * I, G[0], 16), u8)),
            (f"{name}.gate_up_proj_scales", node, gate_up_scales, jax.ShapeDtypeStruct((E, 2 * I, G[0]), u8)),
            (f"{name}.down_proj_blocks", node, down_blocks, jax.ShapeDtypeStruct((E, D, G[1], 16), u8)),
            (f"{name}.down_proj_scales", node, down_scales, jax.ShapeDtypeStruct((E, D, G[1]), u8)),
        ]
        if node.gate_up_bias is not None:
            specs += [(f"{name}.gate_up_proj_bias", node, gate_up_bias, jax.ShapeDtypeStruct((E, 2 * I), dtype)),
                      (f"{name}.down_proj_bias", node, down_bias, jax.ShapeDtypeStruct((E, D), dtype))]
    if not specs:
        raise ValueError("gpt-oss-mxfp4: the model has no quantized GPT-OSS experts")
    config = {"quant_method": "mxfp4", "modules_to_not_convert": [*GPT_OSS_NOT_CONVERTED, *float_experts]}
    return config, specs
