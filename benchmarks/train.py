"""Training-step benchmark: our jitted train step vs transformers + torch, and LoRA vs full fine-tuning.

    python -m benchmarks.train [--quick]

Prints two tables, every number measured in this run on this machine (only same-run ratios
mean anything here):
1. full fine-tuning of a dense Llama (d=512, 4 layers, 8 heads of 64, V=8192, fp32, B=8, T=256):
   tokens/s of tasks.training.trainer.Trainer's step vs a transformers LlamaForCausalLM + torch AdamW step on the
   same config and batch (benchmarks.run.bench_train), and MFU = tokens/s × model FLOPs per token
   (tasks.training.flops.train_flops_per_token, PaLM appendix B) ÷ this machine's jitted f32 matmul peak
   (tasks.training.flops.measure_matmul_flops, measured here);
2. ours, LoRA (r=16 on every attention and MLP projection) vs full: tokens/s, MFU (LoRA counts 4 FLOPs
   per frozen weight and 6 per adapter weight, see train_flops_per_token), trainable parameters, the
   bytes of trainable parameters + optimizer state (Trainer.state()), and XLA's compiled memory
   estimate for the step (Trainer.compile(): arguments + temporaries).
Each throughput is the best over interleaved rounds (2 by default) of best-of-3 step times, and the MFU
denominator the best of the matmul readings taken between them; about 3-4 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from benchmarks.run import _best, bench_train, matmul_peak
from tasks.training.config import TrainConfig
from tasks.training.flops import matmul_params_per_token, measure_matmul_flops, train_flops_per_token
from tasks.training.trainer import Trainer

LORA_RANK, LORA_ALPHA = 16, 32


def make_batch(vocab_size: int, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One packed batch: B rows of T random tokens, one segment each, loss on every target; each [B, T] int32."""
    ids = np.random.default_rng(seed).integers(3, vocab_size, (batch, seq + 1)).astype(np.int32)  # [B, T+1]
    ones = np.ones((batch, seq), np.int32)
    return {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:],
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
            "segment_ids": ones, "loss_mask": ones.copy()}


