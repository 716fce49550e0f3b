"""Peer-ratio benchmarks: forgeline (JAX) vs transformers + torch, same config, same run, same machine.

    python -m benchmarks.run [--quick]

Prints one table:
- matmul peak: f32 2048^2 matmul GFLOP/s in JAX and in torch (the denominator for "fraction of peak");
- train step: tokens/s of our jitted full fine-tuning step (AdamW, clipping) vs a transformers
  LlamaForCausalLM + torch.optim.AdamW step on the identical config and batch (the peer config: Llama
  d=512, 8 layers, B=8, T=512), and our model FLOPs/s as a fraction of the JAX matmul peak;
- decode: batch-1 greedy tokens/s of our jitted KV-cache loop vs transformers `generate` on the same
  weights (our checkpoint saved with save_pretrained and loaded by transformers).
Only same-run ratios mean anything on these machines (one matmul read 90-223 GFLOP/s at
different moments), so every row is measured here, interleaved, after warm-up.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from tasks.training.config import TrainConfig
from tasks.training.flops import measure_matmul_flops, train_flops_per_token
from tasks.training.trainer import Trainer


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_peak(n: int = 2048, repeats: int = 5) -> tuple[float, float]:
    """(JAX, torch) GFLOP/s of an [n, n] @ [n, n] f32 matmul, measured now (not cached)."""
    import torch

    ta = torch.randn(n, n)
    t_torch = _best(lambda: ta @ ta, repeats)
    return measure_matmul_flops(jnp.float32, n, repeats) / 1e9, 2 * n**3 / t_torch / 1e9


def bench_train(cfg: models.LlamaConfig, batch: int, seq: int, steps: int) -> tuple[float, float]:
    import torch
    import transformers

    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    data = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:],
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
            "segment_ids": np.ones((batch, seq), np.int32), "loss_mask": np.ones((batch, seq), np.int32)}
    trainer = Trainer(models.Llama(cfg, rngs=nnx.Rngs(0)), TrainConfig(steps=1000, batch_size=batch))
    t_ours = _best(lambda: float(trainer.step(data)["loss"]), steps)

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf().items()
                                         if k not in ("architectures", "model_type", "dtype")})
    hf = transformers.LlamaForCausalLM(hf_cfg).float().train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    x = torch.tensor(data["input_ids"], dtype=torch.long)
    y = torch.tensor(data["target_ids"], dtype=torch.long)

    def torch_step():
        opt.zero_grad(set_to_none=True)
        logits = hf(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        return loss.item()

    t_torch = _best(torch_step, steps)
    return batch * seq / t_ours, batch * seq / t_torch


def bench_decode(cfg: models.LlamaConfig, prompt_len: int, new_tokens: int, repeats: int) -> tuple[float, float]:
    import torch
    import transformers

    model = models.Llama(cfg, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(1).integers(3, cfg.vocab_size, (1, prompt_len)).astype(np.int32)

    def ours():
        out = models.generate(model, prompt, prompt_lengths=np.array([prompt_len], np.int32),
                              max_new_tokens=new_tokens, temperature=0.0)
        return np.asarray(out.tokens)

    t_ours = _best(ours, repeats)
    with tempfile.TemporaryDirectory() as tmp:
        models.save_pretrained(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    x = torch.tensor(prompt, dtype=torch.long)

    def theirs():
        with torch.no_grad():
            return hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)

    t_hf = _best(theirs, repeats)
    same = np.array_equal(ours()[0], theirs()[0, prompt_len:].numpy())
    return new_tokens / t_ours, new_tokens / t_hf, same


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller config (d=256, 4 layers, T=256)")
    a = p.parse_args(argv)
    import torch

    if a.quick:
        cfg = models.LlamaConfig.small(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=4, head_dim=64)
        batch, seq, steps = 4, 256, 3
    else:
        cfg = models.LlamaConfig.small()  # d=512, 8 layers, 8 heads of 64, F=1376: the peer config
        batch, seq, steps = 8, 512, 3
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(models.Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    print(f"config: Llama d={cfg.hidden_size} L={cfg.num_hidden_layers} V={cfg.vocab_size} "
          f"({n_params / 1e6:.1f}M params), f32, B={batch} T={seq}; jax {jax.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch threads")
    peak_jax, peak_torch = matmul_peak()
    ours_tps, torch_tps = bench_train(cfg, batch, seq, steps)
    flops = train_flops_per_token(cfg, seq, causal=True)  # MaxText's causal halving
    dec_ours, dec_hf, same = bench_decode(cfg, prompt_len=32, new_tokens=128, repeats=3)
    peak_after, _ = matmul_peak()
    peak = max(peak_jax, peak_after)  # the conservative denominator for "fraction of peak"
    rows = [
        ("matmul f32 2048^2 (GFLOP/s)", f"{peak_jax:.0f} (after: {peak_after:.0f})", f"{peak_torch:.0f}",
         f"{peak_jax / peak_torch:.2f}"),
        ("train step (tokens/s)", f"{ours_tps:.0f}", f"{torch_tps:.0f}", f"{ours_tps / torch_tps:.2f}"),
        ("train step (GFLOP/s model)", f"{ours_tps * flops / 1e9:.0f}", f"{torch_tps * flops / 1e9:.0f}", ""),
        ("train step / JAX matmul peak", f"{ours_tps * flops / 1e9 / peak:.0%}",
         f"{torch_tps * flops / 1e9 / peak_torch:.0%} of torch peak", ""),
        ("decode B=1 greedy (tokens/s)", f"{dec_ours:.0f}", f"{dec_hf:.0f}", f"{dec_ours / dec_hf:.2f}"),
        ("decode tokens identical", str(same), "", ""),
    ]
    w = [max(len(r[i]) for r in rows + [("metric", "forgeline (JAX)", "transformers+torch", "ratio")])
         for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"
    print(line(("metric", "forgeline (JAX)", "transformers+torch", "ratio")))
    print("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for r in rows:
        print(line(r))


if __name__ == "__main__":
    from tasks.host_memory import reexec_tuned

    reexec_tuned()  # the host-memory setting `forgeline` runs under (both sides of the comparison share it)
    main()
