"""The one command to run when a GPU is lent: what matters, measured against the device's published bounds.

    python -m benchmarks.gpu [--toy] [--json rows.json] [--only decode speculative ...] [--budget 420]

Prints one markdown table, one row per measurement: the value, its bound or peer, their ratio, and the
target. Sizes follow the backend: the real ones on a GPU (about 6-7 minutes on one H200, compiles
included), toy ones on a CPU or with `--toy` (a slow-tier test runs that, so it cannot rot). Sections, in
run order:

- bounds: a jitted bf16 matmul (FLOP/s) and a large array reduction / copy (bytes/s) measured here, against
  the device's published bf16 dense peak and HBM bandwidth (PEAKS, keyed by `device_kind`). A CPU has no
  published peak: the measured values are then the bounds of every row below, and the table says so.
- attention: one causal GQA attention forward + backward at the training size, the fused path
  (`jax.nn.dot_product_attention`: cuDNN on a GPU, its XLA implementation on a CPU; models/layers.py
  `attention_impl`, what FORGELINE_ATTENTION=auto runs on a GPU) vs today's `attention_core`. On a GPU the
  faster one (today's if cuDNN fails) runs the training sections.
- train_dense / train_moe: MFU of the real Trainer step (tasks/training/trainer.py, compute_dtype bfloat16,
  AdamW, fp32 master weights) for a ~0.9B dense Llama (d 2048, 16 layers, vocab 32k, T 2048) and a
  Qwen3-MoE of about the same active size; model FLOPs from tasks.training.flops.train_flops_per_token
  (PaLM appendix B, causal attention halved as MaxText counts it). Targets on an H200: >= 55% dense, >= 40% MoE.
- decode: greedy tokens/s of our jitted KV-cache loop (models/generate.py) for a 3.1B bf16 Llama (d 4096,
  16 layers: 6.2 GB read per step) at batch 1 and 64, against the HBM bound B x bandwidth / (weight bytes +
  KV-cache bytes read per step). Target >= 70%.
- speculative: EAGLE-3 chain speculative decoding (models/speculative.py, k=4) vs plain decoding of the
  same bandwidth-bound bf16 target in the same run. No trained draft fits the budget, so the target's LM
  head is zeroed (every greedy token is id 0, every matmul still runs) and so is the draft's (it always
  proposes id 0): acceptance is total (tau = k + 1) and the speedup is the ceiling the verify/draft costs
  allow; a trained draft's speedup is about that ceiling scaled by its tau / (k + 1).
- moe_impl: the MoE block (Router + Experts, bf16) forward and forward + backward with the grouped
  ("blocked", today's default) dispatch vs `jax.lax.ragged_dot`, at the train_moe size; prints the winner,
  which (on a GPU, unless FORGELINE_MOE_IMPL is set) train_moe then runs.
- load: models.from_pretrained of a local safetensors checkpoint written in this run, GB/s, against
  safetensors.torch.load_file (+ one copy of each tensor) when torch is importable (benchmarks/load.py).
- rollout: GRPO's rollout path (tasks/training/grpo.py `sample(trainer.model(), ...)`, the region fit_grpo
  times) vs plain `models.generate` on the same model, pre-padded batch and rng (benchmarks/rollout.py), at
  the train_dense model size (fp32 master weights, bf16 compute on a GPU), the decode section's larger batch
  in groups of (up to) 8 and its new tokens. Target >= 90% (a same-run ratio, judged on any device at
  the real sizes; not at the toy ones, where a step takes milliseconds and fixed per-call costs dominate).

Every section is bounded (warm-up + a few timed steps, and an alarm), and sections are skipped once
`--budget` seconds are spent; a failing section prints its error in its row and the rest still run;
progress and each section's elapsed time go to stderr; the exit status is 1 when any section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.run import _best

# Published per-GPU peaks: (device_kind substring, dense bf16 TFLOP/s without sparsity, HBM TB/s), first
# match wins. From NVIDIA's datasheets: "NVIDIA H200 Tensor Core GPU" (H200 SXM: 989 TFLOP/s, 4.8 TB/s),
# "NVIDIA H100 Tensor Core GPU" (SXM: 989, 3.35; PCIe: 756, 2.0), "NVIDIA A100 Tensor Core GPU"
# (312; 80GB: 2.0 (PCIe 1.935, SXM 2.039), 40GB: 1.555), "NVIDIA DGX B200" / "NVIDIA Blackwell" (B200:
# 2250 per GPU, 8.0) and "NVIDIA L40S GPU" (362.05, 0.864). The datasheets quote the bf16 tensor-core
# numbers "with sparsity"; these are the dense halves.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-40GB", 312e12, 1.555e12),
    ("A100-PCIE-40GB", 312e12, 1.555e12),
    ("A100", 312e12, 2.0e12),  # 80GB
    ("B200", 2250e12, 8.0e12),
    ("L40S", 362e12, 0.864e12),
)
# fraction of the published bound (H200); rollout: of its peer measured in the same run
TARGETS = {"train_dense": 0.55, "train_moe": 0.40, "decode": 0.70, "rollout": 0.90}
# in run order: `attention` and `moe_impl` pick the kernels the training sections after them use
SECTIONS = ("bounds", "attention", "train_dense", "decode", "speculative", "moe_impl", "train_moe", "load",
            "rollout")


def published_peaks(device_kind: str) -> tuple[float, float] | None:
    """(bf16 dense FLOP/s, HBM bytes/s) of a `jax.devices()[0].device_kind`, or None when unknown."""
    for key, flops, bandwidth in PEAKS:
        if key.lower() in device_kind.lower():
            return flops, bandwidth
    return None


# -- sizes -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU toy run."""

    dense: dict[str, Any]  # LlamaConfig fields (train_dense, attention)
    decode: dict[str, Any]  # LlamaConfig fields (decode, speculative), in bf16
    moe: dict[str, Any]  # Qwen3MoeConfig fields (train_moe, moe_impl)
    batch: int  # training rows
    seq: int  # training length
    remat: str
    train_steps: int  # timed steps after one warm-up step
    matmul_n: int
    bandwidth_bytes: int
    decode_batches: tuple[int, int]
    prompt: int
    new_tokens: int
    spec_k: int
    repeats: int  # timed calls of the small kernels
    load_gb: float | None  # None: save_pretrained the toy dense model instead of benchmarks.load's checkpoint
    section_s: int  # alarm per section


