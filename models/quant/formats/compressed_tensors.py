"""The compressed-tensors checkpoint layout, written and read: config.json's `quantization_config` and
the tensors of every quantized module, HF names, [out, in] layout, experts written per expert.

* `pack-quantized` int4 / int8 (weight-only, group or channel, symmetric or asymmetric): `weight_packed`
  int32 words (32/b codes a word, offset to unsigned, low bits first), `weight_scale` [out, G],
  `weight_shape` [2], and `weight_zero_point` [ceil(out·b/32), G] packed along the output axis; mirrors
  compressed-tensors 0.20 `compressors/pack_quantized/base.py` and `compressors/pack_quantized/helpers.py`
  (`pack_to_int32` / `unpack_from_int32`).
* `float-quantized` FP8 128x128 blocks or per output channel (fp8-dynamic): `weight` float8_e4m3fn and
  `weight_scale` float32 tiles / [out, 1]; mirrors `compressors/naive_quantized/base.py`
  (`FloatQuantizationCompressor`).
* `int-quantized` int8 per channel (int8-w8a8): `weight` int8 [out, in] and `weight_scale` [out, 1]
  (`IntQuantizationCompressor`), the layout vLLM's W8A8 int8 kernels load.
* `nvfp4-pack-quantized` / `mxfp4-pack-quantized` FP4: `weight_packed` uint8 [out, in/2] (two E2M1 codes a
  byte, the even element in the low nibble, code = sign bit 8 | magnitude index 0..7), `weight_scale`
  float8_e4m3fn [out, in/16] (NVFP4) or uint8 E8M0 exponents [out, in/32] (MXFP4, value 2^(e - 127)), and
  NVFP4's `weight_global_scale` float32 [1]; mirrors `compressors/nvfp4/` (`pack_fp4_to_uint8`) and
  `compressors/mxfp4/base.py` with `compressors/mx_utils.py`.
* `kv_cache_scheme`: null, or an FP8 KV cache's args (models/quant/kv_cache.py), its `self_attn.k_scale` /
  `v_scale` written by the attention modules themselves.
* `quantization_config`: one config group targeting Linear (`quantization/quant_config.py`,
  `quantization/quant_args.py`), `ignore` = the float modules and the routers; `input_activations` as the
  FP8_DYNAMIC, W8A8, W4AFP8, NVFP4 and MXFP4 presets have them (per-token dynamic FP8 / int8, NVFP4 groups
  of 16 with a static global scale written per module as `input_global_scale` float32 [1], MXFP4 groups
  of 32), `null` for weight-only schemes.

See docs/formats/compressed-tensors.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from models.layers import Linear
from models.moe import Experts
from models.numerics import E2M1_VALUES, e2m1_index
from models.quant.schemes import FP4_GROUP, FP8_BLOCK, Scheme, parse_scheme
from models.quant.state import QMatrix, iter_qmatrices, set_activations, set_experts, set_linear
from models.quant.targets import ALWAYS_IGNORED, quant_units

ROUTER_PATTERNS = (r"re:.*mlp\.gate$", r"re:.*mlp\.router$")  # written to `ignore` for engines that wrap routers


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


def pack(q: np.ndarray, bits: int, axis: int = 1) -> np.ndarray:
    """Signed codes int8 [rows, cols] -> int32 words along `axis` (docs/formats/compressed-tensors.md):
    offset by 2^(b-1) to unsigned, 32/b per word, element p·j + i in bits b·i .. b·i + b - 1, the last
    word zero-padded."""
    if axis == 0:
        return np.ascontiguousarray(pack(q.T, bits).T)
    per = 32 // bits
    rows, n = q.shape
    u = (q.astype(np.int64) + (1 << (bits - 1))).astype(np.uint32)
    u = np.pad(u, ((0, 0), (0, -n % per))).reshape(rows, -1, per)  # [rows, words, per]
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.ascontiguousarray(np.bitwise_or.reduce(u << shifts, axis=-1)).view(np.int32)


def unpack(packed: np.ndarray, bits: int, shape: tuple[int, int], axis: int = 1) -> np.ndarray:
    """Inverse of `pack`: int32 words -> signed int8 codes of `shape`."""
    if axis == 0:
        return np.ascontiguousarray(unpack(np.asarray(packed).T, bits, (shape[1], shape[0])).T)
    per, mask = 32 // bits, (1 << bits) - 1
    rows, n = shape
    u = np.asarray(packed).astype(np.int32).view(np.uint32)[:, :, None]
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    vals = ((u >> shifts) & mask).reshape(rows, -1)[:, :n]
    return (vals.astype(np.int32) - (1 << (bits - 1))).astype(np.int8)


FP4_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
ACT_SCHEMES = ("fp8-dynamic", "int8-w8a8", "w4afp8", "nvfp4", "mxfp4")  # with input_activations, as read back


def pack_fp4(q: np.ndarray) -> np.ndarray:
    """E2M1 values [rows, cols] (cols even) -> uint8 [rows, cols/2]: code = 8·signbit | magnitude index, the
    even element in the low nibble (compressed-tensors `pack_fp4_to_uint8`)."""
    qf = np.asarray(q, np.float32)
    codes = e2m1_index(qf) | (np.signbit(qf).astype(np.uint8) << 3)
    return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_fp4`: uint8 [rows, cols/2] -> E2M1 values float32 [rows, cols] (-0 kept)."""
    b = np.asarray(packed).view(np.uint8)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)  # [rows, cols]
    mag = E2M1_VALUES[codes & 0x07]
    return np.where(codes & 0x08, -mag, mag).astype(np.float32)


