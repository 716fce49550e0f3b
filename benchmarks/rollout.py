"""Rollout-throughput benchmark: GRPO's rollout path vs plain `models.generate` on the same model, prompts and rng.

    python -m benchmarks.rollout [--tiny] [--layers 8] [--vocab-size 8192] [--batch-size 16] [--group-size 8]
                                 [--max-new-tokens 64] [--temperature 1.0] [--top-p 1.0] [--beta 0.04]
                                 [--repeats 5] [--compute-dtype float32] [--json rows.json]
    python -m benchmarks.rollout --store file://./artifacts [--release forgeline-tiny] ...

Target (the GRPO issue): rollout throughput (tokens/s) >= 0.9x our plain `generate` on the same model.

(a) GRPO rollout: the part of a `fit_grpo` step (tasks/training/grpo.py) that produces completions, exactly
    the region fit_grpo times for its own `rollout_tokens_per_s`: `sample(trainer.model(), prompts, ...,
    num_samples=group_size)` (batch_size / group_size prompts picked as fit_grpo picks them, each prefilled
    once and sampled group_size times), at the sampling temperature / top_p, with the step's PRNGKey built
    inside the region as fit_grpo does. That includes the per-step `trainer.model()` merge, the host-side
    right-padding to the one compiled prompt length, the host->device transfer, `models.generate`, the
    device->host transfer and the trimming of each completion to its length.
(b) peer: `models.generate` called directly on the same model (`trainer.model()` taken once) on the
    group-repeated prompts (group_size copies of each, one row per completion: how a user without `num_samples`
    calls it), right-padded and already on the device, the same max_new_tokens, temperature, top_p, rng, eos
    and pad, and `jax.block_until_ready` on its outputs: the fastest way a user calls our engine.

Both paths count tokens the same way: generated tokens actually produced, up to and including each row's
eos (`GenerateOutput.lengths`); the padded slots (B x max_new_tokens) are printed next to them. Both are
compiled before timing (a warm-up step), then timed alternately (the order flips every repeat), each
repeat a new fit_grpo step number (new prompts and rng, the same for both paths); the table gives the
median over repeats and (a)/(b). The two paths must produce identical tokens (same computation, same rng):
the table says whether they did.

Other per-step work of fit_grpo between sampling and the optimizer step is timed as its own rows and not
counted by the target (it is about generation throughput, like with like): the reference model's
log-probability forward over the packed batch (`ref_logps`, only when beta > 0; this GRPO takes one update
per rollout, so there is no old-policy forward: ρ's denominator is the current policy under stop_gradient)
and the host packing (`group_advantages` + `rollout_batch`). The checker's scoring is not timed (it
depends on the checker). Without `--store` the model is a random Llama (`LlamaConfig.small`, 34M
parameters, or `--tiny`) and the prompts random token ids; with `--store` the release's base model and its
data_prep held-out prompts, eos and pad.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from models.generate import generate
from tasks.training import grpo
from tasks.training.config import TrainConfig
from tasks.training.trainer import Trainer

TARGET = 0.9  # (a) / (b), tokens/s


@dataclasses.dataclass
class RolloutResult:
    """Medians over the timed repeats (seconds per fit_grpo step); token counts are per step."""

    batch_size: int
    group_size: int
    max_new_tokens: int
    prompt_len: int
    repeats: int
    tokens: list[int]  # per timed repeat: tokens produced (incl. eos), the same for both paths when identical
    peer_tokens: list[int]
    stopped_at_eos: int  # rows of the timed repeats that ended with eos (the rest ran to max_new_tokens)
    rollout_s: float  # (a)
    peer_s: float  # (b)
    rollout_tps: float
    peer_tps: float
    identical: bool  # (a) and (b) produced the same tokens in every repeat
    ref_s: float | None  # the reference log-prob forward (None: beta = 0)
    pack_s: float  # advantages + rollout_batch
    model_s: float  # trainer.model() alone
    pad_put_s: float  # host padding + host->device alone
    fetch_trim_s: float  # device->host + trimming alone (outputs already computed)
    split_s: float  # nnx.split of the model, which generate does on every call (both paths)
    last_rollout: list[np.ndarray] = dataclasses.field(repr=False)  # the last timed repeat's completions, (a)
    last_peer: list[np.ndarray] = dataclasses.field(repr=False)  # and (b), each trimmed to its length

    @property
    def padded_slots(self) -> int:
        return self.batch_size * self.max_new_tokens

    @property
    def step_tokens(self) -> float:
        """Median tokens produced per step by (a)."""
        return float(statistics.median(self.tokens))

    @property
    def full_tps(self) -> float:
        """(a) with the host packing and the reference forward added to its time (not what the target counts)."""
        return self.step_tokens / (self.rollout_s + (self.ref_s or 0.0) + self.pack_s)

    @property
    def ratio(self) -> float:
        return self.rollout_tps / self.peer_tps if self.peer_tps > 0 else math.nan

    @property
    def met(self) -> bool:
        return math.isfinite(self.ratio) and self.ratio >= TARGET

    def rows(self) -> list[dict[str, Any]]:
        """One dict per table row (what --json writes)."""
        tok = self.step_tokens
        rows = [
            {"path": "(a) GRPO rollout: sample(trainer.model(), ...) as fit_grpo times it", "tokens": tok,
             "seconds": self.rollout_s, "tokens_per_s": self.rollout_tps, "vs_peer": self.ratio, "counted": True},
            {"path": "(b) peer: models.generate, pre-padded device arrays, block_until_ready",
             "tokens": statistics.median(self.peer_tokens), "seconds": self.peer_s, "tokens_per_s": self.peer_tps,
             "vs_peer": 1.0, "counted": True},
        ]
        rows.append({"path": "(a) + host packing" + (" + reference log-prob forward" if self.ref_s else ""),
                     "tokens": tok, "seconds": self.rollout_s + (self.ref_s or 0.0) + self.pack_s,
                     "tokens_per_s": self.full_tps, "vs_peer": self.full_tps / self.peer_tps, "counted": False})
        if self.ref_s is not None:
            rows.append({"path": "reference log-prob forward alone (ref_logps, beta > 0)", "tokens": None,
                         "seconds": self.ref_s, "tokens_per_s": None, "vs_peer": None, "counted": False})
        rows.append({"path": "host: group_advantages + rollout_batch alone", "tokens": None, "seconds": self.pack_s,
                     "tokens_per_s": None, "vs_peer": None, "counted": False})
        return rows

    def table(self) -> str:
        from benchmarks.train import table

        cell = lambda x, f: "" if x is None else f.format(x)
        body = [(r["path"], cell(r["tokens"], "{:.0f}"), f"{self.padded_slots}" if r["tokens"] is not None else "",
                 f"{r['seconds'] * 1e3:.1f}", cell(r["tokens_per_s"], "{:,.1f}"), cell(r["vs_peer"], "{:.3f}"),
                 "yes" if r["counted"] else "no") for r in self.rows()]
        head = ("path", "tokens/step (produced, incl. eos)", "padded slots", "ms/step (median)", "tokens/s",
                "vs (b)", "counted by target")
        verdict = (f"(a)/(b) = {self.ratio:.3f} (aim >= {TARGET}): met {'yes' if self.met else 'no'}; identical "
                   f"tokens (a) vs (b): {'yes' if self.identical else 'NO'}; rows stopped at eos: "
                   f"{self.stopped_at_eos} of {self.batch_size * self.repeats}\n"
                   f"(a) minus (b): {(self.rollout_s - self.peer_s) * 1e3:+.2f} ms/step; measured alone: "
                   f"trainer.model() {self.model_s * 1e3:.2f} ms, host pad + put {self.pad_put_s * 1e3:.2f} ms, "
                   f"fetch + trim {self.fetch_trim_s * 1e3:.2f} ms; in both paths, generate's nnx.split "
                   f"{self.split_s * 1e3:.2f} ms")
        return table(head, body) + "\n" + verdict


def random_prompts(vocab_size: int, n: int, min_len: int, max_len: int, bos: int = 1, seed: int = 0) -> grpo.PromptSet:
    """`n` prompts of bos + random ids in [3, vocab_size), lengths uniform in [min_len, max_len] (bos included)."""
    rng = np.random.default_rng(seed)
    ids = [np.concatenate([[bos], rng.integers(3, vocab_size, int(rng.integers(min_len, max_len + 1)) - 1)])
           .astype(np.int32) for _ in range(n)]
    return grpo.PromptSet(ids, [""] * n)


def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(model: nnx.Module, prompts: grpo.PromptSet, *, batch_size: int = 16, group_size: int = 8,
        max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, eos: int = 2, pad: int = 0,
        beta: float = 0.04, repeats: int = 5, compute_dtype: str = "float32", seed: int = 0) -> RolloutResult:
    """Measure (a) and (b) (module docstring) on `model` (adopted by a GRPO Trainer, as fit_grpo's is) and
    `prompts`. With beta > 0 a copy of the model taken before the Trainer is the reference (finetune's)."""
    if batch_size % group_size:
        raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {group_size}")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    tc = TrainConfig(steps=repeats + 1, batch_size=batch_size, compute_dtype=compute_dtype, seed=seed)
    objective = grpo.grpo_objective(clip_eps=0.2, beta=beta, loss_agg="sequence", temperature=temperature,
                                    width=max_new_tokens)
    trainer = Trainer(model, tc, loss_fn=objective, count_fn=grpo.grpo_count("sequence"))
    reference = trainer.snapshot() if beta > 0 else None  # finetune's
    G, P = group_size, batch_size // group_size
    prompt_len = max(len(p) for p in prompts.ids)  # fit_grpo: over the train and held-out prompts
    seq_len = prompt_len + max_new_tokens
    ref_logps = nnx.jit(lambda m, b: grpo.completion_logps(m, b, grpo.completion_window(b, max_new_tokens)[0],
                                                           temperature))  # fit_grpo's
    peer_model = trainer.model()  # the same model, taken once
    opts = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)

    def step_prompts(step: int) -> list[np.ndarray]:  # fit_grpo's pick for this step
        picks = np.random.default_rng([seed, step]).choice(len(prompts), size=P, replace=len(prompts) < P)
        return [prompts.ids[i] for i in picks for _ in range(G)]

    def step_key(step: int) -> int:
        return seed * 1_000_003 + step

    def bucket(group: list[np.ndarray]) -> int:  # fit_grpo's padded prompt length for this step
        return grpo.length_bucket(max(len(p) for p in group), prompt_len)

    def rollout(step: int, group: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        t = time.perf_counter()  # fit_grpo's timed region, verbatim
        completions = grpo.sample(trainer.model(), group[::G], **opts, rng=jax.random.PRNGKey(step_key(step)),
                                  eos=eos, pad=pad, prompt_len=grpo.length_bucket(max(len(p) for p in group),
                                                                                  prompt_len), num_samples=G)
        return time.perf_counter() - t, completions

    def padded(group: list[np.ndarray]) -> tuple[jax.Array, jax.Array]:  # the same shape as the rollout's
        n = bucket(group)
        ids = np.full((len(group), n), pad, np.int32)
        for i, p in enumerate(group):
            ids[i, : len(p[-n:])] = p[-n:]
        lengths = np.asarray([min(len(p), n) for p in group], np.int32)
        return jax.block_until_ready((jax.device_put(ids), jax.device_put(lengths)))

    def peer(step: int, group: list[np.ndarray]) -> tuple[float, Any]:
        ids, lengths = padded(group)  # prepared before the clock: the peer's inputs are already on the device
        key = jax.block_until_ready(jax.random.PRNGKey(step_key(step)))
        t = time.perf_counter()
        out = generate(peer_model, ids, prompt_lengths=lengths, padding_side="right", **opts, rng=key,
                       eos_token_id=eos, pad_token_id=pad)
        jax.block_until_ready((out.tokens, out.lengths))
        return time.perf_counter() - t, out

    def pack(group: list[np.ndarray], completions: list[np.ndarray]) -> dict[str, np.ndarray]:
        rewards = np.asarray([len(c) % 2 for c in completions], np.float32).reshape(P, G)  # scoring: not timed
        adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards))).reshape(-1)
        return grpo.rollout_batch(group, completions, adv, seq_len=seq_len, pad=pad)

    def ref_forward(batch: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(ref_logps(reference, {k: jnp.asarray(v) for k, v in batch.items()}))

    # warm-up: compile both paths (the same jitted program) at every padded length the timed steps use, and the
    # reference forward
    for group in {bucket(g): g for g in map(step_prompts, range(repeats + 1))}.values():
        rollout(0, group)
        peer(0, group)
    group = step_prompts(0)
    _, completions = rollout(0, group)
    batch = pack(group, completions)
    if reference is not None:
        ref_forward(batch)

    times_a, times_b, times_ref, times_pack, tokens_a, tokens_b = [], [], [], [], [], []
    identical, stopped = True, 0
    for r in range(repeats):
        step = r + 1
        group = step_prompts(step)
        if r % 2 == 0:
            t_a, completions = rollout(step, group)
            t_b, out = peer(step, group)
        else:
            t_b, out = peer(step, group)
            t_a, completions = rollout(step, group)
        toks, n = np.asarray(out.tokens), np.asarray(out.lengths)
        peer_completions = [toks[i, : n[i]] for i in range(len(n))]
        identical &= len(completions) == len(n) and all(
            np.array_equal(c, d) for c, d in zip(completions, peer_completions, strict=True))
        stopped += sum(int(len(c) > 0 and c[-1] == eos) for c in completions)
        times_a.append(t_a)
        times_b.append(t_b)
        tokens_a.append(int(sum(len(c) for c in completions)))
        tokens_b.append(int(n.sum()))
        t = time.perf_counter()
        batch = pack(group, completions)
        times_pack.append(time.perf_counter() - t)
        if reference is not None:
            t = time.perf_counter()
            ref_forward(batch)
            times_ref.append(time.perf_counter() - t)

    # (a)'s extra work over (b), each piece alone; and nnx.split, which generate does in both paths
    group = step_prompts(1)

    def pad_put() -> Any:  # sample's padding and transfer
        ids, lengths = grpo._padded([p[-prompt_len:] for p in group[::G]], pad)
        ids = np.pad(ids, ((0, 0), (0, prompt_len - ids.shape[1])), constant_values=pad)
        return jax.block_until_ready((jnp.asarray(ids), jnp.asarray(lengths)))

    fetch_times = []
    for _ in range(min(repeats, 3)):  # a fresh output each time: np.asarray caches an array's host copy
        _, out = peer(1, group)
        t = time.perf_counter()
        tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
        [tokens[i, : n[i]] for i in range(len(group))]
        fetch_times.append(time.perf_counter() - t)
    model_s = _median_time(trainer.model, max(repeats, 5))
    pad_put_s = _median_time(pad_put, max(repeats, 5))
    split_s = _median_time(lambda: nnx.split(peer_model), max(repeats, 5))

    tps = lambda toks, times: statistics.median(k / t for k, t in zip(toks, times, strict=True))
    return RolloutResult(
        batch_size=batch_size, group_size=group_size, max_new_tokens=max_new_tokens, prompt_len=prompt_len,
        repeats=repeats, tokens=tokens_a, peer_tokens=tokens_b, stopped_at_eos=stopped,
        rollout_s=statistics.median(times_a), peer_s=statistics.median(times_b),
        rollout_tps=tps(tokens_a, times_a), peer_tps=tps(tokens_b, times_b), identical=bool(identical),
        ref_s=statistics.median(times_ref) if times_ref else None, pack_s=statistics.median(times_pack),
        model_s=model_s, pad_put_s=pad_put_s, fetch_trim_s=statistics.median(fetch_times), split_s=split_s,
        last_rollout=completions, last_peer=peer_completions)


def from_store(url: str, release: str) -> tuple[nnx.Module, grpo.PromptSet, int, int, str]:
    """A release's base model, its data_prep held-out prompts, eos and pad, and a label."""
    import storage
    from storage import Store

    st = Store(storage.normalize_url(url))
    bundle = st.read_pointer(f"releases/{release}")
    if bundle is None:
        raise SystemExit(f"benchmarks.rollout: no release {release!r} in {url} (run the release first)")
    lineage = json.loads((st.fetch(bundle) / "lineage.json").read_text())
    base_dir = st.fetch(st.load(st.url(lineage["stages"]["base"]["key"]))) / "model"
    data_dir = st.fetch(st.load(st.url(lineage["stages"]["data"]["key"])))
    special = json.loads((data_dir / "special_tokens.json").read_text())
    model = models.from_pretrained(str(base_dir), dtype=jnp.float32)
    return model, grpo.heldout_prompts(data_dir), special["eos"], special["pad"], f"release {release}'s base model"


def main(argv: list[str] | None = None) -> RolloutResult:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rollout", description=__doc__.splitlines()[0])
    p.add_argument("--store", help="a store URL: use its release's base model and held-out prompts")
    p.add_argument("--release", default="forgeline-tiny")
    p.add_argument("--tiny", action="store_true", help="LlamaConfig.tiny (2 layers, D 64) instead of .small")
    p.add_argument("--layers", type=int, help="decoder layers of the random model (default: the preset's)")
    p.add_argument("--vocab-size", type=int, help="vocabulary of the random model (default: the preset's)")
    p.add_argument("--prompts", type=int, default=64, help="random prompts to pick from")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"),
                   help="random prompt lengths (bos included)")
    p.add_argument("--batch-size", type=int, default=16, help="completions per step (train.batch_size)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.04, help="KL weight; 0: no reference forward row")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    if a.store:
        model, prompts, eos, pad, label = from_store(a.store, a.release)
    else:
        over = {k: v for k, v in (("num_hidden_layers", a.layers), ("vocab_size", a.vocab_size)) if v is not None}
        cfg = (models.LlamaConfig.tiny if a.tiny else models.LlamaConfig.small)(**over)
        model = models.Llama(cfg, rngs=nnx.Rngs(a.seed))
        prompts = random_prompts(cfg.vocab_size, a.prompts, *a.prompt_len, seed=a.seed)
        eos, pad = int(cfg.eos_token_id), 0
        label = f"random Llama d={cfg.hidden_size} L={cfg.num_hidden_layers} V={cfg.vocab_size}"
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"{label} ({n_params / 1e6:.1f}M params, compute {a.compute_dtype}); {len(prompts)} prompts; "
          f"B={a.batch_size} = {a.batch_size // a.group_size} prompts x group {a.group_size}, "
          f"max_new_tokens {a.max_new_tokens}, T={a.temperature:g} top_p={a.top_p:g}, eos {eos}, beta {a.beta:g}; "
          f"jax {jax.__version__} ({jax.default_backend()}); median of {a.repeats} alternating repeats", flush=True)
    r = run(model, prompts, batch_size=a.batch_size, group_size=a.group_size, max_new_tokens=a.max_new_tokens,
            temperature=a.temperature, top_p=a.top_p, eos=eos, pad=pad, beta=a.beta, repeats=a.repeats,
            compute_dtype=a.compute_dtype, seed=a.seed)
    print(f"prompt length (one compiled shape) {r.prompt_len}\n")
    print(r.table())
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    if a.json:
        a.json.write_text(json.dumps({"rows": r.rows(), "ratio": r.ratio, "met": r.met, "identical": r.identical,
                                      "padded_slots": r.padded_slots, "stopped_at_eos": r.stopped_at_eos}, indent=1))
    return r


if __name__ == "__main__":
    main()
