"""Mixture-of-experts: routers, stacked experts with grouped (sorted, block-sparse) dispatch, and the
MoE block with optional shared experts — the pieces Qwen3-MoE, DeepSeek-V3/Kimi K2, GLM-4.5 and
GPT-OSS assemble.

Mirrors docs/models/qwen3-moe.md (softmax over all experts, top-k, optional renormalisation; the
dispatch), docs/models/deepseek-v3.md (sigmoid scores, e_score_correction_bias for selection only,
group score = sum of the group's top-2, −inf outside the kept groups, weights from the unbiased
sigmoid, renormalise + 1e-20, × routed_scaling_factor, router math in fp32; shared experts) and
docs/models/gpt-oss.md (logits + bias, top-k, softmax over the k selected logits; interleaved gate/up,
clamped SwiGLU with (up + 1), per-expert biases added before the routing weight).

Dispatch scales with top-k, not with the number of experts: the T·k (token, expert) pairs are
sorted by expert, each expert's rows are padded to a multiple of a block of rows, and every block
is one [block, D] × [D, O] GEMM against its expert's weights (`grouped_matmul`). The work is
≈ T·k + E·block rows whatever E is; `jax.lax.ragged_dot` does the same job with a native kernel where
the backend has one (impl="ragged"; XLA:CPU lowers it to a dense loop over all experts).
`Experts(..., impl="dense")` runs every token through every expert: the reference the tests and the
benchmark compare against.

Shape legend: T tokens (B·T flattened), D model, E experts, k experts per token, I expert width,
R = T·k routed rows, G router groups.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import views
from models.layers import INIT_STD, MLP, Buffer, dequantize, param
from models.numerics import quantize_activation

# ------------------------------------------------------------------------------------------------
# Routers
# ------------------------------------------------------------------------------------------------

SCORINGS = ("softmax", "softmax_topk", "sigmoid", "sqrtsoftplus")
BIASED_SCORES = {"sigmoid": jax.nn.sigmoid, "sqrtsoftplus": lambda x: jnp.sqrt(jax.nn.softplus(x))}


class Router(nnx.Module):
    """x [T, D] -> (weights [T, k] fp32, experts [T, k] int32, logits [T, E]).

    scoring:
      "softmax"       Qwen3-MoE: softmax over all E in fp32, top-k, optional renormalisation.
      "softmax_topk"  GPT-OSS: logits = x Wᵀ + bias, top-k logits, softmax over those k only.
      "sigmoid"       DeepSeek-V3 / Kimi K2 / GLM-4.5: fp32 logits, sigmoid, + e_score_correction_bias
                      to choose (group-limited), weights from the unbiased sigmoid, renormalised,
                      × routed_scaling_factor.
      "sqrtsoftplus"  DeepSeek-V4: as "sigmoid" with sqrt(softplus(logits)) scores (router weight in the
                      parameter dtype, the math in fp32).
    HF tensors: `<prefix>.weight` [E, D] and `<prefix>.bias` or `<prefix>.e_score_correction_bias` [E].
    """

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, *, scoring: str, norm_topk_prob: bool = False,
        n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0, use_bias: bool = False,
        rngs: nnx.Rngs, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
    ):
        if scoring not in SCORINGS:
            raise ValueError(f"router scoring {scoring!r} (known: {SCORINGS})")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group {n_group} / topk_group {topk_group} do not fit {num_experts} experts")
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} > {num_experts} experts")
        self.num_experts, self.top_k, self.scoring = num_experts, top_k, scoring
        self.norm_topk_prob, self.n_group, self.topk_group = norm_topk_prob, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.dtype = dtype
        sigmoid = scoring == "sigmoid"
        biased = scoring in BIASED_SCORES
        self.keep_fp32 = sigmoid  # DeepSeek / GLM keep the router in fp32, in memory and on disk
        wdtype = jnp.float32 if sigmoid else param_dtype
        init = nnx.initializers.normal(INIT_STD)
        self.weight = param(init(rngs.params(), (num_experts, hidden_size), wdtype), (None, "embed"))
        self.bias = nnx.data(param(jnp.zeros((num_experts,), param_dtype), (None,)) if use_bias else None)
        self.e_score_correction_bias = nnx.data(
            param(jnp.zeros((num_experts,), jnp.float32), (None,), Buffer) if biased else None)
        self.hf_raw = ("weight", "e_score_correction_bias") if biased else ("weight", "bias") if use_bias \
            else ("weight",)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        k = self.top_k
        if self.scoring in BIASED_SCORES:
            logits = x.astype(jnp.float32) @ self.weight[...].astype(jnp.float32).T  # [T, E] fp32
            scores = BIASED_SCORES[self.scoring](logits)
            choice = scores + self.e_score_correction_bias[...]
            if self.n_group > 1:
                T, E, G = x.shape[0], self.num_experts, self.n_group
                grouped = choice.reshape(T, G, E // G)
                group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G] sum of the top-2
                _, keep = jax.lax.top_k(group_score, self.topk_group)  # [T, topk_group]
                group_mask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep].set(True)
                choice = jnp.where(jnp.repeat(group_mask, E // G, axis=1), choice, -jnp.inf)
            _, idx = jax.lax.top_k(choice, k)  # [T, k]
            w = jnp.take_along_axis(scores, idx, axis=-1)  # unbiased scores
            if self.norm_topk_prob:
                w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
            return w * self.routed_scaling_factor, idx.astype(jnp.int32), logits
        xd = x.astype(self.dtype)
        logits = xd @ self.weight[...].astype(self.dtype).T  # [T, E]
        if self.scoring == "softmax_topk":
            if self.bias is not None:
                logits = logits + self.bias[...].astype(self.dtype)
            vals, idx = jax.lax.top_k(logits, k)
            return jax.nn.softmax(vals, axis=-1).astype(jnp.float32), idx.astype(jnp.int32), logits
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        w, idx = jax.lax.top_k(probs, k)
        if self.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        return w.astype(logits.dtype).astype(jnp.float32), idx.astype(jnp.int32), logits


# ------------------------------------------------------------------------------------------------
# Grouped matmul: rows sorted by expert, padded per expert to whole blocks, one GEMM per block
# ------------------------------------------------------------------------------------------------


def block_rows(rows: int, num_experts: int) -> int:
    """Rows per block: about the mean rows per expert, as a power of two in [32, 256]."""
    mean = max(1, -(-rows // num_experts))
    return int(min(256, max(32, 1 << int(np.ceil(np.log2(mean))))))


class ExpertWeights(NamedTuple):
    """A quantized expert stack for grouped_matmul: `fn(e)` dequantizes expert e's [D, O] weight."""

    fn: Callable[[jax.Array], jax.Array]
    shape: tuple[int, int, int]  # [E, D, O]


