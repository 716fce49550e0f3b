"""MoE layer time vs number of experts and top-k: our grouped dispatch against the dense every-expert
reference, `jax.lax.ragged_dot`, and transformers' Qwen3-MoE block (torch, eager) — all in the same run.

    python -m benchmarks.moe [--quick]

One MoE block (softmax top-k router + E SwiGLU experts of width I) on T tokens of width D, f32.
The claim under test (issue 3): grouped time follows T·k, not E — so the `grouped` column stays
flat across E at fixed k and grows with k, while `dense` grows with E. Every time is the best of a
few calls after warm-up; ratios are what to read (absolute CPU numbers drift).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.run import _best
from models.moe import Experts, MoE, Router


def jax_block(E: int, k: int, D: int, I: int, impl: str):
    moe = MoE(Router(D, E, k, scoring="softmax", norm_topk_prob=True, rngs=nnx.Rngs(0)),
              Experts(E, D, I, impl=impl, rngs=nnx.Rngs(1)))
    graphdef, state = nnx.split(moe)
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    grad = jax.jit(jax.grad(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)))
    return state, fwd, grad


def torch_block(E: int, k: int, D: int, I: int):
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E,
                                      num_experts_per_tok=k, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def time_jax(E: int, k: int, D: int, I: int, impl: str, x: jax.Array, repeats: int) -> tuple[float, float | None]:
    """(forward s, forward+backward s or None for ragged_dot) of one jitted MoE block."""
    state, fwd, grad = jax_block(E, k, D, I, impl)
    t_fwd = _best(lambda: fwd(state, x).block_until_ready(), repeats)
    if impl == "ragged":
        return t_fwd, None
    return t_fwd, _best(lambda: jax.block_until_ready(grad(state, x)), repeats)


def time_torch(E: int, k: int, D: int, I: int, x: np.ndarray, repeats: int) -> tuple[float, float]:
    import torch

    block = torch_block(E, k, D, I)
    tx = torch.tensor(x)[None]
    with torch.no_grad():
        t_fwd = _best(lambda: block(tx), repeats)
    txg = tx.clone().requires_grad_(True)
    return t_fwd, _best(lambda: (block(txg) ** 2).sum().backward(), repeats)


def run(tokens: int, D: int, I: int, experts: tuple[int, ...], topks: tuple[int, ...], repeats: int,
        with_torch: bool) -> list[dict]:
    x = jax.random.normal(jax.random.PRNGKey(0), (tokens, D), jnp.float32)
    rows = []
    for k in topks:
        for E in experts:
            row: dict = {"E": E, "k": k}
            for impl in ("blocked", "dense", "ragged"):
                row[f"{impl}_fwd"], row[f"{impl}_fwdbwd"] = time_jax(E, k, D, I, impl, x, repeats)
            if with_torch:
                row["torch_fwd"], row["torch_fwdbwd"] = time_torch(E, k, D, I, np.asarray(x), repeats)
            rows.append(row)
            print(_fmt_row(row, with_torch), flush=True)
    return rows


HEADER = ("| E | k | grouped fwd ms | grouped fwd+bwd ms | dense fwd ms | dense fwd+bwd ms | ragged_dot fwd ms "
          "| dense/grouped (fwd+bwd) |")


def _fmt_row(r: dict, with_torch: bool) -> str:
    ms = lambda s: f"{s * 1e3:.1f}"
    cells = [str(r["E"]), str(r["k"]), ms(r["blocked_fwd"]), ms(r["blocked_fwdbwd"]), ms(r["dense_fwd"]),
             ms(r["dense_fwdbwd"]), ms(r["ragged_fwd"]), f"{r['dense_fwdbwd'] / r['blocked_fwdbwd']:.2f}"]
    if with_torch:
        cells += [ms(r["torch_fwd"]), ms(r["torch_fwdbwd"]), f"{r['torch_fwdbwd'] / r['blocked_fwdbwd']:.2f}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="T=512, D=128, I=64, k=2 only")
    p.add_argument("--no-torch", action="store_true", help="skip the transformers peer")
    args = p.parse_args(argv)
    if args.quick:
        tokens, D, I, topks, repeats = 512, 128, 64, (2,), 2
    else:
        tokens, D, I, topks, repeats = 2048, 256, 128, (2, 8), 3
    with_torch = not args.no_torch
    print(f"MoE block, T={tokens} tokens, D={D}, I={I}, f32, {jax.devices()[0].platform}")
    header = HEADER + (" transformers fwd ms | transformers fwd+bwd ms | transformers/grouped (fwd+bwd) |"
                       if with_torch else "")
    print(header)
    print("|" + "---|" * header.count(" | ") + ("---|" if header.endswith("|") else ""))
    rows = run(tokens, D, I, (8, 32, 128), topks, repeats, with_torch)
    by = {(r["E"], r["k"]): r for r in rows}
    for k in topks:
        g = [by[(E, k)]["blocked_fwdbwd"] for E in (8, 32, 128)]
        d = [by[(E, k)]["dense_fwdbwd"] for E in (8, 32, 128)]
        print(f"k={k}: grouped fwd+bwd at E=128 / E=8 = {g[2] / g[0]:.2f}x; dense = {d[2] / d[0]:.2f}x")
    if len(topks) > 1:
        for E in (8, 32, 128):
            a, b = by[(E, topks[0])]["blocked_fwdbwd"], by[(E, topks[-1])]["blocked_fwdbwd"]
            print(f"E={E}: grouped fwd+bwd k={topks[-1]} / k={topks[0]} = {b / a:.2f}x")


if __name__ == "__main__":
    main()
