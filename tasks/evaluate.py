"""Stage `evaluate`: held-out quality of every model in the release, and the gates export obeys.

    python -m tasks.evaluate --finetune DIR --data DIR [--base DIR --quant DIR --draft DIR] --out DIR

(each DIR an artifact folder of that stage: `--quant` the quantize stage's output, a folder per scheme)

Measured in one run, on the same held-out rows and prompts:
- perplexity of the base, the fine-tuned model and each quantized variant (masked next-token loss
  over data_prep's valid split -- for instruction data, the answer tokens only);
- per quantized scheme: token-level KL(fine-tuned || quantized) and top-1 agreement over the same
  positions, and the decoder weight bytes relative to float32; its KV cache (fp8 with calibrated scales, or the
  serving dtype) and the cache's bytes per token vs bf16 (our forward applies an FP8 KV cache, so its effect is
  in every number);
- on preference data (chosen/rejected pairs, tasks/training/preference.py), over the held-out pairs: the
  base's and the fine-tuned model's own preference for the chosen answers, and the fine-tuned model's
  implicit reward against the base (gate `min_preference_accuracy`);
- task accuracy: for every registered checker (tasks/checkers/) that judges some of the data's prompts (the
  held-out ones; the train split's, said so, when it judges none held out), pass@1 greedy and at
  `serve_temperature` of the base, the fine-tuned model and each quantized variant, and the data's own
  answers' score as the ceiling (gates `min_task_accuracy`, `max_task_accuracy_drop`);
- every draft candidate of the draft artifact (EAGLE-3, P-EAGLE, DFlash; and, for DeepSeek-V3/V3.2, GLM-4.5/GLM-5
  targets, the target's own MTP head): speculative decoding vs plain decoding of the served target (the
  fine-tuned model or the quantized variant named by `spec_target`), at the same batch size, on held-out
  prompts, at every `spec_temperatures` (`spec_k` draft tokens per verify: chained, or in one forward
  for a block draft) and with EAGLE-2 dynamic-tree drafting at temperature 0 (chain drafts): mean
  acceptance length τ (tokens emitted per target verify forward), per-position acceptance, wall-clock
  speedup (tokens/s ratio; both decoders compiled before timing and timed alternately) and, at
  temperature 0, losslessness (the outputs must equal greedy decoding). `draft` in the report is the
  candidate the release ships: the fastest at `serve_temperature` that passes the draft gates.
Output: `report.json` (what was measured about the models: deterministic), `timing.json` (wall-clock
numbers: speedups, tokens/s, quantize seconds) and `report.md` (both, for people; `load_report` merges
the two JSON files back). Gates are evaluated and recorded; the export stage refuses to publish a
release whose gates failed.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pyarrow.parquet as pq
from flax import nnx
from tokenizers import Tokenizer

import models
from models import quant
from models.draft_format import folder_kind
from models.drafts import load_draft, target_head
from models.generate import generate, jit_forward
from models.speculative import MTPDraft, is_block_draft, speculative_generate, tree_unsupported
from tasks import checkers
from tasks.cli import stage_cli
from tasks.configs import EvalConfig, Gates
from tasks.data.rows import documents_from_rows
from tasks.eval_report import markdown
from tasks.layout import draft_candidates, model_dir
from tasks.stage import StageContext, read_report, write_report
from tasks.training import grpo
from tasks.training import preference as pm
from tasks.training.config import Progress
from tasks.training.data import PackedBatches
from tasks.training.grpo import PromptSet

log = logging.getLogger("forgeline.evaluate")


# -- quality ---------------------------------------------------------------------------------------


def _logits_fn(model: nnx.Module):
    """The model's jitted logits on a packed batch ([B, T, V]). `jit_forward` keeps one program per architecture
    and shape: the base and the fine-tuned model (one graph, other weights) share its compile."""
    forward = jit_forward(model)
    return lambda batch: forward(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])


def _batches(data_dir: Path, cfg: EvalConfig) -> list[dict[str, np.ndarray]]:
    valid = PackedBatches(data_dir, "valid", cfg.batch_size, shuffle=False)
    n = min(cfg.eval_batches, math.ceil(valid.total / cfg.batch_size))
    return [valid.batch(i) for i in range(n)]


def perplexity(model: nnx.Module, batches: list[dict[str, np.ndarray]]) -> float:
    f = _logits_fn(model)
    total, count = 0.0, 0.0
    for b in batches:
        logits = f(b).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["target_ids"])
        mask = b["loss_mask"].astype(np.float32)
        total += float((ce * mask).sum())
        count += float(mask.sum())
    return math.exp(total / max(count, 1.0))


def agreement(reference: nnx.Module, other: nnx.Module, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """`other`'s perplexity, and token-level KL(reference || other) over the loss positions - its mean, 99th
    percentile and maximum (a mean can hide the few tokens whose answers change) - and top-1 agreement with its
    complement, the flip rate: the share of positions whose greedy token differs (Dutta et al. 2024, "Accuracy
    is not all you need", arXiv:2407.09141). One compiled program per batch runs both models and reduces their
    [B, T, V] logits to per-position numbers: each model's logits serve its perplexity too (`perplexity` and
    `reference_perplexity`: a separate perplexity pass ran a forward a second time), and the [B, T, V]
    intermediates never leave the program."""
    ref_def, ref_state = nnx.split(reference)
    other_def, other_state = nnx.split(other)

    @jax.jit
    def scores(ref_state, other_state, batch):  # -> ce, reference ce, kl, flip: [B, T] each
        def logits(graphdef, state):
            m = nnx.merge(graphdef, state)
            return m(batch["input_ids"], positions=batch["positions"],
                     segment_ids=batch["segment_ids"]).astype(jnp.float32)  # [B, T, V]

        lp = jax.nn.log_softmax(logits(ref_def, ref_state), -1)
        zq = logits(other_def, other_state)
        lq = jax.nn.log_softmax(zq, -1)
        ce = optax.softmax_cross_entropy_with_integer_labels(zq, batch["target_ids"])
        ref_ce = -jnp.take_along_axis(lp, batch["target_ids"][..., None], axis=-1)[..., 0]
        kl = (jnp.exp(lp) * (lp - lq)).sum(-1)
        return ce, ref_ce, kl, lp.argmax(-1) != lq.argmax(-1)

    kls, flips = [], []
    total, ref_total, count = 0.0, 0.0, 0.0
    for b in batches:
        ce, ref_ce, kl, flip = scores(ref_state, other_state, b)
        mask = np.asarray(b["loss_mask"]) > 0  # [B, T]
        total += float((ce * b["loss_mask"].astype(np.float32)).sum())
        ref_total += float((ref_ce * b["loss_mask"].astype(np.float32)).sum())
        count += float(mask.sum())
        kls.append(np.asarray(kl)[mask])
        flips.append(np.asarray(flip)[mask])
    kl, flip = np.concatenate(kls), np.concatenate(flips)
    if kl.size == 0:
        raise ValueError("evaluate: no loss positions in the held-out batches")
    flip_rate = float(flip.mean())
    return {"perplexity": math.exp(total / count), "reference_perplexity": math.exp(ref_total / count),
            "kl": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "top1_agreement": 1.0 - flip_rate, "top1_flip_rate": flip_rate, "positions": int(kl.size)}


# -- speculative decoding --------------------------------------------------------------------------


def spec_prompts(data_dir: Path, cfg: EvalConfig) -> list[np.ndarray]:
    """Held-out prompts cut to one length (one compiled shape): the first `spec_prompt_len` tokens of
    prompt + reference."""
    table = pq.read_table(data_dir / "prompts.parquet", columns=["prompt_ids", "reference_ids"])
    out = []
    for p, r in zip(table.column("prompt_ids").to_pylist(), table.column("reference_ids").to_pylist(), strict=True):
        seq = (p + r)[: cfg.spec_prompt_len]
        if len(seq) == cfg.spec_prompt_len:
            out.append(np.asarray(seq, np.int32)[None, :])
        if len(out) == cfg.spec_prompts:
            break
    if len(out) < cfg.spec_batch_size:
        raise ValueError(f"evaluate: {len(out)} held-out prompts of {cfg.spec_prompt_len} tokens in {data_dir}, "
                         f"fewer than spec_batch_size={cfg.spec_batch_size}")
    return out


def _trimmed(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return [tokens[i, : int(lengths[i])] for i in range(tokens.shape[0])]


def speculative(target: nnx.Module, draft: nnx.Module, prompts: list[np.ndarray], cfg: EvalConfig, eos: Any,
                *, temperature: float, mode: str = "chain") -> dict[str, Any]:
    """Speculative decoding vs plain decoding of the same target at the same batch size and temperature,
    on the same prompts: acceptance (τ = tokens emitted per verify forward, per draft position), wall-clock
    speedup (both compiled before timing, timed alternately), and at temperature 0 losslessness (the
    outputs must equal greedy decoding token for token)."""
    n, B, k = cfg.spec_max_new_tokens, cfg.spec_batch_size, cfg.spec_k
    batches = [np.concatenate(prompts[i: i + B]) for i in range(0, len(prompts) - B + 1, B)]
    tree = dict(tree_top_k=cfg.tree_top_k, tree_depth=cfg.tree_depth, tree_tokens=cfg.tree_tokens) \
        if mode == "tree" else {}

    def plain(p, key):  # the outputs are plain dataclasses: wait on their arrays, or the timer sees dispatch only
        out = generate(target, p, max_new_tokens=n, temperature=temperature, rng=key, eos_token_id=eos)
        jax.block_until_ready((out.tokens, out.lengths))
        return out

    def spec(p, key):
        out = speculative_generate(target, draft, p, max_new_tokens=n, k=k, temperature=temperature, rng=key,
                                   eos_token_id=eos, mode=mode, **tree)
        jax.block_until_ready((out.tokens, out.lengths))
        return out

    key = jax.random.key(cfg.seed)
    plain(batches[0], key)  # compile both before timing
    spec(batches[0], key)
    t_plain = t_spec = 0.0
    mismatches = plain_tokens = spec_tokens = 0
    emitted_sum = emitted_count = 0
    width = cfg.tree_depth if mode == "tree" else k  # tree mode counts acceptance per depth
    accepted_at, drafted_at = np.zeros(width), np.zeros(width)
    for i, p in enumerate(batches):
        key_i = jax.random.fold_in(key, i)
        t0 = time.perf_counter()
        ref = plain(p, key_i)
        t_plain += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = spec(p, key_i)
        t_spec += time.perf_counter() - t0
        ref_rows = _trimmed(np.asarray(ref.tokens), np.asarray(ref.lengths))
        got_rows = _trimmed(np.asarray(out.tokens), np.asarray(out.lengths))
        if temperature == 0.0:
            mismatches += sum(not np.array_equal(a, b) for a, b in zip(ref_rows, got_rows, strict=True))
        plain_tokens += sum(len(r) for r in ref_rows)
        spec_tokens += sum(len(r) for r in got_rows)
        emitted = np.asarray(out.emitted)
        emitted_sum += int(emitted.sum())
        emitted_count += int((emitted > 0).sum())
        accepted_at += np.asarray(out.position_accepted)
        drafted_at += np.asarray(out.position_drafted)
    plain_rate, spec_rate = plain_tokens / max(t_plain, 1e-9), spec_tokens / max(t_spec, 1e-9)
    result = {
        "mode": mode, "temperature": temperature, "batch_size": B, "draft_tokens": width, "prompts": len(batches) * B,
        **({"tree_top_k": cfg.tree_top_k, "tree_tokens": cfg.tree_tokens} if mode == "tree" else {}),
        "acceptance_length": emitted_sum / max(emitted_count, 1),  # τ: tokens emitted per verify forward
        "per_position_acceptance": [round(float(a / max(d, 1)), 4) for a, d in zip(accepted_at, drafted_at,
                                                                                  strict=True)],
        # tokens per second, not total time: at T > 0 the two runs sample different continuations
        "speedup": spec_rate / max(plain_rate, 1e-9),
        "plain_tokens_per_s": plain_rate, "speculative_tokens_per_s": spec_rate,
    }
    if temperature == 0.0:
        result |= {"lossless": mismatches == 0, "mismatched_rows": mismatches}
    return result


def draft_report(target: nnx.Module, draft: nnx.Module, prompts: list[np.ndarray], cfg: EvalConfig,
                 eos: Any) -> dict[str, Any]:
    """One draft's entry of the report: chain (or, for a block draft, parallel) decoding at every
    `spec_temperatures` (the headline numbers are temperature 0's), plus the EAGLE-2 dynamic tree at
    temperature 0 when `spec_tree`, the draft drafts one token per forward and the target's cache can verify a
    tree (else `tree_skipped` says why)."""
    runs = {f"chain_t{t:g}": speculative(target, draft, prompts, cfg, eos, temperature=t)
            for t in cfg.spec_temperatures}
    tree = cfg.spec_tree and not is_block_draft(draft)
    skipped = tree_unsupported(target) if tree else None
    if tree and skipped is None:
        runs["tree_t0"] = speculative(target, draft, prompts, cfg, eos, temperature=0.0, mode="tree")
    greedy = runs.get("chain_t0") or speculative(target, draft, prompts, cfg, eos, temperature=0.0)
    serving = runs[f"chain_t{cfg.serve_temperature:g}"]
    forwards = 1 if is_block_draft(draft) else cfg.spec_k  # draft forwards per verify (chain: extend + k - 1)
    weights = streamed_params(target), streamed_params(draft)
    return {"acceptance_length": greedy["acceptance_length"], "speedup": greedy["speedup"],
            "serve_temperature": cfg.serve_temperature, "serve_acceptance_length": serving["acceptance_length"],
            "serve_speedup": serving["speedup"], "draft_forwards_per_verify": forwards,
            "speedup_memory_bound": memory_bound_speedup(serving["acceptance_length"], forwards, *weights),
            "draft_tokens": cfg.spec_k, "lossless": all(r.get("lossless", True) for r in runs.values()),
            "mismatched_rows": sum(r.get("mismatched_rows", 0) for r in runs.values()),
            "per_position_acceptance": greedy["per_position_acceptance"], "runs": runs,
            **({"tree_skipped": skipped} if skipped else {})}


def streamed_params(model: nnx.Module) -> int:
    """Parameters one decoding forward reads in full: every weight but embedding tables (a forward
    gathers a few rows of those) and the frozen target pieces a draft shares (its `embed_tokens`)."""
    total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model)):
        if "embed_tokens" in path or not hasattr(leaf.get_value(), "size"):
            continue
        total += int(leaf.get_value().size)
    return total


def memory_bound_speedup(tau: float, draft_forwards: int, target_params: int, draft_params: int) -> float:
    """Speculative over plain decoding where decode is memory-bound (batch 1 on an accelerator: a forward
    costs the bytes of the weights it reads, whatever its width): τ tokens per verify, each verify reading
    the target once and the draft `draft_forwards` times, vs one target read per plain token."""
    return tau * target_params / (target_params + draft_forwards * draft_params)


def choose_draft(reports: dict[str, dict[str, Any]], min_acceptance_length: float = 0.0) -> str:
    """The candidate the release ships: the fastest among those that pass the draft gates (lossless, τ at
    T = 0 >= the acceptance floor), else among the lossless ones, else among all (the gates then fail the
    release and say why). "Fastest" is `memory_bound_speedup` at the serving temperature, computed from the
    measured τ and the weights each draft reads: deterministic, so a rerun of the release (after a crash,
    on another worker) ships the same draft and the same bytes, and it ranks drafts as a memory-bound
    serving GPU does; the wall-clock speedup on the evaluating machine (timing.json) is reported beside it."""
    passing = [n for n, r in reports.items() if r["lossless"] and r["acceptance_length"] >= min_acceptance_length]
    pool = passing or [n for n, r in reports.items() if r["lossless"]] or list(reports)
    return max(pool, key=lambda n: (reports[n]["speedup_memory_bound"], n))


def mtp_draft(finetuned: Path, folder: Path) -> nnx.Module:
    """A fine-tuned MTP head (a draft folder's `mtp/`) as a draft: a copy of the fine-tuned model (the full-
    precision main stack the head was trained on, whatever variant is served) with those MTP layers."""
    import safetensors.numpy

    from models.mtp_finetune import load_mtp_state
    copy = models.from_pretrained(str(finetuned))
    load_mtp_state(copy, safetensors.numpy.load_file(str(folder / "mtp" / "model.safetensors")))
    return MTPDraft(copy)


def candidates_report(served: nnx.Module, candidates: dict[str, Path], prompts: list[np.ndarray], cfg: EvalConfig,
                      eos: Any, finetuned: Path) -> dict[str, dict[str, Any]]:
    """Every draft candidate measured on the same prompts against the same served model, with what the
    draft stage recorded about it (kind, objective, parameters, training time, selected checkpoint)."""
    out = {}
    if cfg.drafts is not None:
        unknown = sorted(set(cfg.drafts) - set(candidates))
        if unknown:
            raise ValueError(f"evaluate.drafts: no draft candidate named {unknown} (have: {sorted(candidates)})")
        candidates = {n: candidates[n] for n in cfg.drafts}
    for name, folder in candidates.items():
        if folder_kind(folder) == "mtp":
            draft = mtp_draft(finetuned, folder)
        else:
            draft = load_draft(folder, served.embed_tokens.weight[...], target_head(served))
        meta_file = folder / "draft_config.json"
        meta = read_report(lambda n, f=folder: (f / n).read_bytes(), meta_file.name) if meta_file.exists() else {}
        trained = {k: meta[k] for k in ("objective", "train_temperature", "trainable_params", "train_seconds",
                                        "selected_step", "selected_acceptance_length") if k in meta}
        out[name] = {"kind": folder_kind(folder), **trained, **draft_report(served, draft, prompts, cfg, eos)}
    return out


# -- gates and report ------------------------------------------------------------------------------


def gates(report: dict[str, Any], g: Gates) -> list[dict[str, Any]]:
    """Each enabled gate judged on the report: {gate, value, threshold, passed}."""
    ppl = report["perplexity"]
    out = []
    if g.finetune_improves and "base" in ppl:
        out.append({"gate": "finetuned perplexity < base perplexity", "value": ppl["finetuned"],
                    "threshold": ppl["base"], "passed": ppl["finetuned"] < ppl["base"]})
    for scheme, q in report["quantization"].items():
        inc = g.quant_limit(scheme)
        limit = ppl["finetuned"] * (1 + inc)
        out.append({"gate": f"{scheme} perplexity <= finetuned x {1 + inc:g}",
                    "value": ppl[scheme], "threshold": limit, "passed": ppl[scheme] <= limit})
        for gate, key, what in (("max_quant_kl_p99", "kl_p99", "KL p99"),
                                ("max_quant_flip_rate", "top1_flip_rate", "top-1 flip rate")):
            limit = g.quant_limit(scheme, gate)
            out.append({"gate": f"{scheme} {what} <= {limit:g}", "value": q[key], "threshold": limit,
                        "passed": q[key] <= limit})
    if g.min_preference_accuracy > 0 and "preference" in report:
        acc = report["preference"]["reward_accuracy"]
        out.append({"gate": "held-out preference accuracy (fine-tuned vs base)", "value": acc,
                    "threshold": g.min_preference_accuracy, "passed": acc >= g.min_preference_accuracy})
    if g.min_rl_accuracy_gain > 0 and "rl" in report:
        gain = report["rl"]["accuracy_after"]["accuracy_t0"] - report["rl"]["accuracy_before"]["accuracy_t0"]
        out.append({"gate": f"RL ({report['rl']['checker']}): held-out pass@1 gain over its start (T=0)",
                    "value": gain, "threshold": g.min_rl_accuracy_gain, "passed": gain >= g.min_rl_accuracy_gain})
    if g.min_task_accuracy > 0 and not report.get("tasks"):  # a floor with nothing measured fails, never passes
        out.append({"gate": "task accuracy: no registered checker judges this release's prompts", "value": 0.0,
                    "threshold": g.min_task_accuracy, "passed": False})
    for name, t in report.get("tasks", {}).items():
        acc = t["accuracy"]
        if g.min_task_accuracy > 0:
            out.append({"gate": f"task {name}: fine-tuned pass@1 (T=0)", "value": acc["finetuned"]["t0"],
                        "threshold": g.min_task_accuracy, "passed": acc["finetuned"]["t0"] >= g.min_task_accuracy})
        if g.max_task_accuracy_drop < 1:
            for scheme in report["quantization"]:
                drop = acc["finetuned"]["t0"] - acc[scheme]["t0"]
                out.append({"gate": f"task {name}: {scheme} pass@1 drop vs fine-tuned (T=0)", "value": drop,
                            "threshold": g.max_task_accuracy_drop, "passed": drop <= g.max_task_accuracy_drop})
    if "draft" in report:
        d = report["draft"]
        if g.speculative_lossless:
            out.append({"gate": "speculative decoding identical to greedy", "value": d["mismatched_rows"],
                        "threshold": 0, "passed": bool(d["lossless"])})
        if g.min_acceptance_length > 0:
            out.append({"gate": "draft acceptance length (greedy, chain)", "value": d["acceptance_length"],
                        "threshold": g.min_acceptance_length,
                        "passed": d["acceptance_length"] >= g.min_acceptance_length})
    return out


def judge(report: dict[str, Any], cfg: EvalConfig) -> dict[str, Any]:
    """The report's gate section: `gates` and `passed` under the gates in force, the `waivers` forgeline recorded
    (gates the recipe lowers below their defaults, with its reasons; gates `--set` loosens below the recipe), and
    `passed_as_declared` (under the recipe's own gates, which decide whether the release pointer moves; judged
    apart when `--set` loosened them). No gate at all is an error, never a pass."""
    judged = gates(report, cfg.gates)
    if not judged:
        raise ValueError("evaluate.gates: no gate applies to this release (enable at least one)")
    out: dict[str, Any] = {"gates": judged, "passed": all(g["passed"] for g in judged), "waivers": list(cfg.waivers)}
    if cfg.declared_gates is not None:
        out["declared_gates"] = gates(report, cfg.declared_gates)
    out["passed_as_declared"] = all(g["passed"] for g in out.get("declared_gates", judged))
    return out


def preference_report(base: nnx.Module, finetuned: nnx.Module, data_dir: Path, cfg: EvalConfig) -> dict[str, Any]:
    """On the data's held-out preference pairs: each model's own preference (how often it scores the chosen
    answer higher, by sequence and by mean token log-probability) and the fine-tuned model's implicit reward
    against the base (log-ratio margin, β = 1, and the share of pairs where it is positive)."""
    pairs = pm.PairBatches(data_dir, "valid", cfg.batch_size, shuffle=False)
    put = functools.partial(jax.tree.map, jnp.asarray)
    lp = {name: pm.sequence_logps(m, pairs, put) for name, m in (("base", base), ("finetuned", finetuned))}
    return {"pairs": int(pairs.total), **pm.implicit_reward(lp["finetuned"], lp["base"]),
            "base": pm.own_preference(lp["base"]), "finetuned": pm.own_preference(lp["finetuned"])}


# -- task accuracy ---------------------------------------------------------------------------------


@dataclass
class Task:
    """The prompts a registered checker judges, from one split of the data, with their reference answers."""

    checker: checkers.Checker
    split: str  # "valid" (held out), or "train" when the checker judges no held-out prompt
    prompts: PromptSet
    references: list[str]  # the data's own answers: their score is the task's ceiling
    scored: dict[tuple[str, str], float] = field(default_factory=dict)  # (prompt, completion) -> the checker's score

    def score(self, prompt: str, completion: str) -> float:
        """The checker's score, each distinct (prompt, completion) judged once per evaluation: the fine-tuned
        model and its quantized variants mostly answer alike, and the code checker runs each answer in a sandboxed
        child process. A checker's reward depends on the pair alone (tasks/checkers/registry.py)."""
        key = (prompt, completion)
        if key not in self.scored:
            self.scored[key] = self.checker.score(prompt, completion)
        return self.scored[key]


def task_sets(data_dir: Path, cfg: EvalConfig, decode: Callable[[list[int]], str], bos: int,
              eos: int) -> dict[str, Task]:
    """Per registered checker that judges some of the data's documents: up to `task_prompts` of them, held
    out when it judges at least `TASK_MIN_HELDOUT` held-out documents, else from the train split (the default
    release's documented standard-library functions with doctest examples all fall in its train modules).
    Documents are read back
    from the packed rows (`documents_from_rows`), the first `TASK_SCAN` of each split."""
    if cfg.task_prompts == 0:
        return {}
    out: dict[str, Task] = {}
    for split in ("valid", "train"):
        docs = documents_from_rows(data_dir, split, TASK_SCAN, bos, sys.maxsize)
        texts = [decode(p[1:]) for p, _ in docs]
        for name, idx in checkers.judged(texts).items():
            # held out when there are enough of them to measure with (a handful would make one flip a gate)
            enough = split == "train" or len(idx) >= min(cfg.task_prompts, TASK_MIN_HELDOUT)
            if name not in out and enough:
                idx = idx[: cfg.task_prompts]
                refs = [docs[i][1][: docs[i][1].index(eos)] if eos in docs[i][1] else docs[i][1] for i in idx]
                out[name] = Task(checkers.get(name), split,
                                 PromptSet([np.asarray(docs[i][0], np.int32) for i in idx], [texts[i] for i in idx]),
                                 [decode(r) for r in refs])
    return out


TASK_SCAN = 20_000  # documents read per split when looking for the prompts a checker judges
TASK_MIN_HELDOUT = 16  # fewer held-out prompts than this (and than task_prompts): the train split's instead


def task_temperatures(cfg: EvalConfig) -> list[float]:
    """pass@1 greedy and at the serving temperature (one entry when the release serves greedy)."""
    return sorted({0.0, cfg.serve_temperature})


def task_max_new_tokens(task: Task, cfg: EvalConfig) -> int:
    return min(task.checker.max_new_tokens, cfg.task_max_new_tokens or task.checker.max_new_tokens)


def task_accuracy(model: nnx.Module, tasks: dict[str, Task], cfg: EvalConfig, decode: Callable[[list[int]], str],
                  eos: int, pad: int) -> dict[str, dict[str, float]]:
    """pass@1 of `model` on each task at each of `task_temperatures`: one completion per prompt, through the
    jitted decoder (tasks/training/grpo.py `accuracy`), scored by the task's checker; {task: {"t0": acc}}."""
    return {name: {f"t{t:g}": grpo.accuracy(model, task.prompts, task.score, decode, temperature=t,
                                            max_new_tokens=task_max_new_tokens(task, cfg), eos=eos, pad=pad,
                                            prompt_len=max(len(p) for p in task.prompts.ids),
                                            batch_size=cfg.task_batch_size, seed=cfg.seed)
                   for t in task_temperatures(cfg)}
            for name, task in tasks.items()}


def task_report(tasks: dict[str, Task], accuracy: dict[str, dict[str, dict[str, float]]],
                cfg: EvalConfig) -> dict[str, Any]:
    """The report's `tasks` section: per task its checker, split, prompt count, the references' score (the
    ceiling) and every model's pass@1 ({model: {"t0": ..}})."""
    return {name: {"checker": name, "description": t.checker.description, "split": t.split,
                   "prompts": len(t.prompts), "max_new_tokens": task_max_new_tokens(t, cfg),
                   "reference": float(np.mean(np.asarray(checkers.score_all(t.score, t.prompts.text,
                                                                             t.references)) >= 1.0)),
                   "accuracy": {m: acc[name] for m, acc in accuracy.items()}}
            for name, t in tasks.items()}


def evaluate(cfg: EvalConfig, *, base: Path | None, finetuned: Path, quantized: dict[str, Path], draft: Path | None,
             data_dir: Path, out_dir: Path, rl: dict[str, Any] | None = None,
             distilled: dict[str, Any] | None = None) -> dict[str, Any]:
    """`rl`: a GRPO fine-tune's rl.json (its held-out accuracy at the start of RL and at the end); `distilled`: a
    distillation's distill.json (teacher, student and SFT student on held-out data, as finetune measured them)."""
    batches = _batches(data_dir, cfg)
    target = models.from_pretrained(str(finetuned))
    report: dict[str, Any] = {"perplexity": {}, "quantization": {}}
    if distilled is not None:
        report["distill"] = distilled
    if rl is not None:
        report["rl"] = rl
    elif cfg.gates.min_rl_accuracy_gain > 0:
        raise ValueError("evaluate.gates.min_rl_accuracy_gain: the fine-tune is not an RL run (finetune.method: grpo)")
    no_pairs = (f"evaluate.gates.min_preference_accuracy: {data_dir} has no held-out preference pairs (and a base "
                "to compare with is needed)")
    if base is None and cfg.gates.min_preference_accuracy > 0:
        raise ValueError(no_pairs)
    if cfg.spec_target != "finetuned" and cfg.spec_target not in quantized:
        raise ValueError(f"evaluate: spec_target {cfg.spec_target!r} is not among the quantized variants "
                         f"{sorted(quantized)}")
    special = json.loads((data_dir / "special_tokens.json").read_text())
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    tasks = task_sets(data_dir, cfg, decode, special["bos"], special["eos"])
    if tasks:
        log.info("evaluate: task accuracy on %s", ", ".join(f"{n} ({len(t.prompts)} {t.split} prompts)"
                                                            for n, t in tasks.items()))
    accuracy = {}  # task accuracy per model: base, fine-tuned, each quantized variant
    if base is not None:  # everything measured on the base, from one load of it
        base_model = models.from_pretrained(str(base))
        report["perplexity"]["base"] = perplexity(base_model, batches)
        if pm.count_pairs(data_dir, "valid"):
            report["preference"] = preference_report(base_model, target, data_dir, cfg)
        elif cfg.gates.min_preference_accuracy > 0:
            raise ValueError(no_pairs)
        if tasks:
            accuracy["base"] = task_accuracy(base_model, tasks, cfg, decode, special["eos"], special["pad"])
        del base_model
    if not quantized:  # else the first quantized variant's agreement pass measures it (one forward fewer)
        report["perplexity"]["finetuned"] = perplexity(target, batches)
    if tasks:
        accuracy["finetuned"] = task_accuracy(target, tasks, cfg, decode, special["eos"], special["pad"])
    served = target
    for scheme, qdir in quantized.items():
        qmodel = models.from_pretrained(str(qdir))
        if tasks:
            accuracy[scheme] = task_accuracy(qmodel, tasks, cfg, decode, special["eos"], special["pad"])
        if scheme == cfg.spec_target:
            served = qmodel  # the model speculative decoding is measured against, loaded once
        agree = agreement(target, qmodel, batches)  # with its FP8 KV cache, if it has one
        finetuned_ppl = agree.pop("reference_perplexity")
        report["perplexity"].setdefault("finetuned", finetuned_ppl)  # from the first variant's pass
        report["perplexity"][scheme] = p = agree.pop("perplexity")
        kv = quant.kv_cache_strategy(qmodel)  # what the loaded checkpoint's attention applies
        kv = None if kv is None else f"fp8-{kv}"
        made = qdir / "quantization_report.json"  # what the quantize stage measured: bytes on disk, time
        made = read_report(lambda n, q=qdir: (q / n).read_bytes(), made.name) if made.exists() else {}
        report["quantization"][scheme] = {
            "perplexity": p, "perplexity_increase": p / report["perplexity"]["finetuned"] - 1,
            **agree,
            "kv_cache": kv, **quant.kv_cache_bytes(qmodel, kv and "fp8"),
            **{k: made[k] for k in ("weight_bytes_ratio_vs_bf16", "checkpoint_bytes_ratio_vs_bf16",
                                    "mean_output_error", "calibration_tokens") if k in made},
            **({"quantize_seconds": made["seconds"]} if "seconds" in made else {}),
        }
    if tasks:
        report["tasks"] = task_report(tasks, accuracy, cfg)
    eos = json.loads((finetuned / "config.json").read_text()).get("eos_token_id")
    if draft is not None or getattr(target, "num_mtp_layers", 0):
        prompts = spec_prompts(data_dir, cfg)
        if draft is not None:
            report["drafts"] = candidates_report(served, draft_candidates(draft), prompts, cfg, eos, finetuned)
            chosen = choose_draft(report["drafts"], cfg.gates.min_acceptance_length)
            report["draft"] = {**report["drafts"][chosen], "name": chosen, "target": cfg.spec_target}
        if getattr(served, "num_mtp_layers", 0):  # DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5: the MTP head
            report["mtp"] = draft_report(served, MTPDraft(served), prompts, cfg, eos)
    report |= judge(report, cfg)
    report["eval_tokens"] = int(sum(b["loss_mask"].sum() for b in batches))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_report(out_dir / "report.json", report)  # the wall-clock numbers go to timing.json
    (out_dir / "report.md").write_text(markdown(report))
    log.info("evaluate:\n%s", markdown(report))
    return {"passed": report["passed"], "perplexity": report["perplexity"],
            "acceptance_length": report.get("draft", {}).get("acceptance_length")}


def load_report(read: Callable[[str], bytes]) -> dict[str, Any]:
    """The full report, timings merged in; `read(name)` returns a file of the evaluate artifact."""
    return read_report(read, "report.json")


def run(config: EvalConfig, inputs: Mapping[str, Path], output: Path, *, progress: Progress | None = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The stage: inputs `finetune`, `data`, and optionally `base`, `draft` and `quant` (one artifact, a
    folder per scheme)."""
    quant = inputs.get("quant")
    schemes = {p.name: p for p in sorted(quant.iterdir()) if (p / "config.json").exists()} if quant else {}
    rl = inputs["finetune"] / "rl.json"  # a GRPO finetune artifact's
    distilled = inputs["finetune"] / "distill.json"  # a distillation's
    return evaluate(config, base=model_dir(inputs["base"]) if "base" in inputs else None,
                    finetuned=model_dir(inputs["finetune"]), quantized=schemes,
                    draft=inputs.get("draft"),
                    data_dir=inputs["data"], out_dir=output,
                    rl=json.loads(rl.read_text()) if rl.is_file() else None,
                    distilled=json.loads(distilled.read_text()) if distilled.is_file() else None)


main = stage_cli(__name__)  # `python -m tasks.evaluate`: the command line its declaration implies (tasks/cli.py)


if __name__ == "__main__":
    main()
