"""Stage `export`: the release bundle, published only when every eval gate passed.

    <bundle>/
      model/              HF layout (config.json, safetensors, tokenizer.json + tokenizer_config.json with the
                          chat template the data was rendered with, generation_config.json)
      adapter/            PEFT LoRA adapter (LoRA runs)
      draft/              the draft candidate evaluate chose (the fastest that passes the gates): speculators/ (vLLM
                          speculators layout: Eagle3Speculator, PEagleSpeculator or DFlashSpeculator), sglang/
                          (EAGLE-3 only: LlamaForCausalLMEagle3, SGLang and vLLM), draft_config.json
      quantized/<scheme>/ compressed-tensors checkpoints
      eval/               report.json, report.md
      training/           the fine-tune's curves: training.json (numbers) and curves.png (loss; DPO rewards; GRPO
                          reward, KL and held-out accuracy before and after)
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

from models.draft_format import folder_kind
from storage import git_sha
from tasks.cli import stage_cli
from tasks.code import source_version
from tasks.configs import ExportConfig
from tasks.layout import draft_dir
from tasks.stage import StageContext


class GateError(RuntimeError):
    """The release failed an eval gate in force; nothing is exported."""


def _copytree(src: Path, dst: Path) -> None:
    """A copy of an input artifact's folder, without its manifest (lineage.json names it by digest)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete", "manifest.json"))


