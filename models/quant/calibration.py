"""Calibration statistics, one decoder layer at a time: for every quantizable input, H = Σ x xᵀ (the
Hessian proxy GPTQ needs), Σ |x| (the activation magnitudes AWQ's scale search needs) and the token
count, padding (segment 0) excluded.

Calibration runs layer by layer, as GPTQ (arXiv:2210.17323) and llm-compressor's sequential pipeline
(`pipelines/sequential/pipeline.py`) do: the calibration tokens go through decoder layer i with every
Linear and expert sowing its inputs; the statistics quantize the layer (models/quant/driver.py); the
*quantized* layer's output feeds layer i + 1. MoE experts get their own statistics from the tokens routed
to them, with a leading expert axis. See docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder import build_context
from models.moe import Experts
from models.quant.targets import Unit, _module


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


def calibration_tokens(batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    return int(sum((np.asarray(seg) != 0).sum() for _, seg in batches))
