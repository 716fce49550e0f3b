"""Hadamard rotations folded into the weights (QuaRot, Ashkboos et al. 2024, arXiv:2404.00456; SpinQuant,
Liu et al. 2024, arXiv:2405.16406): remove activation outliers before low-bit activation quantization
without changing the float model's function.

`rotate_model(model)` applies, in place:

* R1, the residual stream: every RMSNorm weight γ reading the residual (input_layernorm,
  post_attention_layernorm, the final norm) is first folded into the Linears that read its output (their input
  rows × γ; γ := 1), so that the norm commutes with any orthogonal Q (rms(xQ) = rms(x)). Then the embedding
  becomes E·Q, every reader of the normed residual Qᵀ·W (q/k/v or MLA's q / q_a / kv_a, the MLP's or every
  expert's and the shared experts' gate/up, the router, the LM head) and every writer W·Q, biases b·Q
  (o_proj, down_proj, each expert's down). The residual stream then carries x·Q: an outlier channel of x is
  spread over all D channels of every GEMM input that reads it.
* R2, per attention head: v_proj's output per KV head × H_h and o_proj's input rows per head × H_hᵀ (GQA
  families): the attention output that o_proj quantizes is rotated too.

Q is a randomized Hadamard matrix (H·diag(±1)/√n, seeded) when n is a power of two; otherwise n = 2^k·m and Q
= (H_{2^k}/√2^k) ⊗ R_m with R_m a seeded random orthogonal m×m (QuaRot stores Hadamard matrices of sizes
12, 20, 28, 40, 172, ...; the Kronecker factor with a dense random orthogonal block spreads an outlier over
all n channels as well). All in float64, cast once to each weight's dtype.

What is not folded and stays documented (docs/quantization.md, rotations): QuaRot's online rotations, R3
(a Hadamard on queries and keys after RoPE, for a quantized KV cache) and R4 (a Hadamard on down_proj's
input, applied at run time by the engine and undone in W_down): engines run them as a transform of the
checkpoint (compressed-tensors `transform_config`), which this module does not write. So down_proj's input
keeps its outliers. Refused: tied embeddings (the final norm's γ cannot fold into a head shared with the
embedding), MTP layers (their eh_proj reads two normed streams and shares the head), LoRA adapters (merge
first) and quantized models. MLA (DeepSeek-V3 / Kimi K2) gets R1 only.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import Linear, RMSNorm, hf_name
from models.moe import Experts

# ------------------------------------------------------------------------------------------------
# The orthogonal matrices
# ------------------------------------------------------------------------------------------------


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def random_hadamard(n: int, seed: int = 0) -> np.ndarray:
    """An orthogonal [n, n] float64 matrix: H_n·diag(±1)/√n for n a power of two, else
    (H_{2^k}·diag(±1)/√2^k) ⊗ R_m (n = 2^k·m, m odd, R_m a random orthogonal m×m), seeded."""
    if n < 1:
        raise ValueError(f"rotation size must be positive, got {n}")
    rng = np.random.default_rng(seed)
    p = n & -n  # the largest power of two dividing n
    m = n // p
    h = _sylvester(p) * rng.choice([-1.0, 1.0], size=p)[None, :] / np.sqrt(p)  # [p, p]
    if m == 1:
        return h
    r, upper = np.linalg.qr(rng.standard_normal((m, m)))
    r = r * np.sign(np.diag(upper))[None, :]  # Haar-distributed
    return np.kron(h, r)  # [n, n]


# ------------------------------------------------------------------------------------------------
# Folding helpers (float64 math, cast back to each weight's dtype)
# ------------------------------------------------------------------------------------------------


def _set(var: nnx.Variable, value: np.ndarray) -> None:
    var[...] = jnp.asarray(value, var[...].dtype)


def _f64(var: nnx.Variable) -> np.ndarray:
    return np.asarray(var[...], np.float64)


def _read_rows(lin: Linear, left: np.ndarray) -> None:
    """A Linear reading the rotated stream: kernel [in, out] := left @ kernel (left [in, in])."""
    _set(lin.kernel, left @ _f64(lin.kernel))


def _write_cols(lin: Linear, q: np.ndarray) -> None:
    """A Linear writing the rotated stream: kernel [in, out] := kernel @ q, bias := bias @ q."""
    _set(lin.kernel, _f64(lin.kernel) @ q)
    if lin.bias is not None:
        _set(lin.bias, _f64(lin.bias) @ q)


def _fold_norm(norm: RMSNorm, readers: list[Any]) -> None:
    """γ of `norm` into its readers' input rows (Linears, expert stacks [E, D, 2I], routers [E, D]); γ := 1."""
    g = _f64(norm.weight)
    for r in readers:
        if isinstance(r, Linear):
            _set(r.kernel, g[:, None] * _f64(r.kernel))
        elif isinstance(r, Experts):
            _set(r.gate_up, g[None, :, None] * _f64(r.gate_up))
        else:  # a router: weight [E, D] in the HF orientation
            _set(r.weight, _f64(r.weight) * g[None, :])
    _set(norm.weight, np.ones_like(g))


