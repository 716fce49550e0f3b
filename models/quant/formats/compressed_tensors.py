"""The compressed-tensors checkpoint layout, written and read: config.json's `quantization_config` and
the tensors of every quantized module, HF names, [out, in] layout, experts written per expert. Each
weight's tensors and QuantizationArgs are its registered weight format's (models/quant/formats/registry.py:
`weight_args`, `specs`, `pack`, `unpack`, `read`; int_formats.py, fp8_formats.py, fp4_formats.py); this module
writes the config around them and dispatches to them. The built-in formats:

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

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from models.layers import Linear
from models.moe import Experts
from models.quant.formats import fp8_formats  # noqa: F401 - the built-in formats this reads and writes
from models.quant.formats.fp4_formats import pack_fp4, unpack_fp4  # noqa: F401 - re-exported
from models.quant.formats.int_formats import pack, unpack  # noqa: F401 - re-exported
from models.quant.formats.registry import weight_formats
from models.quant.schemes import Scheme, parse_scheme
from models.quant.state import QMatrix, iter_qmatrices, set_activations, set_experts, set_linear
from models.quant.targets import ALWAYS_IGNORED, expert_part, float_by_default, quant_units

ROUTER_PATTERNS = (r"re:.*mlp\.gate$", r"re:.*mlp\.router$")  # written to `ignore` for engines that wrap routers


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

ACT_SCHEMES = ("fp8-dynamic", "int8-w8a8", "w4afp8", "nvfp4", "mxfp4")  # with input_activations, as read back


def _weights_args(scheme: Scheme) -> dict[str, Any]:
    return scheme.format.weight_args(scheme)


def _input_args(scheme: Scheme) -> dict[str, Any] | None:
    """The input_activations args of the scheme's compressed-tensors preset (None: weight-only)."""
    act = scheme.act_format
    return None if act is None else copy.deepcopy(dict(act.args))


def format_of(scheme: Scheme) -> str:
    return scheme.format.compressed_tensors_format(scheme)


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
    out = scheme.format.pack(name, qm, scheme, scale_dtype)
    if scheme.static_act:
        if qm.input_global is None:
            raise ValueError(f"{name}: scheme {scheme.name} quantizes activations but the module has no input "
                             "global scale")
        out[f"{name}.input_global_scale"] = np.asarray(qm.input_global, np.float32).reshape(1)
    return out


def tensor_specs(name: str, out: int, n_in: int, scheme: Scheme, scale_dtype: Any) -> list[tuple[str, tuple, Any]]:
    """(tensor name, shape, numpy dtype) of what `_tensors_for` writes for one [out, in] weight, in its order,
    from the shape alone (streaming quantization plans a file's header before any tensor is computed)."""
    specs = scheme.format.specs(name, out, n_in, scheme, scale_dtype)
    return specs + ([(f"{name}.input_global_scale", (1,), np.dtype(np.float32))] if scheme.static_act else [])


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

    config = compressed_tensors_config(scheme, (*float_by_default(model), *ignore))  # + DSA's weights_proj
    return {**config, "kv_cache_scheme": kv_cache_scheme(model)}, tensors


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
    for wf in weight_formats():
        if (scheme := wf.read(fmt, w)) is not None:
            return scheme
    read = ", ".join(wf.read_note for wf in weight_formats() if wf.read_note)
    raise ValueError(f"{source}: unsupported quantization_config weights {dict(w)} in format {fmt!r} (read: {read})")


def prepare_for_load(model: nnx.Module, scheme: Scheme, names: set[str]) -> None:
    """Give every module the checkpoint holds quantized (its `weight_packed`, or FP8 `weight_scale`) zero
    quantized state of the right shapes, so hf_to_state can fill it; `model.quant_scheme` records the scheme."""
    marker = "weight_scale"
    for u in quant_units(model, float_by_default=False):
        m = u.module
        if isinstance(m, Linear):
            if f"{u.name}.{marker}" in names:
                set_linear(m, scheme.format.zeros(m.out_features, m.in_features, scheme), scheme)
        elif f"{u.name}.0.{expert_part(m, 'down_proj')}.{marker}" in names:
            E, D, I = m.num_experts, m.hidden_size, m.intermediate_size
            gate = [scheme.format.zeros(I, D, scheme)] * E
            set_experts(m, gate, gate, [scheme.format.zeros(D, I, scheme)] * E, scheme)
    model.quant_scheme = scheme


def read_qmatrix(get: Any, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
    """Read one module's quantized tensors through hf_to_state's `get(name, shape)` (which records
    missing and mis-shaped tensors); None when any is missing."""
    qm = scheme.format.unpack(get, name, out, n_in, scheme)
    if qm is None or not scheme.static_act:
        return qm
    g = get(f"{name}.input_global_scale", (1,))
    if g is None:
        return None
    qm.input_global = np.asarray(g, np.float32).reshape(1)
    return qm


def load_linear(get: Any, name: str, lin: Linear, scheme: Scheme) -> None:
    qm = read_qmatrix(get, name, lin.out_features, lin.in_features, scheme)
    if qm is not None:
        set_linear(lin, qm, scheme)
        set_activations(lin, scheme.act, qm.input_global)


def load_experts(get: Any, ex: Experts, scheme: Scheme) -> None:
    """Per-expert gate_proj / up_proj / down_proj tensors (the stack's `hf_names`) -> the stacked quantized experts."""
    E, D, I = ex.num_experts, ex.hidden_size, ex.intermediate_size
    mats: dict[str, list[QMatrix]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    for e in range(E):
        for part, dims in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            qm = read_qmatrix(lambda sfx, shape, e=e: get(f"{e}.{sfx}", shape), expert_part(ex, part), *dims, scheme)
            if qm is None:
                return
            mats[part].append(qm)
    set_experts(ex, mats["gate_proj"], mats["up_proj"], mats["down_proj"], scheme)
    glob = None
    if scheme.static_act:  # gate and up read the same input: the engine fuses them with one scale (gate's)
        glob = {"gate_up": np.stack([m.input_global for m in mats["gate_proj"]]),
                "down": np.stack([m.input_global for m in mats["down_proj"]])}  # [E, 1] each
    set_activations(ex, scheme.act, glob)
