"""Post-training weight quantization of a decoder (RTN, GPTQ, AWQ int4/int8; FP8 128x128 blocks), the
quantized model state, and the checkpoint layouts serving engines load.

Reference: /work/shared/reference/speculative-and-quantization-formats.md Part B — §B2 compressed-tensors
(`pack-quantized` int4/int8: B2.1 config, B2.2 presets W4A16 / W4A16_ASYM / W8A16, B2.3 tensors and bit
layout; `float-quantized` FP8_BLOCK: B2.4), §B5 DeepSeek block FP8 (`weight_scale_inv`), §B8 (MoE: unfuse,
quantize and calibrate every expert on its own routed tokens, assert coverage, never quantize routers).
The algorithms themselves (min-max parameters, GPTQ, the AWQ scale search, FP8 tiles) are in
models/quantizers.py; this module applies them to a model:

    scheme = parse_scheme("w4a16-gptq")                       # int4, group 128, symmetric, GPTQ
    report = quantize_model(model, scheme, calibration)       # in place; calibration: [(ids, segment_ids)]
    save_pretrained(model, "out/")                            # compressed-tensors, see `to_compressed_tensors`

Schemes (names are also the artifact folders and the eval report keys):
  int8                              W8A16: int8, per output channel, symmetric, round-to-nearest
  w{4,8}a16[-asym]-{rtn,gptq,awq}[-actorder][-g<N>]
                                    int weights, group N along the input (w4a16: 128 by default; w8a16: per
                                    channel unless -gN), symmetric unless -asym; -actorder (GPTQ only) visits
                                    columns by descending Hessian diagonal with static groups (compressed-tensors
                                    `actorder: weight`, which needs no g_idx on disk)
  fp8-block                         FP8 e4m3 weights, one scale per 128x128 tile (DeepSeek-V3's format)

Calibration runs layer by layer (as GPTQ and llm-compressor's sequential pipeline do): the calibration
tokens go through decoder layer i with every Linear and expert sowing its inputs; the statistics H = Σ x xᵀ
(padding excluded) quantize the layer; the *quantized* layer's output feeds layer i + 1. MoE experts get
their own statistics from the tokens routed to them; an expert with fewer than `expert_min_tokens` routed
tokens falls back to the layer's statistics pooled over all its experts (reported per expert). AWQ folds
its per-input-channel scales into the op before each group of Linears: the RMSNorm before q/k/v (or MLA's
q_a / kv_a projections) and before the MLP or experts (the routers get the inverse scale, so routing is
unchanged), MLA's q_a / kv_a norms, and the up projection before each down projection (SwiGLU only). The
attention output projection has no foldable predecessor under GQA and is quantized by RTN, as AutoAWQ does.

Every Linear except `lm_head` and MTP layers' `eh_proj` (ALWAYS_IGNORED), and every expert, is quantized
unless it matches `ignore` (module names, or regexes prefixed `re:`); routers, norms and embeddings are never
Linears here, so they always stay float. A model with an unmerged LoRA adapter is refused.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models import quantizers as Q
from models.decoder import build_context
from models.layers import Linear, QuantScale, QuantWeight, QuantZero, RMSNorm, hf_name, param
from models.moe import Experts

FP8_BLOCK = 128
# lm_head stays float; so does the MTP layers' eh_proj, which vLLM builds as a plain, unquantized Linear
ALWAYS_IGNORED = ("lm_head", r"re:.*\.eh_proj$")
ROUTER_PATTERNS = (r"re:.*mlp\.gate$", r"re:.*mlp\.router$")  # written to `ignore` for engines that wrap routers

# ------------------------------------------------------------------------------------------------
# Schemes
# ------------------------------------------------------------------------------------------------

SCHEME_RE = re.compile(r"(?P<w>w4a16|w8a16)(?P<asym>-asym)?-(?P<method>rtn|gptq|awq)(?P<act>-actorder)?"
                       r"(?:-g(?P<group>\d+))?")


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str
    kind: str  # "int" | "fp8-block"
    bits: int = 8
    group_size: int | None = None  # None: one scale per output channel
    symmetric: bool = True
    method: str = "rtn"  # rtn | gptq | awq (fp8-block: rtn)
    actorder: bool = False

    @property
    def args(self) -> Q.IntArgs:
        return Q.IntArgs(self.bits, self.group_size, self.symmetric)

    def groups(self, in_features: int) -> int:
        return math.ceil(in_features / FP8_BLOCK) if self.kind == "fp8-block" else self.args.groups(in_features)


def parse_scheme(name: str) -> Scheme:
    """A scheme name (see the module docstring) -> Scheme; ValueError naming the accepted forms otherwise."""
    if name == "int8":
        return Scheme("int8", "int", 8, None, True, "rtn")
    if name == "fp8-block":
        return Scheme("fp8-block", "fp8-block", 8)
    m = SCHEME_RE.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown quantization scheme {name!r} (known: int8, fp8-block, "
                         "w4a16|w8a16[-asym]-rtn|gptq|awq[-actorder][-g<N>], e.g. w4a16-gptq, w4a16-asym-awq-g64)")
    bits = 4 if m["w"] == "w4a16" else 8
    group = int(m["group"]) if m["group"] else (128 if bits == 4 else None)
    if group is not None and group <= 0:
        raise ValueError(f"scheme {name!r}: group size must be positive")
    if m["act"] and m["method"] != "gptq":
        raise ValueError(f"scheme {name!r}: -actorder applies to GPTQ only")
    return Scheme(name, "int", bits, group, not m["asym"], m["method"], bool(m["act"]))


# ------------------------------------------------------------------------------------------------
# What gets quantized: Linear layers and stacked experts, by HF module name
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Unit:
    """One quantizable module: a Linear, or an Experts stack (quantized per expert)."""

    name: str  # HF module name: "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts"
    path: tuple
    module: Linear | Experts

    @property
    def layer(self) -> int | None:
        return self.path[1] if len(self.path) > 1 and self.path[0] == "layers" else None

    def in_features(self) -> list[tuple[str, int]]:
        if isinstance(self.module, Linear):
            return [(self.name, self.module.in_features)]
        ex = self.module
        return [(f"{self.name}.gate_up", ex.hidden_size), (f"{self.name}.down_proj", ex.intermediate_size)]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(re.fullmatch(p[3:], name) if p.startswith("re:") else name == p for p in patterns)


def expert_names(prefix: str, experts: Experts) -> list[str]:
    return [f"{prefix}.{e}.{p}" for e in range(experts.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]


def quant_units(model: nnx.Module, ignore: Sequence[str] = ()) -> list[Unit]:
    """Every Linear (but lm_head) and Experts stack not matched by `ignore`, in a stable order.

    An Experts stack is matched by its own name or by all of its per-expert names; ignoring only some
    experts of a stack is refused (an engine loads a stack with one format)."""
    units = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            name = hf_name(path)
            if not _matches(name, (*ALWAYS_IGNORED, *ignore)):
                units.append(Unit(name, tuple(path), node))
        elif isinstance(node, Experts):
            name = hf_name(path)
            hits = [_matches(n, ignore) for n in expert_names(name, node)]
            if _matches(name, ignore) or all(hits):
                continue
            if any(hits):
                raise ValueError(f"quantize.ignore matches only some of {name}'s experts; ignore the whole "
                                 f"stack ({name!r}) or none of it")
            units.append(Unit(name, tuple(path), node))
    return units


def is_quantized(model: nnx.Module) -> bool:
    for _, node in nnx.iter_graph(model):
        if (isinstance(node, Linear) and node.qweight is not None) or (isinstance(node, Experts) and node.quantized):
            return True
    return False


def check_divisible(units: Sequence[Unit], scheme: Scheme) -> None:
    """A group size must divide every quantized layer's input width (compressed-tensors and the serving
    kernels need whole groups): one error naming the first offending layer and the way out."""
    if scheme.kind != "int" or scheme.group_size is None:
        return
    for unit in units:
        for name, n_in in unit.in_features():
            if n_in % scheme.group_size:
                raise ValueError(f"scheme {scheme.name}: group size {scheme.group_size} does not divide {name}'s "
                                 f"input width {n_in}; pick a group size that divides it (suffix -g<N>) or add "
                                 f"the layer to quantize.ignore")


def check_supported(units: Sequence[Unit], scheme: Scheme) -> None:
    """check_divisible, and no GPT-OSS fused experts (they have no compressed-tensors layout)."""
    check_divisible(units, scheme)
    if gpt_oss := [u.name for u in units if isinstance(u.module, Experts) and u.module.hf_layout == "gpt_oss"]:
        raise ValueError(f"{gpt_oss[0]}: GPT-OSS's fused experts have no compressed-tensors layout (the model "
                         "ships them in MXFP4); add 're:.*mlp\\.experts' to quantize.ignore")


# ------------------------------------------------------------------------------------------------
# Quantized state: set from HF-oriented [out, in] codes; transposed to the kernels' [in, out]
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class QMatrix:
    """One quantized weight in the HF orientation: codes [out, in] (int8 or float8_e4m3fn), scale [out, G]
    (or FP8 tiles [out/128, in/128]), zero [out, G] or None."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None = None


