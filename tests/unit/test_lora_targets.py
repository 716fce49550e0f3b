"""LoRA targets (regexes over HF module paths, the ALL_LINEAR preset, the error that lists candidates),
LoRA on stacked MoE experts (grouped == dense, merge == unmerged, gradients), LoRA dropout (train vs
eval, threaded as nnx.RngState through a jitted step) and the PEFT config for MoE bases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.families import family
from models.lora import (
    ALL_LINEAR,
    apply_lora,
    lora_candidates,
    lora_modules,
    lora_state_to_peft,
    match_targets,
    merge_lora,
)
from models.lora_targets import INDEXER
from models.moe import Experts

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
FAMILIES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
            "GptOssForCausalLM", "Glm4MoeForCausalLM")


@nnx.jit
def forward(model, ids):
    return model(ids)


def build(arch: str, *, abstract: bool = False, **overrides):
    config_cls, model_cls = family(arch)
    config = config_cls.tiny(**overrides)
    if abstract:  # shapes only: enough for target matching
        return nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))
    return model_cls(config, rngs=nnx.Rngs(0))


def randomize_b(model, seed: int = 1, scale: float = 0.2) -> None:
    """Nonzero B factors so that every adapter changes the output (numpy: no per-shape compiles)."""
    rng = np.random.default_rng(seed)
    for _, m in lora_modules(model):
        for name in ("lora_b", "gate_up_lora_b", "down_lora_b"):
            var = getattr(m, name, None)
            if var is not None:
                var[...] = jnp.asarray(scale * rng.normal(size=var[...].shape), var[...].dtype)


# ------------------------------------------------------------------------------------------------
# Targets
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", FAMILIES)
def test_all_linear_covers_every_projection_but_the_lm_head(arch):
    model = build(arch, abstract=True)
    names = set(lora_candidates(model))
    chosen = set(match_targets(model, ALL_LINEAR))
    assert chosen == names - {"lm_head"}
    assert not any("embed" in n or n.endswith((".gate", ".router")) for n in names)  # never candidates


def test_deepseek_paths_regexes_and_plain_names():
    model = build("DeepseekV3ForCausalLM", abstract=True)
    names = set(lora_candidates(model))
    assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.q_b_proj",
            "model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.0.self_attn.kv_b_proj",
            "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts",
            "model.layers.2.mlp.shared_experts.up_proj", "lm_head"} <= names
    # plain names: any path ending in ".<name>"; dotted plain names are suffixes too
    assert set(match_targets(model, "q_b_proj")) == {f"model.layers.{i}.self_attn.q_b_proj" for i in range(3)}
    assert set(match_targets(model, "mlp.experts")) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    assert set(match_targets(model, "shared_experts.down_proj")) == {
        "model.layers.1.mlp.shared_experts.down_proj", "model.layers.2.mlp.shared_experts.down_proj"}
    assert set(match_targets(model, "lm_head")) == {"lm_head"}
    # regexes are fullmatched: "down_proj" as a regex would not match, "model\.layers\.1\..*" is layer 1 only
    layer1 = set(match_targets(model, r"model\.layers\.1\..*"))
    assert layer1 == {n for n in names if n.startswith("model.layers.1.")} and "model.layers.1.mlp.experts" in layer1
    assert set(match_targets(model, [r".*\.kv_b_proj", r"model\.layers\.(1|2)\.mlp\.experts"])) == {
        *(f"model.layers.{i}.self_attn.kv_b_proj" for i in range(3)), "model.layers.1.mlp.experts",
        "model.layers.2.mlp.experts"}
    # MTP layers (after the main stack) are never candidates
    mtp = build("DeepseekV3ForCausalLM", abstract=True, num_nextn_predict_layers=1)
    assert len(mtp.layers) == 4 and not any(n.startswith("model.layers.3.") for n in lora_candidates(mtp))


def test_all_linear_on_deepseek_v4_leaves_out_the_indexer():
    """V4's own names (`attn.*`, `ffn.*`): every attention projection (the low-rank q, the shared K=V, the grouped
    low-rank output), the CSA / HCA compressors, the shared and routed experts; not the CSA indexer (its own
    compressor included), the LM head (`head`) or the routers."""
    model = build("DeepseekV4ForCausalLM", abstract=True)  # layers: sliding, CSA (+ indexer), HCA
    names = set(lora_candidates(model))
    chosen = set(match_targets(model, ALL_LINEAR))
    indexer = {f"model.layers.1.attn.indexer.{n}" for n in ("wq_b", "weights_proj", "compressor.wkv",
                                                             "compressor.wgate")}
    assert indexer <= names and chosen == names - {"head"} - indexer
    for i in range(3):
        assert {f"model.layers.{i}.attn.{n}" for n in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")} <= chosen
        assert {f"model.layers.{i}.ffn.{n}" for n in ("shared_experts.w1", "shared_experts.w2",
                                                      "shared_experts.w3", "experts")} <= chosen
    assert {n for n in chosen if ".compressor." in n} == {f"model.layers.{i}.attn.compressor.{n}"
                                                          for i in (1, 2) for n in ("wkv", "wgate")}
    assert set(match_targets(model, INDEXER + ("indexer.compressor.wkv",))) == {  # INDEXER: DSA only
        "model.layers.1.attn.indexer.compressor.wkv"}


def test_peft_config_on_deepseek_v4_names_transformers_modules():
    """The export names transformers' modules (its conversion mapping renames the checkpoint's `attn.wq_a` to the
    module `self_attn.q_a_proj`, the indexer under the compressor); the grouped `o_a_proj` is adapted through its
    weight (peft's lora.Linear cannot run over its G blocks)."""
    model = build("DeepseekV4ForCausalLM")
    apply_lora(model, rank=2, alpha=4, targets=ALL_LINEAR + (r".*\.indexer\..*", "head"), rngs=nnx.Rngs(0))
    config, tensors = lora_state_to_peft(model)
    modules = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0].removesuffix(".base_layer")
               for k in tensors}
    want = {"lm_head"}
    for i in range(3):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        want |= {f"{attn}.{n}" for n in ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")}
        want |= {f"{mlp}.shared_experts.{n}" for n in ("gate_proj", "up_proj", "down_proj")} | {f"{mlp}.experts"}
    want |= {f"model.layers.{i}.self_attn.compressor.{n}" for i in (1, 2) for n in ("kv_proj", "gate_proj")}
    want |= {f"model.layers.1.self_attn.compressor.indexer.{n}" for n in ("kv_proj", "gate_proj", "q_b_proj",
                                                                          "scorer.weights_proj")}
    assert modules == want
    # every candidate is chosen: short names, and o_a_proj (with the MoE-remapped names) as a weight
    assert config["target_modules"] == ["kv_proj", "lm_head", "o_b_proj", "q_a_proj", "q_b_proj", "weights_proj"]
    assert config["target_parameters"] == ["down_proj.weight", "experts.down_proj", "experts.gate_up_proj",
                                           "gate_proj.weight", "o_a_proj.weight", "up_proj.weight"]
    assert tensors["base_model.model.model.layers.0.self_attn.o_a_proj.lora_A.weight"].shape == (2, 64)  # [r, N·Hd/G]
    assert tensors["base_model.model.model.layers.0.self_attn.o_a_proj.lora_B.weight"].shape == (32, 2)  # [G·O, r]


def test_no_match_error_is_one_line_listing_candidates():
    model = build("Qwen3MoeForCausalLM", abstract=True)
    with pytest.raises(ValueError) as e:
        match_targets(model, ["q_a_proj", r"model\.layers\.9\..*"])
    msg = str(e.value)
    assert "\n" not in msg and "q_a_proj" in msg and "candidates (" in msg
    assert "model.layers.0.self_attn.q_proj" in msg and "lm_head" in msg
    with pytest.raises(ValueError, match="routers are never LoRA-adapted"):
        match_targets(model, "mlp.gate")
    with pytest.raises(ValueError, match="not a valid regex"):
        match_targets(model, "layers.(")


# ------------------------------------------------------------------------------------------------
# Factors, merge, experts in every dispatch
# ------------------------------------------------------------------------------------------------


def test_only_lora_factors_are_lora_params_and_merge_matches():
    model = build("DeepseekV3ForCausalLM", num_hidden_layers=2)  # layer 0 dense, layer 1 MoE + shared expert
    base_weights = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    base_state = nnx.state(model, base_weights)
    ref = forward(model, IDS)
    apply_lora(model, rank=3, alpha=6, rngs=nnx.Rngs(2))
    np.testing.assert_allclose(np.asarray(forward(model, IDS)), np.asarray(ref), atol=1e-6, rtol=0)  # B = 0
    lora_state = nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    leaves = {path[-1] for path, _ in lora_state}
    assert leaves == {"lora_a", "lora_b", "gate_up_lora_a", "gate_up_lora_b", "down_lora_a", "down_lora_b"}
    n_linear = sum(not isinstance(m, Experts) for _, (_, m) in match_targets(model, ALL_LINEAR).items())
    assert n_linear == 2 * 5 + 3 + 3  # MLA x 2 layers, dense MLP, shared expert
    assert len(lora_state) == 2 * n_linear + 4  # + the MoE layer's 4 expert factors
    experts = model.layers[1].mlp.experts
    assert experts.gate_up_lora_a[...].shape == (8, 64, 3) and experts.gate_up_lora_b[...].shape == (8, 3, 64)
    assert experts.down_lora_a[...].shape == (8, 32, 3) and experts.down_lora_b[...].shape == (8, 3, 64)
    assert model.lm_head.lora_a is None and model.layers[1].mlp.gate.weight is not None
    # the base weights are still plain Params, untouched
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, base_weights), base_state)
    with pytest.raises(ValueError, match="already applied"):
        apply_lora(model, rank=2, alpha=2, targets="mlp.experts")

    randomize_b(model)
    adapted = np.asarray(forward(model, IDS))
    assert np.abs(adapted - np.asarray(ref)).max() > 1e-2
    exported = {k: np.asarray(v) for k, v in experts.hf_export().items()}  # LoRA folded in, as merged
    merge_lora(model)
    assert not lora_modules(model) and not nnx.state(model, nnx.LoRAParam)
    np.testing.assert_allclose(np.asarray(forward(model, IDS)), adapted, atol=2e-5, rtol=0)
    for k, v in experts.hf_export().items():
        np.testing.assert_allclose(np.asarray(v), exported[k], atol=1e-6, rtol=0, err_msg=k)


