"""LoRA target presets: regexes over HF module paths (models/lora.py matches them with `re.fullmatch`).

Kept apart from models/lora.py, which imports JAX, so that a recipe can default to a preset and be
validated without it (tasks/configs.py).
"""

# Every projection of every decoder layer: attention (GQA and MLA), dense MLP, shared experts and the
# stacked routed experts. Not the LM head, the embeddings or the routers.
ALL_LINEAR = (
    r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)",
    r".*\.mlp\.(gate_proj|up_proj|down_proj)",
    r".*\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)",
    r".*\.mlp\.experts",
)

# A DSA model's lightning indexer (DeepSeek-V3.2, GLM-5): its query, key and head-weight projections. Not in
# ALL_LINEAR: the task loss gives them no gradient (the top-k selection is not differentiable), only the
# indexer's own KL objective does (`finetune.indexer.mode: kl`, which needs these targets in LoRA mode).
INDEXER = (r".*\.self_attn\.indexer\.(wq_b|wk|weights_proj)",)