def _weights_args(scheme: Scheme) -> dict[str, Any]:
    if scheme.kind == "fp4":
        nv = scheme.fp4 == "nvfp4"
        return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group" if nv else "group",
                "group_size": scheme.group_size, "block_structure": None, "dynamic": False, "actorder": None,
                "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
                "zp_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
                "observer": "memoryless_minmax" if nv else "minmax", "observer_kwargs": {}}
    if scheme.kind in ("fp8-block", "fp8"):
        block = scheme.kind == "fp8-block"
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block" if block else "channel",
                "group_size": None, "block_structure": [FP8_BLOCK, FP8_BLOCK] if block else None, "dynamic": False,
                "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric,
            "strategy": "channel" if scheme.group_size is None else "group", "group_size": scheme.group_size,
            "block_structure": None, "dynamic": False, "actorder": "weight" if scheme.actorder else None,
            "observer": "minmax", "observer_kwargs": {}}


def _input_args(scheme: Scheme) -> dict[str, Any] | None:
    """The input_activations args of the scheme's compressed-tensors preset (None: weight-only)."""
    if scheme.act is None:
        return None
    common = {"symmetric": True, "block_structure": None, "actorder": None, "observer_kwargs": {}}
    if scheme.act in ("fp8", "int8"):
        return {"num_bits": 8, "type": "float" if scheme.act == "fp8" else "int", "strategy": "token",
                "group_size": None, "dynamic": True, "observer": None, **common}
    nv = scheme.act == "nvfp4"
    return {"num_bits": 4, "type": "float", "strategy": "tensor_group" if nv else "group",
            "group_size": FP4_GROUP[scheme.act], "dynamic": "local" if nv else True,
            "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
            "zp_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
            "observer": "static_minmax" if nv else None, **common}


def format_of(scheme: Scheme) -> str:
    if scheme.kind == "fp4":
        return FP4_FORMATS[scheme.fp4]
    if scheme.kind in ("fp8-block", "fp8"):
        return "float-quantized"
    return "int-quantized" if scheme.act == "int8" else "pack-quantized"


def compressed_tensors_config(scheme: Scheme, ignore: Sequence[str]) -> dict[str, Any]:
    """`quantization_config` for config.json: one group targeting Linear with the scheme's weight args and
    input activation args (null: weight-only, activations stay in the serving dtype), and the modules
    left in float."""
    fmt = format_of(scheme)
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _weights_args(scheme),
                                      "input_activations": _input_args(scheme), "output_activations": None,
                                      "format": fmt}},
        "ignore": list(dict.fromkeys([*ALWAYS_IGNORED, *ROUTER_PATTERNS, *ignore])),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