# ------------------------------------------------------------------------------------------------
# Experts: every dispatch, forward and gradients, and their dropout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_expert_lora_grouped_equals_dense_forward_and_gradients(activation):
    E, D, I, T, k = 8, 32, 16, 24, 2
    layout = dict(hf_layout="gpt_oss", use_bias=True) if activation == "gpt_oss" else {}
    experts = Experts(E, D, I, activation=activation, rngs=nnx.Rngs(0), **layout)
    experts.add_lora(2, 4.0, key=jax.random.PRNGKey(1))
    randomize_b(experts, scale=0.5)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)  # [T, k]
    w = jnp.asarray(rng.uniform(size=(T, k)), jnp.float32)

    @nnx.jit(static_argnames="impl")
    def loss_and_grads(experts, impl):
        def loss(experts):
            return jnp.mean(experts(x, idx, w, impl=impl) ** 2)
        return nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(experts)

    ref_loss, ref_grads = loss_and_grads(experts, "dense")
    ref_grads = jax.tree.leaves(ref_grads)
    assert len(ref_grads) == 4 and all(float(jnp.abs(g).max()) > 0 for g in ref_grads)
    for impl in ("blocked", "ragged"):
        value, grads = loss_and_grads(experts, impl)
        assert float(value) == pytest.approx(float(ref_loss), rel=1e-5)
        for g, ref in zip(jax.tree.leaves(grads), ref_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=0, atol=1e-5 * float(jnp.abs(ref).max()))
    merged = experts(x, idx, w, impl="dense")
    experts.merge_lora()
    np.testing.assert_allclose(np.asarray(experts(x, idx, w, impl="blocked")), np.asarray(merged), atol=1e-5)


