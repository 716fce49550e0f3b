"""The served model's EAGLE-3 features of packed rows, computed the same way offline (traces writes them
to hidden-state files) and online (draft training computes them per batch), and those files:
`hidden-<split>-NNNNN.safetensors` beside each packed-row shard, holding per row the `aux` features (the
EAGLE-3 layers concatenated, [R, T, n·D]) and the `final` hidden state ([R, T, D]), in bfloat16 by
default, with the layer ids and the format in the file's metadata.
See docs/speculative-decoding.md (which target layers feed the draft, and why the final hidden state)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from models.hf import NUMPY_DTYPES, read_safetensors_header

HIDDEN_FORMAT = "forgeline-traces-hidden/1"


def target_features(model: nnx.Module, batch: Mapping[str, jax.Array],
                    aux_layer_ids: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """The EAGLE-3 features of packed rows, one teacher-forcing forward (pure, jittable; the ids are static).

    batch: `input_ids`, `positions`, `segment_ids` [B, T] (data_prep's packed columns; segments attend
    only within themselves, 0 = padding). Returns aux [B, T, n·D_t] (the outputs of decoder layers
    `aux_layer_ids`, concatenated in that order) and final [B, T, D_t] (the final normed hidden: the
    target's logits are `model.lm_logits(final)`), both zero at padding, in the model's dtype.
    """
    _, hidden = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                      return_hidden=tuple(aux_layer_ids) + (-1,))
    real = (batch["segment_ids"] != 0)[..., None]  # [B, T, 1]
    aux = jnp.where(real, jnp.concatenate(hidden[:-1], axis=-1), 0)  # [B, T, n·D_t]
    final = jnp.where(real, hidden[-1], 0)  # [B, T, D_t]
    return aux, final


def fixed_batches(rows: Mapping[str, np.ndarray], batch_size: int) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
    """(lo, hi, batch) over packed rows [R, T]: rows lo..hi-1 as the forward's columns in batches of one shape
    [min(batch_size, R), T] (one compiled program), the last one filled with padding rows."""
    R, T = np.shape(rows["input_ids"])
    B = max(1, min(batch_size, R))
    for lo in range(0, R, B):
        hi = min(lo + B, R)
        batch = {}
        for c in ("input_ids", "positions", "segment_ids"):
            x = np.zeros((B, T), np.int32)  # rows past R: all padding
            x[: hi - lo] = np.asarray(rows[c][lo:hi], np.int32)
            batch[c] = x
        yield lo, hi, batch


@functools.partial(jax.jit, static_argnames=("graphdef", "aux_layer_ids", "dtype"))
def _features_jit(graphdef, state, batch, *, aux_layer_ids: tuple[int, ...], dtype: str):
    aux, final = target_features(nnx.merge(graphdef, state), batch, aux_layer_ids)
    return aux.astype(jnp.dtype(dtype)), final.astype(jnp.dtype(dtype))  # the LM head is dead code here


def hidden_for_rows(model: nnx.Module, rows: Mapping[str, np.ndarray], aux_layer_ids: Sequence[int],
                    dtype: str | np.dtype = "float32", *, batch_size: int = 8) -> dict[str, np.ndarray]:
    """`target_features` over packed rows [R, T] in fixed batches of `batch_size` (one compiled shape):
    {"aux": [R, T, n·D_t], "final": [R, T, D_t]} as numpy arrays of `dtype` (bfloat16 via ml_dtypes)."""
    name = jnp.dtype(dtype).name
    R, T = np.shape(rows["input_ids"])
    graphdef, state = nnx.split(model)
    D, n = model.config.hidden_size, len(aux_layer_ids)
    out = {"aux": np.zeros((R, T, n * D), jnp.dtype(name)), "final": np.zeros((R, T, D), jnp.dtype(name))}
    for lo, hi, batch in fixed_batches(rows, batch_size):
        aux, final = _features_jit(graphdef, state, batch, aux_layer_ids=tuple(aux_layer_ids), dtype=name)
        out["aux"][lo:hi] = np.asarray(aux)[: hi - lo]
        out["final"][lo:hi] = np.asarray(final)[: hi - lo]
    return out


# -- shard persistence -----------------------------------------------------------------------------


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def write_hidden(path: Path, hidden: Mapping[str, np.ndarray], aux_layer_ids: Sequence[int]) -> None:
    """A hidden-state shard as safetensors (bfloat16 stored natively as BF16 through ml_dtypes)."""
    # one metadata entry: safetensors writes several in hash order, and shards must be byte-reproducible
    meta = {"forgeline": _canonical({"format": HIDDEN_FORMAT, "aux_layer_ids": list(aux_layer_ids),
                                     "dtype": hidden["aux"].dtype.name})}
    save_file({k: np.ascontiguousarray(v) for k, v in hidden.items()}, str(path), metadata=meta)


def load_hidden(path: str | Path) -> dict[str, np.ndarray]:
    """A hidden-state shard ({"aux": [R, T, n·D_t], "final": [R, T, D_t]}) as float32 arrays,
    whatever dtype it was stored in (BF16 / F16 / F32)."""
    header = read_safetensors_header(str(path))
    start = header.pop("__data_start__")
    raw = np.memmap(path, np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        data = raw[start + begin : start + end].view(NUMPY_DTYPES[info["dtype"]])
        out[name] = data.reshape(info["shape"]).astype(np.float32)
    return out


# -- the teacher's top-k log-probabilities (distillation) -------------------------------------------------

TOPK_FORMAT = "forgeline-traces-topk/1"


@functools.partial(jax.jit, static_argnames=("graphdef", "k"))
def _topk_jit(graphdef, state, batch, *, k: int):
    model = nnx.merge(graphdef, state)
    logits = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
    values, ids = jax.lax.top_k(logp, k)  # [B, T, K], highest first
    real = (batch["segment_ids"] != 0)[..., None]  # [B, T, 1]
    return jnp.where(real, values, 0.0), jnp.where(real, ids, 0).astype(jnp.int32)


def topk_for_rows(model: nnx.Module, rows: Mapping[str, np.ndarray], k: int, *,
                  batch_size: int = 8) -> dict[str, np.ndarray]:
    """The model's `k` most likely next tokens at every position of packed rows [R, T], one teacher-forcing
    forward per batch of `batch_size` rows (one compiled shape): {"topk_logprobs": [R, T, K] float32 (log-softmax
    over the whole vocabulary, so what the top k leave out is 1 - sum(exp)), "topk_ids": [R, T, K] int32}, zero
    at padding. Hinton et al. 2015 distil on the whole distribution; keeping the top k (Raman et al. 2023,
    "For distillation, tokens are not all you need"; Anshumann et al. 2025, "Sparse logit sampling") costs K·8
    bytes per token instead of V·4."""
    R, T = np.shape(rows["input_ids"])
    V = model.config.vocab_size
    if not 1 <= k <= V:
        raise ValueError(f"top_k_logits {k}: between 1 and the vocabulary size {V}")
    graphdef, state = nnx.split(model)
    out = {"topk_logprobs": np.zeros((R, T, k), np.float32), "topk_ids": np.zeros((R, T, k), np.int32)}
    for lo, hi, batch in fixed_batches(rows, batch_size):
        values, ids = _topk_jit(graphdef, state, batch, k=k)
        out["topk_logprobs"][lo:hi] = np.asarray(values)[: hi - lo]
        out["topk_ids"][lo:hi] = np.asarray(ids)[: hi - lo]
    return out


def write_topk(path: Path, topk: Mapping[str, np.ndarray]) -> None:
    """A top-k shard as safetensors (rows aligned with its packed-row shard)."""
    meta = {"forgeline": _canonical({"format": TOPK_FORMAT, "k": int(topk["topk_ids"].shape[-1])})}
    save_file({k: np.ascontiguousarray(v) for k, v in topk.items()}, str(path), metadata=meta)


def load_topk(path: str | Path) -> dict[str, np.ndarray]:
    """A top-k shard: {"topk_logprobs": [R, T, K] float32, "topk_ids": [R, T, K] int32}; anything else is an
    error naming the file (safetensors only: no pickle)."""
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get("forgeline", "{}"))
        if meta.get("format") != TOPK_FORMAT:
            raise ValueError(f"{path}: not a top-k logits shard (format {meta.get('format')!r}, want {TOPK_FORMAT})")
        out = {}
        for name, want in (("topk_logprobs", np.float32), ("topk_ids", np.int32)):
            out[name] = f.get_tensor(name) if name in f.keys() else None
            if out[name] is None or out[name].dtype != want:
                raise ValueError(f"{path}: {name} missing or not {np.dtype(want).name}")
    if out["topk_ids"].shape != out["topk_logprobs"].shape:
        raise ValueError(f"{path}: topk_ids {list(out['topk_ids'].shape)} and topk_logprobs "
                         f"{list(out['topk_logprobs'].shape)} differ")
    return out