def install_mtp(model_dir: Path, mtp_file: Path) -> list[str]:
    """Replace the MTP-layer tensors of the checkpoint in `model_dir` by a fine-tuned head's (`mtp_file`,
    the same names), shard by shard, each keeping its dtype: engines that draft with a DeepSeek / GLM
    target's own MTP layers read them from the target checkpoint. Returns the rewritten shard names;
    ValueError naming a tensor the checkpoint does not have or of another shape."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    new = load_file(str(mtp_file))
    index = model_dir / "model.safetensors.index.json"
    where = (json.loads(index.read_text())["weight_map"] if index.exists()
             else dict.fromkeys(new, "model.safetensors"))
    missing = sorted(n for n in new if n not in where)
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint has no tensor {missing[0]} of the fine-tuned MTP head "
                         f"({len(missing)} missing)")
    shards = sorted({where[n] for n in new})
    for shard in shards:
        path = model_dir / shard
        with safe_open(str(path), "numpy") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        for name in (n for n in new if where[n] == shard):
            if tensors[name].shape != new[name].shape:
                raise ValueError(f"{path}: {name} is {list(tensors[name].shape)}, the MTP head's "
                                 f"{list(new[name].shape)}")
            tensors[name] = new[name].astype(tensors[name].dtype)
        save_file(tensors, str(path), metadata=meta)
    return shards


def draft_rows(kind: str, name: str, target: str, k: int) -> list[str]:
    """The model card's rows for the shipped draft: where it is and the serving command of each engine
    that loads its kind (docs/speculative-decoding.md, which engine serves which drafter)."""
    rows = []
    if kind == "mtp":
        return [f"| `draft/mtp/` | `{name}`: the target's own MTP layer(s) fine-tuned on its traces, also written into "
                f"`model/` (vLLM: `--speculative-config '{{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": "
                f"{k}}}'`; SGLang: `--speculative-algorithm NEXTN --speculative-num-steps {k}`) |"]
    if kind == "eagle3":
        rows.append(f"| `draft/sglang/` | EAGLE-3 draft `{name}` for `{target}/`, k={k} (SGLang: "
                    f"`--speculative-algorithm EAGLE3 --speculative-draft-model-path draft/sglang "
                    f"--speculative-num-steps {k} --speculative-eagle-topk 1 "
                    f"--speculative-num-draft-tokens {k + 1}`) |")
        spec = {"model": "draft/speculators", "num_speculative_tokens": k}
        what = "the same draft in vLLM's speculators layout"
    elif kind == "peagle":
        spec = {"model": "draft/speculators", "num_speculative_tokens": k, "parallel_drafting": True}
        what = (f"P-EAGLE draft `{name}` for `{target}/` (all {k} tokens in one draft forward), vLLM's "
                "speculators layout")
    else:
        spec = {"model": "draft/speculators", "num_speculative_tokens": k}
        what = f"DFlash block draft `{name}` for `{target}/` ({k} tokens per block forward), vLLM's speculators layout"
    rows.append(f"| `draft/speculators/` | {what} (`vllm serve {target} --speculative-config '{json.dumps(spec)}'`) |")
    return rows


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_card(cfg: ExportConfig, report_md: str, lineage: dict[str, Any], has_adapter: bool,
               schemes: list[str], draft_kind: str = "eagle3", draft_name: str = "eagle3",
               has_curves: bool = False) -> str:
    ft = cfg.recipe.get("finetune", {})
    draft_k = cfg.recipe.get("draft", {}).get("k", 4)
    base = cfg.recipe.get("base", {}).get("url") or "a scratch Llama pretrained by forgeline (see lineage.json)"
    lines = [
        f"# {cfg.name}", "",
        f"Released by forgeline from {base}, fine-tuned ({ft.get('mode', '?')}) on "
        f"`{cfg.recipe.get('data', {}).get('corpus', '?')}`.", "",
    ]
    lowered = [w for w in lineage["waivers"] if w["source"] != "--set"]
    loosened = [w for w in lineage["waivers"] if w["source"] == "--set"]
    if lowered:
        lines += ["> **Waivers:** the recipe holds gates below forgeline's defaults ("
                  + "; ".join(f"`{w['gate']}` {_shown(w['from'])} → {_shown(w['to'])} ({w['source']}: "
                              f"{' '.join(w['reason'].split())})" for w in lowered) + ").", ""]
    if loosened:
        verdict = ("it also passes them as declared" if lineage["gates_passed_as_declared"]
                   else "**it fails them as declared and is not the promoted release**")
        lines += ["> **Waivers:** released with gates loosened on the command line ("
                  + "; ".join(f"`{w['gate']}` {_shown(w['from'])} → {_shown(w['to'])}" for w in loosened)
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
    lines += draft_rows(draft_kind, draft_name, target, draft_k)
    lines += [f"| `quantized/{s}/` | compressed-tensors checkpoint (`LLM('quantized/{s}')` in vLLM); per-layer error "
              f"plot `quant_error.svg`, details `quantization_report.json` |" for s in schemes]
    lines += ["| `eval/` | report.json, report.md |"]
    if has_curves:
        lines.append(f"| `training/` | the fine-tune's curves ({ft.get('method', 'sft')}): curves.png, training.json |")
    lines += ["| `lineage.json` | what produced every file |", ""]
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
    draft_name = report["draft"]["name"]
    _copytree(draft_dir(inp["draft"], draft_name), out / "draft")
    draft_kind = folder_kind(out / "draft")
    if draft_kind == "mtp":  # engines draft with the target checkpoint's own MTP layers: ship the fine-tuned ones
        install_mtp(out / "model", out / "draft" / "mtp" / "model.safetensors")
    schemes = sorted(p.name for p in inp["quant"].iterdir() if (p / "config.json").exists())
    for s in schemes:
        _copytree(inp["quant"] / s, out / "quantized" / s)
    _copytree(inp["evaluate"], out / "eval")
    has_curves = (inp["finetune"] / "curves.png").exists()
    for name in ("training.json", "curves.png"):
        if (inp["finetune"] / name).exists():
            (out / "training").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(inp["finetune"] / name, out / "training" / name)
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
                                              has_adapter, schemes, draft_kind, draft_name, has_curves))
    return {"name": cfg.name, "gates_passed": not failed, "waivers": len(lineage["waivers"]), "draft": draft_name,
            "schemes": schemes, "adapter": has_adapter,
            "stages": {k: v["fingerprint"] for k, v in lineage["stages"].items()}}


# `python -m tasks.export`: the command line every stage has; export itself refuses to run outside a release,
# whose commit protocol knows the inputs' manifests that lineage.json records.
main = stage_cli(__name__)


if __name__ == "__main__":
    main()
