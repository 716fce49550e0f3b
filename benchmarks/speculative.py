"""Speculative-decoding benchmark: every draft candidate of a release vs plain decoding of the same target.

    python -m benchmarks.speculative [--store file://./artifacts] [--release forgeline-tiny]
                                     [--k 3 5] [--temperatures 0 1] [--prompts 16] [--max-new-tokens 64]
                                     [--mlp-width 16384] [--extra-layers 12] [--drafts NAME ...]

Needs a finished release in the store (the README's first command); measures every candidate the
release's draft stage trained (EAGLE-3, P-EAGLE, DFlash; `--drafts` picks some). Both decoders run
the same target at batch 1 on the same held-out prompts (the release's data_prep `prompts.parquet`),
compiled before timing and timed alternately (tasks/evaluate.py `speculative`). Reported per row
(target × draft × temperature × k): mean acceptance length τ (tokens per target verify forward),
per-position acceptance, the wall-clock speedup over plain decoding (tokens/s ratio) and, at T = 0,
losslessness; the draft's kind, objective, parameters and training time head the table.

Each row also carries its bound, measured in the same run: `verify/step` is the time of one target
forward over the verify width (k + 1 tokens; a tree: its node count + 1) over the time of one decode
step, both with a KV cache, jitted, the median ratio of back-to-back pairs; `bound` = τ / (verify/step)
is the speedup a free draft would give. On a GPU a memory-bound target's verify costs about one step
(the weights are read once either way); on a CPU a few-row GEMM runs well below the one-row GEMV's
bandwidth, so the verify alone can cost 1.5x a step there, and that - not the draft - caps the speedup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
import storage
from models.drafts import kind_of, load_draft, target_head
from models.generate import KVCache, generate
from models.speculative import is_block_draft
from storage import Store
from tasks.evaluate import EvalConfig, spec_prompts, speculative
from tasks.layout import draft_candidates
from tasks.stage import read_report


def expand_target(target: nnx.Module, mlp_width: int, extra_layers: int, seed: int = 0) -> nnx.Module:
    """A bigger model computing the same function as `target` (a Llama/Qwen3 dense decoder): see the
    module docstring. Returns a new model; `target` is untouched."""
    c = target.config
    if mlp_width < c.intermediate_size:
        raise ValueError(f"--mlp-width {mlp_width} < the target's intermediate_size {c.intermediate_size}")
    L, F = c.num_hidden_layers, c.intermediate_size
    big_cfg = dataclasses.replace(c, intermediate_size=mlp_width, num_hidden_layers=L + extra_layers)
    big = type(target)(big_cfg, rngs=nnx.Rngs(seed))
    big.embed_tokens.weight.set_value(target.embed_tokens.weight[...])
    big.norm.weight.set_value(target.norm.weight[...])
    if target.lm_head is not None:
        big.lm_head.kernel.set_value(target.lm_head.kernel[...])
    for i, layer in enumerate(big.layers):
        mlp, attn = layer.mlp, layer.self_attn
        if i < L:  # an original layer: its weights, with the MLP padded by units that output zero
            src = target.layers[i]
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, name).weight.set_value(getattr(src, name).weight[...])
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(attn, name).kernel.set_value(getattr(src.self_attn, name).kernel[...])
            for name in ("gate_proj", "up_proj"):  # [D, F'] : the first F columns are the original units
                getattr(mlp, name).kernel.set_value(getattr(mlp, name).kernel[...].at[:, :F].set(
                    getattr(src.mlp, name).kernel[...]))
            down = jnp.zeros_like(mlp.down_proj.kernel[...]).at[:F].set(src.mlp.down_proj.kernel[...])  # [F', D]
        else:  # an appended layer: random reads, zero writes to the residual stream
            attn.o_proj.kernel.set_value(jnp.zeros_like(attn.o_proj.kernel[...]))
            down = jnp.zeros_like(mlp.down_proj.kernel[...])
        mlp.down_proj.kernel.set_value(down)
    return big


def verify_cost(model: nnx.Module, width: int, context: int, pairs: int = 21) -> float:
    """Time of one forward over `width` new tokens / one forward over 1 new token, each at a KV cache
    already holding `context` positions (batch 1, jitted): the median of `pairs` back-to-back pairs, so
    drifts in the machine's speed cancel."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, positions, cache):  # ids, positions [1, W]
        logits, cache = nnx.merge(graphdef, state)(ids, positions=positions, cache=cache)
        return logits, cache

    def call(w: int):
        cache = KVCache.init(model.config, 1, context + width + 1, model.dtype).rollback(jnp.array([context]))
        ids, positions = jnp.zeros((1, w), jnp.int32), context + jnp.arange(w, dtype=jnp.int32)[None]
        jax.block_until_ready(forward(state, ids, positions, cache))  # compile, warm

        def timed() -> float:
            t0 = time.perf_counter()
            jax.block_until_ready(forward(state, ids, positions, cache))
            return time.perf_counter() - t0
        return timed

    wide, one = call(width), call(1)
    return float(np.median([wide() / one() for _ in range(pairs)]))


