"""EAGLE-3 draft head: one Llama decoder layer on fused target features, a pruned draft vocabulary,
the training-time-test (TTT) loss, and the SGLang / vLLM-speculators checkpoint layouts, one file each:

    config.py    Eagle3Config and the SGLang / speculators config.json formats
    model.py     Eagle3Draft (fc, midlayer, norm, lm_head; the target's embedding)
    loss.py      the TTT unroll and loss
    vocab.py     the pruned vocabulary (d2t / t2d)
    export.py    the SGLang (`midlayer.*`) and speculators (`layers.0.*`) layouts, written and read

    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=32000)
    draft = Eagle3Draft(cfg, rngs=nnx.Rngs(0))
    draft.load_embedding(target.embed_tokens.weight[...])            # frozen, never exported
    feats = jnp.concatenate(target(ids, return_hidden=draft.target_layers)[1], -1)   # [B, T, 3·D_t]
    logits, hidden, _ = draft(next_ids, features=feats, positions=pos)  # [B, T, Vd], [B, T, D]

Mirrors EAGLE-3 (arXiv:2503.01840), vllm-project/speculators 0.9.0 `models/eagle3/` and SGLang's
`LlamaForCausalLMEagle3`. See docs/speculative-decoding.md and docs/formats/eagle3.md.

Tests: `pytest tests/unit/test_eagle3.py` (cache decode, TTT against explicit loops, a numpy reference
of the exported tensors, both layouts' round trip, `for_target` on every family).
"""

from models.eagle3.config import Eagle3Config, default_aux_layer_ids
from models.eagle3.export import load_eagle3, save_sglang, save_speculators
from models.eagle3.loss import ttt_loss
from models.eagle3.model import Eagle3Draft
from models.eagle3.vocab import build_draft_vocab

__all__ = [
    "Eagle3Config", "Eagle3Draft", "build_draft_vocab", "default_aux_layer_ids", "load_eagle3", "save_sglang",
    "save_speculators", "ttt_loss",
]