# ------------------------------------------------------------------------------------------------
# The model walk
# ------------------------------------------------------------------------------------------------


def attention_readers(attn: nnx.Module) -> list[Linear]:
    """The Linears reading the attention block's normed input (q/k/v, or MLA's q / q_a and kv_a)."""
    refuse_indexer(attn, "rotate")
    if getattr(attn, "k_proj", None) is not None:  # GQA
        return [attn.q_proj, attn.k_proj, attn.v_proj]
    first = attn.q_proj if getattr(attn, "q_proj", None) is not None else attn.q_a_proj  # MLA
    return [first, attn.kv_a_proj_with_mqa]


def refuse_indexer(attn: nnx.Module, what: str) -> None:
    """DeepSeek-V3.2's and GLM-5's DSA indexer also reads the normed input (wk, weights_proj) and the q latent
    (wq_b); the folds here do not cover it yet, and leaving it out would change the model silently. GLM-5's
    shared layers hold no indexer but attend to a full layer's selection (`dsa` marks every DSA block)."""
    if getattr(attn, "indexer", None) is not None or getattr(attn, "dsa", False):
        raise NotImplementedError(f"{what}: the attention's DSA indexer (DeepSeek-V3.2, GLM-5) reads the normed "
                                  "input and the q latent, which this transform does not fold yet")


def mlp_parts(mlp: nnx.Module) -> tuple[list[Any], list[Any]]:
    """(readers of the normed residual, writers to the residual) of a dense MLP or an MoE block."""
    if hasattr(mlp, "gate_proj"):
        return [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]
    readers: list[Any] = [mlp.experts, getattr(mlp, mlp.router_name)]
    writers: list[Any] = [mlp.experts]
    if mlp.shared_experts is not None:
        readers += [mlp.shared_experts.gate_proj, mlp.shared_experts.up_proj]
        writers.append(mlp.shared_experts.down_proj)
    return readers, writers


def _check(model: nnx.Module) -> None:
    if model.lm_head is None:
        raise ValueError("rotate: the model ties its LM head to the embedding; the final norm's weight cannot be "
                         "folded into a shared matrix (rotations need an untied lm_head)")
    if model.num_mtp_layers:
        raise ValueError(f"rotate: the model has {model.num_mtp_layers} MTP layer(s), whose eh_proj reads two "
                         "normed streams and shares the LM head: rotations are not supported for it")
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and (node.qweight is not None or node.lora_a is not None):
            raise ValueError(f"rotate: {hf_name(path)} is quantized or has a LoRA adapter; rotate the merged float "
                             "model before quantizing")
        if isinstance(node, Experts) and (node.quantized or node.gate_up_lora_a is not None):
            raise ValueError(f"rotate: {hf_name(path)} is quantized or has a LoRA adapter")