GPU = Sizes(
    # ~0.9B parameters: 16 layers of GQA (16 heads of 128, 8 kv heads) + SwiGLU 5632, untied head over 32k
    dense=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096),
    # 3.1B parameters, 6.2 GB in bf16: a decode step reads 3.5x longer than the 0.9B model (launch overheads hide less)
    decode=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096),
    # the same attention, top-4 of 16 experts of 1408: the active MLP (34.6M) equals the dense one's,
    # 2.55B parameters in all (31 GB of fp32 weights + AdamW moments)
    moe=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
             num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_experts=16,
             num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096),
    batch=8, seq=2048, remat="none", train_steps=3, matmul_n=8192, bandwidth_bytes=2 << 30,
    decode_batches=(1, 64), prompt=16, new_tokens=128, spec_k=4, repeats=3, load_gb=1.0, section_s=150,
)
TOY = Sizes(
    dense=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
    decode=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
    moe=dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=True, max_position_embeddings=512),
    batch=2, seq=64, remat="none", train_steps=2, matmul_n=256, bandwidth_bytes=16 << 20,
    decode_batches=(1, 4), prompt=8, new_tokens=16, spec_k=3, repeats=1, load_gb=None, section_s=120,
)


# -- rows ------------------------------------------------------------------------------------------


