"""The sizing fields every family's config shares, checked before anything is built from them.

A config.json is user input: a size that is negative, zero, fractional, a string or a boolean must be refused
with the file and the key, not reach `nnx.eval_shape` (where JAX fails on the shape with a traceback) or a
silent mis-build. The names are transformers' own (`LlamaConfig`, `Qwen3MoeConfig`, `DeepseekV3Config`,
`GptOssConfig`, `Glm4MoeConfig`, `DeepseekV32Config`, `GlmMoeDsaConfig`), which our family configs keep; a key a
family does not use is still checked when present, so a wrong value never waits for the family that reads it.
`check_sizes` runs twice in a load: on config.json's dict (what the user wrote) and on the family config built from
it (what was derived, e.g. `head_dim = hidden_size // num_attention_heads`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")  # never None
POSITIVE_INT = (*REQUIRED, "intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "decoder_sparse_step", "sliding_window", "index_topk", "index_head_dim", "index_n_heads")
NONNEGATIVE_INT = ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers", "num_mtp_layers")
POSITIVE_FLOAT = ("rms_norm_eps", "rope_theta")
NONNEGATIVE_FLOAT = ("routed_scaling_factor", "router_aux_loss_coef")
LIMIT = 2**31 - 1  # every size indexes arrays with int32 somewhere (positions, expert ids, token ids)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def check_sizes(values: Mapping[str, Any] | Any, source: str) -> None:
    """Raise ValueError "`source`: <key> <value>: <what it must be>" for the first sizing field of `values` (a
    config.json dict or a family config dataclass) that no model can be built with."""
    if dataclasses.is_dataclass(values):
        values = {f.name: getattr(values, f.name) for f in dataclasses.fields(values)}
    for key in REQUIRED:
        if key in values and values[key] is None:
            raise ValueError(f"{source}: {key} is null: must be a positive integer")
    for keys, ok, what in ((POSITIVE_INT, lambda v: _is_int(v) and 0 < v <= LIMIT, "a positive integer"),
                           (NONNEGATIVE_INT, lambda v: _is_int(v) and 0 <= v <= LIMIT, "an integer >= 0"),
                           (POSITIVE_FLOAT, lambda v: _is_real(v) and v > 0, "a positive number"),
                           (NONNEGATIVE_FLOAT, lambda v: _is_real(v) and v >= 0, "a number >= 0")):
        for key in keys:
            v = values.get(key)
            if v is not None and not ok(v):
                raise ValueError(f"{source}: {key} {v!r}: must be {what}")
    experts = next((values[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if values.get(k)), None)
    top_k = values.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        raise ValueError(f"{source}: num_experts_per_tok {top_k}: more than the {experts} experts")
    groups, top_groups = values.get("n_group"), values.get("topk_group")
    if groups is not None and top_groups is not None and top_groups > groups:
        raise ValueError(f"{source}: topk_group {top_groups}: more than n_group {groups}")
    if groups is not None and values.get("n_routed_experts") and values["n_routed_experts"] % groups:
        raise ValueError(f"{source}: n_group {groups} does not divide n_routed_experts {values['n_routed_experts']}")
