"""DFlash block drafter: a few Qwen3-style layers that propose a whole block of tokens in ONE forward,
conditioned on the target's hidden-state features (keys / values of the context come from the fused
features, the block is [anchor token, mask, mask, ...] attended bidirectionally), one file each:

    config.py    DFlashConfig and the speculators `DFlashSpeculator` config.json
    model.py     DFlashDraft (fc, hidden_norm, layers, norm, lm_head; the target's embedding),
                 the training forward and the cached `context` / `propose` decoding interface
    loss.py      anchor selection and the per-slot block loss
    export.py    the speculators layout, written and read

    cfg = DFlashConfig.for_target(target.config, mask_token_id=mask_id, num_layers=2, block_size=8)
    draft = DFlashDraft(cfg, rngs=nnx.Rngs(0))
    draft.load_embedding(target.embed_tokens.weight[...])            # frozen, never exported
    draft.load_lm_head(target_lm_head_weight)                        # [V, D]; frozen unless train_lm_head
    feats = jnp.concatenate(target(ids, return_hidden=draft.target_layers)[1], -1)   # [B, T, num_aux·D]
    logits = draft(ids, feats, anchors, positions=pos, segment_ids=seg)  # [B, n, block_size, Vd]

Mirrors vllm-project/speculators 0.9.0 `models/dflash/` and DFlash (arXiv 2602.06036). See
docs/formats/dflash.md.

Tests: `pytest tests/unit/test_dflash.py` (propose against a plain-ops reference, cache against the
cache-free forward, the block loss against a loop reference, the export round trip) and
`pytest tests/parity/test_dflash_export.py` (speculators loads the export: logits and losses agree).
"""

from models.lazy import exports

# name -> the module that defines it, imported when first used (see models/eagle3/__init__.py)
_LAZY = {
    "DFlashConfig": "models.dflash.config",
    "load_dflash": "models.dflash.export",
    "save_dflash": "models.dflash.export",
    "block_loss": "models.dflash.loss",
    "select_anchors": "models.dflash.loss",
    "DFlashDraft": "models.dflash.model",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = exports(__name__, _LAZY)
