"""AWQ (arXiv:2306.00978): per-input-channel scales s, searched on the calibration statistics
(models/quant/quantizers.py `awq_search`) and folded into the op before each group of Linears, so that
the Linears quantize W·diag(s) while the model computes the same function.

The folds, as llm-compressor's `modifiers/awq/mappings.py` pairs a smoothing op with the layers it
balances: the RMSNorm before q/k/v (or MLA's q_a / kv_a projections) and before the MLP or experts (the
routers get the inverse scale, so routing is unchanged), MLA's q_a / kv_a norms, and the up projection
before each down projection (SwiGLU only). The attention output projection has no foldable predecessor
under GQA and is quantized by RTN, as AutoAWQ does. MoE experts' Hessians arrive chunk by chunk
(models/quant/calibration.py `ExpertStats`): the experts' shared gate/up scale sums each candidate's loss
over the chunks (`_grid_search_chunked`, the candidates and loss of `awq_search`), and the per-expert
down_proj scales are searched chunk by chunk. See docs/quantization.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import Linear, RMSNorm
from models.moe import Experts
from models.quant import quantizers as Q
from models.quant.calibration import ExpertStats, Stats
from models.quant.rotation import refuse_indexer
from models.quant.schemes import IntArgs, Options, Scheme
from models.quant.targets import Unit, _module


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


def awq_layer(layer: nnx.Module, i: int, stats: dict[str, Stats | ExpertStats], units: Sequence[Unit], scheme: Scheme,
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

    for fold, norm, names in attention_folds(layer, pre):
        linear_group(fold, lambda s, norm=norm: _scale_norm(norm, s), names)
    norm_post = lambda s: _scale_norm(layer.post_attention_layernorm, s)  # noqa: E731
    mlp = layer.mlp
    if hasattr(mlp, "gate_proj"):  # dense SwiGLU
        _mlp_groups(linear_group, f"{pre}.mlp", mlp, norm_post)
    elif hasattr(mlp, "experts"):
        rows += _awq_moe(mlp, f"{pre}.mlp", stats, quantized, norm_post, linear_group, search, scheme, opts)
    return rows


def attention_folds(layer: nnx.Module, pre: str) -> list[tuple[str, RMSNorm, list[str]]]:
    """(label, the RMSNorm, the HF names of the Linears reading its output) for the attention block of
    decoder layer `pre`: input_layernorm before q/k/v (GQA) or MLA's first projections, and MLA's q_a / kv_a
    norms before q_b / kv_b. Shared by AWQ and SmoothQuant (models/quant/smoothquant.py)."""
    attn = layer.self_attn
    refuse_indexer(attn, "AWQ / SmoothQuant")
    sa = f"{pre}.self_attn"
    if hasattr(attn, "q_proj") and hasattr(attn, "k_proj"):  # GQA families
        return [(f"{pre}.input_layernorm", layer.input_layernorm,
                 [f"{sa}.{p}" for p in ("q_proj", "k_proj", "v_proj")])]
    if not hasattr(attn, "kv_a_proj_with_mqa"):
        return []
    first = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_a_proj"  # MLA
    folds = [(f"{pre}.input_layernorm", layer.input_layernorm, [f"{sa}.{first}", f"{sa}.kv_a_proj_with_mqa"])]
    if first == "q_a_proj":
        folds.append((f"{sa}.q_a_layernorm", attn.q_a_layernorm, [f"{sa}.q_b_proj"]))
    return folds + [(f"{sa}.kv_a_layernorm", attn.kv_a_layernorm, [f"{sa}.kv_b_proj"])]


def _mlp_groups(linear_group: Any, prefix: str, mlp: nnx.Module, before: Any) -> None:
    linear_group(f"{prefix}: post_attention_layernorm", before,
                 [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
    linear_group(f"{prefix}.up_proj", lambda s: _scale_out(mlp.up_proj, s), [f"{prefix}.down_proj"])


def _grid_search_chunked(pair_chunks: Iterable[list[tuple[np.ndarray, np.ndarray]]], absmean: np.ndarray,
                         args: IntArgs, grid: int) -> tuple[np.ndarray, float, float]:
    """`Q.awq_search` over pairs that arrive in chunks (each chunk's Hessians built, used for every grid
    point, then dropped): the same candidate scales s_r = x_absmean**r, the loss Σ over all pairs summed
    chunk by chunk. Returns (best s [in], its loss, the loss at s = 1, i.e. plain RTN)."""
    xm = jnp.asarray(absmean, jnp.float32).reshape(-1)
    scales = []
    for k in range(grid):  # the candidates exactly as Q.awq_search computes them
        s = jnp.maximum(xm ** jnp.float32(k / grid), 1e-4)
        scales.append(s / jnp.sqrt(jnp.max(s) * jnp.min(s)))
    losses = np.zeros(grid)
    for pairs in pair_chunks:
        if pairs:
            pj, n = Q._awq_pairs(pairs, args)  # on the device once per chunk, for every candidate
            losses += [float(Q._awq_loss(pj, s, **Q._static(args, n))) for s in scales]
    best = int(np.argmin(losses))  # the first minimum, as Q.awq_search keeps the first strictly better loss
    return np.asarray(scales[best], np.float32), float(losses[best]), float(losses[0])  # r = 0: s = 1


def fold_moe_input(moe: nnx.Module, s: np.ndarray, norm_post: Any) -> None:
    """Fold a per-channel scale s [D] into an MoE block's input: every expert's and the shared experts'
    gate/up take W·diag(s) (quantized or not), the norm before divides by s (`norm_post`), the router's
    weights take W·diag(s) so its logits (routing) are unchanged. Shared by AWQ and SmoothQuant."""
    ex: Experts = moe.experts
    ex.gate_up[...] = (ex.gate_up[...].astype(jnp.float32) * jnp.asarray(s)[None, :, None]
                       ).astype(ex.gate_up[...].dtype)  # [E, D, 2I]
    shared = getattr(moe, "shared_experts", None)
    if shared is not None:  # the shared experts read the same normed input: scaled too, quantized or not
        _scale_in(shared.gate_proj, s)
        _scale_in(shared.up_proj, s)
    norm_post(s)
    router = getattr(moe, moe.router_name)
    router.weight[...] = (router.weight[...].astype(jnp.float32) * jnp.asarray(s)[None, :]
                          ).astype(router.weight[...].dtype)  # router input x/s, weights W s: same logits


def _awq_moe(moe: nnx.Module, prefix: str, stats: dict[str, Stats | ExpertStats], quantized: set[str],
             norm_post: Any, linear_group: Any, search: Any, scheme: Scheme, opts: Options) -> list[dict[str, Any]]:
    """AWQ for an MoE block: one scale for everything reading the normed input (all experts' gate/up,
    the shared experts' gate/up), folded into post_attention_layernorm with the router compensated; then
    per expert, a scale for down_proj folded into that expert's up projection (SwiGLU experts only).
    The experts' Hessians come chunk by chunk (`ExpertStats.chunks`), never all at once."""
    ex: Experts = moe.experts
    name = f"{prefix}.experts"
    shared = getattr(moe, "shared_experts", None)
    sh = f"{prefix}.shared_experts"
    rows: list[dict[str, Any]] = []
    if name not in quantized or f"{name}.gate_up" not in stats:
        return rows
    st: ExpertStats = stats[f"{name}.gate_up"]
    gu = np.array(ex.gate_up[...], np.float32)  # [E, D, 2I] (a writable copy)
    shared_names = [n for n in (f"{sh}.gate_proj", f"{sh}.up_proj") if n in quantized and n in stats]
    shared_pairs = [(_hf(getattr(shared, n.rsplit(".", 1)[1])), stats[n].H) for n in shared_names] \
        if shared is not None else []
    pooled = st.pooled()
    if pooled.n > 0:  # then some expert has tokens, so there is something to search over
        # every expert of a chunk takes part (an expert without tokens has H = 0: it adds no loss), so each
        # chunk has the same pairs' structure and the loss compiles once
        expert_chunks = ([(gu[e].T, H[e - c0]) for e in range(c0, c1)] for c0, c1, H in st.chunks())
        s, loss, rtn_loss = _grid_search_chunked(itertools.chain(expert_chunks, [shared_pairs]), pooled.absmean(),
                                                 scheme.args, opts.awq_grid)
        fold_moe_input(moe, s, norm_post)
        for n in shared_names:
            stats[n] = stats[n].scaled(s)
        stats[f"{name}.gate_up"] = st.scaled(s)
        rows.append({"fold": f"{prefix} post_attention_layernorm (+ router)", "modules": [name, *shared_names],
                     "loss": loss, "rtn_loss": rtn_loss})
    if ex.activation == "silu" and f"{name}.down_proj" in stats:
        sd: ExpertStats = stats[f"{name}.down_proj"]
        I = ex.intermediate_size
        gu = np.array(ex.gate_up[...], np.float32)
        down = np.array(ex.down[...], np.float32)  # [E, I, D]
        scales = np.ones((ex.num_experts, I), np.float32)  # [E, I]: 1 where an expert has no tokens
        absmean = sd.absmean()  # [E, I]
        total, total_rtn = 0.0, 0.0
        for c0, c1, H in sd.chunks():  # H [c1 - c0, I, I]
            for e in range(c0, c1):
                if sd.n[e] <= 0:
                    continue
                s, loss, rtn_loss = search([(down[e].T, H[e - c0])], absmean[e])
                down[e] *= s[:, None]
                gu[e, :, I:] /= s[None, :]  # up's output channels (gate's stay): h = silu(gate) · up / s
                scales[e] = s
                total, total_rtn = total + loss, total_rtn + rtn_loss
        ex.gate_up[...] = jnp.asarray(gu, ex.gate_up[...].dtype)
        ex.down[...] = jnp.asarray(down, ex.down[...].dtype)
        stats[f"{name}.down_proj"] = sd.scaled(scales)
        rows.append({"fold": f"{name}.*.up_proj", "modules": [f"{name}.*.down_proj"], "loss": total,
                     "rtn_loss": total_rtn})
    if shared is not None:
        linear_group(f"{sh}.up_proj", lambda s: _scale_out(shared.up_proj, s), [f"{sh}.down_proj"])
    return rows
