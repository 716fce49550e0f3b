"""MoE calibration statistics vs the number of experts, at fixed routed tokens: the expert-chunked, segment-sum
statistics of models/quant/calibration.py ("after") against the per-expert masked `jax.lax.map` they
replaced ("before", a faithful copy kept in this file) — both in the same run.

    python -m benchmarks.calibration [--quick] [--chunk 8]

One Qwen3-MoE decoder layer (D 256, experts of width I 128, top-k 4) on T = 1024 tokens, f32, so
R = T·k = 4096 routed rows for every E in {8, 16, 32, 64, 128}. Each case runs in a fresh subprocess and
measures the statistics of that layer's inputs as quantization needs them, all experts' Hessians included:

  before   the old `_layer_stats` (every expert a masked xᵀx over all R rows: E·R·in² work) returning
           [E, in, in] per expert stack, then float64 host copies of all of them (the old `collect_stats`)
  after    `collect_stats` (one forward per batch: segment sums, the pooled H, the routed rows to the host)
           and every expert's Hessian built chunk by chunk (`ExpertStats.chunks(--chunk)`) and dropped,
           as the driver consumes them (GPTQ itself is not timed: it is the same in both)

Columns: `time` the best of 3 warm runs (compile excluded), `compile` the first run minus that; `XLA layer`
the compiled layer program's temp + output bytes (`jax.jit(...).lower(...).compile().memory_analysis()`):
the forward's own buffers, the same in both, plus before: all [E, in, in] Hessians, after: the segment
sums, the pooled H and the routed rows; `XLA chunk` (after only) the chunk Gram program's argument + temp
+ output bytes at its largest chunk (the chunk's rows and chunk × in² floats); `RSS growth` the process'
peak resident memory (`VmHWM` in /proc/self/status, reset through /proc/self/clear_refs after the warm-up)
over its resident memory just before a warm run of the statistics: host and (on CPU) device memory
together; `H held` the expert-Hessian bytes each holds at once, computed from the shapes (before: both
stacks' [E, in, in] float32 plus float64 host copies; after: one chunk's, float32, device and host),
also printed at DeepSeek-V3 width. The claim under test: `after` time stays about flat in E (work ∝
R·in²) while `before` grows with E, and `after` holds chunk × in² Hessians, not E × in². Absolute CPU
numbers drift between runs; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

EXPERTS = (8, 16, 32, 64, 128)


# ------------------------------------------------------------------------------------------------
# "before": the statistics as models/quant/calibration.py computed them until the chunked version
# (a faithful copy, kept here as the baseline; not used anywhere else)
# ------------------------------------------------------------------------------------------------


def _old_functions() -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models.quant.calibration import Stats, _layer_context, _moments, _set_calibrating
    from models.quant.targets import _module

    @nnx.jit(static_argnames=("i",))
    def old_layer_stats(model: nnx.Module, x: jax.Array, seg: jax.Array, i: int) -> dict[str, tuple]:
        """BEFORE (baseline copy): per-expert moments by a `lax.map` over E of masked products over all R rows."""
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
                    jax.lax.map(per_expert, jnp.arange(E))  # ([E, in, in], [E, in], [E])
        return out

    def old_collect_stats(model, xs, segs, i, units) -> dict[str, Stats]:
        """BEFORE (baseline copy): all experts' Hessians, as float64 host copies."""
        _set_calibrating(units, True)
        try:
            total: dict[str, Stats] = {}
            for x, seg in zip(xs, segs, strict=True):
                for rel, (H, a, n) in old_layer_stats(model, x, seg, i).items():
                    key = f"model.layers.{i}.{rel}"
                    st = Stats(np.asarray(H, np.float64), np.asarray(a, np.float64), np.asarray(n, np.float64))
                    total[key] = total[key] + st if key in total else st
            return total
        finally:
            _set_calibrating(units, False)

    return old_layer_stats, old_collect_stats


# ------------------------------------------------------------------------------------------------
# One case (runs in a fresh subprocess)
# ------------------------------------------------------------------------------------------------


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got["VmRSS"], got["VmHWM"]


