"""What gets quantized: every Linear and every stacked-experts module of a model, by HF module name,
less what `ignore` matches (module names, or regexes prefixed `re:`, the way compressed-tensors'
`targets` / `ignore` are matched in `utils/match.py`).

Every Linear except the LM head (`lm_head`, DeepSeek-V4's top-level `head`) and MTP layers' `eh_proj`
(ALWAYS_IGNORED) and what the publishers ship in bf16 beside FP8 (FLOAT_BY_DEFAULT: the DSA indexer's
`weights_proj`, DeepSeek-V4's compressors and its indexer's compressor), and every expert, is quantized unless it
matches `ignore`; routers, norms and embeddings are never Linears here, so they always stay float. An Experts
stack is quantized whole or not at all (an engine loads a stack with one format), and a group size must divide
every quantized input width. Experts are named on disk by the stack's `hf_names` (DeepSeek-V4: w1, w3, w2).

GPT-OSS's fused experts (`hf_layout == "gpt_oss"`) have one layout on disk, GPT-OSS's own MXFP4
(models/quant/formats/mxfp4.py), so only `mxfp4a16[-gptq]` quantizes them; and as in the published
checkpoint (and as transformers' single-method `quantization_config` requires), that scheme then quantizes
ONLY the experts: attention Linears stay float (`quant_units(..., scheme)`). See docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from flax import nnx

from models.layers import Linear, hf_name
from models.moe import Experts
from models.quant.schemes import Scheme

# lm_head stays float; so does the MTP layers' eh_proj, which vLLM builds as a plain, unquantized Linear
ALWAYS_IGNORED = ("lm_head", r"re:.*\.eh_proj$")
# the LM head under the name a family writes it when not `lm_head` (DeepSeek-V4: `head`, which transformers loads
# as `lm_head`); float like lm_head, named in a checkpoint's ignore list only for the models that have it
OTHER_HEADS = ("head",)
# Left float when quantizing (`quant_units`' default), still read quantized from a checkpoint that holds them so
# (`float_by_default=False`): the DSA indexer's per-head weights (DeepSeek-V3.2 / GLM-5 `indexer.weights_proj`),
# bf16 in every published FP8 checkpoint (GLM-5-FP8 lists it in modules_to_not_convert), fp32 in the reference code
# and in transformers (`_keep_in_fp32_modules`, which its FP8 loader never converts), a bf16 GEMM in the engines
# DeepSeek-V4-Flash ships its attention compressors' and its indexer's compressor's wkv / wgate in bf16 beside
# FP8 (transformers lists them, as `compressor.{kv,gate}_proj` / `compressor.indexer.{kv,gate}_proj`, in
# DeepseekV4's `_keep_in_fp32_modules` so that its FP8 loader skips them); the indexer's wq_b ships FP8.
FLOAT_BY_DEFAULT = (r"re:.*\.indexer\.weights_proj$", r"re:.*\.attn\.compressor\.(wkv|wgate)$",
                    r"re:.*\.attn\.indexer\.compressor\.(wkv|wgate)$")
# the same modules under transformers' DeepSeek-V4 names (its conversion mapping renames them on load), where
# compressed-tensors matches a checkpoint's `ignore` list: written there beside ours
HF_RENAMED_FLOAT = {r"re:.*\.attn\.compressor\.(wkv|wgate)$": r"re:.*\.self_attn\.compressor\.(kv|gate)_proj$",
                    r"re:.*\.attn\.indexer\.compressor\.(wkv|wgate)$":
                        r"re:.*\.self_attn\.compressor\.indexer\.(kv|gate)_proj$",
                    r"re:.*\.indexer\.weights_proj$": r"re:.*\.indexer\.scorer\.weights_proj$"}


@dataclasses.dataclass
class Unit:
    """One quantizable module: a Linear, or an Experts stack (quantized per expert)."""

    name: str  # HF module name: "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts"
    path: tuple
    module: Linear | Experts

    @property
    def layer(self) -> int | None:
        return self.path[1] if len(self.path) > 1 and self.path[0] == "layers" else None

    def in_features(self) -> list[tuple[str, int]]:
        if isinstance(self.module, Linear):
            return [(self.name, self.module.in_features)]
        ex = self.module
        return [(f"{self.name}.gate_up", ex.hidden_size), (f"{self.name}.down_proj", ex.intermediate_size)]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(re.fullmatch(p[3:], name) if p.startswith("re:") else name == p for p in patterns)


def float_by_default(model: nnx.Module) -> tuple[str, ...]:
    """The FLOAT_BY_DEFAULT patterns that match a Linear of `model`: what a quantized checkpoint's ignore list
    names besides ALWAYS_IGNORED (a Llama's lists none, a DeepSeek-V3.2's the indexer's weights_proj)."""
    names = [hf_name(path) for path, node in nnx.iter_graph(model) if isinstance(node, Linear)]
    hits = [p for p in (*FLOAT_BY_DEFAULT, *OTHER_HEADS) if any(_matches(n, (p,)) for n in names)]
    v4 = "head" in names  # DeepSeek-V4, whose module names transformers renames on load
    renamed = [HF_RENAMED_FLOAT[p] for p in hits if v4 and p in HF_RENAMED_FLOAT]
    return tuple(hits + renamed)


EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")  # the roles; a stack's `hf_names` are their names on disk


def expert_part(experts: Experts, part: str) -> str:
    """The on-disk name of an expert's "gate_proj" | "up_proj" | "down_proj" (DeepSeek-V4's: w1, w3, w2)."""
    return dict(zip(EXPERT_PARTS, experts.hf_names, strict=True))[part]


def expert_names(prefix: str, experts: Experts) -> list[str]:
    return [f"{prefix}.{e}.{p}" for e in range(experts.num_experts) for p in experts.hf_names]


def is_gpt_oss_experts(module: Any) -> bool:
    return isinstance(module, Experts) and module.hf_layout == "gpt_oss"


def gpt_oss_mxfp4(scheme: Scheme) -> bool:
    """Whether `scheme` writes GPT-OSS's own MXFP4 expert layout: weight-only MXFP4 (mxfp4a16, RTN or GPTQ)."""
    return scheme.weight == "mxfp4" and scheme.act is None


def quant_units(model: nnx.Module, ignore: Sequence[str] = (), scheme: Scheme | None = None, *,
                float_by_default: bool = True) -> list[Unit]:
    """Every Linear (but lm_head) and Experts stack not matched by `ignore`, in a stable order; with
    `float_by_default` False also the FLOAT_BY_DEFAULT Linears (what a loaded checkpoint may hold quantized).

    An Experts stack is matched by its own name or by all of its per-expert names; ignoring only some
    experts of a stack is refused (an engine loads a stack with one format). With `scheme` mxfp4a16 and
    GPT-OSS experts among them, only the experts: GPT-OSS's MXFP4 checkpoint keeps every Linear float."""
    units = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            name = hf_name(path)
            skip = (*ALWAYS_IGNORED, *OTHER_HEADS, *(FLOAT_BY_DEFAULT if float_by_default else ()), *ignore)
            if not _matches(name, skip):
                units.append(Unit(name, tuple(path), node))
        elif isinstance(node, Experts):
            name = hf_name(path)
            hits = [_matches(n, ignore) for n in expert_names(name, node)]
            if _matches(name, ignore) or all(hits):
                continue
            if any(hits):
                raise ValueError(f"quantize.ignore matches only some of {name}'s experts; ignore the whole "
                                 f"stack ({name!r}) or none of it")
            units.append(Unit(name, tuple(path), node))
    if scheme is not None and gpt_oss_mxfp4(scheme) and any(is_gpt_oss_experts(u.module) for u in units):
        units = [u for u in units if isinstance(u.module, Experts)]
    return units


def is_quantized(model: nnx.Module) -> bool:
    for _, node in nnx.iter_graph(model):
        if (isinstance(node, Linear) and node.qweight is not None) or (isinstance(node, Experts) and node.quantized):
            return True
    return False


def check_divisible(units: Sequence[Unit], scheme: Scheme) -> None:
    """A group size must divide every quantized layer's input width (compressed-tensors and the serving
    kernels need whole groups): one error naming the first offending layer and the way out."""
    if scheme.group_size is None:  # channels or tiles: nothing to divide
        return
    way_out = "add" if scheme.format.fixed_group else "pick a group size that divides it (suffix -g<N>) or add"
    for unit in units:
        for name, n_in in unit.in_features():
            if n_in % scheme.group_size:
                raise ValueError(f"scheme {scheme.name}: group size {scheme.group_size} does not divide {name}'s "
                                 f"input width {n_in}; {way_out} the layer to quantize.ignore")


def check_supported(units: Sequence[Unit], scheme: Scheme) -> None:
    """check_divisible, and GPT-OSS's fused experts only with mxfp4a16[-gptq] (their one on-disk layout is
    GPT-OSS's MXFP4; they have no compressed-tensors one), and then no Linear beside them (`quant_units`
    with the scheme leaves them out: GPT-OSS's checkpoint keeps attention float)."""
    gpt_oss = [u.name for u in units if is_gpt_oss_experts(u.module)]
    if gpt_oss and not gpt_oss_mxfp4(scheme):
        raise ValueError(f"quantize: scheme {scheme.name}: {gpt_oss[0]}: GPT-OSS's fused experts are written only "
                         "in GPT-OSS's own MXFP4 layout: quantize them with mxfp4a16 (or mxfp4a16-gptq), or add "
                         "'re:.*mlp\\.experts' to quantize.ignore")
    if gpt_oss and (linears := [u.name for u in units if isinstance(u.module, Linear)]):
        raise ValueError(f"quantize: scheme {scheme.name}: {linears[0]}: with GPT-OSS's MXFP4 experts every Linear "
                         "stays float (one quantization_config per checkpoint); select the units with "
                         "quant_units(model, ignore, scheme)")
    check_divisible(units, scheme)


def check_folds(units: Sequence[Unit], scheme: Scheme, rotate: str | None) -> None:
    """DeepSeek-V4 (clamped SwiGLU experts) with a transform that folds scales or rotations into the model: refused
    by name, the rest of quantization (RTN, GPTQ, the FP8 / FP4 / int formats, unsmoothed W8A8) runs on it. AWQ's
    fold through the up projection into down_proj moves the clamp (clip(up / s) ≠ clip(up) / s); the AWQ /
    SmoothQuant norm folds and the rotations cover the GQA / MLA readers of the normed input, not V4's (its
    compressors, its indexer, its q latent's two readers); a rotation of the residual would also have to rotate
    every mHC stream and the hc_fn / hc_head weights that read them."""
    v4 = [u.name for u in units if getattr(u.module, "activation", None) == "silu_clamped"]
    folds = [what for what, on in (("AWQ", scheme.method == "awq"), ("SmoothQuant", scheme.smooth),
                                   (f"rotate={rotate}", rotate is not None)) if on]
    if v4 and folds:
        way_out = " (int8-w8a8-nosmooth quantizes without it)" if folds == ["SmoothQuant"] else ""
        raise ValueError(f"quantize: scheme {scheme.name}: {folds[0]}: DeepSeek-V4 ({v4[0]}: clamped experts, "
                         f"compressed attention, mHC streams) is not supported by quantization's folds{way_out}; "
                         "RTN, GPTQ and the FP8 schemes are")


def _module(root: nnx.Module, rel: str) -> Any:
    node = root
    for p in rel.split("."):
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    return node
