"""Model FLOPs per token and the measured matmul peak, the two halves of MFU.

Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B): 6N per token for the matmul weights N a token
touches (forward 2N + backward 4N) plus 12·L·H·Q·T for attention scores and values; MoE counts only the
active experts (each family's `layer_flops` in models/). The exact conventions are in `train_flops_per_token`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from models.flops import LayerFlops
from storage import cache_root

# -- peak FLOP/s -----------------------------------------------------------------------------------

_PEAK: dict[str, float] = {}


def measure_matmul_flops(dtype: Any = jnp.float32, n: int = 2048, repeats: int = 10) -> float:
    """One fresh reading: FLOP/s of a jitted [n, n] @ [n, n] matmul on the default backend, 2n³ over the
    best of `repeats` timed calls (compilation and a warm-up call excluded)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)  # [n, n]
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()  # compile + warm-up
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def matmul_peak_flops(dtype: Any = jnp.float32, n: int = 2048, repeats: int = 10) -> float:
    """`measure_matmul_flops`, measured once per machine: the reading is kept in forgeline's cache folder
    (`$FORGELINE_CACHE/matmul_peak.json`) under the host, jax's version, the backend, the device kind, the CPUs
    this process may use (XLA:CPU sizes its thread pool by them), the dtype and `n`, and every later process
    there reads it instead (a reading took 1.5-3 s of each training process's start on 2 CPU cores). Only
    compare MFU numbers taken against the same reading; on a machine busy with other work the reading can be
    low (MFU then reads high): delete the file to measure again."""
    key = "|".join((socket.gethostname(), jax.__version__, jax.default_backend(), jax.devices()[0].device_kind,
                    str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
                    jnp.dtype(dtype).name, str(n)))
    if key in _PEAK:
        return _PEAK[key]
    path = cache_root() / "matmul_peak.json"
    known = _read_peaks(path)
    if not (isinstance(known.get(key), float) and known[key] > 0):
        reading = measure_matmul_flops(dtype, n, repeats)
        known = {**_read_peaks(path), key: reading}  # read again after the seconds measured: others' readings kept
        try:  # whole or not at all: another process may read (or write) it at the same moment
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:  # a read-only cache folder: this process keeps its reading to itself
            pass
    _PEAK[key] = known[key]
    return _PEAK[key]


def _read_peaks(path: Path) -> dict[str, float]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in found.items() if isinstance(v, float)} if isinstance(found, dict) else {}


# -- model FLOPs per token -------------------------------------------------------------------------


def layer_flops(config: Any) -> list[LayerFlops]:
    """Per-layer accounting of the main stack (MTP layers are not in it), as the family's config reports it."""
    if not callable(getattr(config, "layer_flops", None)):
        raise TypeError(f"train_flops_per_token: unsupported config {type(config).__name__} (a family's config "
                        f"reports its FLOPs with layer_flops(), models/flops.py)")
    return config.layer_flops()


def matmul_params_per_token(config: Any) -> int:
    """N of PaLM's 6N: matmul weights one token touches — every layer's projections, the router and the
    active experts only (top-k of E, plus shared), and the LM head (counted even when tied to the
    embedding, whose lookup is not a matmul and is excluded). Biases, norms and sinks are not matmuls."""
    return sum(layer.matmul_params for layer in layer_flops(config)) + config.hidden_size * config.vocab_size


def attended_keys(seq_len: int, window: int | None, causal: bool) -> float:
    """Keys per query: PaLM counts the whole sequence (min(T, W) with a sliding window of W keys); with
    `causal` the exact mean over positions of min(t + 1, W), about T/2 (MaxText's halving, PR #1988)."""
    W = seq_len if window is None else min(window, seq_len)
    if not causal:
        return float(W)
    return (W * (W + 1) / 2 + (seq_len - W) * W) / seq_len


def train_flops_per_token(config: Any, seq_len: int, trainable_only: bool = False, *, adapter_params: int = 0,
                          causal: bool = False) -> float:
    """Model FLOPs of one training step per token at sequence length `seq_len` (PaLM appendix B).

        6·N + Σ_layers 6·keys·(H·Q_qk + H·Q_v)      (= 6N + 12·L·H·Q·T for plain full attention)

    N is `matmul_params_per_token(config)`. The attention term is 2 FLOPs per multiply-add for q·k and
    p·v over `keys = attended_keys(T, window, causal)`, × 3 for forward + backward; MLA uses its own
    query/key (nope + rope) and value head dims. Rematerialisation is not counted (MFU, not HFU).

    `trainable_only=True` is the LoRA convention (frozen base): the base weights still cost the forward
    (2N) and the activation gradients that flow through them (2N) but no weight gradients, so 4N; the
    attention term is all activation gradients and stays; `adapter_params` (trainable matmul weights
    outside N, e.g. LoRA A and B factors touched by every token) are counted at 6 each.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1 (got {seq_len})")
    per_param = 4 if trainable_only else 6
    flops = per_param * matmul_params_per_token(config) + 6 * adapter_params
    for layer in layer_flops(config):
        flops += 6 * attended_keys(seq_len, layer.window, causal) * (layer.qk_width + layer.v_width)
    return float(flops)


# -- per-step metrics ------------------------------------------------------------------------------