def _codes_dtype(scheme_kind: str) -> Any:
    return jnp.float8_e4m3fn if scheme_kind == "fp8-block" else jnp.int8


def set_linear(lin: Linear, qm: QMatrix, kind: str, bits: int = 8) -> None:
    """Turn a Linear into its quantized form (the float kernel and LoRA factors are dropped)."""
    a_in, a_out = lin.axes
    lin.qweight = param(jnp.asarray(qm.q.T, _codes_dtype(kind)), (a_in, a_out), QuantWeight)  # [in, out]
    lin.scale = param(jnp.asarray(qm.scale.T, jnp.float32), (None, a_out), QuantScale)  # [G, out]
    lin.zero = None if qm.zero is None else param(jnp.asarray(qm.zero.T, jnp.int8), (None, a_out), QuantZero)
    lin.qblock = FP8_BLOCK if kind == "fp8-block" else None
    lin.qbits = bits
    lin.kernel = None
    lin.lora_a = lin.lora_b = lin.lora_dropout = None


def set_experts(ex: Experts, gate: Sequence[QMatrix], up: Sequence[QMatrix], down: Sequence[QMatrix], kind: str,
                bits: int = 8) -> None:
    """Per-expert HF matrices (gate_proj, up_proj [I, D]; down_proj [D, I]) -> stacked codes: gate_up
    [E, D, 2I] (gate columns first), scales [E, G, 2I] (FP8: gate's tiles then up's, [E, D/128, 2·I/128])."""
    fused = [QMatrix(np.concatenate([g.q, u.q], 0), np.concatenate([g.scale, u.scale], 0),
                     None if g.zero is None else np.concatenate([g.zero, u.zero], 0))
             for g, u in zip(gate, up, strict=True)]
    for w, mats, axes in (("gate_up", fused, ("expert", "embed", "mlp")), ("down", down, ("expert", "mlp", "embed"))):
        setattr(ex, f"{w}_q", param(jnp.asarray(np.stack([m.q.T for m in mats]), _codes_dtype(kind)), axes,
                                    QuantWeight))  # [E, in, out]
        setattr(ex, f"{w}_scale", param(jnp.asarray(np.stack([m.scale.T for m in mats]), jnp.float32),
                                        (axes[0], None, axes[2]), QuantScale))  # [E, G, out]
        zero = None if mats[0].zero is None else param(jnp.asarray(np.stack([m.zero.T for m in mats]), jnp.int8),
                                                       (axes[0], None, axes[2]), QuantZero)
        setattr(ex, f"{w}_zero", zero)
        setattr(ex, w, None)
    ex.gate_up_lora_a = ex.gate_up_lora_b = ex.down_lora_a = ex.down_lora_b = ex.lora_dropout = None
    ex.qblock = FP8_BLOCK if kind == "fp8-block" else None
    ex.qbits = bits


