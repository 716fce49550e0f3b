"""A fine-tuned MTP layer (models/mtp_finetune.py) read back by transformers 5.24's own MTP loader.

A tiny random GLM-4.5 / DeepSeek-V3 checkpoint gets an MTP layer at `model.layers.{L}` (transformers never
writes one: a donor model's block plus random enorm / hnorm / eh_proj / shared_head.norm, as
test_glm4_moe_parity.py and test_deepseek_v3_parity.py build it); we load it, fine-tune the MTP layer a few
steps with `mtp_loss`, write `mtp_state_dict` over the checkpoint's MTP tensors, and let transformers'
`MtpModel.from_pretrained(main_model)` load them (its own key renaming and per-expert -> fused expert
conversion). Its logits for the first two recursive steps (step 2 fed step 1's post-normed output, as
`MTPCandidateGenerator` does) must equal our `mtp_unroll` to 1e-4 relative error (fp32, eager attention).

transformers finds MTP tensors through `_keys_to_ignore_on_load_unexpected`, which names the published depths
(GLM-4.5: layers 46 / 92, DeepSeek-V3: 61); the tiny checkpoints put the layer at L, so the test points that
attribute of the loaded main model at `model.layers.{L}` before calling the loader.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from parity_helpers import build_from_config, rel_err
from transformers.modeling_layers import MtpModel

from models import from_pretrained
from models.mtp_finetune import mtp_loss, mtp_state_dict, mtp_trainable, mtp_unroll

pytestmark = pytest.mark.parity
D, L, T, B = 64, 3, 16, 2
GLM = dict(vocab_size=160, hidden_size=D, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=L,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
           n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
           partial_rotary_factor=0.5, rms_norm_eps=1e-5, max_position_embeddings=256, use_qk_norm=True,
           routed_scaling_factor=2.5)
DEEPSEEK = dict(vocab_size=128, hidden_size=D, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=L,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, first_k_dense_replace=1, max_position_embeddings=128, rms_norm_eps=1e-5)
CONFIGS = {"glm4_moe": (transformers.Glm4MoeConfig, GLM), "deepseek_v3": (transformers.DeepseekV3Config, DEEPSEEK)}


def checkpoint_with_mtp(name: str, root) -> tuple[dict[str, np.ndarray], str]:
    """A saved tiny checkpoint plus an MTP layer at model.layers.{L}: a donor's last block (L + 1 layers, so
    the block is a MoE one) and random enorm / hnorm / eh_proj / shared_head.norm, the embedding / head copies
    the main ones. -> (all tensors, folder)."""
    cls, kw = CONFIGS[name]
    main = build_from_config(cls(**kw), seed=21)
    donor = build_from_config(cls(**{**kw, "num_hidden_layers": L + 1}), seed=22)
    main.save_pretrained(root / "main")
    donor.save_pretrained(root / "donor")
    tensors = safetensors.numpy.load_file(str(root / "main" / "model.safetensors"))
    donor_t = safetensors.numpy.load_file(str(root / "donor" / "model.safetensors"))
    p = f"model.layers.{L}."
    mtp = {k: v for k, v in donor_t.items() if k.startswith(p)}
    g = np.random.default_rng(23)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{p}{n}.weight"] = (1 + 0.2 * g.standard_normal(D)).astype(np.float32)
    mtp[f"{p}eh_proj.weight"] = (0.1 * g.standard_normal((D, 2 * D))).astype(np.float32)  # [D, 2D]
    mtp[f"{p}embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    mtp[f"{p}shared_head.head.weight"] = tensors["lm_head.weight"]
    tensors.update(mtp)
    safetensors.numpy.save_file(tensors, str(root / "main" / "model.safetensors"), metadata={"format": "pt"})
    return tensors, str(root / "main")


def packed_batch(vocab: int) -> dict[str, jax.Array]:
    """Two rows, each two packed sequences (9 + 7 tokens), every target scored but the prompts'."""
    g = np.random.default_rng(24)
    ids = g.integers(1, vocab, (B, T + 1)).astype(np.int32)
    seg = np.repeat(np.array([[1] * 9 + [2] * 7]), B, 0).astype(np.int32)
    pos = np.repeat(np.array([list(range(9)) + list(range(7))]), B, 0).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    mask[:, [0, 1, 9, 10]] = 0
    return {k: jnp.asarray(v) for k, v in dict(input_ids=ids[:, :T], target_ids=ids[:, 1:], positions=pos,
                                                 segment_ids=seg, loss_mask=mask).items()}


