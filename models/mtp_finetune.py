"""Fine-tuning a target's OWN multi-token-prediction (MTP) layers as a speculative-decoding draft.

DeepSeek-V3/R1 / V3.2 and GLM-4.5 / GLM-5 ship MTP layers after their main stack (`model.layers.{L + m}`,
models/decoder.py `MTPLayer`; V3.2's and GLM-5's with their own DSA indexer). After the target is fine-tuned, its
MTP layer no longer matches the target's distribution; this module re-trains only that layer on the fine-tuned
target's own traces, FastMTP-style, so that the release can ship it as the draft that models/speculative.py
`MTPDraft` runs.

    trainable = mtp_trainable(model)                                   # an nnx filter: the MTP layers only
    total, stats = mtp_loss(model, batch, final_hidden=f, target_logits=model.lm_logits(f), steps=3)
    tensors = mtp_state_dict(model)                                    # {"model.layers.{L+m}.*": np.ndarray}
    load_mtp_state(other_model, tensors)

The objective mirrors:
  * FastMTP (Cai et al., arXiv 2509.18362): ONE MTP layer reused recursively for `steps` steps, each step a
    full causal pass over the sequence, step k fed the ground-truth token t_{p+1+k} and the previous step's
    output hidden state; the step losses weighted by normalised exponential decay α_k = β^k / Σ_j β^j (Eq. 2).
  * vllm-project/speculators 0.9.0 `speculators/models/mtp/core.py` (`MTPDraftModel.forward`,
    `compute_step_weights`): the same recursion, the hidden fed back after the MTP layer's final norm, the
    same rotary positions at every step, the gradient flowing through the recursion (no stop-gradient).
  * DeepSeek-V3 (arXiv 2412.19437, §2.2 Multi-Token Prediction): h'_i = M [RMSNorm(h_i); RMSNorm(Emb(t_{i+k}))],
    then the block, the shared output head; the embedding and the output head are shared with the main model.

Differences from speculators (all deliberate):
  * packed rows: several sequences per row (`segment_ids`), attention and labels kept within a segment;
    speculators trains one unpacked sequence per row (batch 1);
  * soft labels: with `target_logits` every step is scored against the target's own next-token distribution
    at the label position through models/draft_losses.py (`kl_div`, `tv`, ... as speculators names them);
    speculators' MTP trains hard cross entropy on the data tokens (ours without `target_logits`);
  * the loss is a weighted SUM over positions (the trainer divides by its token count), not a per-step mean;
  * h at step 0 is the target's final NORMED hidden f_p, as transformers' `MTPCandidateGenerator` and our
    `MTPDraft` feed it at inference (models/decoder.py MTPLayer).

Shape legend: B batch, T length, D model width, V vocab, L main-stack layers, m MTP depth, k recursion step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder import DecoderLM, build_context
from models.draft_losses import Objective, check_objective, draft_loss
from models.hf import Placer, hf_tensors, hf_to_state, place_whole, to_host
from models.layers import hf_name

__all__ = ["load_mtp_state", "mtp_layer_names", "mtp_loss", "mtp_loss_fn", "mtp_state_dict", "mtp_trainable",
           "mtp_unroll", "step_weights", "target_final_hidden"]

# Names inside an MTP layer that, in published DeepSeek/GLM checkpoints, are copies of the main model's
# embedding and LM head (models/decoder.py `hf_extra_export` writes them; our MTPLayer does not hold them).
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _mtp_indices(model: DecoderLM) -> range:
    """The layer indices L .. L + num_mtp_layers - 1 of the MTP layers."""
    L = model.config.num_hidden_layers
    return range(L, L + model.num_mtp_layers)


def _check_depth(model: DecoderLM, depth: int) -> None:
    if not 0 <= depth < model.num_mtp_layers:
        raise ValueError(f"mtp depth {depth}: the model has {model.num_mtp_layers} MTP layers "
                         "(build it with num_mtp_layers >= 1)")


# ------------------------------------------------------------------------------------------------
# 1. What is trained: the MTP layers' own parameters
# ------------------------------------------------------------------------------------------------


def mtp_trainable(model: DecoderLM) -> Any:
    """An nnx filter selecting exactly the `nnx.Param`s under `layers.{L + m}` (m < num_mtp_layers): the
    MTP block, enorm, hnorm, eh_proj and shared_head.norm. The embedding and the LM head the MTP layers use
    are the main model's (`model.embed_tokens`, `model.lm_head`: the checkpoints' `embed_tokens` /
    `shared_head.head` inside the MTP layer are copies of them), so they stay frozen with the main stack.
    Buffers (DeepSeek's e_score_correction_bias) are not Params and stay frozen too."""
    if model.num_mtp_layers < 1:
        raise ValueError("mtp_trainable: the model has no MTP layers (build it with num_mtp_layers >= 1)")
    indices = frozenset(_mtp_indices(model))
    shared = tuple(c.rsplit(".", 1)[0] for c in SHARED_COPIES)  # "embed_tokens", "shared_head.head"

    def in_mtp_layer(path: tuple, value: Any) -> bool:
        if len(path) < 2 or path[0] != "layers" or path[1] not in indices:
            return False
        inner = ".".join(str(p) for p in path[2:])
        return not any(inner == s or inner.startswith(s + ".") for s in shared)

    return nnx.All(nnx.Param, in_mtp_layer)


# ------------------------------------------------------------------------------------------------
# 2. The recursive multi-step loss (FastMTP)
# ------------------------------------------------------------------------------------------------


def step_weights(beta: float = 0.6, steps: int = 3) -> list[float]:
    """FastMTP's step weights α_k = β^k / Σ_{j<steps} β^j, k = 0 .. steps-1 (speculators'
    `compute_step_weights`)."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    raw = [float(beta) ** k for k in range(steps)]
    total = sum(raw)
    return [w / total for w in raw]


def _shift(x: jax.Array, s: int) -> jax.Array:
    """Row p holds x[p + s]; zeros (False) past the end. [B, T, ...] -> [B, T, ...]"""
    T = x.shape[1]
    if s >= T:
        return jnp.zeros_like(x)
    pad = [(0, 0), (0, s)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, s:], pad)


def mtp_unroll(model: DecoderLM, input_ids: jax.Array, final_hidden: jax.Array, *, positions: jax.Array,
               segment_ids: jax.Array | None, steps: int, depth: int = 0) -> list[jax.Array]:
    """The MTP layer `depth` unrolled `steps` times without a cache -> logits [B, T, V] of each step.

    Step k at row p reads token t_{p+1+k} (input_ids[p + 1 + k], 0 past the end) and h = f_p (k = 0) or
    step k-1's output at p after shared_head.norm, attends causally within p's segment to the same step's
    rows, and predicts t_{p+2+k}. Rotary positions are `positions` at every step (speculators; MTPDraft puts
    the chained entry at p + k, a uniform shift per pass: RoPE sees only differences, so the logits agree).
    """
    _check_depth(model, depth)
    B, T = input_ids.shape
    L = model.config.num_hidden_layers
    layer = model.layers[L + depth]
    ctx, _ = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=None, windows=set())
    ctx.rope = model.rope(ctx.positions)
    h = final_hidden  # [B, T, D]
    out = []
    for k in range(steps):
        emb = model.embed_tokens(_shift(input_ids, 1 + k))  # [B, T, D]: t_{p+1+k}
        h = layer.predict(emb, h, ctx, L + depth)  # [B, T, D] normed; the next step's hidden
        out.append(model.lm_logits(h))  # [B, T, V]: predicts t_{p+2+k}
    return out


def mtp_loss(model: DecoderLM, batch: Mapping[str, jax.Array], *, final_hidden: jax.Array,
             target_logits: jax.Array | None = None, steps: int = 3, step_weight_beta: float = 0.6,
             objective: Objective = "kl_div", temperature: float = 1.0, depth: int = 0
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """FastMTP's recursive multi-step loss of MTP layer `depth` over one packed batch (jit / grad friendly).

    batch: data_prep's packed columns `input_ids` (t_p), `target_ids` (t_{p+1}), `positions`, `segment_ids`
    (0 = padding), `loss_mask` [B, T] (loss_mask[p]: t_{p+1} is an answer token). `final_hidden` [B, T, D]:
    the frozen target's final normed hidden f_p (tasks/data/features.py `target_features`). `target_logits`
    [B, T, V] (optional): the target's logits at every position, `model.lm_logits(final_hidden)`.

    Step k at row p (see `mtp_unroll`) predicts t_{p+2+k}. Its label: soft, `draft_loss(logits_k[p],
    target_logits[p+1+k], objective, temperature)`, when `target_logits` is given; else hard cross entropy
    on target_ids[p+1+k] (`objective` / `temperature` then unused). Mask m_k[p] = loss_mask[p+1+k] ∧
    (p+1+k in p's segment) ∧ segment_ids[p] != 0.

    Returns (Σ_k α_k Σ_{b,p} m_k · loss_k, stats) with α = `step_weights(step_weight_beta, steps)` and stats
    (each [steps], fp32): `loss` the unweighted per-step sums, `acc_num` masked rows where the draft argmax
    equals the target's argmax (soft) or the label (hard), `acc_den` masked rows. The caller divides by its
    token count.
    """
    weights = step_weights(step_weight_beta, steps)
    soft = target_logits is not None
    if soft:
        check_objective(objective)
    ids, labels = batch["input_ids"], batch["target_ids"]
    seg, loss_mask = batch["segment_ids"], batch["loss_mask"] != 0

    if soft:
        target_logits = target_logits.astype(jnp.float32)  # [B, T, V]
        label_arg = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, T]
    else:
        label_arg = labels.astype(jnp.int32)  # [B, T]

    all_logits = mtp_unroll(model, ids, final_hidden, positions=batch["positions"], segment_ids=seg,
                            steps=steps, depth=depth)
    total = jnp.zeros((), jnp.float32)
    losses, nums, dens = [], [], []
    for k, logits in enumerate(all_logits):
        s = 1 + k  # label offset: step k at p is scored at position p + 1 + k
        keep = _shift(loss_mask, s) & (_shift(seg, s) == seg) & (seg != 0)  # [B, T]
        m = keep.astype(jnp.float32)
        logits = logits.astype(jnp.float32)  # [B, T, V]
        if soft:
            per_pos = draft_loss(logits, _shift(target_logits, s), objective, temperature)  # [B, T]
        else:
            logp = jax.nn.log_softmax(logits, axis=-1)
            per_pos = -jnp.take_along_axis(logp, _shift(label_arg, s)[..., None], axis=-1)[..., 0]  # [B, T]
        loss_k = jnp.sum(jnp.where(keep, per_pos, 0.0))  # rows past a segment's end never reach the sum
        correct = (jnp.argmax(logits, axis=-1) == _shift(label_arg, s)).astype(jnp.float32)  # [B, T]
        total = total + weights[k] * loss_k
        losses.append(loss_k)
        nums.append(jnp.sum(m * correct))
        dens.append(jnp.sum(m))
    stats = {"loss": jnp.stack(losses), "acc_num": jnp.stack(nums), "acc_den": jnp.stack(dens)}
    return total, stats


def target_final_hidden(model: DecoderLM, batch: Mapping[str, jax.Array]) -> jax.Array:
    """The target's final normed hidden f_p [B, T, D] of packed rows under stop_gradient, zero at padding
    (tasks/data/features.py `target_features`' `final`, without the EAGLE-3 features)."""
    _, (final,) = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                        return_hidden=(-1,))
    final = jnp.where((batch["segment_ids"] != 0)[..., None], final, 0)  # [B, T, D]
    return jax.lax.stop_gradient(final)


def mtp_loss_fn(*, steps: int = 3, step_weight_beta: float = 0.6, objective: Objective = "kl_div",
                temperature: float = 1.0, soft: bool = True, depth: int = 0) -> Any:
    """A tasks/training `LossFn` (model, batch) -> (loss sum, MoE aux loss) for `Trainer(model, cfg,
    trainable=mtp_trainable(model), loss_fn=...)`: the target's final normed hidden (and, with `soft`, its
    logits as labels) computed online from the frozen main stack under stop_gradient, then `mtp_loss`.
    The aux loss is the MTP layers' MoE load-balancing loss as they sow it (0 when nothing is sown)."""

    def loss_fn(model: DecoderLM, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        def run(model: DecoderLM) -> jax.Array:
            final = target_final_hidden(model, batch)  # [B, T, D]: the frozen target's f_p
            logits = jax.lax.stop_gradient(model.lm_logits(final)) if soft else None  # [B, T, V]
            total, _ = mtp_loss(model, batch, final_hidden=final, target_logits=logits, steps=steps,
                                step_weight_beta=step_weight_beta, objective=objective,
                                temperature=temperature, depth=depth)
            return total

        total, sown = nnx.capture(run, nnx.Intermediate)(model)
        # only what the trained MTP layer sowed (the main stack's MoE layers sow during the features forward)
        mtp = model.config.num_hidden_layers + depth
        leaves = [jnp.sum(x) for path, v in nnx.to_flat_state(sown) if path[:2] == ("layers", mtp)
                  for x in jax.tree.leaves(v)]
        return total, sum(leaves, jnp.float32(0.0)) / max(len(leaves), 1)

    return loss_fn


# ------------------------------------------------------------------------------------------------
# 3. Export / import of the MTP layers under their HF checkpoint names
# ------------------------------------------------------------------------------------------------


def mtp_layer_names(model: DecoderLM) -> tuple[str, ...]:
    """The HF module prefixes of the MTP layers: ("model.layers.{L}.", ...) (models/layers.py `hf_name`)."""
    return tuple(hf_name(("layers", i)) + "." for i in _mtp_indices(model))


def mtp_state_dict(model: DecoderLM, dtype: Any = "bfloat16", *, include_shared: bool = True
                   ) -> dict[str, np.ndarray]:
    """The MTP layers' tensors as models/hf.py `save_pretrained` writes them (`hf_tensors`: the same names,
    [out, in] weights, stacked experts split per expert, fp32 buffers and sigmoid routers kept fp32), in
    `dtype`, on the host. With `include_shared` also the layers' `embed_tokens` / `shared_head.head` copies
    of the main embedding and LM head (which published checkpoints carry, and `load_mtp_state` skips)."""
    if model.num_mtp_layers < 1:
        raise ValueError("mtp_state_dict: the model has no MTP layers")
    prefixes = mtp_layer_names(model)
    out: dict[str, np.ndarray] = {}
    for name, fn in hf_tensors(model, dtype=jnp.dtype(dtype)):
        if not name.startswith(prefixes):
            continue
        if not include_shared and name.split(".", 3)[3] in SHARED_COPIES:
            continue
        out[name] = to_host(fn())  # only these tensors are computed (hf_tensors is lazy)
    return out


def load_mtp_state(model: DecoderLM, tensors: Mapping[str, np.ndarray], *, place: Placer = place_whole) -> None:
    """Install MTP-layer tensors named as `mtp_state_dict` writes them into `model` in place, through
    models/hf.py `hf_to_state` (the same views as a checkpoint load: transposed Linear weights, per-expert
    stacks, `place` for sharded models). Every MTP-layer tensor must be present; the shared embedding / head
    copies are ignored (the main ones stay); anything else raises one ValueError naming it."""
    prefixes = mtp_layer_names(model)
    stray = sorted(n for n in tensors if not n.startswith(prefixes))
    if stray:
        raise ValueError(f"load_mtp_state: {len(stray)} tensors outside the MTP layers {list(prefixes)}: "
                         f"{', '.join(stray[:8])}")
    for i, prefix in zip(_mtp_indices(model), prefixes, strict=True):
        # hf_to_state names a sub-module's tensors from its own root ("model.<inner>"): re-root them
        local = {"model." + n[len(prefix):]: v for n, v in tensors.items()
                 if n.startswith(prefix) and n[len(prefix):] not in SHARED_COPIES}
        hf_to_state(model.layers[i], local, source=f"{prefix[:-1]} (MTP layer)", place=place)
