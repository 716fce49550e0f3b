"""Stage `export`: the release bundle, published only when every eval gate passed.

    <bundle>/
      model/              HF layout (config.json, safetensors, tokenizer.json + tokenizer_config.json with the
                          chat template the data was rendered with, generation_config.json)
      adapter/            PEFT LoRA adapter (LoRA runs)
      draft/              the EAGLE-3 draft: sglang/ (LlamaForCausalLMEagle3, SGLang and vLLM), speculators/
                          (vLLM speculators Eagle3Speculator), draft_config.json
      quantized/<scheme>/ compressed-tensors checkpoints
      eval/               report.json, report.md
      lineage.json        recipe, stage fingerprints, digests and store keys, waivers, git SHA, code version
      README.md           the model card with the eval table
      manifest.json       every file's sha256 and size + the lineage (written last, by the store)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from storage import git_sha
from tasks.code import source_version
from tasks.configs import ExportConfig
from tasks.stage import StageContext


class GateError(RuntimeError):
    """The release failed an eval gate in force; nothing is exported."""


def _copytree(src: Path, dst: Path) -> None:
    """A copy of an input artifact's folder, without its manifest (lineage.json names it by digest)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete", "manifest.json"))


def model_card(cfg: ExportConfig, report_md: str, lineage: dict[str, Any], has_adapter: bool,
               schemes: list[str]) -> str:
    ft = cfg.recipe.get("finetune", {})
    draft_k = cfg.recipe.get("draft", {}).get("k", 4)
    base = cfg.recipe.get("base", {}).get("url") or "a scratch Llama pretrained by forgeline (see lineage.json)"
    lines = [
        f"# {cfg.name}", "",
        f"Released by forgeline from {base}, fine-tuned ({ft.get('mode', '?')}) on "
        f"`{cfg.recipe.get('data', {}).get('corpus', '?')}`.", "",
    ]
    if lineage["waivers"]:
        verdict = ("it also passes them as declared" if lineage["gates_passed_as_declared"]
                   else "**it fails them as declared and is not the promoted release**")
        lines += ["> **Waivers:** released with gates loosened on the command line ("
                  + "; ".join(f"`{w['gate']}` {w['declared']} → {w['effective']}" for w in lineage["waivers"])
                  + f"); {verdict}.", ""]
    lines += [
        "## Contents", "",
        "| path | what |", "|---|---|",
        "| `model/` | merged weights, HF layout (`AutoModelForCausalLM.from_pretrained('model')`) |",
    ]
    if has_adapter:
        lines.append("| `adapter/` | the LoRA adapter, PEFT layout (`PeftModel.from_pretrained(base, 'adapter')`) |")
    served = cfg.recipe.get("serve", "finetuned")
    target = "model" if served == "finetuned" else f"quantized/{served}"
    lines.append(f"| `draft/sglang/` | EAGLE-3 draft for `{target}/`, k={draft_k} (SGLang: `--speculative-algorithm "
                 f"EAGLE3 --speculative-draft-model-path draft/sglang --speculative-num-steps {draft_k} "
                 f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {draft_k + 1}`) |")
    spec_cfg = json.dumps({"model": "draft/speculators", "num_speculative_tokens": draft_k})
    lines.append(f"| `draft/speculators/` | the same draft in vLLM's speculators layout "
                 f"(`vllm serve {target} --speculative-config '{spec_cfg}'`) |")
    lines += [f"| `quantized/{s}/` | compressed-tensors checkpoint (`LLM('quantized/{s}')` in vLLM); per-layer error "
              f"plot `quant_error.svg`, details `quantization_report.json` |" for s in schemes]
    lines += ["| `eval/` | report.json, report.md |", "| `lineage.json` | what produced every file |", ""]
    lines += [report_md.replace("# Evaluation report", "## Evaluation").strip(), "",
              "## Lineage", "", f"- git SHA: `{lineage['git_sha']}`", f"- code version: `{lineage['code_version']}`"]
    lines += [f"- {k}: `{v['fingerprint']}` (content digest `{v['digest'][:16]}…`)"
              for k, v in lineage["stages"].items()]
    return "\n".join(lines) + "\n"


def run(config: ExportConfig, inputs: Mapping[str, Path], output: Path, *, progress: Any = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The bundle, when the gates in force passed (GateError otherwise). Lineage names every input by its
    key in the store (not its URL), so a bundle reads the same wherever its store is: the stage runs only
    inside the commit protocol (`context`), which knows the inputs' manifests."""
    if context is None:
        raise ValueError("export: runs inside a release (it records its inputs' manifests in lineage.json)")
    cfg, ctx, out, inp = config, context, output, inputs
    report = json.loads((inp["evaluate"] / "report.json").read_text())
    failed = [g["gate"] for g in report["gates"] if not g["passed"]]
    if failed and cfg.enforce_gates:
        where = ctx.refs["evaluate"].url
        raise GateError(f"release {cfg.name}: eval gates failed: {'; '.join(failed)} (see {where})")
    _copytree(inp["finetune"] / "model", out / "model")
    has_adapter = (inp["finetune"] / "adapter").exists()
    if has_adapter:
        _copytree(inp["finetune"] / "adapter", out / "adapter")
    _copytree(inp["draft"] / "draft", out / "draft")
    schemes = sorted(p.name for p in inp["quant"].iterdir() if (p / "config.json").exists())
    for s in schemes:
        _copytree(inp["quant"] / s, out / "quantized" / s)
    _copytree(inp["evaluate"], out / "eval")
    lineage = {
        "name": cfg.name, "recipe": cfg.recipe, "git_sha": git_sha(), "code_version": source_version(),
        "stages": {k: {"kind": r.kind, "fingerprint": r.fingerprint, "digest": r.digest,
                       "key": ctx.store.key_of(r.url) if ctx.store is not None else r.url}
                   for k, r in ctx.refs.items()},
        "gates_passed": not failed,
        "gates_passed_as_declared": report.get("passed_as_declared", not failed),
        "waivers": report.get("waivers", []),
    }
    (out / "lineage.json").write_text(json.dumps(lineage, indent=1, sort_keys=True))
    (out / "README.md").write_text(model_card(cfg, (inp["evaluate"] / "report.md").read_text(), lineage,
                                              has_adapter, schemes))
    return {"name": cfg.name, "gates_passed": not failed, "waivers": len(lineage["waivers"]),
            "schemes": schemes, "adapter": has_adapter,
            "stages": {k: v["fingerprint"] for k, v in lineage["stages"].items()}}