def grouped_matmul(x: jax.Array, w: jax.Array | ExpertWeights, group_sizes: jax.Array, *,
                   impl: str = "blocked") -> jax.Array:
    """x [R, D] sorted by group, w [E, D, O], group_sizes [E] (sum R) -> [R, O]: row r of group e
    is x[r] @ w[e].

    "blocked": each group's rows go to their own run of `block` rows (zero-padded), the blocks run
    as a `lax.map` of [block, D] × [D, O] GEMMs, and the rows are gathered back. Cost and memory
    grow with R + E·block, not with E·R. "ragged": `jax.lax.ragged_dot`.
    With quantized experts (`ExpertWeights`) each block dequantizes only its own expert's weight, so
    no float copy of the whole stack is ever held (forward only: quantized codes are not trained);
    "ragged" needs the dense stack and dequantizes it all.
    """
    quantized = isinstance(w, ExpertWeights)
    if impl == "ragged":
        dense = jax.lax.map(w.fn, jnp.arange(w.shape[0])) if quantized else w
        return jax.lax.ragged_dot(x, dense.astype(x.dtype), group_sizes)
    if impl != "blocked":
        raise ValueError(f"grouped_matmul impl {impl!r} (known: blocked, ragged)")
    R, D = x.shape
    E, _, O = w.shape
    block = block_rows(R, E)
    nb = -(-R // block) + E  # upper bound: each group wastes less than one block
    blocks_per = (group_sizes + block - 1) // block  # [E]
    block_end = jnp.cumsum(blocks_per)  # [E]
    row_start = jnp.cumsum(group_sizes) - group_sizes  # [E]
    gid = jnp.repeat(jnp.arange(E, dtype=jnp.int32), group_sizes, total_repeat_length=R)  # [R]
    dest = (block_end - blocks_per)[gid] * block + jnp.arange(R, dtype=jnp.int32) - row_start[gid]  # [R]
    buf = jnp.zeros((nb * block, D), x.dtype).at[dest].set(x, unique_indices=True)  # [nb*block, D]
    block_expert = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(nb), side="right"), E - 1)  # [nb]
    xb = buf.reshape(nb, block, D)
    if quantized:
        out = jax.lax.map(lambda a: a[0] @ w.fn(a[1]).astype(x.dtype), (xb, block_expert))  # [nb, block, O]
    else:
        out = block_gemm(xb, w.astype(x.dtype), block_expert)  # [nb, block, O]
    return out.reshape(nb * block, O)[dest]  # [R, O]


