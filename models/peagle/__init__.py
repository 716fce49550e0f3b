"""P-EAGLE: an EAGLE-3 draft that proposes all k draft tokens in ONE forward (parallel drafting), one
file each:

    model.py     PEagleConfig, PEagleDraft (Eagle3Draft + a learned `mask_hidden` and a mask token, `propose`)
    loss.py      `parallel_unroll`: the training-time view of the parallel depths (for `ttt_loss`)
    export.py    the vLLM speculators layout (`PEagleSpeculator`), written and read

    draft = PEagleDraft(PEagleConfig(**eagle3_fields, mask_token_id=0, num_depths=5), rngs=nnx.Rngs(0))
    logits, cache = draft.propose(pend_tok, pend_feat, pend_n, cache=cache, k=5)   # [B, k, Vd]

Mirrors P-EAGLE as vllm-project/speculators 0.9.0 implements it (`models/peagle/{config,core,attention}.py`)
and vLLM serves it (`"parallel_drafting": true`). See docs/speculative-decoding.md (parallel drafting)
and docs/formats/peagle.md.

Tests: `pytest tests/unit/test_peagle.py tests/parity/test_peagle_export.py`.
"""

from models.lazy import exports

_LAZY = {
    "PEagleConfig": "models.peagle.model",
    "PEagleDraft": "models.peagle.model",
    "parallel_unroll": "models.peagle.loss",
    "load_peagle": "models.peagle.export",
    "save_peagle": "models.peagle.export",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = exports(__name__, _LAZY)
