"""Fine-tuning a DSA model (DeepSeek-V3.2, GLM-5; tasks/training/indexer.py, `finetune.indexer`): the indexer's KL
objective reaches the indexer alone (the main model's gradients are the same with and without it) and decreases
when trained; `frozen` leaves the indexer bit-identical after a step that moves everything else; LoRA targets
and the indexer's mode must agree; the indexer's parameters and the experts carry sensible logical axes; bad
recipe values are one error naming the key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import deepseek_v32, glm_moe_dsa, llama, lora
from models.lora_targets import ALL_LINEAR, INDEXER
from models.sharding import logical_to_spec, make_mesh
from tasks.recipe import ConfigError, load_release
from tasks.training import indexer as ix
from tasks.training.config import IndexerConfig, TrainConfig
from tasks.training.losses import xent_sum_and_aux
from tasks.training.trainer import Trainer, prepare_for_training

pytestmark = pytest.mark.unit

B, T = 2, 16  # T > index_topk (8): the sparse path runs
FAMILIES = {
    "deepseek_v32": (deepseek_v32.DeepseekV32Config, deepseek_v32.DeepseekV32),
    "glm_moe_dsa": (glm_moe_dsa.GlmMoeDsaConfig, glm_moe_dsa.GlmMoeDsa),  # layer 1 shares layer 0's top-k
}


def _model(family: str, scale: float = 1.0) -> nnx.Module:
    """A tiny random model; `scale` sharpens the attention and the index scores (its q/kv up-projections and the
    indexer's projections times `scale`), so that the two distributions differ measurably."""
    config_cls, model_cls = FAMILIES[family]
    model = model_cls(config_cls.tiny(), rngs=nnx.Rngs(0))
    for _, m in nnx.iter_graph(model):
        if isinstance(m, deepseek_v32.DSAttention):
            linears = [m.q_b_proj, m.kv_b_proj]
            if hasattr(m, "indexer"):
                linears += [m.indexer.wq_b, m.indexer.wk, m.indexer.weights_proj]
            for lin in linears:
                lin.kernel[...] = lin.kernel[...] * scale
    return model


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 256, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[1, T - 3:] = 0  # padding: its queries see no key and add no KL
    return {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:], "positions": np.tile(np.arange(T, dtype=np.int32),
            (B, 1)), "segment_ids": seg, "loss_mask": seg.copy()}


def _is_indexer(path) -> bool:
    return "indexer" in path


@pytest.mark.parametrize("family, form", [("deepseek_v32", "sparse"), ("deepseek_v32", "dense"),
                                          ("glm_moe_dsa", "sparse")])
def test_indexer_kl_reaches_only_the_indexer(family, form):
    """The gradients of task loss + KL split exactly: the KL's part is zero on every non-indexer parameter (so
    the main model's gradients are the task loss's, with or without the KL) and the task loss's zero on the
    indexer; the KL's reaches every indexer parameter."""
    model = _model(family, scale=4.0)
    prepare_for_training(model, TrainConfig(), IndexerConfig(mode="kl", form=form))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}

    def terms(params):  # (task loss, indexer KL)
        ce_sum, aux = xent_sum_and_aux(nnx.merge(graphdef, params, rest), batch)
        return ce_sum / batch["loss_mask"].sum(), aux.indexer_kl

    @jax.jit
    def grads(params):  # one forward, the two terms' gradients
        (ce, kl), vjp = jax.vjp(terms, params)
        return kl, vjp((jnp.float32(1), jnp.float32(0)))[0], vjp((jnp.float32(0), jnp.float32(1)))[0]

    kl, g_ce, g_kl = grads(params)
    assert float(kl) > 1e-3
    g_ce, g_kl = dict(nnx.to_flat_state(g_ce)), dict(nnx.to_flat_state(g_kl))
    indexer = [p for p in g_kl if _is_indexer(p)]
    assert indexer and len(indexer) < len(g_kl)
    for path in g_kl:
        ce, kl = np.asarray(g_ce[path][...]), np.asarray(g_kl[path][...])
        if _is_indexer(path):  # the task loss gives the indexer nothing (top-k); its KL does
            assert not ce.any() and np.abs(kl).max() > 0, path
        else:  # the KL gives the main model nothing
            assert not kl.any(), path
            assert np.abs(ce).max() > 0 or path[-1] in ("bias", "e_score_correction_bias"), path