def _expert(w: jax.Array, e: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


@jax.custom_vjp
def block_gemm(xb: jax.Array, w: jax.Array, block_expert: jax.Array) -> jax.Array:
    """xb [nb, block, D], w [E, D, O], block_expert [nb] -> [nb, block, O]: one GEMM per block.

    Custom backward: dx per block against wᵀ, and dw accumulated in place per block's expert
    (`dw.at[e].add`) — autodiff of the map would add a full [E, D, O] zero-padded update per block."""
    return jax.lax.map(lambda a: a[0] @ _expert(w, a[1]), (xb, block_expert))


def _block_gemm_fwd(xb, w, block_expert):
    return block_gemm(xb, w, block_expert), (xb, w, block_expert)


def _block_gemm_bwd(res, d_out):
    xb, w, block_expert = res
    dx = jax.lax.map(lambda a: a[0] @ _expert(w, a[1]).T, (d_out, block_expert))  # [nb, block, D]

    def accumulate(dw, a):
        x_i, d_i, e = a
        return dw.at[e].add(x_i.T @ d_i), None  # [D, O] into expert e

    dw, _ = jax.lax.scan(accumulate, jnp.zeros_like(w), (xb, d_out, block_expert))
    return dx, dw, None


block_gemm.defvjp(_block_gemm_fwd, _block_gemm_bwd)


# ------------------------------------------------------------------------------------------------
# Experts
# ------------------------------------------------------------------------------------------------

ACTIVATIONS = ("silu", "gpt_oss", "silu_clamped")
HF_LAYOUTS = ("per_expert", "gpt_oss")
IMPLS = ("blocked", "ragged", "dense")
# "blocked" is measured to scale with top-k on XLA:CPU (benchmarks/moe.py) and stays the default on every
# backend: nothing measured yet says the native ragged_dot kernel wins on GPU. `python -m benchmarks.gpu`
# times both at a training size and prints the winner; set FORGELINE_MOE_IMPL=ragged where it wins.
DEFAULT_IMPL = os.environ.get("FORGELINE_MOE_IMPL", "blocked")
if DEFAULT_IMPL not in IMPLS:
    raise ValueError(f"FORGELINE_MOE_IMPL={DEFAULT_IMPL!r} (known: {', '.join(IMPLS)})")


EP_VARIABLES = ("gate_up", "down", "gate_up_bias", "down_bias", "gate_up_lora_a", "gate_up_lora_b", "down_lora_a",
                "down_lora_b")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How an expert stack is laid out on a mesh, for `Experts._expert_parallel`: the mesh, the batch axes the
    token rows are split over, the mesh axes of the stacked-expert dimension, each variable's PartitionSpec,
    and the capacity factor (None: dropless)."""

    mesh: Any
    rows: tuple[str, ...]
    expert_axes: tuple[str, ...]
    specs: tuple[tuple[str, Any], ...]
    capacity_factor: float | None = None

    @property
    def expert_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.expert_axes)

    def usable(self, tokens: int) -> bool:
        """The expert axes must split the batch too (the default rules), and the tokens divide evenly."""
        shards = math.prod(self.mesh.shape[a] for a in self.rows)
        return set(self.expert_axes) <= set(self.rows) and tokens % shards == 0

    def spec(self, name: str) -> Any:
        return dict(self.specs)[name]

    def gather(self, name: str, a: jax.Array) -> jax.Array:
        """Inside shard_map: this device's shard of variable `name`, all-gathered over every mesh axis that
        splits it except the expert axes of its leading (expert) dimension."""
        for dim, entry in enumerate(self.spec(name)):
            axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
            if dim == 0:
                axes = tuple(x for x in axes if x not in self.expert_axes)
            if axes:
                a = jax.lax.all_gather(a, axes, axis=dim, tiled=True)
        return a


class Experts(nnx.Module):
    """E SwiGLU experts, stacked: gate_up [E, D, 2I] (gate = first I columns, up = last I), down
    [E, I, D], optional biases gate_up_bias [E, 2I] and down_bias [E, D].

    activation "silu": silu(gate) · up. "gpt_oss": gate ≤ limit, −limit ≤ up ≤ limit,
    (up + 1) · gate · sigmoid(alpha · gate). "silu_clamped" (DeepSeek-V4): silu(min(gate, limit)) ·
    clip(up, ±limit). `hf_names` renames the per-expert gate / up / down tensors (DeepSeek-V4: w1, w3, w2).
    HF layout "per_expert" (Qwen3-MoE, DeepSeek, GLM on disk): `<prefix>.{e}.gate_proj.weight` [I, D],
    `up_proj` [I, D], `down_proj` [D, I]. "gpt_oss": `<prefix>.gate_up_proj` [E, D, 2I] with gate/up
    interleaved (even/odd columns), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, D], `down_proj_bias` [E, D].

    LoRA (models/lora.py; PEFT's ParamWrapper on transformers 5's fused `gate_up_proj` / `down_proj`):
    per-expert factors, all nnx.LoRAParam, gate_up_lora_a [E, D, r] / gate_up_lora_b [E, r, 2I] and
    down_lora_a [E, I, r] / down_lora_b [E, r, D]; expert e computes x W_e + scale · (drop(x) A_e) B_e in
    every impl (the grouped impls run the two factors as two more grouped matmuls: no [E, D, 2I] delta).
    LoRA dropout draws its masks per routed row in the grouped impls and per (expert, token) in the dense
    one, so grouped == dense holds with dropout off (`eval()`).

    Quantized (models/quant/): gate_up / down are None and each has codes `<w>_q` QuantWeight [E, in, out],
    scales `<w>_scale` QuantScale [E, G, out] (or FP8 tiles [E, in/128, out/128] with `qblock`) and, for
    asymmetric schemes, `<w>_zero` QuantZero [E, G, out], for NVFP4 `<w>_global` QuantScale [E, 1] (gate and
    up share one): every expert quantized on its own; the forward dequantizes them on the fly. With
    `input_quant` set each expert's input rows are quantized-dequantized first as the engine does (models/numerics.py;
    NVFP4's calibrated global input scales in `<w>_input_global` QuantScale [E, 1]).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
        use_bias: bool = False, hf_layout: str = "per_expert", alpha: float = 1.702, limit: float = 7.0,
        impl: str | None = None, hf_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        rngs: nnx.Rngs, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
    ):
        if activation not in ACTIVATIONS or hf_layout not in HF_LAYOUTS:
            raise ValueError(f"experts: activation {activation!r} / hf_layout {hf_layout!r}")
        E, D, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, D, I
        self.activation, self.hf_layout, self.alpha, self.limit = activation, hf_layout, alpha, limit
        self.hf_names = tuple(hf_names)
        self.impl = impl or DEFAULT_IMPL
        self.dtype = dtype
        init = nnx.initializers.normal(INIT_STD)
        self.gate_up = param(init(rngs.params(), (E, D, 2 * I), param_dtype), ("expert", "embed", "mlp"))
        self.down = param(init(rngs.params(), (E, I, D), param_dtype), ("expert", "mlp", "embed"))
        self.gate_up_bias = nnx.data(param(jnp.zeros((E, 2 * I), param_dtype), ("expert", "mlp")) if use_bias
                                     else None)
        self.down_bias = nnx.data(param(jnp.zeros((E, D), param_dtype), ("expert", "embed")) if use_bias else None)
        self.gate_up_lora_a = nnx.data(None)
        self.gate_up_lora_b = nnx.data(None)
        self.down_lora_a = nnx.data(None)
        self.down_lora_b = nnx.data(None)
        self.lora_dropout = nnx.data(None)
        self.lora_scale = 0.0  # alpha / r
        self.lora_rank, self.lora_alpha = 0, 0.0
        for w in ("gate_up", "down"):
            for part in ("q", "scale", "zero", "global"):  # global: NVFP4's per-expert global scale [E, 1]
                setattr(self, f"{w}_{part}", nnx.data(None))
        self.qblock: int | None = None
        self.qbits = 0
        self.input_quant: str | None = None  # quantized inputs (models/numerics.py), as Linear.input_quant
        self.gate_up_input_global = nnx.data(None)  # NVFP4 activations: global input scales [E, 1]
        self.down_input_global = nnx.data(None)
        self.calibrating = False  # models/quant/: sow the routed rows for per-expert calibration
        self.expert_parallel: ExpertParallel | None = None  # on a mesh: the per-device dispatch (__call__)

    # -- LoRA ------------------------------------------------------------------------------------

    def add_lora(self, rank: int, alpha: float, *, key: jax.Array, dropout: float = 0.0,
                 dropout_rngs: nnx.RngStream | None = None) -> None:
        """A factors ~ U(±1/sqrt(fan_in)) per expert (PEFT's kaiming-uniform), B factors = 0."""
        if self.gate_up_lora_a is not None:
            raise ValueError("LoRA is already applied; merge_lora first")
        E, D, I, r = self.num_experts, self.hidden_size, self.intermediate_size, rank
        if self.gate_up is None:
            raise ValueError("cannot add LoRA to quantized experts")
        dtype = self.gate_up[...].dtype
        k1, k2 = jax.random.split(key)
        b1, b2 = 1.0 / np.sqrt(D), 1.0 / np.sqrt(I)
        self.gate_up_lora_a = param(jax.random.uniform(k1, (E, D, r), dtype, -b1, b1), ("expert", "embed", None),
                                    nnx.LoRAParam)  # [E, D, r]
        self.gate_up_lora_b = param(jnp.zeros((E, r, 2 * I), dtype), ("expert", None, "mlp"), nnx.LoRAParam)
        self.down_lora_a = param(jax.random.uniform(k2, (E, I, r), dtype, -b2, b2), ("expert", "mlp", None),
                                 nnx.LoRAParam)  # [E, I, r]
        self.down_lora_b = param(jnp.zeros((E, r, D), dtype), ("expert", None, "embed"), nnx.LoRAParam)
        self.lora_dropout = nnx.Dropout(dropout, rngs=dropout_rngs) if dropout > 0 else None
        self.lora_scale, self.lora_rank, self.lora_alpha = float(alpha) / rank, rank, float(alpha)

    @property
    def quantized(self) -> bool:
        return self.gate_up_q is not None

    def base_weights(self, dtype: Any = None) -> tuple[jax.Array, jax.Array]:
        """(gate_up [E, D, 2I], down [E, I, D]) without LoRA: the params, or the codes dequantized."""
        if not self.quantized:
            gu, down = self.gate_up[...], self.down[...]
            return (gu, down) if dtype is None else (gu.astype(dtype), down.astype(dtype))

        def deq(w: str) -> jax.Array:  # [E, in, out]
            return jax.lax.map(self.expert_weights(w, dtype or jnp.float32).fn, jnp.arange(self.num_experts))

        return deq("gate_up"), deq("down")

    def expert_weights(self, w: str, dtype: Any) -> ExpertWeights:
        """The quantized stack `w` ("gate_up" | "down") for grouped_matmul, dequantized one expert at a time."""
        q, s, z, g = (getattr(self, f"{w}_{p}") for p in ("q", "scale", "zero", "global"))
        q, s, z, g = q[...], s[...], None if z is None else z[...], None if g is None else g[...]
        I, block = self.intermediate_size, self.qblock

        def fn(e: jax.Array) -> jax.Array:  # [D, O] of expert e
            qe, se = _expert(q, e), _expert(s, e)
            if block is not None and w == "gate_up":  # FP8 tiles are per projection: gate's, then up's
                st = se.shape[-1] // 2
                return jnp.concatenate([dequantize(qe[:, :I], se[:, :st], None, block, dtype),
                                        dequantize(qe[:, I:], se[:, st:], None, block, dtype)], axis=-1)
            return dequantize(qe, se, None if z is None else _expert(z, e), block, dtype,
                              None if g is None else _expert(g, e))

        return ExpertWeights(fn, tuple(q.shape))

    def weights(self) -> tuple[jax.Array, jax.Array]:
        """The effective (gate_up [E, D, 2I], down [E, I, D]) with LoRA folded in."""
        gu, down = self.base_weights()
        if self.gate_up_lora_a is not None:
            s = self.lora_scale
            gu = gu + (s * jnp.einsum("edr,erf->edf", self.gate_up_lora_a[...], self.gate_up_lora_b[...])
                       ).astype(gu.dtype)
            down = down + (s * jnp.einsum("eir,erd->eid", self.down_lora_a[...], self.down_lora_b[...])
                           ).astype(down.dtype)
        return gu, down

    def merge_lora(self) -> None:
        """Fold the adapters into gate_up / down and drop the factors."""
        if self.quantized:
            raise ValueError("cannot merge LoRA into quantized experts; merge before quantizing")
        gu, down = self.weights()
        self.gate_up[...], self.down[...] = gu, down
        self.gate_up_lora_a = self.gate_up_lora_b = self.down_lora_a = self.down_lora_b = None
        self.lora_dropout = None
        self.lora_scale, self.lora_rank, self.lora_alpha = 0.0, 0, 0.0

    def _lora_in(self, x: jax.Array) -> jax.Array:
        """The LoRA branch's input: dropout on it only (the base matmul sees x unchanged)."""
        return x if self.lora_dropout is None else self.lora_dropout(x)

    # -- math ------------------------------------------------------------------------------------

    def act(self, gu: jax.Array) -> jax.Array:
        """[..., 2I] -> [..., I]."""
        gate, up = jnp.split(gu, 2, axis=-1)
        if self.activation == "silu":
            return jax.nn.silu(gate) * up
        if self.activation == "silu_clamped":
            return jax.nn.silu(jnp.minimum(gate, self.limit)) * jnp.clip(up, -self.limit, self.limit)
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)

    def _act_quant(self, h: jax.Array, w: str, expert: jax.Array) -> jax.Array:
        """Rows h [..., in] entering projection `w` ("gate_up" | "down") of experts `expert` [...] (broadcast
        against h's leading axes), quantized-dequantized as the engine does when the scheme quantizes
        activations; h unchanged otherwise."""
        if self.input_quant is None:
            return h
        g = getattr(self, f"{w}_input_global")
        return quantize_activation(h, self.input_quant, None if g is None else g[...][expert])  # g: [..., 1]

    def __call__(self, x: jax.Array, idx: jax.Array, w: jax.Array, *, impl: str | None = None) -> jax.Array:
        """x [T, D], idx [T, k] experts, w [T, k] routing weights -> Σ_k w · expert_idx(x), [T, D].

        On a mesh (`expert_parallel`, set by models.sharding.set_activation_sharding) the dispatch runs per
        device (`_expert_parallel`); calibration (which sows the routed rows), LoRA dropout (which draws
        masks) and quantized stacks dispatch as one program over all tokens."""
        impl = impl or self.impl
        if impl == "dense":
            return self._dense(x, idx, w)
        x = x.astype(self.dtype)
        ep = self.expert_parallel
        if ep is not None and ep.usable(x.shape[0]) and not (self.calibrating or self.quantized
                                                               or self.lora_dropout is not None):
            return self._expert_parallel(x, idx, w, impl, ep)
        if self.quantized:  # dequantized on the fly, one expert per block
            weights = self.expert_weights("gate_up", self.dtype), self.expert_weights("down", self.dtype)
        else:
            weights = self.base_weights(self.dtype)
        return self._routed(x, idx, w, weights, impl)

    def _expert_parallel(self, x: jax.Array, idx: jax.Array, w: jax.Array, impl: str, ep: ExpertParallel
                         ) -> jax.Array:
        """Expert parallelism under `jax.shard_map`: each device holds T_l of the tokens (rows over the batch
        axes) and E_l = E / X of the experts (the stacked-expert axis over the X devices of the expert
        axes, which also split the batch). Per layer, on each device:

        1. its experts' weights (and LoRA factors, biases) are all-gathered over the other axes that split
           them (FSDP's gather, in the compute dtype), never the other experts';
        2. the tokens of its X expert-axis peers are all-gathered (x [X·T_l, D], their routes);
        3. the routed rows that go to its own experts are sorted by expert and run through the grouped
           matmuls; at most C rows (C = X·T_l·k: dropless; with `capacity_factor` f, C = f·T_l·k, the
           average times f: rows past C are dropped, as capacity-based MoE training does);
        4. the weighted rows are summed per token and reduce-scattered back over the expert axes.

        The same function of the inputs as `_routed` (dropless), with no sort or buffer over the global
        batch and no expert stack gathered whole: what XLA's own partitioning of `_routed` did (the capacity
        planner, tasks/training/plan.py, measured it replicating every routed row on every device)."""
        E, D, k = self.num_experts, self.hidden_size, idx.shape[1]
        names = [n for n in EP_VARIABLES if getattr(self, n) is not None]
        arrays = [getattr(self, n)[...].astype(self.dtype) for n in names]
        X, axes, lora = ep.expert_size, ep.expert_axes, self.gate_up_lora_a is not None
        E_l = E // X
        P = jax.sharding.PartitionSpec

        def local(x_l, idx_l, w_l, *ws):  # [T_l, D], [T_l, k], [T_l, k], this device's shards
            ws = {n: ep.gather(n, a) for n, a in zip(names, ws, strict=True)}  # [E_l, ...] whole per expert
            if X > 1:
                x_l, idx_l, w_l = (jax.lax.all_gather(a, axes, axis=0, tiled=True) for a in (x_l, idx_l, w_l))
                me = jax.lax.axis_index(axes)
            else:
                me = 0
            R = x_l.shape[0] * k  # routed rows of the gathered tokens
            C = R if ep.capacity_factor is None else min(R, math.ceil(ep.capacity_factor * R / X))
            flat = idx_l.reshape(-1)  # [R]
            key = jnp.where(flat // E_l == me, flat - me * E_l, E_l)  # local expert, or E_l: another device's
            order = jnp.argsort(key, stable=True)[:C]  # [C] this device's rows first, by expert
            group = key[order]  # [C]
            sizes = jnp.bincount(group, length=E_l + 1).astype(jnp.int32)  # [E_l + 1], the last: not ours
            token = order // k  # [C]
            ext = lambda a: jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])  # + a zero group
            xs = x_l[token]  # [C, D]
            gu = grouped_matmul(xs, ext(ws["gate_up"]), sizes, impl=impl)  # [C, 2I]
            scale = jnp.asarray(self.lora_scale, self.dtype)
            if lora:
                t = grouped_matmul(xs, ext(ws["gate_up_lora_a"]), sizes, impl=impl)  # [C, r]
                gu = gu + grouped_matmul(t, ext(ws["gate_up_lora_b"]), sizes, impl=impl) * scale
            if "gate_up_bias" in ws:
                gu = gu + ext(ws["gate_up_bias"])[group]
            h = self.act(gu)  # [C, I]
            y = grouped_matmul(h, ext(ws["down"]), sizes, impl=impl)  # [C, D]
            if lora:
                t = grouped_matmul(h, ext(ws["down_lora_a"]), sizes, impl=impl)  # [C, r]
                y = y + grouped_matmul(t, ext(ws["down_lora_b"]), sizes, impl=impl) * scale
            if "down_bias" in ws:
                y = y + ext(ws["down_bias"])[group]
            weight = jnp.where(group < E_l, w_l.reshape(-1)[order], 0.0)  # [C]
            out = jnp.zeros((x_l.shape[0], D), y.dtype).at[token].add(y * weight[:, None].astype(y.dtype))
            return jax.lax.psum_scatter(out, axes, scatter_dimension=0, tiled=True) if X > 1 else out  # [T_l, D]

        rows = P(ep.rows, None)
        return jax.shard_map(local, mesh=ep.mesh, in_specs=(rows, rows, rows, *(ep.spec(n) for n in names)),
                             out_specs=rows, check_vma=False)(x, idx, w, *arrays)

    def _routed(self, x: jax.Array, idx: jax.Array, w: jax.Array, weights: tuple[Any, Any], impl: str) -> jax.Array:
        """The grouped dispatch of x [T, D] (already in the compute dtype): rows sorted by expert, two grouped
        matmuls, rows weighted and summed back per token -> [T, D]."""
        T, k = idx.shape
        E = self.num_experts
        w_gu, w_down = weights
        flat = idx.reshape(-1)  # [R]
        order = jnp.argsort(flat, stable=True)  # [R] rows grouped by expert
        token = order // k  # [R] source token of each sorted row
        expert = flat[order]  # [R]
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E]
        lora = self.gate_up_lora_a is not None

        def lora_delta(h: jax.Array, a: nnx.Variable, b: nnx.Variable) -> jax.Array:  # [R, in] -> [R, out]
            t = grouped_matmul(self._lora_in(h), a[...], sizes, impl=impl)  # [R, r]
            return grouped_matmul(t, b[...], sizes, impl=impl) * jnp.asarray(self.lora_scale, h.dtype)

        xs = x[token]  # [R, D]
        if self.calibrating:
            self.sow(nnx.Intermediate, "calib_rows", (token, expert))
            self.sow(nnx.Intermediate, "calib_gate_up", xs)
        xs = self._act_quant(xs, "gate_up", expert)
        gu = grouped_matmul(xs, w_gu, sizes, impl=impl)  # [R, 2I]
        if lora:
            gu = gu + lora_delta(xs, self.gate_up_lora_a, self.gate_up_lora_b)
        if self.gate_up_bias is not None:
            gu = gu + self.gate_up_bias[...].astype(self.dtype)[expert]
        h = self.act(gu)  # [R, I]
        if self.calibrating:
            self.sow(nnx.Intermediate, "calib_down", h)
        h = self._act_quant(h, "down", expert)
        y = grouped_matmul(h, w_down, sizes, impl=impl)  # [R, D]
        if lora:
            y = y + lora_delta(h, self.down_lora_a, self.down_lora_b)
        if self.down_bias is not None:
            y = y + self.down_bias[...].astype(self.dtype)[expert]
        y = y * w.reshape(-1)[order][:, None].astype(y.dtype)
        return jnp.zeros((T, self.hidden_size), y.dtype).at[token].add(y)  # [T, D]

    def _dense(self, x: jax.Array, idx: jax.Array, w: jax.Array) -> jax.Array:
        """Reference: every token through every expert, then the routing weights pick [T, D]."""
        x = x.astype(self.dtype)
        lora = self.gate_up_lora_a is not None
        scale = jnp.asarray(self.lora_scale, self.dtype)
        w_gu, w_down = self.base_weights(self.dtype)
        E = self.num_experts
        if self.input_quant is not None:  # each expert quantizes its own copy of the input (own global scale)
            xe = self._act_quant(jnp.broadcast_to(x, (E, *x.shape)), "gate_up", jnp.arange(E)[:, None])
            gu = jnp.einsum("etd,edf->etf", xe, w_gu)  # [E, T, 2I]
        else:
            gu = jnp.einsum("td,edf->etf", x, w_gu)  # [E, T, 2I]
        if lora:
            t = jnp.einsum("td,edr->etr", self._lora_in(x), self.gate_up_lora_a[...].astype(self.dtype))  # [E, T, r]
            gu = gu + jnp.einsum("etr,erf->etf", t, self.gate_up_lora_b[...].astype(self.dtype)) * scale
        if self.gate_up_bias is not None:
            gu = gu + self.gate_up_bias[...].astype(self.dtype)[:, None, :]
        h = self.act(gu)  # [E, T, I]
        y = jnp.einsum("eti,eid->etd", self._act_quant(h, "down", jnp.arange(E)[:, None]), w_down)  # [E, T, D]
        if lora:
            t = jnp.einsum("eti,eir->etr", self._lora_in(h), self.down_lora_a[...].astype(self.dtype))  # [E, T, r]
            y = y + jnp.einsum("etr,erd->etd", t, self.down_lora_b[...].astype(self.dtype)) * scale
        if self.down_bias is not None:
            y = y + self.down_bias[...].astype(self.dtype)[:, None, :]
        combine = jnp.zeros((x.shape[0], self.num_experts), jnp.float32)
        combine = combine.at[jnp.arange(x.shape[0])[:, None], idx].add(w.astype(jnp.float32))  # [T, E]
        return jnp.einsum("te,etd->td", combine.astype(y.dtype), y)

    # -- HF tensors (models/hf.py) ---------------------------------------------------------------

    def hf_export(self) -> dict[str, jax.Array]:
        I = self.intermediate_size
        gu, down = self.weights()  # LoRA (if any) folded in, as Linear.weight() does
        if self.hf_layout == "gpt_oss":
            inter = jnp.stack([gu[..., :I], gu[..., I:]], axis=-1).reshape(gu.shape)  # gate even, up odd
            out = {"gate_up_proj": inter, "down_proj": down}
            if self.gate_up_bias is not None:
                b = self.gate_up_bias[...]
                out["gate_up_proj_bias"] = jnp.stack([b[..., :I], b[..., I:]], axis=-1).reshape(b.shape)
                out["down_proj_bias"] = self.down_bias[...]
            return out
        out = {}
        gate, up, dn = self.hf_names
        for e in range(self.num_experts):
            out[f"{e}.{gate}.weight"] = gu[e, :, :I].T  # [I, D]
            out[f"{e}.{up}.weight"] = gu[e, :, I:].T
            out[f"{e}.{dn}.weight"] = down[e].T  # [D, I]
        return out

    def hf_views(self, get: Callable[[str, tuple[int, ...]], views.View | None]) -> dict[str, views.View | None]:
        """How each stacked variable is made of transformers' tensors, as lazy views (models/views.py), so a
        device holding experts [e0, e1) reads only theirs: per-expert `{e}.gate_proj/up_proj/down_proj.weight`
        ([I, D], [I, D], [D, I]) stacked and transposed, or GPT-OSS's stacked `gate_up_proj` [E, D, 2I] with
        gate and up interleaved on the last axis."""
        E, D, I = self.num_experts, self.hidden_size, self.intermediate_size

        def split(v: views.View | None) -> views.View | None:  # gate even, up odd -> [gate | up]
            return None if v is None else views.Deinterleaved(v)

        if self.hf_layout == "gpt_oss":
            out = {"gate_up": split(get("gate_up_proj", (E, D, 2 * I))), "down": get("down_proj", (E, I, D))}
            if self.gate_up_bias is not None:
                out["gate_up_bias"] = split(get("gate_up_proj_bias", (E, 2 * I)))
                out["down_bias"] = get("down_proj_bias", (E, D))
            return out
        gate_n, up_n, down_n = self.hf_names
        parts = [[get(f"{e}.{n}.weight", s) for n, s in ((gate_n, (I, D)), (up_n, (I, D)), (down_n, (D, I)))]
                 for e in range(E)]
        if any(p is None for trio in parts for p in trio):
            return {}  # `get` has recorded what is missing or mis-shaped
        # stack the HF tensors as they are, then one permutation: the loader applies it on the devices
        gate, up, down = (views.Stacked([trio[k] for trio in parts]) for k in range(3))  # [E, I, D], [E, D, I]
        return {"gate_up": views.Permuted(views.Concat([gate, up], axis=1), (0, 2, 1)),
                "down": views.Permuted(down, (0, 2, 1))}