def _reset_hwm() -> None:
    """Give freed heap pages back (glibc malloc_trim) and reset VmHWM to the current RSS (Linux: 5 >
    /proc/self/clear_refs), so the next peak is the next run's own."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _xla_bytes(compiled: Any, with_args: bool = False) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes + (m.argument_size_in_bytes if with_args else 0))


def run_case(method: str, E: int, tokens: int, D: int, I: int, k: int, chunk: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models import quant, qwen3_moe
    from models.quant import calibration

    jax.config.update("jax_default_matmul_precision", "highest")
    cfg_cls, model_cls = qwen3_moe.FAMILY
    cfg = cfg_cls.tiny(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                       num_hidden_layers=1, mlp_only_layers=(), num_attention_heads=4, num_key_value_heads=2,
                       head_dim=D // 4)
    model = model_cls(cfg, rngs=nnx.Rngs(0))
    units = [u for u in quant.quant_units(model) if u.layer == 0]
    B = 4
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, tokens // B)).astype(np.int32)
    xs, segs = [model.embed_tokens(jnp.asarray(ids))], [jnp.ones((B, tokens // B), jnp.int32)]
    old_layer_stats, old_collect_stats = _old_functions()

    def before() -> None:
        old_collect_stats(model, xs, segs, 0, units)

    def after() -> None:
        for st in calibration.collect_stats(model, xs, segs, 0, units, expert_chunk=chunk).values():
            if isinstance(st, calibration.ExpertStats):
                for _ in st.chunks():  # each chunk's Hessians, dropped before the next (as the driver does)
                    pass

    fn = before if method == "before" else after
    first = _timed(fn)  # compiles
    best = min(_timed(fn) for _ in range(3))
    _reset_hwm()  # the peak of a warm run: not the compiler's
    rss0, _ = _rss()
    fn()
    _, hwm = _rss()
    # the compiled programs' own account of their buffers
    chunk_bytes = 0
    calibration._set_calibrating(units, True)
    try:
        if method == "before":
            xla = _xla_bytes(old_layer_stats.lower(model, xs[0], segs[0], i=0).compile())
        else:
            xla = _xla_bytes(calibration._layer_stats.lower(model, xs[0], segs[0], i=0).compile())
            for key in ("gate_up", "down_proj"):
                st = calibration.collect_stats(model, xs, segs, 0, units, expert_chunk=chunk)[
                    f"model.layers.0.mlp.experts.{key}"]
                sizes = np.asarray(st.n, np.int64)
                blocks = int(max(-(-sizes[c:c + chunk] // st.block).sum() for c in range(0, E, chunk)))
                nb = calibration._bucket(max(blocks, 1))
                args = (jax.ShapeDtypeStruct((nb, st.block, st.in_features), jnp.float32),
                        jax.ShapeDtypeStruct((nb,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
                chunk_bytes = max(chunk_bytes, _xla_bytes(
                    calibration._grouped_gram.lower(*args, experts=min(chunk, E)).compile(), with_args=True))
    finally:
        calibration._set_calibrating(units, False)
    return {"method": method, "E": E, "time": best, "compile": max(first - best, 0.0), "xla_bytes": xla,
            "xla_chunk_bytes": chunk_bytes, "rss_growth": max(hwm - rss0, 0)}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _subprocess(method: str, E: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.calibration", "--case", method, str(E), "--tokens", str(args.tokens),
           "--chunk", str(args.chunk)]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if p.returncode != 0:
        raise SystemExit(f"benchmarks.calibration: case {method} E={E} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _mb(b: float) -> str:
    return f"{b / 2**20:.1f}"


def held_before(E: int, D: int, I: int) -> int:
    """Bytes of expert Hessians the old statistics held at once (computed): both stacks' [E, in, in] float32
    from the device and their float64 host copies."""
    return E * (D * D + I * I) * (4 + 8)


def held_after(E: int, D: int, I: int, chunk: int) -> int:
    """Bytes of expert Hessians the chunked statistics hold at once (computed): one chunk of one stack,
    float32, on the device and its host copy."""
    return min(chunk, E) * max(D, I) ** 2 * (4 + 4)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="E in {8, 32} and T = 512 only")
    p.add_argument("--chunk", type=int, default=8, help="experts per Hessian chunk (calibration.expert_chunk)")
    p.add_argument("--tokens", type=int, default=None, help="calibration tokens T (default 1024; --quick 512)")
    p.add_argument("--case", nargs=2, metavar=("METHOD", "E"), help=argparse.SUPPRESS)  # one case, in a child
    args = p.parse_args(argv)
    args.tokens = args.tokens or (512 if args.quick else 1024)
    D, I, k = 256, 128, 4
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.tokens, D, I, k, args.chunk)))
        return
    experts = (8, 32) if args.quick else EXPERTS
    print(f"MoE calibration statistics, T={args.tokens} tokens, k={k} (R={args.tokens * k} routed rows), D={D}, "
          f"I={I}, f32, expert_chunk={args.chunk}, one fresh process per case")
    print("| E | before time (s) | after time (s) | speed-up | before compile (s) | after compile (s) | "
          "before XLA layer (MB) | after XLA layer (MB) | after XLA chunk (MB) | before RSS growth (MB) | "
          "after RSS growth (MB) | before H held (MB) | after H held (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for E in experts:
        b, a = _subprocess("before", E, args), _subprocess("after", E, args)
        print(f"| {E} | {b['time']:.3f} | {a['time']:.3f} | {b['time'] / a['time']:.1f}x | {b['compile']:.2f} | "
              f"{a['compile']:.2f} | {_mb(b['xla_bytes'])} | {_mb(a['xla_bytes'])} | {_mb(a['xla_chunk_bytes'])} | "
              f"{_mb(b['rss_growth'])} | {_mb(a['rss_growth'])} | {_mb(held_before(E, D, I))} | "
              f"{_mb(held_after(E, D, I, args.chunk))} |", flush=True)
    print(f"\nAt DeepSeek-V3 width (E 256, D 7168, I 2048), computed the same way: before "
          f"{held_before(256, 7168, 2048) / 2**30:.0f} GiB of Hessians held per layer, after "
          f"{held_after(256, 7168, 2048, args.chunk) / 2**30:.1f} GiB (expert_chunk {args.chunk}).")


if __name__ == "__main__":
    main()
