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