def _params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=os.environ.get("FORGELINE_STORE", "file://./artifacts"))
    ap.add_argument("--release", default="forgeline-tiny")
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--mlp-width", type=int, default=16384)
    ap.add_argument("--extra-layers", type=int, default=12)
    ap.add_argument("--targets", nargs="+", default=["release", "memory-bound"], choices=["release", "memory-bound"])
    ap.add_argument("--drafts", nargs="*",
                    help="candidate names (default: every candidate of the release's draft stage)")
    ap.add_argument("--no-tree", action="store_true", help="skip the EAGLE-2 tree rows")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--bundle", type=Path, help="a release bundle folder instead of the store's release pointer")
    ap.add_argument("--data", type=Path, help="with --bundle: the data_prep folder holding prompts.parquet")
    ap.add_argument("--draft-artifact", type=Path, help="with --bundle: a draft stage output (all candidates)")
    a = ap.parse_args(argv)

    if a.bundle is not None:
        bundle_dir, data_dir = a.bundle, a.data
        if data_dir is None:
            raise SystemExit("benchmarks.speculative: --bundle needs --data (the folder with prompts.parquet)")
        drafts_at = a.draft_artifact or bundle_dir
    else:
        st = Store(storage.normalize_url(a.store))
        bundle = st.read_pointer(f"releases/{a.release}")
        if bundle is None:
            raise SystemExit(f"benchmarks.speculative: no release {a.release!r} in {a.store} (run the release first)")
        bundle_dir = st.fetch(bundle)
        lineage = json.loads((bundle_dir / "lineage.json").read_text())
        data_dir = st.fetch(st.load(st.url(lineage["stages"]["data"]["key"])))
        drafts_at = st.fetch(st.load(st.url(lineage["stages"]["draft"]["key"])))
    target = models.from_pretrained(str(bundle_dir / "model"))
    eos = json.loads((bundle_dir / "model" / "config.json").read_text()).get("eos_token_id")
    found = draft_candidates(drafts_at)
    names = a.drafts or list(found)
    drafts = {n: load_draft(found[n], target.embed_tokens.weight[...], target_head(target)) for n in names}
    meta = {n: read_report(lambda f, d=found[n]: (d / f).read_bytes(), "draft_config.json")
            if (found[n] / "draft_config.json").exists() else {} for n in names}

    big = expand_target(target, a.mlp_width, a.extra_layers) if "memory-bound" in a.targets else None
    cfg0 = EvalConfig(spec_prompts=a.prompts, spec_max_new_tokens=a.max_new_tokens, spec_tree=False)
    prompts = spec_prompts(data_dir, cfg0)
    line = f"release target: {_params(target) / 1e6:.1f}M params"
    if big is not None:
        same = all(np.array_equal(
            np.asarray(generate(target, p, max_new_tokens=a.max_new_tokens, eos_token_id=eos).tokens),
            np.asarray(generate(big, p, max_new_tokens=a.max_new_tokens, eos_token_id=eos).tokens))
            for p in prompts[:4])
        line += (f"; memory-bound target: {_params(big) / 1e6:.1f}M params ({4 * _params(big) / 2**20:.0f} MiB fp32), "
                 f"same greedy output on 4 prompts: {same}")
    print(line)
    for n, d in drafts.items():
        m = meta[n]
        print(f"draft {n}: {kind_of(d)}, {_params(d) / 1e6:.2f}M params, objective {m.get('objective', '?')} at "
              f"T={m.get('train_temperature', '?')}, trained {m.get('train_seconds', '?')} s, selected step "
              f"{m.get('selected_step', 'last')}")
    print(f"jax {jax.__version__} ({jax.default_backend()}), {len(prompts)} held-out prompts, {a.max_new_tokens} "
          f"new tokens, batch 1; speedup = speculative tok/s / plain greedy-or-sampled tok/s of the same target\n")

    rows = []
    header = ("| target | draft | kind | objective | mode | T | k | τ | per-position acceptance | plain tok/s "
              "| spec tok/s | speedup | verify/step | bound | lossless |")
    print(header + "\n" + "|---" * 15 + "|")
    context = max(len(p[0]) for p in prompts) + a.max_new_tokens // 2  # a typical cache length mid-decode
    ratios: dict[tuple[str, int], float] = {}
    targets = ([("release", target)] if "release" in a.targets else []) + \
        ([("memory-bound", big)] if big is not None else [])
    for tname, model in targets:
        for n, d in drafts.items():
            runs = [(k, t, "chain") for k in a.k for t in a.temperatures if k <= getattr(d, "max_block", k)]
            if not a.no_tree and not is_block_draft(d):
                runs.append((max(a.k), 0.0, "tree"))
            for k, t, mode in runs:
                cfg = cfg0.model_copy(update={"spec_k": k, "tree_depth": k})
                t0 = time.perf_counter()
                r = speculative(model, d, prompts, cfg, eos, temperature=t, mode=mode)
                width = cfg.tree_tokens + 1 if mode == "tree" else k + 1
                if (tname, width) not in ratios:
                    ratios[tname, width] = verify_cost(model, width, context)
                r["verify_cost_ratio"] = ratios[tname, width]
                r["speedup_bound"] = r["acceptance_length"] / ratios[tname, width]
                r |= {"target": tname, "draft": n, "kind": kind_of(d), "objective": meta[n].get("objective"),
                      "draft_params": _params(d), "train_seconds": meta[n].get("train_seconds"),
                      "seconds": round(time.perf_counter() - t0, 1)}
                rows.append(r)
                label = "parallel" if is_block_draft(d) and mode == "chain" else mode
                print(f"| {tname} | {n} | {kind_of(d)} | {meta[n].get('objective', '?')} | {label} | {t:g} | {k} "
                      f"| {r['acceptance_length']:.2f} | {' '.join(f'{x:.2f}' for x in r['per_position_acceptance'])} "
                      f"| {r['plain_tokens_per_s']:.1f} | {r['speculative_tokens_per_s']:.1f} | {r['speedup']:.2f}x "
                      f"| {r['verify_cost_ratio']:.2f} | {r['speedup_bound']:.2f}x | {r.get('lossless', 'n/a')} |",
                      flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