def fine_tune(model, batch: dict[str, jax.Array], steps: int = 4) -> list[float]:
    """A few Adam steps on the MTP layer alone (soft kl_div labels from the target itself, 3 recursive steps)."""
    trainable = mtp_trainable(model)
    _, (final,) = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                        return_hidden=(-1,))
    target_logits = model.lm_logits(final)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=trainable)

    @nnx.jit
    def step(model, opt):
        loss = lambda m: mtp_loss(m, batch, final_hidden=final, target_logits=target_logits, steps=3)[0]
        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, trainable))(model)
        opt.update(model, grads)
        return value

    return [float(step(model, opt)) for _ in range(steps)]


@functools.partial(jax.jit, static_argnums=0)
def _unroll(graphdef, state, ids, hidden):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return mtp_unroll(model, ids, hidden, positions=positions, segment_ids=None, steps=2)


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_transformers_mtp_model_loads_the_fine_tuned_layer(name, tmp_path):
    tensors, path = checkpoint_with_mtp(name, tmp_path)
    model = from_pretrained(path)
    assert model.num_mtp_layers == 1
    batch = packed_batch(model.config.vocab_size)
    losses = fine_tune(model, batch)
    assert losses[-1] < losses[0], losses
    tuned = mtp_state_dict(model, "float32")
    p = f"model.layers.{L}."
    assert set(tuned) == {k for k in tensors if k.startswith(p)}
    assert not np.array_equal(tuned[p + "eh_proj.weight"], tensors[p + "eh_proj.weight"])  # really fine-tuned

    # the export stage's move: the fine-tuned MTP tensors over the checkpoint's
    out = tmp_path / "tuned"
    out.mkdir()
    safetensors.numpy.save_file({**tensors, **tuned}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((tmp_path / "main" / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*"]  # the tiny depth (module docstring)
    ref_model = MtpModel.from_pretrained(hf).eval()
    layer = ref_model.layers[0]
    np.testing.assert_array_equal(layer.eh_proj.weight.detach().numpy(), tuned[p + "eh_proj.weight"])
    np.testing.assert_array_equal(layer.post_norm.weight.detach().numpy(), tuned[p + "shared_head.norm.weight"])

    ids = np.random.default_rng(25).integers(0, model.config.vocab_size, (B, T)).astype(np.int32)
    graphdef, state = nnx.split(model)
    _, (hidden,) = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, return_hidden=(-1,)))(state, jnp.asarray(ids))
    ours = [np.asarray(x) for x in _unroll(graphdef, state, jnp.asarray(ids), hidden)]  # 2 × [B, T, V]
    with torch.no_grad():
        tids = torch.tensor(ids, dtype=torch.long)
        assert rel_err(np.asarray(hidden), hf(tids, output_hidden_states=True).hidden_states[-1].numpy()) <= 1e-5
        h = torch.tensor(np.asarray(hidden))
        pos1 = torch.arange(T - 1)[None].expand(B, -1)
        out1 = ref_model.forward_layer(0, h[:, :-1], pos1, None, input_ids=tids[:, 1:])  # post-normed
        ref1 = ref_model._project_to_logits(out1).numpy()  # [B, T-1, V]: t_{p+2}
        pos2 = torch.arange(T - 2)[None].expand(B, -1)
        out2 = ref_model.forward_layer(0, out1[:, :-1], pos2, None, input_ids=tids[:, 2:])
        ref2 = ref_model._project_to_logits(out2).numpy()  # [B, T-2, V]: t_{p+3}
    err1, err2 = rel_err(ours[0][:, :T - 1], ref1), rel_err(ours[1][:, :T - 2], ref2)
    print(f"{name} fine-tuned MTP vs transformers MtpModel: step 1 rel err {err1:.2e}, step 2 {err2:.2e}")
    assert err1 <= 1e-4 and err2 <= 1e-4
