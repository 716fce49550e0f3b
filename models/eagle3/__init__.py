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

from models.lazy import exports

# name -> the module that defines it, imported when first used: importing one part does not import the
# others, and `tasks/code.py` can tell what `from models.eagle3 import name` depends on.
_LAZY = {
    "Eagle3Config": "models.eagle3.config",
    "default_aux_layer_ids": "models.eagle3.config",
    "load_eagle3": "models.eagle3.export",
    "save_sglang": "models.eagle3.export",
    "save_speculators": "models.eagle3.export",
    "ttt_loss": "models.eagle3.loss",
    "Eagle3Draft": "models.eagle3.model",
    "build_draft_vocab": "models.eagle3.vocab",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = exports(__name__, _LAZY)
