"""LoRA target presets: regexes over HF module paths (models/lora.py matches them with `re.fullmatch`).

Kept apart from models/lora.py, which imports JAX, so that a recipe can default to a preset and be
validated without it (tasks/configs.py).
"""

# Every projection of every decoder layer: attention (GQA and MLA), dense MLP, shared experts and the
# stacked routed experts. Not the LM head, the embeddings or the routers.
#
# DeepSeek-V4 (models/deepseek_v4.py) is matched by its own HF names (the reference's `attn.*` / `ffn.*`, not
# `self_attn` / `mlp`): the low-rank query (wq_a, wq_b), the shared K=V projection (wkv), the grouped low-rank
# output (wo_a, G blocks, and wo_b), the clamped shared expert (w1, w3, w2) and the routed experts. Its CSA / HCA
# layers' compressor (`attn.compressor.{wkv, wgate}`) is in: the compressed entries it makes are keys and values
# of the attention (a softmax(wgate x + ape)-weighted sum of wkv x, RMS-normed), so the task loss differentiates
# it as it does wkv, and it is a per-token projection of the residual stream like every other target. The
# indexer of a CSA layer (`attn.indexer.{wq_b, weights_proj}` and its own `attn.indexer.compressor.*`) is out,
# for the reason INDEXER gives below: it only chooses which compressed entries a query sees.
ALL_LINEAR = (
    r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)",
    r".*\.mlp\.(gate_proj|up_proj|down_proj)",
    r".*\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)",
    r".*\.mlp\.experts",
    r".*\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)",  # DeepSeek-V4 attention
    r".*\.attn\.compressor\.(wkv|wgate)",  # DeepSeek-V4 CSA / HCA compressor (not the indexer's)
    r".*\.ffn\.shared_experts\.(w1|w2|w3)",  # DeepSeek-V4 shared expert
    r".*\.ffn\.experts",  # DeepSeek-V4 routed experts
)

# A DSA model's lightning indexer (DeepSeek-V3.2, GLM-5): its query, key and head-weight projections. Not in
# ALL_LINEAR: the task loss gives them no gradient (the top-k selection is not differentiable), only the
# indexer's own KL objective does (`finetune.indexer.mode: kl`, which needs these targets in LoRA mode).
# DeepSeek-V4's indexer is not here: this repository has no KL objective for it (`finetune.indexer.mode: kl`
# refuses a V4 base), so an adapter on it would never leave its init.
INDEXER = (r".*\.self_attn\.indexer\.(wq_b|wk|weights_proj)",)
