"""What one decoder layer costs a token, for model-FLOPs accounting (MFU): each family's config answers
`layer_flops()` with one `LayerFlops` per layer of its main stack (MTP layers are not in it), so the
training code needs no knowledge of the families. The FLOP formula over these numbers (PaLM, Chowdhery
et al. 2022, appendix B) is `tasks.training.flops.train_flops_per_token`.

Matmul weights count what a token touches: attention projections, then a dense MLP or the router plus
the top-k routed experts plus the shared experts. Biases, norms and sinks are not matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerFlops:
    """What one decoder layer costs a token: matmul weights touched, attention widths, attended keys."""

    matmul_params: int  # attention projections + (dense MLP | router + top-k experts + shared experts)
    qk_width: int  # heads × query/key head dim
    v_width: int  # heads × value head dim
    window: int | None  # sliding-window keys per query (None: full causal attention)


def swiglu(hidden: int, width: int) -> int:
    """gate and up [D, F], down [F, D]."""
    return 3 * hidden * width


def gqa_layer(config: Any, ffn: int, window: int | None = None) -> LayerFlops:
    """Grouped-query attention (q: N heads, k and v: K heads, of H dims each; o back to D) plus `ffn`."""
    D, N, K, H = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return LayerFlops(D * H * (N + 2 * K) + N * H * D + ffn, N * H, N * H, window)


def routed_ffn(config: Any, experts: int, width: int, shared: int = 0) -> int:
    """A router over `experts`, top-k (`num_experts_per_tok`) SwiGLU experts of `width`, and `shared`
    always-on experts of the same width (DeepSeek-V3 / GLM-4.5's shared expert is one MLP of shared × width)."""
    D = config.hidden_size
    return D * experts + config.num_experts_per_tok * swiglu(D, width) + (swiglu(D, width * shared) if shared else 0)