def linear_qmatrix(lin: Linear) -> QMatrix:
    return QMatrix(np.asarray(lin.qweight[...]).T, np.asarray(lin.scale[...], np.float32).T,
                   None if lin.zero is None else np.asarray(lin.zero[...]).T)


def expert_qmatrices(ex: Experts) -> Iterator[tuple[int, str, QMatrix]]:
    """(expert, "gate_proj" | "up_proj" | "down_proj", QMatrix in the HF orientation) of quantized experts."""
    I = ex.intermediate_size
    for w in ("gate_up", "down"):
        q, s, z = (getattr(ex, f"{w}_{p}") for p in ("q", "scale", "zero"))
        q, s = np.asarray(q[...]), np.asarray(s[...], np.float32)
        z = None if z is None else np.asarray(z[...])
        for e in range(q.shape[0]):
            m = QMatrix(q[e].T, s[e].T, None if z is None else z[e].T)
            if w == "down":
                yield e, "down_proj", m
                continue
            st = s.shape[-1] // 2 if ex.qblock else I  # the split point of the scales' rows
            for part, rows, srows in (("gate_proj", slice(0, I), slice(0, st)),
                                      ("up_proj", slice(I, 2 * I), slice(st, None))):
                yield e, part, QMatrix(m.q[rows], m.scale[srows], None if m.zero is None else m.zero[rows])


# ------------------------------------------------------------------------------------------------
# Calibration statistics: one decoder layer at a time
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stats:
    """Σ x xᵀ [.., in, in], Σ |x| [.., in] and the token count [..] of one module input (leading E for experts)."""

    H: np.ndarray
    abs_sum: np.ndarray
    n: np.ndarray

    def __add__(self, other: Stats) -> Stats:
        return Stats(self.H + other.H, self.abs_sum + other.abs_sum, self.n + other.n)

    def absmean(self) -> np.ndarray:
        return self.abs_sum / np.maximum(self.n, 1.0)[..., None]

    def pooled(self) -> Stats:
        """Experts' statistics summed over the expert axis."""
        return Stats(self.H.sum(0), self.abs_sum.sum(0), self.n.sum(0))

    def scaled(self, s: np.ndarray) -> Stats:
        """Statistics of x / s (the input after an AWQ scale s was folded into the op before)."""
        return Stats(self.H / (s[..., :, None] * s[..., None, :]), self.abs_sum / s, self.n)


