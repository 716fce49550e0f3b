"""The P-EAGLE draft in Flax NNX: an EAGLE-3 draft (models/eagle3) that drafts all k tokens in one forward.

EAGLE-3 drafts token i+1 from its own token i and its own hidden output i, so k tokens cost k sequential
draft forwards. P-EAGLE appends k − 1 placeholder entries after the newest real entry, each carrying a
fixed mask token and a learned `mask_hidden` vector in place of the target feature, and runs them in the
same forward: the entry at depth d (d = 1 … k − 1) attends to the real context and to the depths before
it, and predicts the token d positions further ahead. One draft forward + one target verify per step.

    entry          token                 "feature" (fc input)   rotary position   predicts
    real p         t_{p+1}               f_p (target layers)    p                 t_{p+2}
    depth d ≥ 1    mask_token_id         mask_hidden            P − 1 + d         t_{P+1+d}

(P − 1 is the newest real entry, whose token is the newest emitted token x = t_P.)

Training (models/peagle/loss.py `parallel_unroll`) is the same picture at every position p at once: depth 0 is the plain
EAGLE-3 forward; depth d at anchor p attends to the depth-0 keys of positions ≤ p in its segment and to
the depth 1 … d keys of the same anchor, i.e. exactly the attention pattern of the EAGLE-3 training-time
test (models/eagle3/loss.py `ttt_attention`) with the mask inputs in place of the fed-back ones, and it
is scored against the target at p + 1 + d. speculators subsamples anchors per depth (COD sampling) to save
memory; here every anchor is kept at every depth (the cost of a TTT unroll of the same length).

Mirrors vllm-project/speculators 0.9.0 `models/peagle/core.py` (`PEagleDraftModel`: `mask_hidden`
[1, 1, num_aux·D_t], `mask_token_id`), `models/peagle/attention.py` (the mask) and vLLM's parallel
drafting (`speculative_config={"parallel_drafting": true}`). See docs/speculative-decoding.md.

Shape legend: B batch, T length, W pending-block width, k draft tokens, D draft width, F = num_aux·D_t,
Vd draft vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.eagle3.config import Eagle3Config
from models.eagle3.model import Eagle3Draft
from models.generate import KVCache
from models.layers import param

MASK_HIDDEN_STD = 1.0  # speculators initialises mask_hidden with torch.randn


@dataclasses.dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    """Eagle3Config plus the placeholder token and the number of parallel depths trained (the most
    draft tokens one forward proposes)."""

    mask_token_id: int = 0
    num_depths: int = 8  # speculators' default

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} must be a token id in [0, {self.vocab_size})")
        if self.num_depths < 1:
            raise ValueError("num_depths must be >= 1")

    @classmethod
    def from_eagle3(cls, config: Eagle3Config, *, mask_token_id: int, num_depths: int) -> PEagleConfig:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(Eagle3Config)}
        return cls(**fields, mask_token_id=int(mask_token_id), num_depths=int(num_depths))


class PEagleDraft(Eagle3Draft):
    """Eagle3Draft + `mask_hidden` [F] (an nnx.Param, exported) and `config.mask_token_id`; drafts k ≤
    `num_depths` tokens per forward with `propose`."""

    def __init__(self, config: PEagleConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        super().__init__(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        F = config.num_aux * config.target_hidden_size
        init = nnx.initializers.normal(MASK_HIDDEN_STD)
        self.mask_hidden = param(init(rngs.params(), (F,), param_dtype), ("mlp",))  # [F]

    @property
    def max_block(self) -> int:
        return self.config.num_depths

    def context(self, input_ids: jax.Array, features: jax.Array, *, positions: jax.Array,
                segment_ids: jax.Array | None = None, cache: KVCache) -> KVCache:
        """Write real entries (token t_{p+1}, feature f_p) [B, T] at each row's cache.length."""
        return self(input_ids, features=features, positions=positions, segment_ids=segment_ids, cache=cache)[2]

    def propose(self, input_ids: jax.Array, features: jax.Array, num_valid: jax.Array, *, cache: KVCache,
                k: int) -> tuple[jax.Array, KVCache]:
        """The pending block input_ids [B, W] / features [B, W, F] (entries j < num_valid[b] are real, at
        positions cache.length + j) plus k − 1 mask entries right after each row's last real entry, in one
        forward. -> (logits [B, k, Vd]: row i is the draft for the token at P + 1 + i, P = the position of
        the newest token; the cache holding the real entries only)."""
        if not 1 <= k <= self.max_block:
            raise ValueError(f"k {k}: this P-EAGLE draft was trained for 1..{self.max_block} parallel tokens")
        B, W = input_ids.shape
        Wp = W + k - 1
        j = jnp.arange(Wp, dtype=jnp.int32)[None, :]  # [1, Wp]
        n = num_valid[:, None]  # [B, 1]
        real, is_mask = j < n, (j >= n) & (j < n + k - 1)  # [B, Wp]
        tok = jnp.where(real, jnp.pad(input_ids, ((0, 0), (0, k - 1))), self.config.mask_token_id)  # [B, Wp]
        feats = jnp.pad(features, ((0, 0), (0, k - 1), (0, 0)))  # [B, Wp, F]
        feats = jnp.where(real[..., None], feats, self.mask_hidden[...].astype(feats.dtype))
        start = cache.length  # [B]
        logits, _, cache = self(tok.astype(jnp.int32), features=feats, positions=start[:, None] + j,
                                segment_ids=(real | is_mask).astype(jnp.int32), cache=cache)  # [B, Wp, Vd]
        idx = num_valid[:, None] - 1 + jnp.arange(k, dtype=jnp.int32)[None, :]  # [B, k]
        return jnp.take_along_axis(logits, idx[..., None], axis=1), cache.rollback(start + num_valid)
