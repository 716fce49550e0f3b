"""Calibration statistics, one decoder layer at a time: for every quantizable input, H = Σ x xᵀ (the
Hessian proxy GPTQ needs), Σ |x| (the activation magnitudes AWQ's scale search needs), max |x| per channel
(SmoothQuant's activation ranges; NVFP4 activations' global scale) and the token count, padding (segment
0) excluded.

Calibration runs layer by layer, as GPTQ (arXiv:2210.17323) and llm-compressor's sequential pipeline
(`pipelines/sequential/pipeline.py`) do: the calibration tokens go through decoder layer i with every
Linear and expert stack sowing its inputs; the statistics quantize the layer (models/quant/driver.py); the
*quantized* layer's output feeds layer i + 1 (with what layer i passed on in `Context.carry`: GLM-5's shared
DSA layers attend to the last full layer's top-k selection; `layer_inputs` / `next_inputs`). See
docs/quantization.md.

MoE experts (`ExpertStats`) get their own statistics from the tokens routed to them, at a cost in
proportion to the routed rows, not to experts × rows, and without ever holding all E Hessians:

* the layer's forward (one per batch) gives, for each expert stack input, its routed rows sorted by expert
  (the grouped dispatch of models/moe.py sows them in that order: `calib_rows` = (token, expert) per row,
  `calib_gate_up` = the token's input, `calib_down` = the expert's hidden activation). Σ|x| [E, in] and the
  counts [E] are segment sums over the rows; the pooled H = Σ_e H_e = Xᵀ X over all real routed rows is
  one [in, in] matmul (for gate_up, over the tokens weighted by how many experts they reached). The rows
  go to the host in the model's dtype, padding dropped: the gate/up input as the [tokens, D] layer input
  plus a token index per row (not k copies), the down input as its [rows, I] hidden rows.
* the per-expert Hessians are built `expert_chunk` experts at a time (`ExpertStats.chunks`): the chunk's
  rows (contiguous in the sorted order) are laid out in blocks of `block` rows, each block holding one
  expert's rows (zero-padded, as models/moe.py's "blocked" grouped matmul lays out its GEMMs), and a
  loop over the real blocks adds each block's xᵀx [in, in] into its expert's slot of a [chunk, in, in]
  accumulator. Work is (rows + chunk·block)·in² per chunk, so O(R·in²) per layer whatever E is; memory
  is the chunk's rows plus chunk × in² floats, on the device and on the host. The old per-expert masked
  product over all R rows (`lax.map` over E) cost E·R·in² and held [E, in, in] (plus float64 host
  copies): ~52 GB per layer at DeepSeek-V3 width. `jax.lax.ragged_dot_general` with a ragged
  contraction computes the same grouped xᵀx, but XLA:CPU runs it as a loop over every group (measured:
  16x the groups at fixed rows, 19x the time), so the explicit block loop is used on every backend.

The driver consumes the Hessians chunk by chunk (GPTQ per expert, then the chunk is dropped); the pooled
fallback for experts under `expert_min_tokens` uses the pooled H computed in the forward pass, so it is
ready before the first chunk.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder import build_context
from models.moe import Experts, block_rows
from models.quant.targets import Unit, _module

_HI = jax.lax.Precision.HIGHEST  # full-fp32 matmuls also on GPUs that default to TF32
INPUT_IDS = "input_ids"  # a calibration carry's token ids [B, T], set as the layers' Context.input_ids


@dataclasses.dataclass
class Stats:
    """Σ x xᵀ [.., in, in], Σ |x| [.., in], the token count [..] and max |x| [.., in] of one module input
    (one expert's too)."""

    H: np.ndarray
    abs_sum: np.ndarray
    n: np.ndarray
    abs_max: np.ndarray | None = None

    def __add__(self, other: Stats) -> Stats:
        amax = None if self.abs_max is None or other.abs_max is None else np.maximum(self.abs_max, other.abs_max)
        return Stats(self.H + other.H, self.abs_sum + other.abs_sum, self.n + other.n, amax)

    def absmean(self) -> np.ndarray:
        return self.abs_sum / np.maximum(self.n, 1.0)[..., None]

    def pooled(self) -> Stats:
        """Statistics summed over the leading axis."""
        return Stats(self.H.sum(0), self.abs_sum.sum(0), self.n.sum(0),
                     None if self.abs_max is None else self.abs_max.max(0))

    def scaled(self, s: np.ndarray) -> Stats:
        """Statistics of x / s (the input after an AWQ or SmoothQuant scale s was folded into the op before)."""
        return Stats(self.H / (s[..., :, None] * s[..., None, :]), self.abs_sum / s, self.n,
                     None if self.abs_max is None else self.abs_max / s)


# ------------------------------------------------------------------------------------------------
# Experts: routed rows on the host, Hessians by chunks of experts
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Routed:
    """One calibration batch's routed rows of an expert stack input, real tokens only, sorted by expert:
    row r is `source[index[r]]` (`source[r]` when index is None) and was routed to expert `expert[r]`."""

    source: np.ndarray  # [N, in], the model's dtype
    index: np.ndarray | None  # [R] int32 rows of source, or None: source holds the rows themselves
    expert: np.ndarray  # [R] int32, non-decreasing

    def bounds(self, num_experts: int) -> np.ndarray:
        """[E + 1] row offsets: expert e's rows are [bounds[e], bounds[e + 1])."""
        return np.searchsorted(self.expert, np.arange(num_experts + 1), side="left")


def _bucket(nb: int) -> int:
    """nb rounded up to 2^k · {1, 1.25, 1.5, 1.75}: few compiled shapes, at most 25 % padding."""
    if nb <= 8:
        return max(nb, 1)
    step = 1 << (nb.bit_length() - 3)
    return -(-nb // step) * step


@functools.partial(jax.jit, static_argnames=("experts",))
def _grouped_gram(xb: jax.Array, block_expert: jax.Array, nb: jax.Array, experts: int) -> jax.Array:
    """xb [NB, block, in] row blocks (each of one expert, zero rows pad), block_expert [NB], nb: the real
    blocks (the rest is shape padding, skipped) -> H [experts, in, in] float32, H[e] = Σ over e's blocks
    of xbᵀ xb."""
    d = xb.shape[-1]

    def body(j: jax.Array, H: jax.Array) -> jax.Array:
        x = jax.lax.dynamic_index_in_dim(xb, j, keepdims=False).astype(jnp.float32)  # [block, in]
        e = block_expert[j]
        he = jax.lax.dynamic_index_in_dim(H, e, keepdims=False)  # [in, in]
        return jax.lax.dynamic_update_index_in_dim(H, he + jnp.matmul(x.T, x, precision=_HI), e, 0)

    return jax.lax.fori_loop(0, nb, body, jnp.zeros((experts, d, d), jnp.float32))  # [experts, in, in]


@dataclasses.dataclass
class ExpertStats:
    """The statistics of one expert stack input (gate_up or down_proj) over all calibration batches.

    Σ|x| [E, in], the counts [E] and the pooled H [in, in] are held; the per-expert Hessians are built
    from the kept routed rows, `chunk` experts at a time (`chunks`, `hessians`), and dropped by the
    caller. `scale` [E, in] (AWQ folds, `scaled`) makes these the statistics of x / scale[e].
    """

    batches: list[Routed]
    raw_abs_sum: np.ndarray  # [E, in] float64, of the unscaled rows
    n: np.ndarray  # [E] float64
    raw_pooled_H: np.ndarray  # [in, in] float64: Σ_e H_e of the unscaled rows
    raw_abs_max: np.ndarray | None = None  # [E, in] float64, max |x| of the unscaled rows (0: no rows)
    chunk: int = 8  # experts per Hessian chunk (Options.expert_chunk)
    scale: np.ndarray | None = None  # [E, in] float32

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"expert_chunk must be >= 1, got {self.chunk}")
        self.block = block_rows(max(int(self.n.sum()), 1), self.num_experts)  # rows per Gram block

    @property
    def num_experts(self) -> int:
        return int(self.n.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.raw_pooled_H.shape[0])

    @property
    def abs_sum(self) -> np.ndarray:  # [E, in]
        return self.raw_abs_sum if self.scale is None else self.raw_abs_sum / self.scale

    def absmean(self) -> np.ndarray:  # [E, in]
        return self.abs_sum / np.maximum(self.n, 1.0)[:, None]

    @property
    def abs_max(self) -> np.ndarray | None:  # [E, in]
        if self.raw_abs_max is None:
            return None
        return self.raw_abs_max if self.scale is None else self.raw_abs_max / self.scale

    def scaled(self, s: np.ndarray) -> ExpertStats:
        """Statistics of x / s: s [in] (every expert) or [E, in] (one scale per expert)."""
        s = np.broadcast_to(np.asarray(s, np.float32), (self.num_experts, self.in_features))
        scale = s if self.scale is None else self.scale * s
        return dataclasses.replace(self, scale=np.array(scale, np.float32))

    def expert(self, e: int, H: np.ndarray) -> Stats:
        """Expert e's Stats given its Hessian H [in, in] (from `chunks` / `hessians`)."""
        return Stats(H, self.abs_sum[e], self.n[e], None if self.abs_max is None else self.abs_max[e])

    def hessians(self, c0: int, c1: int) -> np.ndarray:
        """H [c1 - c0, in, in] float32 of experts [c0, c1): their rows in blocks, one grouped Gram."""
        E, d, block = self.num_experts, self.in_features, self.block
        if not 0 <= c0 < c1 <= E:
            raise ValueError(f"expert range [{c0}, {c1}) outside [0, {E})")
        C = c1 - c0
        bounds = [b.bounds(E) for b in self.batches]
        sizes = sum((bd[c0 + 1:c1 + 1] - bd[c0:c1] for bd in bounds), np.zeros(C, np.int64))  # [C] rows
        blocks_per = -(-sizes // block)  # [C]
        nb = int(blocks_per.sum())
        if nb == 0:
            H = np.zeros((C, d, d), np.float32)
        else:
            NB = _bucket(nb)
            dtype = self.batches[0].source.dtype
            xb = np.zeros((NB * block, d), dtype)  # [NB*block, in]: expert-major, zero-padded blocks
            nxt = (np.cumsum(blocks_per) - blocks_per) * block  # [C] next free row of each expert
            for b, bd in zip(self.batches, bounds, strict=True):
                lo, hi = int(bd[c0]), int(bd[c1])
                if hi == lo:
                    continue
                local = b.expert[lo:hi] - c0  # [r] expert within the chunk
                dest = nxt[local] + np.arange(lo, hi) - bd[c0:c1][local]  # [r]
                xb[dest] = b.source[np.arange(lo, hi) if b.index is None else b.index[lo:hi]]
                nxt = nxt + (bd[c0 + 1:c1 + 1] - bd[c0:c1])
            block_expert = np.zeros(NB, np.int32)
            block_expert[:nb] = np.repeat(np.arange(C, dtype=np.int32), blocks_per)  # [NB]
            H = np.asarray(_grouped_gram(jnp.asarray(xb.reshape(NB, block, d)), jnp.asarray(block_expert),
                                         jnp.int32(nb), C))  # [C, in, in]
        if self.scale is not None:
            s = self.scale[c0:c1]  # [C, in]
            H = H / (s[:, :, None] * s[:, None, :])
        return H

    def chunks(self, chunk: int | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
        """(c0, c1, H [c1 - c0, in, in]) for consecutive chunks of `chunk` (default: self.chunk) experts."""
        size = chunk or self.chunk
        for c0 in range(0, self.num_experts, size):
            c1 = min(c0 + size, self.num_experts)
            yield c0, c1, self.hessians(c0, c1)

    def pooled(self) -> Stats:
        """The statistics pooled over all experts: Σ_e H_e, Σ_e Σ|x|, Σ_e n. From the forward pass' pooled
        H unless per-expert scales differ (an AWQ down_proj fold), then summed chunk by chunk."""
        if self.scale is None:
            H = self.raw_pooled_H
        elif np.all(self.scale == self.scale[:1]):
            s = self.scale[0].astype(np.float64)
            H = self.raw_pooled_H / (s[:, None] * s[None, :])
        else:
            H = np.zeros_like(self.raw_pooled_H)
            for _, _, h in self.chunks():
                H += h.sum(0, dtype=np.float64)
        return Stats(H, self.abs_sum.sum(0), self.n.sum(0), None if self.abs_max is None else self.abs_max.max(0))

    @property
    def H(self) -> np.ndarray:
        """All experts' Hessians [E, in, in] at once: for tests and small models; the driver never asks."""
        return self.hessians(0, self.num_experts)


# ------------------------------------------------------------------------------------------------
# One layer's forward with the modules sowing their inputs
# ------------------------------------------------------------------------------------------------


def _moments(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [R, n], row weights w [R] (0/1) -> (xᵀ diag(w) x [n, n], Σ w |x| [n], Σ w, max over w > 0 of |x| [n])."""
    x = x.astype(jnp.float32)
    xw = x * w[:, None]
    return jnp.matmul(xw.T, x, precision=_HI), jnp.abs(xw).sum(0), w.sum(), jnp.max(jnp.abs(xw), axis=0)


def _routed_moments(rows: jax.Array, expert: jax.Array, w: jax.Array, E: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """rows [R, in], expert [R], row weights w [R] -> (Σ w |x| per expert [E, in], Σ w per expert [E],
    max |x| over each expert's real rows [E, in], 0 for an expert without any)."""
    aw = jnp.abs(rows.astype(jnp.float32)) * w[:, None]  # [R, in]
    a = jax.ops.segment_sum(aw, expert, E)  # [E, in]
    return a, jax.ops.segment_sum(w, expert, E), jnp.maximum(jax.ops.segment_max(aw, expert, E), 0.0)


def _layer_context(model: nnx.Module, seg: jax.Array, i: int, carry: Mapping[str, jax.Array] | None = None):
    """Layer i's context for a batch with segments `seg` [B, T]; `carry` is what earlier layers passed on in the
    same forward (`Context.carry`: GLM-5's shared DSA layers attend to the last full layer's top-k selection)."""
    B, T = seg.shape
    ctx, _ = build_context(T, B, positions=None, segment_ids=seg, cache=None, windows={model.layer_window(i)})
    ctx.rope = model.rope(ctx.positions)
    ctx.carry = dict(carry or {})
    ctx.input_ids = ctx.carry.get(INPUT_IDS)  # [B, T] the batch's tokens (DeepSeek-V4's hash routers read them)
    return ctx


@nnx.jit(static_argnames=("i",))
def _layer_stats(model: nnx.Module, x: jax.Array, seg: jax.Array, i: int,
                 carry: Mapping[str, jax.Array] | None = None) -> dict[str, tuple | dict]:
    """Run decoder layer i on x [B, T, D] with its quantizable modules sowing their inputs, padding
    (segment 0) excluded. Per module (relative dotted path): a Linear's (H [in, in], Σ|x| [in], n); an
    expert stack input's dict of src (rows, or gate_up's [B*T, D] input), index (row -> src row, or None),
    expert [R], w [R] (0 = padding), a = Σ|x| [E, in], n [E] and pooled H [in, in], the rows in the order
    models/moe.py sows them (sorted by expert). `carry`: what earlier layers passed on (see _layer_context)."""
    layer = model.layers[i]
    ctx = _layer_context(model, seg, i, carry)
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
            token, expert = flat[(*path[:-1], "calib_rows")]  # [R], [R]
            E = _module(layer, mod).num_experts
            w = valid[token]  # [R]
            a, n, amax = _routed_moments(value, expert, w, E)
            if what == "calib_gate_up":  # row r is the token's input: keep [B*T, D] + token, pool per token
                src = jnp.zeros((valid.shape[0], value.shape[1]), value.dtype).at[token].set(value)  # [B*T, D]
                mult = jax.ops.segment_sum(w, token, valid.shape[0])  # [B*T] real routed rows per token
                pooled = _moments(src, mult)[0]  # [D, D]
                out[f"{mod}.gate_up"] = dict(src=src, index=token, expert=expert, w=w, a=a, n=n, pooled=pooled,
                                             amax=amax)
            else:
                out[f"{mod}.down_proj"] = dict(src=value, index=None, expert=expert, w=w, a=a, n=n,
                                               pooled=_moments(value, w)[0], amax=amax)
    return out


@nnx.jit(static_argnames=("i",))
def _layer_forward(model: nnx.Module, x: jax.Array, seg: jax.Array, i: int) -> jax.Array:
    return model.layers[i](x, _layer_context(model, seg, i), None, i)[0]


@nnx.jit(static_argnames=("i",))
def _layer_forward_carry(model: nnx.Module, x: jax.Array, seg: jax.Array, i: int, carry: Mapping[str, jax.Array]
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoder layer i on x [B, T, D] given what earlier layers carried -> (its output [B, T, D], the carry for the
    layers after it): the layer-by-layer walk of a model whose layers pass state on (GLM-5's shared top-k)."""
    ctx = _layer_context(model, seg, i, carry)
    return model.layers[i](x, ctx, None, i)[0], ctx.carry


def layer_inputs(model: nnx.Module, batches: Sequence[tuple[np.ndarray, np.ndarray]]
                 ) -> tuple[list[jax.Array], list[jax.Array], list[dict[str, jax.Array]]]:
    """The first layer's inputs of calibration `batches`: (the residual the layers carry: embeddings [B, T, D], or
    DeepSeek-V4's streams [B, T, n, D]; segment ids [B, T]; carries holding only the batch's token ids), one per
    batch; `next_inputs` walks them through each layer."""
    xs = [model.streams_in(model.embed_tokens(jnp.asarray(ids))) for ids, _ in batches]  # [B, T, (n,) D] each
    carries = [{INPUT_IDS: jnp.asarray(ids, jnp.int32)} for ids, _ in batches]
    return xs, [jnp.asarray(seg, jnp.int32) for _, seg in batches], carries


def next_inputs(model: nnx.Module, xs: Sequence[jax.Array], segs: Sequence[jax.Array],
                carries: Sequence[Mapping[str, jax.Array]], i: int) -> tuple[list[jax.Array], list[dict]]:
    """Layer i's outputs (the next layer's inputs) and the carries after it, batch by batch."""
    out = [_layer_forward_carry(model, x, seg, i, dict(c)) for x, seg, c in zip(xs, segs, carries, strict=True)]
    return [x for x, _ in out], [c for _, c in out]


def _set_calibrating(units: Sequence[Unit], on: bool) -> None:
    for u in units:
        u.module.calibrating = on
        if isinstance(u.module, Experts) and u.module.impl == "dense":
            raise ValueError(f"{u.name}: calibration needs the grouped experts path (impl 'blocked' or 'ragged')")


def _routed(src: Any, index: Any, expert: Any, w: Any) -> Routed:
    """One batch's device rows -> host `Routed`: padding rows dropped, sorted by expert if they are not."""
    keep = np.asarray(w) > 0  # [R]
    expert = np.asarray(expert, np.int32)[keep]
    if index is None:
        source, idx = np.asarray(src)[keep], None
    else:
        source, idx = np.asarray(src), np.asarray(index, np.int32)[keep]
    if expert.size and np.any(np.diff(expert) < 0):  # the grouped dispatch sorts; any other sower may not
        order = np.argsort(expert, kind="stable")
        expert = expert[order]
        source, idx = (source[order], None) if idx is None else (source, idx[order])
    return Routed(source, idx, expert)


def collect_stats(model: nnx.Module, xs: Sequence[jax.Array], segs: Sequence[jax.Array], i: int,
                  units: Sequence[Unit], *, expert_chunk: int = 8,
                  carries: Sequence[Mapping[str, jax.Array]] | None = None) -> dict[str, Stats | ExpertStats]:
    """Statistics of layer i's quantizable inputs over all calibration batches, by HF module name: a
    Linear's `Stats`; an expert stack's `ExpertStats` under "<name>.gate_up" and "<name>.down_proj"
    (per-expert Hessians built `expert_chunk` experts at a time). `carries`: per batch, what the layers before
    i passed on (`next_inputs`; None: nothing)."""
    _set_calibrating(units, True)
    try:
        total: dict[str, Stats] = {}
        routed: dict[str, list] = {}
        for x, seg, carry in zip(xs, segs, carries or [{}] * len(xs), strict=True):
            for rel, v in _layer_stats(model, x, seg, i, dict(carry)).items():
                key = f"model.layers.{i}.{rel}"
                if isinstance(v, dict):  # an expert stack input
                    st = Stats(*(np.asarray(v[k], np.float64) for k in ("pooled", "a", "n", "amax")))
                    acc = routed.setdefault(key, [None, []])
                    acc[0] = st if acc[0] is None else acc[0] + st
                    acc[1].append(_routed(v["src"], v["index"], v["expert"], v["w"]))
                else:
                    st = Stats(*(np.asarray(t, np.float64) for t in v))
                    total[key] = total[key] + st if key in total else st
        out: dict[str, Stats | ExpertStats] = dict(total)
        for key, (st, batches) in routed.items():
            out[key] = ExpertStats(batches, st.abs_sum, st.n, st.H, st.abs_max, chunk=expert_chunk)
        return out
    finally:
        _set_calibrating(units, False)


def calibration_tokens(batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    return int(sum((np.asarray(seg) != 0).sum() for _, seg in batches))