def _moments(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [R, n], row weights w [R] (0/1) -> (xᵀ diag(w) x [n, n], Σ w |x| [n], Σ w)."""
    x = x.astype(jnp.float32)
    xw = x * w[:, None]
    return jnp.matmul(xw.T, x, precision=jax.lax.Precision.HIGHEST), jnp.abs(xw).sum(0), w.sum()


def _layer_context(model: nnx.Module, seg: jax.Array, i: int):
    B, T = seg.shape
    ctx, _ = build_context(T, B, positions=None, segment_ids=seg, cache=None, windows={model.layer_window(i)})
    ctx.rope = model.rope(ctx.positions)
    return ctx


@nnx.jit(static_argnames=("i",))
def _layer_stats(model: nnx.Module, x: jax.Array, seg: jax.Array, i: int) -> dict[str, tuple]:
    """Run decoder layer i on x [B, T, D] with its quantizable modules sowing their inputs; return the
    moments per module (relative dotted path), padding (segment 0) excluded."""
    layer = model.layers[i]
    ctx = _layer_context(model, seg, i)
    _, sown = nnx.capture(lambda lyr: lyr(x, ctx, None, i), nnx.Intermediate)(layer)
    valid = (seg != 0).reshape(-1).astype(jnp.float32)  # [B*T]
    flat = {tuple(str(p) for p in path): (v.get_value() if hasattr(v, "get_value") else v)[0]
            for path, v in nnx.to_flat_state(sown)}
    out: dict[str, tuple] = {}
    for path, value in flat.items():
        mod, what = ".".join(path[:-1]), path[-1]
        if what == "calib":  # a Linear's input [B*T, in]
            out[mod] = _moments(value, valid)
        elif what in ("calib_gate_up", "calib_down"):  # an expert stack's routed rows [R, in]
            token, expert = flat[(*path[:-1], "calib_rows")]
            E = _module(layer, mod).num_experts

            def per_expert(e, rows=value, token=token, expert=expert):
                return _moments(rows, valid[token] * (expert == e))

            out[f"{mod}.{'gate_up' if what == 'calib_gate_up' else 'down_proj'}"] = \
                jax.lax.map(per_expert, jnp.arange(E))
    return out


@nnx.jit(static_argnames=("i",))
def _layer_forward(model: nnx.Module, x: jax.Array, seg: jax.Array, i: int) -> jax.Array:
    return model.layers[i](x, _layer_context(model, seg, i), None, i)[0]


def _set_calibrating(units: Sequence[Unit], on: bool) -> None:
    for u in units:
        u.module.calibrating = on
        if isinstance(u.module, Experts) and u.module.impl == "dense":
            raise ValueError(f"{u.name}: calibration needs the grouped experts path (impl 'blocked' or 'ragged')")


def collect_stats(model: nnx.Module, xs: Sequence[jax.Array], segs: Sequence[jax.Array], i: int,
                  units: Sequence[Unit]) -> dict[str, Stats]:
    """Statistics of layer i's quantizable inputs over all calibration batches, by HF module name
    (experts: "<name>.gate_up" and "<name>.down_proj", with a leading expert axis)."""
    _set_calibrating(units, True)
    try:
        total: dict[str, Stats] = {}
        for x, seg in zip(xs, segs, strict=True):
            for rel, (H, a, n) in _layer_stats(model, x, seg, i).items():
                key = f"model.layers.{i}.{rel}"
                st = Stats(np.asarray(H, np.float64), np.asarray(a, np.float64), np.asarray(n, np.float64))
                total[key] = total[key] + st if key in total else st
        return total
    finally:
        _set_calibrating(units, False)


# ------------------------------------------------------------------------------------------------
# Quantizing one matrix
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    dampening_frac: float = 0.01
    expert_min_tokens: int = 16  # fewer routed tokens: GPTQ on the layer's pooled expert statistics
    awq_grid: int = 20


def quantize_matrix(w: np.ndarray, stats: Stats | None, scheme: Scheme, opts: Options) -> tuple[QMatrix, str]:
    """w [out, in] float32 -> (QMatrix, the algorithm used: fp8-block, gptq or rtn). GPTQ without
    calibration tokens falls back to RTN; AWQ's weights arrive already scaled and are rounded by RTN."""
    if scheme.kind == "fp8-block":
        q, s = Q.fp8_block(w, (FP8_BLOCK, FP8_BLOCK))
        return QMatrix(np.asarray(q), np.asarray(s, np.float32)), "fp8-block"
    if scheme.method == "gptq" and stats is not None and stats.n > 0:
        qt = Q.gptq(w, stats.H.astype(np.float32), scheme.args, dampening_frac=opts.dampening_frac,
                    actorder=scheme.actorder)
        how = "gptq"
    else:
        qt = Q.rtn(w, scheme.args)
        how = "rtn"
    return QMatrix(np.asarray(qt.q, np.int8), np.asarray(qt.scale, np.float32),
                   None if qt.zero is None else np.asarray(qt.zero, np.int8)), how


def dequantized(qm: QMatrix, scheme: Scheme) -> np.ndarray:
    if scheme.kind == "fp8-block":
        return np.asarray(Q.dequantize_fp8_block(qm.q, qm.scale, (FP8_BLOCK, FP8_BLOCK)))
    return np.asarray(Q.dequantize(Q.QTensor(qm.q, qm.scale, qm.zero), scheme.args))


def _row(name: str, w: np.ndarray, qm: QMatrix, stats: Stats | None, scheme: Scheme, how: str,
         fallback: str | None = None) -> dict[str, Any]:
    """One report row; `fallback` says why a module did not get the scheme's own algorithm."""
    w_hat = dequantized(qm, scheme)
    row = {"module": name, "method": how, "tokens": int(stats.n) if stats is not None else 0,
           "weight_error": float(np.linalg.norm(w - w_hat) / max(np.linalg.norm(w), 1e-30))}
    if fallback:
        row["fallback"] = fallback
    if stats is not None and stats.n > 0:
        row["output_error"] = float(Q.output_error(w, w_hat, stats.H.astype(np.float32)))
    return row


# ------------------------------------------------------------------------------------------------
# AWQ: per-input-channel scales folded into the op before each group of Linears
# ------------------------------------------------------------------------------------------------


def _scale_norm(norm: RMSNorm, s: np.ndarray) -> None:
    norm.weight[...] = (norm.weight[...].astype(jnp.float32) / jnp.asarray(s)).astype(norm.weight[...].dtype)


def _scale_in(lin: Linear, s: np.ndarray) -> None:
    """Linear input channel i multiplied by s[i] (its input will arrive divided by s)."""
    lin.kernel[...] = (lin.kernel[...].astype(jnp.float32) * jnp.asarray(s)[:, None]).astype(lin.kernel[...].dtype)


def _scale_out(lin: Linear, s: np.ndarray) -> None:
    """Linear output channel j divided by s[j] (bias too)."""
    lin.kernel[...] = (lin.kernel[...].astype(jnp.float32) / jnp.asarray(s)[None, :]).astype(lin.kernel[...].dtype)
    if lin.bias is not None:
        lin.bias[...] = (lin.bias[...].astype(jnp.float32) / jnp.asarray(s)).astype(lin.bias[...].dtype)


def _hf(lin: Linear) -> np.ndarray:
    return np.asarray(lin.kernel[...], np.float32).T  # [out, in]


def awq_layer(layer: nnx.Module, i: int, stats: dict[str, Stats], units: Sequence[Unit], scheme: Scheme,
              opts: Options) -> list[dict[str, Any]]:
    """Search and fold AWQ scales for decoder layer i in place; update `stats` to the scaled inputs.
    Returns one row per folded group (where to, the best loss vs plain RTN's)."""
    quantized = {u.name for u in units}
    pre = f"model.layers.{i}"
    rows: list[dict[str, Any]] = []

    def search(pairs: list[tuple[np.ndarray, np.ndarray]], absmean: np.ndarray) -> tuple[np.ndarray, float, float]:
        s, loss = Q.awq_search(pairs, absmean, scheme.args, grid=opts.awq_grid)
        rtn_loss = Q.awq_loss(pairs, np.ones_like(absmean), scheme.args)
        return np.asarray(s, np.float32), float(loss), float(rtn_loss)

    def linear_group(fold: str, before: Any, names: list[str]) -> None:
        """`names`: every Linear reading `before`'s output. The search runs over the quantized ones; all
        of them (ignored ones too, which stay float) take the scale, so the fold is exact."""
        qnames = [n for n in names if n in quantized and n in stats]
        if not qnames or stats[qnames[0]].n <= 0:
            return
        st = stats[qnames[0]]
        s, loss, rtn_loss = search([(_hf(_module(layer, n[len(pre) + 1:])), st.H) for n in qnames], st.absmean())
        for n in names:
            _scale_in(_module(layer, n[len(pre) + 1:]), s)
        before(s)
        for n in qnames:
            stats[n] = stats[n].scaled(s)
        rows.append({"fold": fold, "modules": qnames, "loss": loss, "rtn_loss": rtn_loss})

    attn = layer.self_attn
    norm_in = lambda s: _scale_norm(layer.input_layernorm, s)  # noqa: E731
    if hasattr(attn, "q_proj") and hasattr(attn, "k_proj"):  # GQA families
        linear_group(f"{pre}.input_layernorm", norm_in,
                     [f"{pre}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
    elif hasattr(attn, "kv_a_proj_with_mqa"):  # MLA
        first = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_a_proj"
        linear_group(f"{pre}.input_layernorm", norm_in, [f"{pre}.self_attn.{p}" for p in (first, "kv_a_proj_with_mqa")])
        if first == "q_a_proj":
            linear_group(f"{pre}.self_attn.q_a_layernorm", lambda s: _scale_norm(attn.q_a_layernorm, s),
                         [f"{pre}.self_attn.q_b_proj"])
        linear_group(f"{pre}.self_attn.kv_a_layernorm", lambda s: _scale_norm(attn.kv_a_layernorm, s),
                     [f"{pre}.self_attn.kv_b_proj"])
    norm_post = lambda s: _scale_norm(layer.post_attention_layernorm, s)  # noqa: E731
    mlp = layer.mlp
    if hasattr(mlp, "gate_proj"):  # dense SwiGLU
        _mlp_groups(linear_group, f"{pre}.mlp", mlp, norm_post)
    elif hasattr(mlp, "experts"):
        rows += _awq_moe(mlp, f"{pre}.mlp", stats, quantized, norm_post, linear_group, search)
    return rows


def _mlp_groups(linear_group: Any, prefix: str, mlp: nnx.Module, before: Any) -> None:
    linear_group(f"{prefix}: post_attention_layernorm", before,
                 [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
    linear_group(f"{prefix}.up_proj", lambda s: _scale_out(mlp.up_proj, s), [f"{prefix}.down_proj"])


def _awq_moe(moe: nnx.Module, prefix: str, stats: dict[str, Stats], quantized: set[str], norm_post: Any,
             linear_group: Any, search: Any) -> list[dict[str, Any]]:
    """AWQ for an MoE block: one scale for everything reading the normed input (all experts' gate/up,
    the shared experts' gate/up), folded into post_attention_layernorm with the router compensated; then
    per expert, a scale for down_proj folded into that expert's up projection (SwiGLU experts only)."""
    ex: Experts = moe.experts
    name = f"{prefix}.experts"
    shared = getattr(moe, "shared_experts", None)
    sh = f"{prefix}.shared_experts"
    rows: list[dict[str, Any]] = []
    if name not in quantized or f"{name}.gate_up" not in stats:
        return rows
    st = stats[f"{name}.gate_up"]
    gu = np.array(ex.gate_up[...], np.float32)  # [E, D, 2I] (a writable copy)
    pairs = [(gu[e].T, st.H[e]) for e in range(ex.num_experts) if st.n[e] > 0]
    shared_names = [n for n in (f"{sh}.gate_proj", f"{sh}.up_proj") if n in quantized and n in stats]
    if shared is not None and shared_names:
        pairs += [(_hf(getattr(shared, n.rsplit(".", 1)[1])), stats[n].H) for n in shared_names]
    pooled = st.pooled()
    if pairs and pooled.n > 0:
        s, loss, rtn_loss = search(pairs, pooled.absmean())
        ex.gate_up[...] = jnp.asarray(gu * s[None, :, None], ex.gate_up[...].dtype)
        if shared is not None:  # the shared experts read the same normed input: scaled too, quantized or not
            _scale_in(shared.gate_proj, s)
            _scale_in(shared.up_proj, s)
        for n in shared_names:
            stats[n] = stats[n].scaled(s)
        norm_post(s)
        router = getattr(moe, moe.router_name)
        router.weight[...] = (router.weight[...].astype(jnp.float32) * jnp.asarray(s)[None, :]
                              ).astype(router.weight[...].dtype)  # router input x/s, weights W s: same logits
        stats[f"{name}.gate_up"] = Stats(st.H / (s[:, None] * s[None, :])[None], st.abs_sum / s[None], st.n)
        rows.append({"fold": f"{prefix} post_attention_layernorm (+ router)", "modules": [name, *shared_names],
                     "loss": loss, "rtn_loss": rtn_loss})
    if ex.activation == "silu" and f"{name}.down_proj" in stats:
        sd = stats[f"{name}.down_proj"]
        I = ex.intermediate_size
        gu = np.array(ex.gate_up[...], np.float32)
        down = np.array(ex.down[...], np.float32)  # [E, I, D]
        H, A = sd.H.copy(), sd.abs_sum.copy()
        total, total_rtn = 0.0, 0.0
        for e in range(ex.num_experts):
            if sd.n[e] <= 0:
                continue
            s, loss, rtn_loss = search([(down[e].T, sd.H[e])], sd.absmean()[e])
            down[e] *= s[:, None]
            gu[e, :, I:] /= s[None, :]  # up's output channels (gate's stay): h = silu(gate) · up / s
            H[e] = sd.H[e] / (s[:, None] * s[None, :])
            A[e] = sd.abs_sum[e] / s
            total, total_rtn = total + loss, total_rtn + rtn_loss
        ex.gate_up[...] = jnp.asarray(gu, ex.gate_up[...].dtype)
        ex.down[...] = jnp.asarray(down, ex.down[...].dtype)
        stats[f"{name}.down_proj"] = Stats(H, A, sd.n)
        rows.append({"fold": f"{name}.*.up_proj", "modules": [f"{name}.*.down_proj"], "loss": total,
                     "rtn_loss": total_rtn})
    if shared is not None:
        linear_group(f"{sh}.up_proj", lambda s: _scale_out(shared.up_proj, s), [f"{sh}.down_proj"])
    return rows


def _module(root: nnx.Module, rel: str) -> Any:
    node = root
    for p in rel.split("."):
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    return node


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


def _quantize_unit(unit: Unit, stats: dict[str, Stats], scheme: Scheme, opts: Options,
                   awq_folded: set[str] = frozenset()) -> list[dict[str, Any]]:
    if isinstance(unit.module, Linear):
        w = np.asarray(unit.module.weight(), np.float32).T  # [out, in], LoRA folded in
        st = stats.get(unit.name)
        qm, how = quantize_matrix(w, st, scheme, opts)
        set_linear(unit.module, qm, scheme.kind, scheme.bits)
        return [_row(unit.name, w, qm, st, scheme, *_label(unit.name, how, st, scheme, awq_folded))]
    ex: Experts = unit.module
    gu, down = (np.asarray(a, np.float32) for a in ex.weights())  # [E, D, 2I], [E, I, D]
    I = ex.intermediate_size
    rows: list[dict[str, Any]] = []
    mats: dict[str, list[QMatrix]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    for key, parts in (("gate_up", (("gate_proj", gu[:, :, :I]), ("up_proj", gu[:, :, I:]))),
                       ("down_proj", (("down_proj", down),))):
        st_all = stats.get(f"{unit.name}.{key}")
        pooled = st_all.pooled() if st_all is not None else None
        for e in range(ex.num_experts):
            st = None if st_all is None else Stats(st_all.H[e], st_all.abs_sum[e], st_all.n[e])
            fallback = st is not None and st.n < opts.expert_min_tokens and pooled is not None and pooled.n > 0
            for part, stack in parts:
                w = stack[e].T  # [out, in]
                qm, how = quantize_matrix(w, pooled if fallback else st, scheme, opts)
                how, note = _label(unit.name, how, pooled if fallback else st, scheme, awq_folded)
                if fallback and scheme.method == "gptq":
                    note = f"{int(st.n)} routed tokens < expert_min_tokens {opts.expert_min_tokens}: pooled experts' H"
                mats[part].append(qm)
                rows.append(_row(f"{unit.name}.{e}.{part}", w, qm, st, scheme, how, note))
    set_experts(ex, mats["gate_proj"], mats["up_proj"], mats["down_proj"], scheme.kind, scheme.bits)
    return rows


def _label(name: str, how: str, st: Stats | None, scheme: Scheme, awq_folded: set[str]) -> tuple[str, str | None]:
    """(method, fallback reason or None) for the report."""
    if scheme.kind == "fp8-block" or scheme.method == "rtn":
        return how, None
    if st is None or st.n <= 0:
        return "rtn", "no calibration tokens reached it: RTN"
    if scheme.method == "awq" and name not in awq_folded:
        return "rtn", "no foldable op before it: RTN"
    return scheme.method, None


def calibration_tokens(batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    return int(sum((np.asarray(seg) != 0).sum() for _, seg in batches))


def quantize_model(model: nnx.Module, scheme: Scheme, batches: Sequence[tuple[np.ndarray, np.ndarray]], *,
                   ignore: Sequence[str] = (), opts: Options | None = None) -> dict[str, Any]:
    """Quantize `model` in place with `scheme`, calibrating on `batches` of (input_ids [B, T], segment_ids
    [B, T]) (chat-templated, packed rows; segment 0 = padding). Returns the report: per-module rows
    (method, routed tokens, relative weight and output error), AWQ folds, seconds."""
    opts = opts or Options()
    t0 = time.perf_counter()
    if is_quantized(model):
        raise ValueError("the model is already quantized")
    for path, node in nnx.iter_graph(model):
        if getattr(node, "lora_a", None) is not None or getattr(node, "gate_up_lora_a", None) is not None:
            raise ValueError(f"{hf_name(path)} has a LoRA adapter: merge it (models.merge_lora) before quantizing")
    units = quant_units(model, ignore)
    if not units:
        raise ValueError("nothing to quantize: every Linear is ignored")
    check_supported(units, scheme)
    if not batches:  # RTN and FP8 need no data (the report then has weight errors only); GPTQ / AWQ do
        if scheme.kind == "int" and scheme.method != "rtn":
            raise ValueError(f"scheme {scheme.name}: {scheme.method.upper()} needs calibration data")
        rows = [r for u in units for r in _quantize_unit(u, {}, scheme, opts)]
        model.quant_scheme, model.quant_ignore = scheme, tuple(ignore)
        return {"scheme": scheme.name, "modules": rows, "awq": [], "seconds": time.perf_counter() - t0,
                "calibration_tokens": 0}
    L = model.config.num_hidden_layers
    xs = [model.embed_tokens(jnp.asarray(ids)) for ids, _ in batches]  # [B, T, D] each
    segs = [jnp.asarray(seg, jnp.int32) for _, seg in batches]
    rows: list[dict[str, Any]] = []
    awq_rows: list[dict[str, Any]] = []
    for i in range(L):
        layer_units = [u for u in units if u.layer == i]
        stats = collect_stats(model, xs, segs, i, layer_units) if layer_units else {}
        if scheme.method == "awq":
            awq_rows += awq_layer(model.layers[i], i, stats, layer_units, scheme, opts)
        folded = {m for r in awq_rows for m in r["modules"]}
        for u in layer_units:
            rows += _quantize_unit(u, stats, scheme, opts, folded)
        xs = [_layer_forward(model, x, seg, i) for x, seg in zip(xs, segs, strict=True)]  # quantized layer's output
    for u in units:  # modules the main stack never runs (e.g. DeepSeek/GLM MTP layers): no calibration
        if u.layer is None or u.layer >= L:
            rows += _quantize_unit(u, {}, scheme, opts)
    model.quant_scheme, model.quant_ignore = scheme, tuple(ignore)
    missing = [u.name for u in units if not _unit_quantized(u)]
    if missing:  # coverage: every selected module must come out quantized (issue trackers, §B8.1)
        raise AssertionError(f"not quantized: {missing}")
    return {"scheme": scheme.name, "modules": rows, "awq": awq_rows, "seconds": time.perf_counter() - t0,
            "calibration_tokens": calibration_tokens(batches)}


def _unit_quantized(u: Unit) -> bool:
    return u.module.qweight is not None if isinstance(u.module, Linear) else u.module.quantized


def quantize_int8(model: nnx.Module) -> nnx.Module:
    """W8A16 round-to-nearest without calibration (int8 needs none); in place, returns the model."""
    quantize_model(model, parse_scheme("int8"), [])
    return model


# ------------------------------------------------------------------------------------------------
# Sizes
# ------------------------------------------------------------------------------------------------


def weight_bytes(model: nnx.Module, *, linears_only: bool = False) -> int:
    """Bytes of the weights held in memory: float params, quantized codes (one byte each, int4 too) and
    their scales / zero points (LoRA factors excluded). `linears_only` counts only the quantizable
    modules (Linears but the LM head, and experts)."""
    if linears_only:
        total = 0
        for u in quant_units(model):
            total += sum(x.nbytes for x in jax.tree.leaves(nnx.state(u.module, nnx.Any(
                nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)), QuantWeight, QuantScale, QuantZero))))
        return total
    weights = nnx.state(model, nnx.Any(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)), QuantWeight, QuantScale, QuantZero))
    return sum(x.nbytes for x in jax.tree.leaves(weights))


# ------------------------------------------------------------------------------------------------
# compressed-tensors (pack-quantized int, float-quantized FP8 blocks) and DeepSeek FP8
# ------------------------------------------------------------------------------------------------


def pack(q: np.ndarray, bits: int, axis: int = 1) -> np.ndarray:
    """Signed codes int8 [rows, cols] -> int32 words along `axis` (B2.3): offset by 2^(b-1) to unsigned,
    32/b per word, element p·j + i in bits b·i .. b·i + b - 1, the last word zero-padded."""
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


def _weights_args(scheme: Scheme) -> dict[str, Any]:
    if scheme.kind == "fp8-block":
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "group_size": None,
                "block_structure": [FP8_BLOCK, FP8_BLOCK], "dynamic": False, "actorder": None,
                "observer": "minmax", "observer_kwargs": {}}
    return {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric,
            "strategy": "channel" if scheme.group_size is None else "group", "group_size": scheme.group_size,
            "block_structure": None, "dynamic": False, "actorder": "weight" if scheme.actorder else None,
            "observer": "minmax", "observer_kwargs": {}}


def compressed_tensors_config(scheme: Scheme, ignore: Sequence[str]) -> dict[str, Any]:
    """`quantization_config` for config.json: one group targeting Linear with the scheme's weight args,
    weight-only (activations stay in the serving dtype), and the modules left in float."""
    fmt = "float-quantized" if scheme.kind == "fp8-block" else "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _weights_args(scheme),
                                      "input_activations": None, "output_activations": None, "format": fmt}},
        "ignore": list(dict.fromkeys([*ALWAYS_IGNORED, *ROUTER_PATTERNS, *ignore])),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