# ------------------------------------------------------------------------------------------------
# MoE block
# ------------------------------------------------------------------------------------------------


def load_balancing_loss(logits: jax.Array, idx: jax.Array, scoring: str) -> jax.Array:
    """Switch-Transformer load balancing, as transformers' `load_balancing_loss_func`:
    E · Σ_e f_e · P_e with f_e the fraction of tokens routed to expert e (top-k counted k times) and
    P_e the mean router probability; k for a perfectly balanced router. Sigmoid routers (DeepSeek-V3's
    complementary sequence-wise loss) use their scores normalised per token as probabilities."""
    E = logits.shape[-1]
    logits = logits.astype(jnp.float32)  # [T, E]
    if scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
    routed = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=1)  # [T, E] (k ones per token)
    return E * jnp.sum(jnp.mean(routed, axis=0) * jnp.mean(probs, axis=0))


class MoE(nnx.Module):
    """Σ_k w_k · expert_k(x) (+ shared experts on every token). The router lives at `router_name`
    ("gate" for Qwen3-MoE / DeepSeek / GLM, "router" for GPT-OSS) so HF names map structurally."""

    def __init__(self, router: Router, experts: Experts, shared_experts: nnx.Module | None = None,
                 *, router_name: str = "gate"):
        self.router_name = router_name
        setattr(self, router_name, router)
        self.experts = experts
        self.shared_experts = nnx.data(shared_experts)
        self.collect_aux = False  # the trainer turns this on: sow the load-balancing loss per call

    def route(self, x: jax.Array, tokens: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] (and, for a router that reads them, token ids [T]) -> (weights, experts, logits)."""
        router = getattr(self, self.router_name)
        return router(x) if tokens is None else router(x, tokens)

    def __call__(self, x: jax.Array, tokens: jax.Array | None = None) -> jax.Array:
        """x [..., D] -> [..., D]; `tokens` [...] (the input ids) for a router that routes by token id
        (DeepSeek-V4's hash layers)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])  # [T, D]
        w, idx, logits = self.route(flat, None if tokens is None else tokens.reshape(-1))
        if self.collect_aux:
            router = getattr(self, self.router_name)
            self.sow(nnx.Intermediate, "aux_loss", load_balancing_loss(logits, idx, router.scoring))
        y = self.experts(flat, idx, w).astype(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.reshape(*lead, -1)


def sigmoid_moe(
    hidden_size: int, num_experts: int, top_k: int, expert_width: int, num_shared: int, *, n_group: int,
    topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float, rngs: nnx.Rngs, dtype: Any,
    param_dtype: Any,
) -> MoE:
    """The DeepSeek-V3 / Kimi K2 / GLM-4.5 block (docs/models/deepseek-v3.md): sigmoid group-limited router `gate`,
    per-expert SwiGLUs, and a shared SwiGLU of width expert_width · num_shared (none when 0)."""
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    router = Router(hidden_size, num_experts, top_k, scoring="sigmoid", norm_topk_prob=norm_topk_prob,
                    n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, **kw)
    experts = Experts(num_experts, hidden_size, expert_width, hf_layout="per_expert", **kw)
    shared = MLP(hidden_size, expert_width * num_shared, **kw) if num_shared else None
    return MoE(router, experts, shared, router_name="gate")