@pytest.mark.parametrize("form", ["sparse", "dense"])
def test_indexer_kl_decreases_when_trained(form):
    model = _model("deepseek_v32", scale=4.0)
    only_indexer = nnx.All(nnx.Param, nnx.PathContains("indexer"))  # the paper's warm-up: the rest held
    trainer = Trainer(model, TrainConfig(steps=5, batch_size=B, learning_rate=1e-2, warmup_steps=0),
                      trainable=only_indexer, mesh=make_mesh(devices=jax.devices()[:1]),
                      indexer=IndexerConfig(mode="kl", form=form))
    kls = [float(trainer.step(_batch())["indexer_kl"]) for _ in range(5)]
    assert kls[0] > 1e-3 and kls[-1] < 0.5 * kls[0], kls
    assert all(b < a for a, b in zip(kls[1:], kls[2:], strict=False)), kls


def _indexer_state(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if _is_indexer(p)}


def test_frozen_indexer_is_bit_identical_after_a_full_step(family="deepseek_v32"):
    cfg = TrainConfig(steps=2, batch_size=B, learning_rate=1e-2, warmup_steps=0, weight_decay=0.1)
    mesh = make_mesh(devices=jax.devices()[:1])
    model = _model(family)
    before = _indexer_state(model)
    q_a = np.asarray(model.layers[0].self_attn.q_a_proj.kernel[...])
    trainer = Trainer(model, cfg, trainable=ix.trainable(model, "full", IndexerConfig()), mesh=mesh)
    assert "indexer_kl" not in trainer.step(_batch())
    after = _indexer_state(trainer.model())
    assert before.keys() == after.keys() and before
    for p in before:
        np.testing.assert_array_equal(after[p], before[p], err_msg=str(p))
    assert not np.array_equal(np.asarray(trainer.model().layers[0].self_attn.q_a_proj.kernel[...]), q_a)
    # every Param trained instead: weight decay alone moves the indexer, which is what `frozen` prevents
    plain = Trainer(_model(family), cfg, trainable=nnx.Param, mesh=mesh)
    plain.step(_batch())
    moved = _indexer_state(plain.model())
    assert any(not np.array_equal(moved[p], before[p]) for p in before)


def test_lora_targets_and_the_indexer_mode_must_agree():
    model = _model("deepseek_v32")
    names = set(lora.lora_candidates(model))
    indexer = {n for n in names if ".indexer." in n}
    assert len(indexer) == 3 * 3  # wq_b, wk, weights_proj in each of the 3 layers
    assert not indexer & set(lora.match_targets(model, ALL_LINEAR))  # the default preset leaves them out
    assert set(lora.match_targets(model, INDEXER)) == indexer

    lora.apply_lora(model, rank=2, alpha=4, targets=ALL_LINEAR)
    assert ix.trainable(model, "lora", IndexerConfig()) is nnx.LoRAParam
    with pytest.raises(ValueError, match=r"^finetune\.lora_targets: match none of the DSA indexer"):
        ix.trainable(model, "lora", IndexerConfig(mode="kl"))
    both = lora.apply_lora(_model("deepseek_v32"), rank=2, alpha=4, targets=ALL_LINEAR + INDEXER)
    assert ix.trainable(both, "lora", IndexerConfig(mode="kl")) is nnx.LoRAParam
    with pytest.raises(ValueError, match=r"^finetune\.lora_targets: match the DSA indexer's projections"):
        ix.trainable(both, "lora", IndexerConfig())
    dense = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    assert ix.trainable(dense, "full", IndexerConfig()) is nnx.Param
    with pytest.raises(ValueError, match=r"^finetune\.indexer\.mode: kl trains a DSA lightning indexer; Llama"):
        ix.trainable(dense, "full", IndexerConfig(mode="kl"))