def test_expert_lora_dropout():
    E, D, I, T = 4, 16, 8, 10
    experts = Experts(E, D, I, rngs=nnx.Rngs(0))
    experts.add_lora(2, 4.0, key=jax.random.PRNGKey(1), dropout=0.5, dropout_rngs=nnx.Rngs(dropout=2).dropout)
    randomize_b(experts, scale=0.5)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(T, D)), jnp.float32)
    idx, w = jnp.asarray(np.arange(T) % E, jnp.int32)[:, None], jnp.ones((T, 1), jnp.float32)
    run = nnx.jit(lambda experts: experts(x, idx, w))  # the rng state advances through nnx.jit
    experts.eval()
    a, b = run(experts), run(experts)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # eval: deterministic
    experts.train()
    c, d = run(experts), run(experts)
    assert float(jnp.abs(c - a).max()) > 1e-3 and float(jnp.abs(d - c).max()) > 1e-3


# ------------------------------------------------------------------------------------------------
# Dropout on Linear, threaded through a jitted functional step
# ------------------------------------------------------------------------------------------------


def test_dropout_train_vs_eval_and_threaded_rng_state():
    model = build("LlamaForCausalLM")
    apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(0))
    assert not nnx.state(model, nnx.RngState)  # p = 0: no Dropout, no rng state
    model = build("LlamaForCausalLM")
    apply_lora(model, rank=4, alpha=8, dropout=0.5, rngs=nnx.Rngs(0))
    randomize_b(model)
    assert nnx.state(model, nnx.RngState)
    assert all(m.lora_dropout is not None and m.lora_dropout.rate == 0.5 for _, m in lora_modules(model))
    model.eval()
    a, b = np.asarray(forward(model, IDS)), np.asarray(forward(model, IDS))
    np.testing.assert_array_equal(a, b)  # eval: deterministic
    model.train()
    c, d = np.asarray(forward(model, IDS)), np.asarray(forward(model, IDS))
    assert np.abs(c - a).max() > 1e-3 and np.abs(d - c).max() > 1e-3  # train: a fresh mask per call

    # the trainer's functional step: (LoRAParam, RngState, rest) in, new RngState out
    graphdef, lora, rng, rest = nnx.split(model, nnx.LoRAParam, nnx.RngState, ...)

    @jax.jit
    def step(lora, rng, rest):
        m = nnx.merge(graphdef, lora, rng, rest)
        out = m(IDS)
        return out, nnx.state(m, nnx.RngState)

    out1, rng1 = step(lora, rng, rest)
    out1_again, _ = step(lora, rng, rest)
    out2, _ = step(lora, rng1, rest)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out1_again))  # same state, same mask
    assert np.abs(np.asarray(out2) - np.asarray(out1)).max() > 1e-3  # advanced state, new mask

    # merged weights == the eval-mode adapter
    merge_lora(model)
    assert not nnx.state(model, nnx.RngState)
    np.testing.assert_allclose(np.asarray(forward(model, IDS)), a, atol=2e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# PEFT config on MoE bases (the layout itself is checked against peft in tests/parity)
# ------------------------------------------------------------------------------------------------


def test_peft_config_targets_parameters_on_moe_bases():
    model = build("DeepseekV3ForCausalLM", num_hidden_layers=2)
    apply_lora(model, rank=2, alpha=4, dropout=0.1, rngs=nnx.Rngs(0))
    config, tensors = lora_state_to_peft(model, "base")
    assert config["base_model_name_or_path"] == "base" and config["r"] == 2 and config["lora_alpha"] == 4
    assert config["target_modules"] == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
    # gate/up/down_proj would be remapped by peft onto the fused experts: their weights are targeted instead
    assert config["target_parameters"] == ["down_proj.weight", "experts.down_proj", "experts.gate_up_proj",
                                           "gate_proj.weight", "up_proj.weight"]
    assert config["lora_dropout"] == 0.0  # peft's ParamWrapper refuses dropout
    prefix = "base_model.model.model.layers.1.mlp.experts"
    assert tensors[f"{prefix}.base_layer.lora_A.weight"].shape == (8 * 2, 64)  # gate_up_proj [E·r, D]
    assert tensors[f"{prefix}.base_layer.lora_B.weight"].shape == (64, 2 * 8)  # [2I, r·E]
    assert tensors[f"{prefix}.lora_A.weight"].shape == (8 * 2, 32)  # down_proj [E·r, I]
    assert tensors[f"{prefix}.lora_B.weight"].shape == (64, 2 * 8)  # [D, r·E]
    assert tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"].shape == (160, 2)

    # a partial selection is written as full paths
    merge_lora(model)
    apply_lora(model, rank=2, alpha=4, targets=[r"model\.layers\.1\..*"], rngs=nnx.Rngs(0))
    config, _ = lora_state_to_peft(model)
    assert config["target_modules"] == [f"model.layers.1.self_attn.{n}" for n in
                                        ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj")]
    assert config["target_parameters"] == [  # every expert block is chosen: the short name; the MLP weights: paths
        "model.layers.1.mlp.shared_experts.down_proj.weight", "experts.down_proj", "experts.gate_up_proj",
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"]
    # a dense base keeps plain target_modules and the dropout
    llama = build("LlamaForCausalLM")
    apply_lora(llama, rank=2, alpha=4, dropout=0.1, rngs=nnx.Rngs(0))
    config, _ = lora_state_to_peft(llama)
    assert config["target_parameters"] is None and config["lora_dropout"] == 0.1
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