@dataclass
class Row:
    section: str
    metric: str
    value: float | None = None
    unit: str = ""
    bound: float | None = None  # the bound or the peer, in the value's unit
    bound_label: str = ""
    target: float | None = None  # on value / bound
    note: str = ""
    judged: bool = True  # False: the bound is a local measurement, the (H200) target is shown but not applied
    error: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.value is None or not self.bound else self.value / self.bound

    def cells(self) -> tuple[str, ...]:
        if self.error:
            return self.section, self.metric, f"ERROR: {self.error}", "", "", "", self.note
        num = lambda x: "" if x is None else _fmt(x, self.unit)
        bound = " ".join(x for x in (num(self.bound), self.bound_label) if x)
        ratio = "" if self.ratio is None else (f"{self.ratio:.1%}" if self.target is not None else f"{self.ratio:.2f}x")
        target = ""
        if self.target is not None:
            verdict = " (on H200)" if self.ratio is None or not self.judged else \
                (" ok" if self.ratio >= self.target else " MISSED")
            target = f">= {self.target:.0%}{verdict}"
        return self.section, self.metric, num(self.value), bound, ratio, target, self.note

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def _fmt(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if unit in ("FLOP/s", "B/s", "B") and abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    if unit == "ms":
        return f"{x:.3g} ms"
    if unit == "x":
        return f"{x:.2f}x"
    if unit == "tok/s":
        return f"{x:,.0f} tok/s"
    return f"{x:.4g} {unit}".strip()


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def table(rows: list[Row]) -> str:
    from benchmarks.train import table as md

    return md(("section", "measurement", "value", "bound / peer", "ratio", "target", "notes"),
              [r.cells() for r in rows])


# -- shared helpers --------------------------------------------------------------------------------


def _sync_best(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of `repeats` calls of `fn` (after one warm-up call), waiting for its arrays."""
    return _best(lambda: jax.block_until_ready(fn()), repeats)


def _bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclass
class Bounds:
    flops: float  # bf16 FLOP/s: the MFU denominator
    bandwidth: float  # bytes/s: the decode bound
    label: str  # where they come from
    published: bool


def measure_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of the faster of a jitted f32 sum (reads `nbytes`) and a jitted x + 1 (reads and writes them)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total, plus_one = jax.jit(jnp.sum), jax.jit(lambda a: a + 1)
    t_sum = _sync_best(lambda: total(x), repeats)
    t_copy = _sync_best(lambda: plus_one(x), repeats)
    return max(nbytes / t_sum, 2 * nbytes / t_copy)


def bench_bounds(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    from tasks.training.flops import measure_matmul_flops

    dev = jax.devices()[0]
    mm = measure_matmul_flops(jnp.bfloat16, s.matmul_n, repeats=5)
    bw = measure_bandwidth(s.bandwidth_bytes, repeats=5)
    peaks = published_peaks(dev.device_kind) if dev.platform == "gpu" else None
    if peaks is None:
        ctx["bounds"] = Bounds(mm, bw, "(measured here: no published peak)", published=False)
        why = f"no published peak for {dev.platform} {dev.device_kind!r}: this reading is the bound below"
        return [Row("bounds", f"bf16 matmul {s.matmul_n}^2", mm, "FLOP/s", note=why),
                Row("bounds", f"memory bandwidth (f32 sum / copy of {s.bandwidth_bytes >> 20} MiB)", bw, "B/s",
                    note=why)]
    ctx["bounds"] = Bounds(*peaks, f"({dev.device_kind} published)", published=True)
    return [Row("bounds", f"bf16 matmul {s.matmul_n}^2", mm, "FLOP/s", peaks[0], "published bf16 dense"),
            Row("bounds", f"memory bandwidth (f32 sum / copy of {s.bandwidth_bytes >> 20} MiB)", bw, "B/s",
                peaks[1], "published HBM")]


def _bounds(ctx: dict[str, Any]) -> Bounds:
    if "bounds" not in ctx:  # --only without `bounds`
        bench_bounds(ctx["sizes"], ctx)
    return ctx["bounds"]


# -- training MFU ----------------------------------------------------------------------------------


def train_mfu(section: str, model: nnx.Module, s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    """MFU of the product Trainer's step (bf16 compute) for `model`."""
    from benchmarks.train import make_batch
    from models.moe import DEFAULT_IMPL, Experts
    from tasks.training.config import TrainConfig
    from tasks.training.flops import matmul_params_per_token, train_flops_per_token
    from tasks.training.trainer import Trainer

    b = _bounds(ctx)
    cfg = model.config
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # the kernels the `attention` / `moe_impl` sections found faster, unless the environment names them
    attn = os.environ.get("FORGELINE_ATTENTION") or ctx.get("attention") or "auto"
    experts = [m for _, m in nnx.iter_graph(model) if isinstance(m, Experts)]
    if experts and "FORGELINE_MOE_IMPL" not in os.environ:
        for m in experts:
            m.impl = ctx.get("moe_impl", DEFAULT_IMPL)
    kernels = f"attention {attn}" + (f", MoE {experts[0].impl}" if experts else "")
    saved = os.environ.get("FORGELINE_ATTENTION")
    os.environ["FORGELINE_ATTENTION"] = attn  # read when the step is traced (models/layers.py attention_impl)
    try:
        trainer = Trainer(model, TrainConfig(steps=1000, batch_size=s.batch, compute_dtype="bfloat16",
                                             remat=s.remat))
        data = trainer.put(make_batch(cfg.vocab_size, s.batch, s.seq))
        t0 = time.perf_counter()
        est = trainer.compile(data)
        compile_s = time.perf_counter() - t0
        t = _best(lambda: float(trainer.step(data)["loss"]), s.train_steps)
    finally:
        if saved is None:
            os.environ.pop("FORGELINE_ATTENTION", None)
        else:
            os.environ["FORGELINE_ATTENTION"] = saved
    trainer = data = None  # free the device memory before the next section
    gc.collect()
    tokens_per_s = s.batch * s.seq / t
    flops = train_flops_per_token(cfg, s.seq, causal=True)
    note = (f"{_count(n_params)} params, {_count(matmul_params_per_token(cfg))} matmul params per token, "
            f"B={s.batch} T={s.seq} remat={s.remat}, {kernels}, {tokens_per_s:,.0f} tokens/s, "
            f"step {t * 1e3:.0f} ms, compile {compile_s:.0f} s"
            + (f", XLA {est['total'] / 2**30:.1f} GiB" if isinstance(est, dict) and "total" in est else ""))
    return [Row(section, "train step MFU (bf16, Trainer)", tokens_per_s * flops, "FLOP/s", b.flops,
                f"bf16 peak {b.label}", TARGETS[section], note, judged=b.published)]


def bench_train_dense(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    import models

    return train_mfu("train_dense", models.Llama(models.LlamaConfig(**s.dense), rngs=nnx.Rngs(0)), s, ctx)


def bench_train_moe(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

    return train_mfu("train_moe", Qwen3Moe(Qwen3MoeConfig(**s.moe), rngs=nnx.Rngs(0)), s, ctx)


# -- attention kernel ------------------------------------------------------------------------------


def bench_attention(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    """Forward + backward of one causal GQA attention at the dense training size: fused vs today's kernel."""
    from models.layers import attention, attention_impl

    c = s.dense
    B, T, N, K, H = s.batch, s.seq, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k, v = (jax.random.normal(kk, (B, K, T, H), dtype) for kk in keys[1:])
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    fused = "cudnn" if jax.default_backend() == "gpu" else "xla"

    def time_impl(impl: str) -> float:
        loss = lambda q, k, v: jnp.sum(attention(q, k, v, mask, causal=True, impl=impl).astype(jnp.float32))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return _sync_best(lambda: step(q, k, v), s.repeats)

    times = {"core": time_impl("core")}
    try:
        if attention_impl(q, k, v, causal=True, sinks=None, impl=fused) != fused:
            raise RuntimeError("attention_impl does not route this call to it")
        times[fused] = time_impl(fused)
    except Exception as e:
        if jax.default_backend() == "gpu":
            ctx["attention"] = "core"
        raise RuntimeError(f"the {fused} path failed ({type(e).__name__}: {e}); the training sections use "
                           f"FORGELINE_ATTENTION=core") from e
    winner = min(times, key=times.get)
    if jax.default_backend() == "gpu":
        ctx["attention"] = winner  # what the training sections run
    note = f"B={B} T={T} {N} heads / {K} kv heads of {H}, {jnp.dtype(dtype).name}, causal; faster: {winner}"
    return [Row("attention", f"fwd+bwd, {fused} (jax.nn.dot_product_attention)", times[fused] * 1e3, "ms",
                times["core"] * 1e3, "attention_core (today)", note=note)]


# -- decode ----------------------------------------------------------------------------------------


def _decode_model(s: Sizes, ctx: dict[str, Any]) -> nnx.Module:
    import models

    if "decode_model" not in ctx:
        ctx["decode_model"] = models.Llama(models.LlamaConfig(**s.decode), rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                           param_dtype=jnp.bfloat16)
    return ctx["decode_model"]


def bytes_per_step(model: nnx.Module, batch: int, cache_len: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) one decode step reads: every parameter but the embedding table (B rows
    of it), and every slot of the allocated cache (our loop attends over all of them, masked)."""
    c = model.config
    emb = model.embed_tokens.weight[...]
    weights = _bytes(nnx.state(model, nnx.Param)) - emb.nbytes + batch * emb.shape[1] * emb.dtype.itemsize
    per_slot = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * jnp.dtype(model.dtype).itemsize  # k, v
    kv = batch * cache_len * per_slot
    return weights, kv


def bench_decode(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    from models.generate import generate

    b = _bounds(ctx)
    model = _decode_model(s, ctx)
    rows = []
    for batch in s.decode_batches:
        prompt = np.random.default_rng(batch).integers(3, model.config.vocab_size, (batch, s.prompt)).astype(np.int32)
        t = _sync_best(lambda prompt=prompt: generate(model, prompt, max_new_tokens=s.new_tokens).tokens, s.repeats)
        w, kv = bytes_per_step(model, batch, s.prompt + s.new_tokens)
        note = (f"bf16, prompt {s.prompt} (prefill included) + {s.new_tokens} greedy tokens; per step "
                f"{_fmt(w, 'B')} weights + {_fmt(kv, 'B')} KV cache")
        rows.append(Row("decode", f"greedy decode B={batch} (tokens/s)", batch * s.new_tokens / t, "tok/s",
                        batch * b.bandwidth / (w + kv), f"HBM bound {b.label}", TARGETS["decode"], note,
                        judged=b.published))
    return rows


# -- speculative decoding --------------------------------------------------------------------------


def bench_speculative(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    """Plain vs EAGLE-3 chain decoding of the bf16 decode target with both LM heads zeroed (see the module doc)."""
    from models.eagle3.config import Eagle3Config
    from models.eagle3.model import Eagle3Draft
    from models.generate import generate
    from models.speculative import speculative_generate

    target = _decode_model(s, ctx)  # decode is done with it: zeroing its head costs no second copy
    ctx.pop("decode_model")
    cfg = target.config
    bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    target.lm_head.kernel.set_value(jnp.zeros_like(target.lm_head.kernel[...]))
    draft = Eagle3Draft(Eagle3Config.for_target(cfg, draft_vocab_size=min(cfg.vocab_size, 8192)), rngs=nnx.Rngs(2),
                        **bf16)
    draft.load_embedding(target.embed_tokens.weight[...])
    draft.lm_head.kernel.set_value(jnp.zeros_like(draft.lm_head.kernel[...]))  # always draft id 0 -> target id 0
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, s.prompt)).astype(np.int32)
    plain = lambda: generate(target, prompt, max_new_tokens=s.new_tokens).tokens
    spec = lambda: speculative_generate(target, draft, prompt, max_new_tokens=s.new_tokens, k=s.spec_k)
    t_plain, t_spec = _sync_best(plain, s.repeats), _sync_best(lambda: spec().tokens, s.repeats)
    out = spec()
    same = bool(np.array_equal(np.asarray(out.tokens), np.asarray(plain())))
    note = (f"bf16, B=1, {s.new_tokens} tokens, EAGLE-3 chain k={s.spec_k}, tau={out.mean_acceptance_length:.2f} "
            f"(oracle draft: ratio = the speedup ceiling), same tokens as plain: {same}")
    if not same:
        raise RuntimeError(f"speculative output differs from plain greedy decoding ({note})")
    return [Row("speculative", "speculative decode (tokens/s)", s.new_tokens / t_spec, "tok/s", s.new_tokens / t_plain,
                "plain decode (same target, same run)", note=note)]


# -- MoE dispatch ----------------------------------------------------------------------------------


def bench_moe_impl(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    """One MoE block (softmax top-k Router in fp32 + Experts in bf16) on the train_moe batch's tokens."""
    from models.decoder import set_compute_dtype
    from models.moe import Experts, MoE, Router

    c = s.moe
    T, D, E, k, I = s.batch * s.seq, c["hidden_size"], c["num_experts"], c["num_experts_per_tok"], \
        c["moe_intermediate_size"]
    x = jax.random.normal(jax.random.key(0), (T, D), jnp.bfloat16)
    times: dict[str, tuple[float, float]] = {}
    for impl in ("blocked", "ragged"):
        moe = MoE(Router(D, E, k, scoring="softmax", norm_topk_prob=True, rngs=nnx.Rngs(0)),
                  Experts(E, D, I, impl=impl, rngs=nnx.Rngs(1)))
        set_compute_dtype(moe, jnp.bfloat16)
        graphdef, state = nnx.split(moe)
        fwd = jax.jit(lambda st, x, g=graphdef: nnx.merge(g, st)(x))
        grad = jax.jit(jax.grad(lambda st, x, g=graphdef: jnp.sum(nnx.merge(g, st)(x).astype(jnp.float32) ** 2)))
        times[impl] = (_sync_best(lambda f=fwd, st=state: f(st, x), s.repeats),
                       _sync_best(lambda f=grad, st=state: f(st, x), s.repeats))
    note = f"T={T} tokens, D={D}, top-{k} of {E} experts of {I}, bf16"
    if jax.default_backend() == "gpu":  # CPU keeps the product default
        ctx["moe_impl"] = min(times, key=lambda m: times[m][1])  # what train_moe runs
    rows = []
    for i, what in enumerate(("forward", "forward+backward")):
        winner = min(times, key=lambda m, i=i: times[m][i])
        rows.append(Row("moe_impl", f"ragged_dot {what}", times["ragged"][i] * 1e3, "ms", times["blocked"][i] * 1e3,
                        "grouped 'blocked' (default)", note=f"{note}; faster: {winner}"))
    return rows


# -- checkpoint load -------------------------------------------------------------------------------


def bench_load(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    import models
    from benchmarks.load import _variables, write_checkpoint

    with tempfile.TemporaryDirectory(prefix="forgeline-bench-gpu-") as tmp:
        folder = Path(tmp)
        if s.load_gb is not None:
            write_checkpoint(folder, s.load_gb)  # bf16 Qwen3-MoE, one file
        else:
            models.save_pretrained(_decode_model(s, ctx), tmp)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))

        def ours() -> None:
            model = models.from_pretrained(tmp, dtype=jnp.bfloat16)
            jax.block_until_ready([v.get_value() for v in _variables(model)])

        t_ours = _best(ours, s.repeats)
        t_peer, peer_note = None, ""
        try:
            import safetensors.torch

            def peer() -> None:  # load_file maps the file; clone() reads it, as load_state_dict's copy would
                for f in folder.glob("*.safetensors"):
                    for t in safetensors.torch.load_file(str(f)).values():
                        t.clone()

            t_peer = _best(peer, s.repeats)
        except ImportError as e:
            peer_note = f"; no peer ({e})"
    note = (f"{_fmt(size, 'B')} bf16 safetensors, page cache warm, onto {jax.devices()[0].platform} "
            f"(one device){peer_note}")
    return [Row("load", "models.from_pretrained", size / t_ours, "B/s", None if t_peer is None else size / t_peer,
                "safetensors.torch.load_file + copy", note=note)]


# -- GRPO rollout ----------------------------------------------------------------------------------


def bench_rollout(s: Sizes, ctx: dict[str, Any]) -> list[Row]:
    """GRPO's rollout path vs plain generate of the same model, batch and rng (benchmarks/rollout.py)."""
    import models
    from benchmarks.rollout import random_prompts
    from benchmarks.rollout import run as rollout

    cfg = models.LlamaConfig(**s.dense)
    batch = s.decode_batches[1]
    group = min(8, batch // 2)
    r = rollout(models.Llama(cfg, rngs=nnx.Rngs(0)), random_prompts(cfg.vocab_size, 64, s.prompt // 2, s.prompt),
                batch_size=batch, group_size=group, max_new_tokens=s.new_tokens, temperature=1.0, top_p=1.0,
                eos=int(cfg.eos_token_id), pad=0, beta=0.04, repeats=max(s.repeats, 3),
                compute_dtype="bfloat16" if jax.default_backend() == "gpu" else "float32")
    gc.collect()
    note = (f"B={batch} ({batch // group} prompts x {group}), {s.new_tokens} new tokens, T=1; "
            f"{r.step_tokens:.0f} of {r.padded_slots} slots produced; identical tokens: {r.identical}; "
            f"(a)-(b) {(r.rollout_s - r.peer_s) * 1e3:+.1f} ms/step (trainer.model() {r.model_s * 1e3:.1f} ms, "
            f"pad+put {r.pad_put_s * 1e3:.1f} ms, fetch+trim {r.fetch_trim_s * 1e3:.1f} ms)")
    return [Row("rollout", "GRPO rollout, sample() as fit_grpo times it (tokens/s)", r.rollout_tps, "tok/s",
                r.peer_tps, "plain generate (same model, batch, rng)", TARGETS["rollout"], note,
                judged=s is not TOY),  # at toy sizes a step is a few ms: fixed per-call costs, not the aim
            Row("rollout", "rollout + packing + reference log-prob forward (tokens/s)",
                r.full_tps, "tok/s", r.peer_tps, "plain generate",
                note=f"not counted by the target; reference forward {(r.ref_s or 0.0) * 1e3:.1f} ms, packing "
                     f"{r.pack_s * 1e3:.1f} ms per step")]


BENCHES: dict[str, Callable[[Sizes, dict[str, Any]], list[Row]]] = {
    "bounds": bench_bounds, "attention": bench_attention, "train_dense": bench_train_dense, "decode": bench_decode,
    "speculative": bench_speculative, "moe_impl": bench_moe_impl, "train_moe": bench_train_moe, "load": bench_load,
    "rollout": bench_rollout,
}


# -- driver ----------------------------------------------------------------------------------------


class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def alarm(seconds: int) -> Iterator[None]:
    """Raise SectionTimeout after `seconds` (checked between Python steps: a running compile finishes first)."""
    def fire(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"over its {seconds} s budget")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run(sizes: Sizes, sections: list[str], total_s: float) -> list[Row]:
    start = time.perf_counter()
    log = lambda msg: print(f"[benchmarks.gpu {time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)
    ctx: dict[str, Any] = {"sizes": sizes}
    rows: list[Row] = []
    for name in sections:
        left = total_s - (time.perf_counter() - start)
        if left < 10:
            rows.append(Row(name, name, error=f"skipped: the {total_s:.0f} s budget is spent"))
            log(f"{name}: skipped (budget spent)")
            continue
        log(f"{name}: start")
        t0 = time.perf_counter()
        try:
            with alarm(int(min(sizes.section_s, left))):
                new = BENCHES[name](sizes, ctx)
        except Exception as e:  # noqa: BLE001 - a failing section reports its error in its row
            new = [Row(name, name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")]
        for r in new:
            r.note = (r.note + "; " if r.note else "") + f"section {time.perf_counter() - t0:.0f} s"
        rows += new
        log(f"{name}: {'FAILED' if any(r.error for r in new) else 'done'} in {time.perf_counter() - t0:.1f} s")
        gc.collect()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--toy", action="store_true", help="toy sizes (the default off a GPU)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all sections; later ones are skipped")
    a = p.parse_args(argv)
    from tasks.cli import configure_jax

    configure_jax()  # the persistent compilation cache: a rerun (or the next test run) skips the compiles
    toy = a.toy or jax.default_backend() != "gpu"
    sizes = TOY if toy else GPU
    dev = jax.devices()[0]
    print(f"benchmarks.gpu: {'toy' if toy else 'real'} sizes on {len(jax.devices())} x {dev.platform} "
          f"{dev.device_kind!r}; jax {jax.__version__}", flush=True)
    rows = run(sizes, list(a.only or SECTIONS), a.budget)
    print(table(rows), flush=True)
    if a.json:
        a.json.write_text(json.dumps([r.as_json() for r in rows], indent=1))
    failed = sorted({r.section for r in rows if r.error})
    if failed:
        print(f"failed sections: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