def _tensors_for(name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
    """safetensors writes an array's memory as it is: every tensor here is made C-contiguous."""
    return {k: np.ascontiguousarray(v) for k, v in _tensors_raw(name, qm, scheme, scale_dtype).items()}


def _tensors_raw(name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
    out = _weight_tensors(name, qm, scheme, scale_dtype)
    if scheme.static_act:
        if qm.input_global is None:
            raise ValueError(f"{name}: scheme {scheme.name} quantizes activations but the module has no input "
                             "global scale")
        out[f"{name}.input_global_scale"] = np.asarray(qm.input_global, np.float32).reshape(1)
    return out


def _weight_tensors(name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
    if scheme.kind == "fp4":
        from models.quant.quantizers import mx_code
        out = {f"{name}.weight_packed": pack_fp4(qm.q)}
        if scheme.fp4 == "nvfp4":
            out[f"{name}.weight_scale"] = qm.scale.astype(ml_dtypes.float8_e4m3fn)  # exact: FP8 values
            out[f"{name}.weight_global_scale"] = np.asarray(qm.global_scale, np.float32).reshape(1)
        else:  # E8M0 codes
            out[f"{name}.weight_scale"] = mx_code(qm.scale)
        return out
    if scheme.kind in ("fp8-block", "fp8"):
        return {f"{name}.weight": np.asarray(qm.q).astype(ml_dtypes.float8_e4m3fn),
                f"{name}.weight_scale": qm.scale.astype(scale_dtype)}
    if format_of(scheme) == "int-quantized":
        return {f"{name}.weight": np.asarray(qm.q, np.int8), f"{name}.weight_scale": qm.scale.astype(scale_dtype)}
    out = {f"{name}.weight_packed": pack(qm.q, scheme.bits), f"{name}.weight_scale": qm.scale.astype(scale_dtype),
           f"{name}.weight_shape": np.asarray(qm.q.shape, np.int32)}
    if qm.zero is not None:
        out[f"{name}.weight_zero_point"] = pack(qm.zero, scheme.bits, axis=0)
    return out


def tensor_specs(name: str, out: int, n_in: int, scheme: Scheme, scale_dtype: Any) -> list[tuple[str, tuple, Any]]:
    """(tensor name, shape, numpy dtype) of what `_tensors_for` writes for one [out, in] weight, in its order,
    from the shape alone (streaming quantization plans a file's header before any tensor is computed)."""
    specs = _weight_specs(name, out, n_in, scheme, scale_dtype)
    return specs + ([(f"{name}.input_global_scale", (1,), np.dtype(np.float32))] if scheme.static_act else [])


def _weight_specs(name: str, out: int, n_in: int, scheme: Scheme, scale_dtype: Any) -> list[tuple[str, tuple, Any]]:
    if scheme.kind == "fp4":
        nv = scheme.fp4 == "nvfp4"
        specs = [(f"{name}.weight_packed", (out, n_in // 2), np.dtype(np.uint8)),
                 (f"{name}.weight_scale", (out, scheme.groups(n_in)),
                  np.dtype(ml_dtypes.float8_e4m3fn) if nv else np.dtype(np.uint8))]
        return specs + ([(f"{name}.weight_global_scale", (1,), np.dtype(np.float32))] if nv else [])
    if scheme.kind == "fp8-block":
        return [(f"{name}.weight", (out, n_in), np.dtype(ml_dtypes.float8_e4m3fn)),
                (f"{name}.weight_scale", (math.ceil(out / FP8_BLOCK), math.ceil(n_in / FP8_BLOCK)),
                 np.dtype(scale_dtype))]
    if scheme.kind == "fp8" or format_of(scheme) == "int-quantized":
        return [(f"{name}.weight", (out, n_in), np.dtype(ml_dtypes.float8_e4m3fn if scheme.kind == "fp8" else np.int8)),
                (f"{name}.weight_scale", (out, 1), np.dtype(scale_dtype))]
    per, G = 32 // scheme.bits, scheme.groups(n_in)
    specs = [(f"{name}.weight_packed", (out, -(-n_in // per)), np.dtype(np.int32)),
             (f"{name}.weight_scale", (out, G), np.dtype(scale_dtype)),
             (f"{name}.weight_shape", (2,), np.dtype(np.int32))]
    return specs + ([] if scheme.symmetric else [(f"{name}.weight_zero_point", (-(-out // per), G),
                                                  np.dtype(np.int32))])


def to_compressed_tensors(model: nnx.Module, scheme: Scheme, ignore: Sequence[str] = (), *,
                          scale_dtype: Any = np.float32) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(quantization_config, tensors) for every quantized module, HF names, [out, in] layout
    (docs/formats/compressed-tensors.md); experts are written per expert, as vLLM's fused-MoE loaders and
    transformers' checkpoints name them."""
    tensors: dict[str, np.ndarray] = {}
    for name, qm, bias in iter_qmatrices(model):
        tensors.update(_tensors_for(name, qm, scheme, scale_dtype))
        if bias is not None:
            tensors[f"{name}.bias"] = np.asarray(bias[...]).astype(scale_dtype)
    from models.quant.kv_cache import kv_cache_scheme  # its k/v scales are the attention's own (`hf_raw`) tensors

    return {**compressed_tensors_config(scheme, ignore), "kv_cache_scheme": kv_cache_scheme(model)}, tensors


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


def _same_args(ours: Mapping[str, Any], theirs: Mapping[str, Any], *, group: bool = True) -> bool:
    """Whether a file's QuantizationArgs mean ours: bits, type, strategy, symmetry, dynamic-ness (NVFP4's
    "local" exactly) and, with `group`, the group size."""
    keys = ("num_bits", "type", "strategy") + (("group_size",) if group else ())
    if any(theirs.get(k) != ours[k] for k in keys) or bool(theirs.get("symmetric", True)) != ours["symmetric"]:
        return False
    mine, other = ours["dynamic"], theirs.get("dynamic", False)
    return other == mine if isinstance(mine, str) or isinstance(other, str) else bool(other) == bool(mine)


def read_scheme(qc: Mapping[str, Any], source: str) -> Scheme:
    """The Scheme of a compressed-tensors `quantization_config` this module writes; a clear error for others."""
    groups = list((qc.get("config_groups") or {}).values())
    w = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
    fmt = qc.get("format")
    if qc.get("quant_method") != "compressed-tensors" or len(groups) != 1 or groups[0].get("output_activations"):
        raise ValueError(f"{source}: unsupported quantization_config (only compressed-tensors checkpoints with one "
                         "config group and no output activation quantization are read)")
    if inp := groups[0].get("input_activations"):
        for name in ACT_SCHEMES:
            sch = parse_scheme(name)
            if fmt == format_of(sch) and _same_args(_input_args(sch), inp) \
                    and _same_args(_weights_args(sch), w, group=name != "w4afp8"):
                return parse_scheme(f"w4afp8-g{w.get('group_size')}") if name == "w4afp8" else sch
        raise ValueError(f"{source}: unsupported quantization_config input_activations {dict(inp)} with weights "
                         f"{dict(w)} in format {fmt!r} (read: the FP8_DYNAMIC, W8A8, W4AFP8, NVFP4 and MXFP4 "
                         "presets' layouts)")
    if fmt == "float-quantized" and w.get("type") == "float" and w.get("strategy") == "block" \
            and list(w.get("block_structure") or []) == [FP8_BLOCK, FP8_BLOCK]:
        return parse_scheme("fp8-block")
    for fp4, f in FP4_FORMATS.items():
        if fmt == f and w.get("type") == "float" and w.get("num_bits") == 4 and w.get("group_size") == FP4_GROUP[fp4] \
                and w.get("strategy") == ("tensor_group" if fp4 == "nvfp4" else "group"):
            return parse_scheme(f"{fp4}a16")
    if fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") in (4, 8) \
            and w.get("strategy") in ("group", "channel"):
        group = w.get("group_size") if w.get("strategy") == "group" else None
        return Scheme("loaded", "int", int(w["num_bits"]), group, bool(w.get("symmetric", True)))
    raise ValueError(f"{source}: unsupported quantization_config weights {dict(w)} in format {fmt!r} (read: "
                     "pack-quantized int4/int8 group or channel, float-quantized FP8 128x128 blocks, "
                     "nvfp4-pack-quantized, mxfp4-pack-quantized)")


def prepare_for_load(model: nnx.Module, scheme: Scheme, names: set[str]) -> None:
    """Give every module the checkpoint holds quantized (its `weight_packed`, or FP8 `weight_scale`) zero
    quantized state of the right shapes, so hf_to_state can fill it; `model.quant_scheme` records the scheme."""
    marker = "weight_scale"
    for u in quant_units(model):
        m = u.module
        if isinstance(m, Linear):
            if f"{u.name}.{marker}" in names:
                set_linear(m, _zeros(m.out_features, m.in_features, scheme), scheme.kind, scheme.bits)
        elif f"{u.name}.0.down_proj.{marker}" in names:
            E, D, I = m.num_experts, m.hidden_size, m.intermediate_size
            gate = [_zeros(I, D, scheme)] * E
            set_experts(m, gate, gate, [_zeros(D, I, scheme)] * E, scheme.kind, scheme.bits)
    model.quant_scheme = scheme


def _zeros(out: int, n_in: int, scheme: Scheme) -> QMatrix:
    if scheme.kind == "fp4":
        return QMatrix(np.zeros((out, n_in), ml_dtypes.float8_e4m3fn), np.ones((out, scheme.groups(n_in)), np.float32),
                       None, np.ones((1,), np.float32) if scheme.fp4 == "nvfp4" else None)
    if scheme.kind == "fp8-block":
        return QMatrix(np.zeros((out, n_in), ml_dtypes.float8_e4m3fn),
                       np.ones((math.ceil(out / FP8_BLOCK), math.ceil(n_in / FP8_BLOCK)), np.float32))
    if scheme.kind == "fp8":
        return QMatrix(np.zeros((out, n_in), ml_dtypes.float8_e4m3fn), np.ones((out, 1), np.float32))
    G = scheme.groups(n_in)
    return QMatrix(np.zeros((out, n_in), np.int8), np.ones((out, G), np.float32),
                   None if scheme.symmetric else np.zeros((out, G), np.int8))


def read_qmatrix(get: Any, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
    """Read one module's quantized tensors through hf_to_state's `get(name, shape)` (which records
    missing and mis-shaped tensors); None when any is missing."""
    qm = _read_weight(get, name, out, n_in, scheme)
    if qm is None or not scheme.static_act:
        return qm
    g = get(f"{name}.input_global_scale", (1,))
    if g is None:
        return None
    qm.input_global = np.asarray(g, np.float32).reshape(1)
    return qm


def _read_weight(get: Any, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
    if scheme.kind == "fp4":
        from models.quant.quantizers import mx_scale_value
        G = scheme.groups(n_in)
        packed = get(f"{name}.weight_packed", (out, n_in // 2))
        nv = scheme.fp4 == "nvfp4"
        scale = get(f"{name}.weight_scale", (out, G))
        glob = get(f"{name}.weight_global_scale", (1,)) if nv else None
        if packed is None or scale is None or (nv and glob is None):
            return None
        s = np.asarray(scale).astype(np.float32) if nv else mx_scale_value(np.asarray(scale).view(np.uint8))
        return QMatrix(unpack_fp4(np.asarray(packed)).astype(ml_dtypes.float8_e4m3fn), s, None,
                       None if glob is None else np.asarray(glob, np.float32).reshape(1))
    if scheme.kind == "fp8-block":
        q = get(f"{name}.weight", (out, n_in))
        s = get(f"{name}.weight_scale", (math.ceil(out / FP8_BLOCK), math.ceil(n_in / FP8_BLOCK)))
        if q is None or s is None:
            return None
        return QMatrix(np.asarray(q).astype(ml_dtypes.float8_e4m3fn), np.asarray(s, np.float32))
    if scheme.kind == "fp8" or format_of(scheme) == "int-quantized":
        q = get(f"{name}.weight", (out, n_in))
        s = get(f"{name}.weight_scale", (out, 1))
        if q is None or s is None:
            return None
        codes = np.asarray(q).astype(ml_dtypes.float8_e4m3fn if scheme.kind == "fp8" else np.int8)
        return QMatrix(codes, np.asarray(s, np.float32))
    per = 32 // scheme.bits
    G = scheme.groups(n_in)
    packed = get(f"{name}.weight_packed", (out, -(-n_in // per)))
    shape = get(f"{name}.weight_shape", (2,))
    scale = get(f"{name}.weight_scale", (out, G))
    zero = None if scheme.symmetric else get(f"{name}.weight_zero_point", (-(-out // per), G))
    if packed is None or scale is None or (not scheme.symmetric and zero is None):
        return None
    if shape is not None and [int(v) for v in np.asarray(shape)] != [out, n_in]:
        raise ValueError(f"{name}.weight_shape = {np.asarray(shape).tolist()} (expected {[out, n_in]})")
    return QMatrix(unpack(np.asarray(packed), scheme.bits, (out, n_in)), np.asarray(scale, np.float32),
                   None if zero is None else unpack(np.asarray(zero), scheme.bits, (out, G), axis=0))


def load_linear(get: Any, name: str, lin: Linear, scheme: Scheme) -> None:
    qm = read_qmatrix(get, name, lin.out_features, lin.in_features, scheme)
    if qm is not None:
        set_linear(lin, qm, scheme.kind, scheme.bits)
        set_activations(lin, scheme.act, qm.input_global)


def load_experts(get: Any, ex: Experts, scheme: Scheme) -> None:
    """Per-expert gate_proj / up_proj / down_proj tensors -> the stacked quantized experts."""
    E, D, I = ex.num_experts, ex.hidden_size, ex.intermediate_size
    mats: dict[str, list[QMatrix]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    for e in range(E):
        for part, dims in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            qm = read_qmatrix(lambda sfx, shape, e=e: get(f"{e}.{sfx}", shape), part, *dims, scheme)
            if qm is None:
                return
            mats[part].append(qm)
    set_experts(ex, mats["gate_proj"], mats["up_proj"], mats["down_proj"], scheme.kind, scheme.bits)
    glob = None
    if scheme.static_act:  # gate and up read the same input: the engine fuses them with one scale (gate's)
        glob = {"gate_up": np.stack([m.input_global for m in mats["gate_proj"]]),
                "down": np.stack([m.input_global for m in mats["down_proj"]])}  # [E, 1] each
    set_activations(ex, scheme.act, glob)
