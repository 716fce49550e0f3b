"""The evaluation report for people: `markdown(report)` renders what tasks/evaluate.py measured (report.json
merged with timing.json) as report.md, which the release flow also publishes as the run's Prefect artifact.
Presentation only: every number is computed by the evaluate stage; this module formats it.
"""

from __future__ import annotations

from typing import Any


def markdown(report: dict[str, Any]) -> str:
    ppl = report["perplexity"]
    lines = ["# Evaluation report", "", "## Held-out perplexity", "", "| model | perplexity |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in ppl.items()]
    if "preference" in report:
        p = report["preference"]
        lines += ["", "## Preference pairs (held-out)", "",
                  f"{p['pairs']} held-out chosen/rejected pairs. Reward: log π_ft/π_base of the chosen answer minus "
                  f"that of the rejected one (DPO's implicit reward, β = 1): margin {p['reward_margin']:.3f}, "
                  f"positive on {100 * p['reward_accuracy']:.1f}% of pairs. Each model's own preference: the share "
                  "of pairs it scores the chosen answer higher, by sequence log-probability and per token.", "",
                  "| model | chosen preferred (sequence) | chosen preferred (per token) |", "|---|---|---|"]
        lines += [f"| {m} | {100 * p[m]['preference_accuracy']:.1f}% | "
                  f"{100 * p[m]['preference_accuracy_normalized']:.1f}% |" for m in ("base", "finetuned")]
    if report["quantization"]:
        lines += ["", "## Quantization (vs fine-tuned)", "",
                  "KL(fine-tuned ‖ quantized) per held-out loss position (mean, 99th percentile, max) and the top-1 "
                  "flip rate (positions whose greedy token changes); bytes: the quantized modules, and the whole "
                  "checkpoint (every tensor; the float ones at bf16), each vs bf16; KV cache: the cache the "
                  "checkpoint's attention applies (fp8 with per-tensor or per-head static scales, else the serving "
                  "dtype; its effect is in the numbers) and its bytes per token and layer vs bf16.", "",
                  "| scheme | perplexity | increase | KL mean | KL p99 | KL max | top-1 flips | quantized weights "
                  "vs bf16 | checkpoint vs bf16 | KV cache | quantize time |", "|---" * 11 + "|"]
        for s, q in report["quantization"].items():
            ratio, whole = q.get("weight_bytes_ratio_vs_bf16"), q.get("checkpoint_bytes_ratio_vs_bf16")
            secs = q.get("quantize_seconds")
            lines.append(f"| {s} | {q['perplexity']:.4f} | {100 * q['perplexity_increase']:+.3f}% | {q['kl']:.5f} "
                         f"| {q['kl_p99']:.5f} | {q['kl_max']:.4f} | {100 * q['top1_flip_rate']:.2f}% "
                         f"| {'n/a' if ratio is None else f'{ratio:.3f}x'} "
                         f"| {'n/a' if whole is None else f'{whole:.3f}x'} "
                         f"| {q.get('kv_cache') or 'serving dtype'} ({q.get('kv_bytes_ratio_vs_bf16', 1.0):.2f}x) "
                         f"| {'n/a' if secs is None else f'{secs:.1f} s'} |")
    if "distill" in report:
        d = report["distill"]
        lines += ["", "## Distillation (finetune stage)", "",
                  f"The student is layers {d['student_layers']} of the teacher's {d['teacher_layers']}, trained "
                  f"{d['steps']} steps on the teacher's top-k logits (T={d['temperature']}, alpha={d['alpha']}); the "
                  "SFT student is the same start trained as long on the data's own answers. Held out: cross entropy "
                  "on the data's answers, KL to the teacher's top-k and top-1 agreement on the teacher's answers"
                  + (f", pass@1 (T=0) on {d['prompts']} `{d['checker']}` prompts" if d.get("checker") else "") + ".",
                  "", "| model | layers | parameters | data CE | KL to teacher | top-1 agreement | pass@1 |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in d["models"].items():
            kl = f"{r['teacher_kl']:.4f}" if "teacher_kl" in r else "-"
            agree = f"{100 * r['top1_agreement']:.1f}%" if "top1_agreement" in r else "-"
            acc = f"{100 * r['accuracy_t0']:.1f}%" if "accuracy_t0" in r else "-"
            lines.append(f"| {name} | {r['layers']} | {r['params'] / 1e6:.2f}M | {r['data_loss']:.4f} | {kl} | "
                         f"{agree} | {acc} |")
    if "rl" in report:
        rl = report["rl"]
        temps = sorted(rl["accuracy_before"], key=lambda k: float(k[len("accuracy_t"):]))
        lines += ["", "## RL with verifiable rewards (finetune stage)", "",
                  f"GRPO with the `{rl['checker']}` checker: held-out pass@1 as the finetune stage measured it on "
                  f"its {rl['checker']} prompts, at the start of RL (after {rl['sft_steps']} SFT steps) and after "
                  f"{rl['steps']} RL steps; the curves are the bundle's training/curves.png.", "",
                  "| | " + " | ".join(f"T={k[len('accuracy_t'):]}" for k in temps) + " |",
                  "|---" * (1 + len(temps)) + "|"]
        lines += [f"| {label} | " + " | ".join(f"{100 * rl[key][k]:.1f}%" for k in temps) + " |"
                  for label, key in (("start (SFT)", "accuracy_before"), ("after RL", "accuracy_after"))]
    if report.get("tasks"):
        lines += ["", "## Task accuracy", "",
                  "pass@1 (one completion per prompt, scored by the task's checker: tasks/checkers/) greedy and at "
                  "the serving temperature; `reference`: the data's own answers, the ceiling."]
        for name, t in report["tasks"].items():
            temps = sorted({k for acc in t["accuracy"].values() for k in acc}, key=lambda k: float(k[1:]))
            where = "held-out" if t["split"] == "valid" else "**train split** (no held-out prompt is one it judges)"
            lines += ["", f"**{name}**: {t['description']}; {t['prompts']} prompts, {where}, up to "
                      f"{t['max_new_tokens']} new tokens; reference {100 * t['reference']:.1f}%.", "",
                      "| model | " + " | ".join(f"T={k[1:]}" for k in temps) + " |", "|---" * (1 + len(temps)) + "|"]
            lines += [f"| {m} | " + " | ".join(f"{100 * acc[k]:.1f}%" for k in temps) + " |"
                      for m, acc in t["accuracy"].items()]
    if report.get("drafts"):
        chosen = report["draft"]["name"]
        t_s = report["draft"]["serve_temperature"]
        lines += ["", "## Draft candidates", "",
                  f"Every candidate the draft stage trained, on the same held-out prompts and served model; the "
                  f"bundle ships **{chosen}**: of those that pass the draft gates (lossless, acceptance floor), "
                  f"the one with the highest memory-bound speedup at the serving temperature T={t_s:g} (τ × "
                  f"target weights / (target weights + draft forwards × draft weights): what a batch-1 "
                  f"accelerator sees, and deterministic); the wall-clock speedups are this machine's.", "",
                  "| draft | kind | objective | τ (T=0) " + (f"| τ (T={t_s:g}) " if t_s else "")
                  + f"| per-position acceptance (T=0) | memory-bound speedup (T={t_s:g}) | wall-clock speedup (T=0) "
                  + (f"| wall-clock (T={t_s:g}) " if t_s else "") + "| lossless | draft params | train time |",
                  "|---" * (10 + 2 * bool(t_s)) + "|"]  # at T=0 serving the serving columns are the T=0 ones
        for n, r in report["drafts"].items():
            obj = r.get("objective", "?")
            serve_tau = f"| {r['serve_acceptance_length']:.2f} " if t_s else ""
            serve_speedup = f"| {r['serve_speedup']:.2f}x " if t_s else ""
            lines.append(f"| {'**' + n + '**' if n == chosen else n} | {r['kind']} | {obj} "
                         f"| {r['acceptance_length']:.2f} {serve_tau}"
                         f"| {' '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} "
                         f"| {r['speedup_memory_bound']:.2f}x "
                         f"| {r['speedup']:.2f}x {serve_speedup}| {r['lossless']} "
                         f"| {r.get('trainable_params', 0) / 1e6:.2f}M | {r.get('train_seconds', 0):.0f} s |")
    for name in ("draft", "mtp"):
        if name not in report:
            continue
        what = (f"the shipped draft ({report[name].get('name', 'EAGLE-3')})" if name == "draft"
                else "the target's own MTP head as the draft")
        lines += ["", f"## Speculative decoding: {what}", "",
                  "| run | temperature | batch | k | acceptance length | per-position acceptance | speedup "
                  "| plain tok/s | speculative tok/s | lossless |", "|---|---|---|---|---|---|---|---|---|---|"]
        for run, r in report[name]["runs"].items():
            lines.append(f"| {run} | {r['temperature']:g} | {r['batch_size']} | {r['draft_tokens']} "
                         f"| {r['acceptance_length']:.2f} "
                         f"| {' '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} "
                         f"| {r['speedup']:.2f}x | {r['plain_tokens_per_s']:.1f} | {r['speculative_tokens_per_s']:.1f} "
                         f"| {r.get('lossless', 'n/a (sampling)')} |")
    lines += ["", "## Gates", "", "| gate | value | threshold | passed |", "|---|---|---|---|"]
    lines += [f"| {g['gate']} | {g['value']:.4g} | {g['threshold']:.4g} | {'yes' if g['passed'] else '**NO**'} |"
              for g in report["gates"]]
    if report.get("waivers"):
        lines += ["", "## Waivers", "", "Gates held weaker than the built-in defaults by the recipe (its file, with "
                  "its reason) or than the recipe by the command line (`--set` with `--allow-weaker-gates`)."]
        if any(w["source"] == "--set" for w in report["waivers"]):
            lines[-1] += " " + ("The release also passes the gates as declared." if report["passed_as_declared"]
                                else "**The release fails the gates as declared: it is exported but not promoted.**")
        lines += ["", "| gate | loosened from | to | by | reason |", "|---|---|---|---|---|"]
        lines += [f"| {w['gate']} | {_value(w['from'])} | {_value(w['to'])} | {w['source']} "
                  f"| {_cell(w['reason'] or '(none: command line)')} |" for w in report["waivers"]]
    return "\n".join(lines) + "\n"


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def _cell(text: str) -> str:
    """Free text as one markdown table cell: on one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")