def test_indexer_lora_trains_its_adapters_by_the_kl():
    """LoRA with mode kl: the indexer's adapters (weights_proj's too, which the indexer reads as a weight) get
    the KL's gradient; the other adapters none of it."""
    model = lora.apply_lora(_model("deepseek_v32", scale=4.0), rank=2, alpha=4, targets=ALL_LINEAR + INDEXER)
    for _, m in lora.lora_modules(model):  # B = 0 would stop the A gradients
        for name in ("lora_b", "gate_up_lora_b", "down_lora_b"):
            var = getattr(m, name, None)
            if var is not None:
                var[...] = jnp.full(var[...].shape, 0.1, jnp.float32)
    prepare_for_training(model, TrainConfig(), IndexerConfig(mode="kl"))
    graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    kl = lambda params: xent_sum_and_aux(nnx.merge(graphdef, params, rest), batch)[1].indexer_kl
    grads = dict(nnx.to_flat_state(jax.jit(jax.grad(kl))(params)))
    for path, g in grads.items():
        assert (np.abs(np.asarray(g[...])).max() > 0) == _is_indexer(path), path


def test_indexer_and_expert_logical_axes():
    model = _model("deepseek_v32")
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    spec = lambda var: logical_to_spec(var.get_metadata()["out_sharding"])
    assert spec(attn.indexer.wq_b.kernel) == P(None, "tensor")  # [Q, H·DI]: split by heads, as q_b_proj
    assert spec(attn.indexer.weights_proj.kernel) == P("fsdp", "tensor")  # [D, H]: the same heads
    assert spec(attn.indexer.wk.kernel) == P("fsdp", None)  # [D, DI]: one key per token, every head reads it
    assert spec(attn.indexer.k_norm.weight) == P(None) and spec(attn.indexer.k_norm.bias) == P(None)
    for name in ("gate_up", "down"):
        assert spec(getattr(mlp.experts, name))[0] == "expert"  # the stacked experts on the expert axis


@pytest.mark.parametrize("override, message", [
    ("finetune.indexer.mode=train", "finetune.indexer.mode: Input should be 'frozen' or 'kl'"),
    ("finetune.indexer.form=topk", "finetune.indexer.form: Input should be 'sparse' or 'dense'"),
    ("finetune.indexer.kl_weight=0", "finetune.indexer.kl_weight: Input should be greater than 0"),
    ("finetune.indexer.weight=1", "unknown key 'finetune.indexer.weight'"),
])
def test_bad_indexer_recipe_values_are_one_error_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_release("tiny", [override])
    assert "\n" not in str(e.value)
    ok = load_release("tiny", ["finetune.indexer.mode=kl", "finetune.indexer.kl_weight=0.5"]).finetune.indexer
    assert ok == IndexerConfig(mode="kl", form="sparse", kl_weight=0.5)
    assert load_release("tiny", []).finetune.indexer.mode == "frozen"


def test_deepseek_v4_full_fine_tune_keeps_its_csa_indexer_frozen():
    """DeepSeek-V4's CSA indexer (and the compressor it owns) is outside a full fine-tune's trainable set under
    `frozen`, while the attention's own compressors train; `kl` is refused by name (no KL objective for it)."""
    from models import deepseek_v4

    model = deepseek_v4.DeepseekV4(deepseek_v4.DeepseekV4Config.tiny(), rngs=nnx.Rngs(0))
    every = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    trained = {".".join(map(str, p)) for p, _ in
               nnx.to_flat_state(nnx.state(model, ix.trainable(model, "full", IndexerConfig())))}
    indexer = {p for p in every if ".indexer." in p}
    assert indexer and any(".indexer.compressor." in p for p in indexer)
    assert trained == every - indexer
    assert any(".compressor." in p and ".indexer." not in p for p in trained)
    with pytest.raises(ValueError, match=r"^finetune\.indexer\.mode: kl trains a DSA lightning indexer .*"
                                         r"DeepseekV4's compressed-attention indexer"):
        ix.trainable(model, "full", IndexerConfig(mode="kl"))