class Ours:
    """Our trainer for one variant (full or LoRA), built and compiled once, then timed in several rounds."""

    def __init__(self, cfg: models.LlamaConfig, batch: int, seq: int, lora: bool):
        model = models.Llama(cfg, rngs=nnx.Rngs(0))
        if lora:
            models.apply_lora(model, rank=LORA_RANK, alpha=LORA_ALPHA, rngs=nnx.Rngs(1))
        trainable = nnx.LoRAParam if lora else nnx.Param
        self.trainable_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable)))
        self.trainer = Trainer(model, TrainConfig(steps=1000, batch_size=batch), trainable=trainable)
        self.adapter_params = self.trainer.adapter_params_per_token()
        self.data, self.tokens = self.trainer.put(make_batch(cfg.vocab_size, batch, seq)), batch * seq
        t = time.perf_counter()
        est = self.trainer.compile(self.data)  # per-device bytes from the compiled step
        self.compile_s = time.perf_counter() - t
        self.xla_temp_bytes, self.xla_total_bytes = est["temp"], est["total"]
        self.state_bytes = est["params"] + est["optimizer"]
        self.tokens_per_s = 0.0

    def time(self, steps: int) -> None:
        """Best-of-`steps` step time of this round; keeps the best tokens/s over rounds."""
        t = _best(lambda: float(self.trainer.step(self.data)["loss"]), steps)
        self.tokens_per_s = max(self.tokens_per_s, self.tokens / t)


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    w = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (x + 2) for x in w) + "|", *map(line, rows)])


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or not b else f"{a / b:.3f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 layers, B=4, T=128, 2 timed steps (about a minute)")
    a = p.parse_args(argv)
    import torch

    if a.quick:
        cfg = models.LlamaConfig.small(num_hidden_layers=2)
        batch, seq, steps, rounds = 4, 128, 2, 1
    else:
        cfg = models.LlamaConfig.small(num_hidden_layers=4)
        batch, seq, steps, rounds = 8, 256, 3, 2
    t_start = time.perf_counter()
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(models.Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    print(f"config: Llama d={cfg.hidden_size} L={cfg.num_hidden_layers} H={cfg.num_attention_heads}x{cfg.head_dim} "
          f"F={cfg.intermediate_size} V={cfg.vocab_size} ({n_params / 1e6:.1f}M params, "
          f"{matmul_params_per_token(cfg) / 1e6:.1f}M matmul params per token), f32, B={batch} T={seq}; "
          f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
          flush=True)

    # Other work shares these machines: every number is the best over interleaved rounds, so that a
    # disturbed moment costs one sample, not one variant.
    peaks = [measure_matmul_flops(jnp.float32)]  # GFLOP/s below; measured now (not training's cached reading)
    full, lora = Ours(cfg, batch, seq, lora=False), Ours(cfg, batch, seq, lora=True)
    ours_tps = torch_tps = peak_torch = 0.0
    for _ in range(rounds):
        o, t = bench_train(cfg, batch, seq, steps)  # ours (full) next to transformers + torch, same batch
        ours_tps, torch_tps = max(ours_tps, o), max(torch_tps, t)
        full.time(steps)
        lora.time(steps)
        pj, pt = matmul_peak()
        peaks.append(pj * 1e9)
        peak_torch = max(peak_torch, pt)
    peak = max(peaks)  # the least disturbed reading: the conservative MFU denominator

    flops_full = train_flops_per_token(cfg, seq)
    flops_lora = train_flops_per_token(cfg, seq, trainable_only=True, adapter_params=lora.adapter_params)
    mfu = lambda tps, flops: f"{tps * flops / peak:.1%}"
    print(f"\nmatmul f32 2048^2: JAX {peak / 1e9:.0f} GFLOP/s (the MFU denominator; readings "
          f"{', '.join(f'{x / 1e9:.0f}' for x in peaks)}), torch {peak_torch:.0f} GFLOP/s. Model FLOPs per token: "
          f"full {flops_full / 1e6:.1f}M, LoRA {flops_lora / 1e6:.1f}M (PaLM, non-causal attention)\n")
    print(table(("full fine-tuning step", "forgeline (JAX)", "transformers+torch", "ours/torch"), [
        ("tokens/s", f"{ours_tps:.0f}", f"{torch_tps:.0f}", f"{ours_tps / torch_tps:.2f}"),
        ("MFU (vs the JAX matmul peak)", mfu(ours_tps, flops_full), mfu(torch_tps, flops_full), ""),
    ]))
    print()
    print(table(("ours", "tokens/s", "MFU", "trainable params", "params+opt state MiB", "XLA temp MiB",
                 "XLA total MiB", "compile s"), [
        (name, f"{r.tokens_per_s:.0f}", mfu(r.tokens_per_s, f), f"{r.trainable_params / 1e6:.2f}M",
         mib(r.state_bytes), mib(r.xla_temp_bytes), mib(r.xla_total_bytes), f"{r.compile_s:.1f}")
        for name, r, f in (("full", full, flops_full), (f"LoRA r={LORA_RANK}", lora, flops_lora))
    ] + [("LoRA/full", f"{lora.tokens_per_s / full.tokens_per_s:.2f}", "", "",
          f"{lora.state_bytes / full.state_bytes:.3f}", f"{ratio(lora.xla_temp_bytes, full.xla_temp_bytes)}",
          f"{ratio(lora.xla_total_bytes, full.xla_total_bytes)}", "")]))
    print(f"\nXLA total = params + optimizer state + frozen weights + temporaries (Trainer.compile's per-device "
          f"estimate). Full-step tokens/s next to LoRA: {full.tokens_per_s:.0f}; best of {rounds} rounds x "
          f"{steps} steps; {time.perf_counter() - t_start:.0f} s in all; load average now {os.getloadavg()[0]:.1f} "
          f"(above {os.cpu_count()}: other work shared the CPUs and every number is noisier).")


if __name__ == "__main__":
    main()