def block_hadamard(n: int, block: int, seed: int = 0) -> np.ndarray:
    """blockdiag(H_block·diag(±1)/√block, ...) [n, n]: a Hadamard within each run of `block` channels (the
    micro-scaling group), so an outlier stays in its own scale group (MR-GPTQ, arXiv:2509.23202; BRQ,
    arXiv:2511.04214). `block` must be a power of two dividing n."""
    if block & (block - 1) or n % block:
        raise ValueError(f"block rotation: {block} must be a power of two dividing {n}")
    rng = np.random.default_rng(seed)
    h = _sylvester(block) / np.sqrt(block)
    return np.kron(np.eye(n // block), h) * rng.choice([-1.0, 1.0], size=n)[None, :]


def rotate_model(model: nnx.Module, *, seed: int = 0, heads: bool = True, block: int | None = None) -> dict[str, Any]:
    """Fold R1 (and with `heads` R2 on GQA attention) into `model` in place (module docstring); the float
    model computes the same function. `block`: block-diagonal Hadamards of that size instead of one over
    the whole width (`block_hadamard`). Returns what was done: the sizes, the seed, which layers got R2."""
    _check(model)
    D = model.config.hidden_size
    q = random_hadamard(D, seed) if block is None else block_hadamard(D, block, seed)  # [D, D]
    qt = q.T
    r2_layers = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        readers = attention_readers(attn)
        _fold_norm(layer.input_layernorm, readers)
        mlp_readers, mlp_writers = mlp_parts(layer.mlp)
        _fold_norm(layer.post_attention_layernorm, mlp_readers)
        for r in readers + [m for m in mlp_readers if isinstance(m, Linear)]:
            _read_rows(r, qt)
        for r in mlp_readers:
            if isinstance(r, Experts):
                _set(r.gate_up, np.einsum("dk,eko->edo", qt, _f64(r.gate_up)))  # [E, D, 2I]
            elif not isinstance(r, Linear):  # the router [E, D]: logits x Wᵀ = (xQ)(WQ)ᵀ
                _set(r.weight, _f64(r.weight) @ q)
        _write_cols(attn.o_proj, q)
        for w in mlp_writers:
            if isinstance(w, Experts):
                _set(w.down, _f64(w.down) @ q)  # [E, I, D]
                if w.down_bias is not None:
                    _set(w.down_bias, _f64(w.down_bias) @ q)  # [E, D]
            else:
                _write_cols(w, q)
        if heads and getattr(attn, "k_proj", None) is not None:
            hd = attn.head_dim
            _rotate_heads(attn, random_hadamard(hd, seed + 1 + i) if block is None or hd % block
                          else block_hadamard(hd, block, seed + 1 + i))
            r2_layers.append(i)
    _fold_norm(model.norm, [model.lm_head])
    _read_rows(model.lm_head, qt)
    _set(model.embed_tokens.weight, _f64(model.embed_tokens.weight) @ q)  # [V, D]
    return {"rotation": "hadamard" if block is None else f"hadamard-block{block}", "seed": seed, "hidden_size": D,
            "residual": "R1", "head_layers": r2_layers}


def _rotate_heads(attn: nnx.Module, h: np.ndarray) -> None:
    """R2: v_proj's output per KV head × h [Hd, Hd], o_proj's input rows per query head × hᵀ."""
    K, N, Hd = attn.num_kv_heads, attn.num_heads, attn.head_dim
    v = _f64(attn.v_proj.kernel).reshape(-1, K, Hd)  # [D, K, Hd]
    _set(attn.v_proj.kernel, np.einsum("dkh,hj->dkj", v, h).reshape(-1, K * Hd))
    if attn.v_proj.bias is not None:
        _set(attn.v_proj.bias, (_f64(attn.v_proj.bias).reshape(K, Hd) @ h).reshape(-1))
    o = _f64(attn.o_proj.kernel).reshape(N, Hd, -1)  # [N, Hd, D]
    _set(attn.o_proj.kernel, np.einsum("jh,nhd->njd", h.T, o).reshape(N * Hd, -1))