def scheme_of(model: nnx.Module) -> Scheme:
    """The scheme a quantized model carries: the one `quantize_model` or the loader recorded, else what the
    quantized state shows (codes dtype and width, scales, zero points)."""
    recorded = getattr(model, "quant_scheme", None)
    if recorded is not None:
        return recorded
    for u in quant_units(model):
        m = u.module
        if isinstance(m, Linear) and m.qweight is not None:
            s, z, n_in = m.scale, m.zero, m.in_features
        elif isinstance(m, Experts) and m.quantized:
            s, z, n_in = m.gate_up_scale, m.gate_up_zero, m.hidden_size
        else:
            continue
        if m.qblock is not None:
            return parse_scheme("fp8-block")
        G = s[...].shape[-2]
        return Scheme(f"w{m.qbits}a16", "int", m.qbits, None if G == 1 else n_in // G, z is None)
    raise ValueError("the model is not quantized")


def _tensors_for(name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
    """safetensors writes an array's memory as it is: every tensor here is made C-contiguous."""
    return {k: np.ascontiguousarray(v) for k, v in _tensors_raw(name, qm, scheme, scale_dtype).items()}


def _tensors_raw(name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
    if scheme.kind == "fp8-block":
        return {f"{name}.weight": np.asarray(qm.q).astype(ml_dtypes.float8_e4m3fn),
                f"{name}.weight_scale": qm.scale.astype(scale_dtype)}
    out = {f"{name}.weight_packed": pack(qm.q, scheme.bits), f"{name}.weight_scale": qm.scale.astype(scale_dtype),
           f"{name}.weight_shape": np.asarray(qm.q.shape, np.int32)}
    if qm.zero is not None:
        out[f"{name}.weight_zero_point"] = pack(qm.zero, scheme.bits, axis=0)
    return out


def iter_qmatrices(model: nnx.Module) -> Iterator[tuple[str, QMatrix, Any]]:
    """(HF module name, QMatrix, bias or None) for every quantized Linear and expert projection."""
    for u in quant_units(model):
        m = u.module
        if isinstance(m, Linear):
            if m.qweight is not None:
                yield u.name, linear_qmatrix(m), m.bias
            continue
        if not m.quantized:
            continue
        for e, part, qm in expert_qmatrices(m):
            yield f"{u.name}.{e}.{part}", qm, None


def to_compressed_tensors(model: nnx.Module, scheme: Scheme, ignore: Sequence[str] = (), *,
                          scale_dtype: Any = np.float32) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(quantization_config, tensors) for every quantized module, HF names, [out, in] layout (B2.3/B2.4);
    experts are written per expert, as vLLM's fused-MoE loaders and transformers' checkpoints name them."""
    tensors: dict[str, np.ndarray] = {}
    for name, qm, bias in iter_qmatrices(model):
        tensors.update(_tensors_for(name, qm, scheme, scale_dtype))
        if bias is not None:
            tensors[f"{name}.bias"] = np.asarray(bias[...]).astype(scale_dtype)
    return compressed_tensors_config(scheme, ignore), tensors


def to_deepseek_fp8(model: nnx.Module) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """DeepSeek-V3's native block-FP8 layout (§B5): `weight` float8_e4m3fn + `weight_scale_inv` float32
    [ceil(out/128), ceil(in/128)] (which multiplies, despite its name)."""
    tensors: dict[str, np.ndarray] = {}
    for name, qm, bias in iter_qmatrices(model):
        tensors[f"{name}.weight"] = np.ascontiguousarray(np.asarray(qm.q).astype(ml_dtypes.float8_e4m3fn))
        tensors[f"{name}.weight_scale_inv"] = np.ascontiguousarray(qm.scale.astype(np.float32))
        if bias is not None:
            tensors[f"{name}.bias"] = np.asarray(bias[...], np.float32)
    quantized = {name for name, _, _ in iter_qmatrices(model)}
    float_linears = sorted({hf_name(p) for p, node in nnx.iter_graph(model) if isinstance(node, Linear)} - quantized)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
              # Linears left in float (lm_head, ignored ones): loaders would make every other Linear FP8
              "modules_to_not_convert": float_linears}
    return config, tensors


def read_scheme(qc: Mapping[str, Any], source: str) -> Scheme:
    """The Scheme of a compressed-tensors `quantization_config` this module writes; a clear error for others."""
    groups = list((qc.get("config_groups") or {}).values())
    w = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
    fmt = qc.get("format")
    if qc.get("quant_method") != "compressed-tensors" or len(groups) != 1 or groups[0].get("input_activations"):
        raise ValueError(f"{source}: unsupported quantization_config (only weight-only compressed-tensors "
                         "checkpoints with one config group are read)")
    if fmt == "float-quantized" and w.get("type") == "float" and w.get("strategy") == "block" \
            and list(w.get("block_structure") or []) == [FP8_BLOCK, FP8_BLOCK]:
        return parse_scheme("fp8-block")
    if fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") in (4, 8) \
            and w.get("strategy") in ("group", "channel"):
        group = w.get("group_size") if w.get("strategy") == "group" else None
        return Scheme("loaded", "int", int(w["num_bits"]), group, bool(w.get("symmetric", True)))
    raise ValueError(f"{source}: unsupported quantization_config weights {dict(w)} in format {fmt!r} (read: "
                     "pack-quantized int4/int8 group or channel, float-quantized FP8 128x128 blocks)")


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
    if scheme.kind == "fp8-block":
        return QMatrix(np.zeros((out, n_in), ml_dtypes.float8_e4m3fn),
                       np.ones((math.ceil(out / FP8_BLOCK), math.ceil(n_in / FP8_BLOCK)), np.float32))
    G = scheme.groups(n_in)
    return QMatrix(np.zeros((out, n_in), np.int8), np.ones((out, G), np.float32),
                   None if scheme.symmetric else np.zeros((out, G), np.int8))


def read_qmatrix(get: Any, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
    """Read one module's quantized tensors through hf_to_state's `get(name, shape)` (which records
    missing and mis-shaped tensors); None when any is missing."""
    if scheme.kind == "fp8-block":
        q = get(f"{name}.weight", (out, n_in))
        s = get(f"{name}.weight_scale", (math.ceil(out / FP8_BLOCK), math.ceil(n_in / FP8_BLOCK)))
        if q is None or s is None:
            return None
        return QMatrix(np.asarray(q).astype(ml_dtypes.float8_e4m3fn), np.asarray(s, np.float32))
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
