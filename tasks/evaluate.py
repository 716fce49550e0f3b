"""Stage `evaluate`: held-out quality of every model in the release, and the gates export obeys.

    python -m tasks.evaluate --base DIR --finetuned DIR --quantized int8=DIR --draft DIR --data DIR --out DIR

Measured in one run, on the same held-out rows and prompts:
- perplexity of the base, the fine-tuned model and each quantized variant (masked next-token loss
  over data_prep's valid split -- for instruction data, the answer tokens only);
- per quantized scheme: token-level KL(fine-tuned || quantized) and top-1 agreement over the same
  positions, and the decoder weight bytes relative to float32;
- the draft: speculative decoding (batch 1, greedy) against plain greedy decoding of the target on
  held-out prompts -- the outputs must be identical (lossless), and we report the mean acceptance
  length (tokens emitted per target forward) and the wall-clock speedup, both timed here, compiled
  once before timing.
Output: `report.json`, `report.md`. Gates are evaluated and recorded; the export stage refuses to
publish a release whose gates failed.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pyarrow.parquet as pq
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field

import models
from models.generate import generate
from models.quant import weight_bytes
from models.speculative import speculative_generate
from tasks.cli import OPTIONAL_PATH, PATH, stage_main
from tasks.finetune import model_dir
from tasks.stage import StageContext
from tasks.train import PackedBatches

log = logging.getLogger("forgeline.evaluate")


class Gates(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    finetune_improves: bool = True  # fine-tuned held-out perplexity below the base's
    max_quant_ppl_increase: float = Field(0.01, ge=0)  # int8 ppl <= (1 + this) x fine-tuned ppl
    speculative_lossless: bool = True
    min_acceptance_length: float = Field(1.2, ge=0)


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(16, ge=1)
    eval_batches: int = Field(16, ge=1)
    spec_prompts: int = Field(16, ge=1)
    spec_prompt_len: int = Field(48, ge=2)
    spec_max_new_tokens: int = Field(64, ge=1)
    spec_k: int = Field(4, ge=1)
    gates: Gates = Gates()


# -- quality ---------------------------------------------------------------------------------------


def _logits_fn(model: nnx.Module):
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, batch):
        m = nnx.merge(graphdef, state)
        return m(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])

    return lambda batch: f(state, batch)


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
    """Mean token-level KL(reference || other) and top-1 agreement over the loss positions."""
    f_ref, f_other = _logits_fn(reference), _logits_fn(other)
    kl_sum, agree, count = 0.0, 0.0, 0.0
    for b in batches:
        lp = jax.nn.log_softmax(f_ref(b).astype(jnp.float32), -1)  # [B, T, V]
        lq = jax.nn.log_softmax(f_other(b).astype(jnp.float32), -1)
        mask = b["loss_mask"].astype(np.float32)
        kl = (jnp.exp(lp) * (lp - lq)).sum(-1)  # [B, T]
        kl_sum += float((kl * mask).sum())
        agree += float(((lp.argmax(-1) == lq.argmax(-1)) * mask).sum())
        count += float(mask.sum())
    return {"kl": kl_sum / max(count, 1.0), "top1_agreement": agree / max(count, 1.0)}


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
    if not out:
        raise ValueError(f"evaluate: no held-out prompt of {cfg.spec_prompt_len} tokens in {data_dir}")
    return out


def speculative(target: nnx.Module, draft: nnx.Module, prompts: list[np.ndarray], cfg: EvalConfig,
                eos: int) -> dict[str, Any]:
    n = cfg.spec_max_new_tokens

    def plain(p):
        out = generate(target, p, prompt_lengths=np.array([p.shape[1]], np.int32), max_new_tokens=n,
                       temperature=0.0, eos_token_id=eos)
        return np.asarray(out.tokens)[0, : int(np.asarray(out.lengths)[0])]

    def spec(p):
        out = speculative_generate(target, draft, p, max_new_tokens=n, k=cfg.spec_k, eos_token_id=eos)
        return out

    plain(prompts[0])  # compile both before timing
    spec(prompts[0])
    t_plain = t_spec = 0.0
    mismatches, tokens, calls, accepted = 0, 0, 0, 0
    for p in prompts:
        t0 = time.perf_counter()
        ref = plain(p)
        t_plain += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = spec(p)
        got = np.asarray(out.tokens)[0, : len(ref)] if np.asarray(out.tokens).ndim == 2 else np.asarray(out.tokens)
        t_spec += time.perf_counter() - t0
        mismatches += int(not np.array_equal(got[: len(ref)], ref))
        tokens += len(ref)
        calls += int(out.num_target_calls)
        accepted += int(np.asarray(out.accepted_per_call).sum())
    return {
        "acceptance_length": accepted / max(calls, 1),  # tokens emitted per target verify forward
        "speedup": t_plain / max(t_spec, 1e-9),
        "draft_tokens": cfg.spec_k,
        "lossless": mismatches == 0,
        "mismatched_prompts": mismatches,
        "prompts": len(prompts),
        "plain_tokens_per_s": tokens / max(t_plain, 1e-9),
        "speculative_tokens_per_s": tokens / max(t_spec, 1e-9),
    }


# -- gates and report ------------------------------------------------------------------------------


def gates(report: dict[str, Any], g: Gates) -> list[dict[str, Any]]:
    ppl = report["perplexity"]
    out = []
    if g.finetune_improves and "base" in ppl:
        out.append({"gate": "finetuned perplexity < base perplexity", "value": ppl["finetuned"],
                    "threshold": ppl["base"], "passed": ppl["finetuned"] < ppl["base"]})
    for scheme in report["quantization"]:
        limit = ppl["finetuned"] * (1 + g.max_quant_ppl_increase)
        out.append({"gate": f"{scheme} perplexity <= finetuned x {1 + g.max_quant_ppl_increase:g}",
                    "value": ppl[scheme], "threshold": limit, "passed": ppl[scheme] <= limit})
    if "draft" in report:
        d = report["draft"]
        if g.speculative_lossless:
            out.append({"gate": "speculative decoding identical to greedy", "value": d["mismatched_prompts"],
                        "threshold": 0, "passed": bool(d["lossless"])})
        out.append({"gate": "draft acceptance length", "value": d["acceptance_length"],
                    "threshold": g.min_acceptance_length, "passed": d["acceptance_length"] >= g.min_acceptance_length})
    return out


def markdown(report: dict[str, Any]) -> str:
    ppl = report["perplexity"]
    lines = ["# Evaluation report", "", "## Held-out perplexity", "", "| model | perplexity |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in ppl.items()]
    if report["quantization"]:
        lines += ["", "## Quantization (vs fine-tuned)", "",
                  "| scheme | KL | top-1 agreement | weight bytes ratio |", "|---|---|---|---|"]
        lines += [f"| {s} | {q['kl']:.5f} | {q['top1_agreement']:.4f} | {q['weight_bytes_ratio']:.3f} |"
                  for s, q in report["quantization"].items()]
    if "draft" in report:
        d = report["draft"]
        lines += ["", "## Speculative decoding (batch 1, greedy)", "",
                  "| acceptance length | speedup | draft tokens (k) | lossless | plain tok/s | speculative tok/s |",
                  "|---|---|---|---|---|---|",
                  f"| {d['acceptance_length']:.2f} | {d['speedup']:.2f}x | {d['draft_tokens']} | {d['lossless']} "
                  f"| {d['plain_tokens_per_s']:.1f} | {d['speculative_tokens_per_s']:.1f} |"]
    lines += ["", "## Gates", "", "| gate | value | threshold | passed |", "|---|---|---|---|"]
    lines += [f"| {g['gate']} | {g['value']:.4g} | {g['threshold']:.4g} | {'yes' if g['passed'] else '**NO**'} |"
              for g in report["gates"]]
    return "\n".join(lines) + "\n"


def evaluate(cfg: EvalConfig, *, base: Path | None, finetuned: Path, quantized: dict[str, Path], draft: Path | None,
             data_dir: Path, out_dir: Path) -> dict[str, Any]:
    batches = _batches(data_dir, cfg)
    target = models.from_pretrained(str(finetuned))
    report: dict[str, Any] = {"perplexity": {}, "quantization": {}}
    if base is not None:
        report["perplexity"]["base"] = perplexity(models.from_pretrained(str(base)), batches)
    report["perplexity"]["finetuned"] = perplexity(target, batches)
    float_linear, float_all = weight_bytes(target, linears_only=True), weight_bytes(target)
    for scheme, qdir in quantized.items():
        qmodel = models.from_pretrained(str(qdir))
        report["perplexity"][scheme] = perplexity(qmodel, batches)
        report["quantization"][scheme] = {
            **agreement(target, qmodel, batches),
            # the quantized decoder linears vs their float32 bytes, and the whole checkpoint's ratio
            "weight_bytes_ratio": weight_bytes(qmodel, linears_only=True) / float_linear,
            "model_bytes_ratio": weight_bytes(qmodel) / float_all,
        }
    if draft is not None:
        eos = json.loads((finetuned / "config.json").read_text()).get("eos_token_id")
        report["draft"] = speculative(target, models.from_pretrained(str(draft)), spec_prompts(data_dir, cfg),
                                      cfg, eos)
    report["gates"] = gates(report, cfg.gates)
    report["passed"] = all(g["passed"] for g in report["gates"])
    report["eval_tokens"] = int(sum(b["loss_mask"].sum() for b in batches))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "report.md").write_text(markdown(report))
    log.info("evaluate:\n%s", markdown(report))
    return {"passed": report["passed"], "perplexity": report["perplexity"],
            "acceptance_length": report.get("draft", {}).get("acceptance_length")}


def compute(cfg: EvalConfig):
    """Inputs: `base`, `finetune`, `data`, optional `draft`, and `quant` (one artifact, a folder per scheme)."""

    def _compute(ctx: StageContext) -> dict[str, Any]:
        quant = ctx.inputs.get("quant")
        schemes = {p.name: p for p in sorted(quant.iterdir()) if (p / "config.json").exists()} if quant else {}
        return evaluate(cfg, base=model_dir(ctx.inputs["base"]) if "base" in ctx.inputs else None,
                        finetuned=model_dir(ctx.inputs["finetune"]), quantized=schemes,
                        draft=ctx.inputs["draft"] / "draft" if "draft" in ctx.inputs else None,
                        data_dir=ctx.inputs["data"], out_dir=ctx.out_dir)

    return _compute


def main(argv: list[str] | None = None) -> None:
    def run(cfg: EvalConfig, a) -> dict[str, Any]:
        quantized = {s.split("=", 1)[0]: Path(s.split("=", 1)[1]) for s in a.quantized}
        return evaluate(cfg, base=a.base and model_dir(a.base), finetuned=model_dir(a.finetuned), quantized=quantized,
                        draft=a.draft and model_dir(a.draft), data_dir=a.data, out_dir=a.out)

    stage_main(__doc__, EvalConfig, {
        "--base": OPTIONAL_PATH, "--finetuned": PATH, "--draft": OPTIONAL_PATH, "--data": PATH,
        "--quantized": {"nargs": "*", "default": [], "metavar": "SCHEME=DIR"},
    }, run, argv)

if __name__ == "__main__":
    main()
