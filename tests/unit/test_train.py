"""The training step's options against their plain counterparts: gradient accumulation equals the full
batch, remat equals no remat (full and LoRA), bf16 compute keeps fp32 master weights, Muon orthogonalises only hidden
matrices, weight decay skips vectors, the router correction bias stays frozen, a NaN stops the run
naming the step without checkpointing past it, and the metrics reach TensorBoard."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import deepseek_v3, llama, lora
from models.sharding import make_mesh
from tasks.training.checkpoints import Checkpoints
from tasks.training.config import TrainConfig, TrainingDiverged
from tasks.training.loop import fit
from tasks.training.optimizers import decay_mask, muon_dims
from tasks.training.trainer import Trainer

pytestmark = pytest.mark.unit

B, T = 8, 16


def _batch(seed: int = 0, vocab: int = 256) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (B, T + 1)).astype(np.int32)
    mask = (rng.random((B, T)) < 0.8).astype(np.int32)  # uneven target counts per row
    return {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:], "positions": np.tile(np.arange(T, dtype=np.int32),
            (B, 1)), "segment_ids": np.ones((B, T), np.int32), "loss_mask": mask}


def _trainer(cfg: TrainConfig, model=None, trainable=nnx.Param) -> Trainer:
    model = model if model is not None else llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    return Trainer(model, cfg, trainable=trainable, mesh=make_mesh(devices=jax.devices()[:1]))


def _run(cfg: TrainConfig, steps: int = 3, model=None, stat: str = "loss", trainable=nnx.Param
         ) -> tuple[list[float], dict[str, np.ndarray]]:
    trainer = _trainer(cfg, model, trainable)
    losses = [float(trainer.step(_batch(i % 2))[stat]) for i in range(steps)]
    params = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(trainer.params)}
    return losses, params


def _adam_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], lr: float, steps: int) -> None:
    """Parameters after `steps` Adam steps from identical starts and (to rounding) identical gradients.

    Adam's update is ~lr·g/|g| element-wise, so an element whose gradient is ~0 can move by up to ~lr
    on rounding noise alone: allow at most 0.1% of the elements to differ by more than 1% of one step,
    and none by more than the `steps` full steps that a rounding-flipped sign could cost."""
    assert a.keys() == b.keys()
    for k in a:
        diff = np.abs(a[k] - b[k])
        assert diff.max() <= 2 * lr * steps, (k, diff.max())
        assert np.mean(diff > 0.01 * lr) <= 1e-3, (k, np.mean(diff > 0.01 * lr))


BASE = dict(steps=10, batch_size=B, learning_rate=3e-3, warmup_steps=0)


def test_grad_accumulation_equals_the_full_batch():
    full, accum = _run(TrainConfig(**BASE)), _run(TrainConfig(**BASE, grad_accum=4))
    np.testing.assert_allclose(accum[0], full[0], rtol=1e-5)
    grads = [_run(TrainConfig(**BASE, grad_accum=a), stat="grad_norm")[0] for a in (1, 4)]
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5)
    _adam_close(accum[1], full[1], BASE["learning_rate"], 3)


def test_grad_accum_must_divide_the_batch():
    with pytest.raises(ValueError, match="not a multiple of grad_accum"):
        TrainConfig(batch_size=6, grad_accum=4)


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_changes_nothing_but_memory(policy):
    plain, remat = _run(TrainConfig(**BASE)), _run(TrainConfig(**BASE, remat=policy))
    np.testing.assert_allclose(remat[0], plain[0], rtol=1e-6)
    _adam_close(remat[1], plain[1], BASE["learning_rate"], 3)


def test_remat_with_lora_changes_nothing_but_memory():
    """The frozen base under a remat'd layer (it once failed: nnx refused to write back Variables of the
    enclosing trace)."""
    def adapted():
        return lora.apply_lora(llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0)), rank=4, alpha=8.0,
                               dropout=0.1, rngs=nnx.Rngs(1))

    plain = _run(TrainConfig(**BASE), model=adapted(), trainable=nnx.LoRAParam)
    remat = _run(TrainConfig(**BASE, remat="full"), model=adapted(), trainable=nnx.LoRAParam)
    np.testing.assert_allclose(remat[0], plain[0], rtol=1e-6)
    _adam_close(remat[1], plain[1], BASE["learning_rate"], 3)


def test_full_remat_with_grad_accumulation():
    """remat: full with grad_accum > 1: the same losses and parameters as without remat. It once raised a
    TraceContextError on every family (reported on DeepSeek-V3): the accumulation scan also runs the micro-step
    under `jax.eval_shape`, for its metrics' structure, on the train step's own params, and a remat'd layer writes
    its Variables back, which nnx refuses for Variables of another trace level. The cause is in the step, not in
    a family: the cheapest model shows it (DeepSeek-V4 runs it in tests/parity/test_peft_lora_parity.py)."""
    cfg = dict(BASE, steps=2, grad_accum=2)
    plain, remat = _run(TrainConfig(**cfg), steps=2), _run(TrainConfig(**cfg, remat="full"), steps=2)
    np.testing.assert_allclose(remat[0], plain[0], rtol=1e-6)
    _adam_close(remat[1], plain[1], BASE["learning_rate"], 2)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_snapshot_stays_where_training_started(mode):
    """`Trainer.snapshot()` (GRPO's KL reference): the model as it stood, unmoved by later steps, which donate the
    trainable buffers. In LoRA mode it is the base with its adapters off (B starts at zero) and holds the
    trainer's own frozen arrays, not a second copy of the base."""
    base = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    ids = jnp.asarray(_batch(5)["input_ids"])
    want = np.asarray(base(ids))
    model = lora.apply_lora(base, rank=4, alpha=8.0, rngs=nnx.Rngs(1)) if mode == "lora" else base
    trainer = _trainer(TrainConfig(**BASE), model, nnx.LoRAParam if mode == "lora" else nnx.Param)
    reference = trainer.snapshot()
    for i in range(3):
        trainer.step(_batch(i))
    np.testing.assert_allclose(np.asarray(reference(ids)), want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(trainer.model()(ids)) - want).max() > 1e-3  # the trainer did move
    shared = {id(x) for x in jax.tree.leaves(trainer.frozen)}
    held = [x for x in jax.tree.leaves(nnx.state(reference)) if isinstance(x, jax.Array)]
    if mode == "lora":
        assert len(shared) > 0 and shared <= {id(x) for x in held}  # the base's weights, not copies of them
    else:
        assert not shared


def test_bf16_compute_keeps_fp32_master_weights():
    cfg = TrainConfig(**BASE, compute_dtype="bfloat16")
    trainer = _trainer(cfg)
    hlo = trainer._train_step.lower(*trainer._args(trainer.put(_batch()))).as_text()
    assert "bf16" in hlo  # the matmuls really run in bf16
    losses = [float(trainer.step(_batch(i % 2))["loss"]) for i in range(3)]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.opt_state) if x.ndim)
    ref, _ = _run(TrainConfig(**BASE))
    np.testing.assert_allclose(losses, ref, rtol=2e-2)  # bf16 rounding, same trajectory
    assert losses[2] < losses[0]


def test_muon_trains_hidden_matrices_only():
    model = deepseek_v3.DeepseekV3(deepseek_v3.DeepseekV3Config.tiny(), rngs=nnx.Rngs(0))
    dims = muon_dims(nnx.state(model, nnx.Param))
    flat = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_leaves_with_path(
        dims, is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))}
    embed = [d for k, d in flat.items() if "embed_tokens" in k or "lm_head" in k]
    experts = [d for k, d in flat.items() if "experts" in k and "gate_up" in k and "shared" not in k]
    norms = [d for k, d in flat.items() if "norm" in k]
    assert embed and all(d is None for d in embed)
    assert norms and all(d is None for d in norms)
    assert experts and all(d == optax.contrib.MuonDimensionNumbers(1, 2) for d in experts)
    assert any(d == optax.contrib.MuonDimensionNumbers(0, 1) for d in flat.values())

    losses, params = _run(TrainConfig(**{**BASE, "learning_rate": 2e-2}, optimizer="muon"), steps=5)
    assert losses[4] < losses[0]
    adam_losses, adam_params = _run(TrainConfig(**BASE), steps=5)
    assert losses != adam_losses


def test_weight_decay_skips_norms_and_biases():
    model = llama.Llama(llama.LlamaConfig.tiny(attention_bias=True), rngs=nnx.Rngs(0))
    mask = decay_mask(nnx.state(model, nnx.Param))
    flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
    assert not any(m for k, m in flat.items() if "norm" in k or "bias" in k)
    assert all(m for k, m in flat.items() if "kernel" in k)


def test_router_correction_bias_is_frozen():
    model = deepseek_v3.DeepseekV3(deepseek_v3.DeepseekV3Config.tiny(), rngs=nnx.Rngs(0))
    router = model.layers[1].mlp.gate
    router.e_score_correction_bias[...] = jnp.linspace(-0.1, 0.1, router.num_experts)
    before = np.asarray(router.e_score_correction_bias[...])
    trainer = _trainer(TrainConfig(**BASE), model)
    for i in range(2):
        trainer.step(_batch(i))
    assert not any("e_score_correction_bias" in jax.tree_util.keystr(p)
                   for p, _ in jax.tree_util.tree_leaves_with_path(trainer.params))
    after = trainer.model().layers[1].mlp.gate.e_score_correction_bias[...]
    np.testing.assert_array_equal(np.asarray(after), before)


def test_nan_stops_the_run_naming_the_step(tiny_base, tmp_path):
    import models

    base, data = tiny_base
    cfg = TrainConfig(steps=6, batch_size=4, checkpoint_every=2, eval_batches=1, log_every=5, warmup_steps=0)
    trainer = Trainer(models.from_pretrained(str(base)), cfg)
    step, calls = trainer.step, []

    def poisoned(batch):  # step 3 runs on parameters that went NaN
        calls.append(1)
        if len(calls) == 3:
            leaf = trainer.params["lm_head"]["kernel"]
            leaf[...] = jnp.full_like(leaf[...], jnp.nan)
        return step(batch)

    trainer.step = poisoned
    ckpt = Checkpoints(tmp_path / "ckpt", None, "t")
    with pytest.raises(TrainingDiverged, match=r"step 3: loss nan .*last good checkpoint: step 2"):
        fit(trainer, data, checkpoints=ckpt)
    ckpt.close()
    assert ckpt.manager.all_steps() == [2]  # nothing was checkpointed past the NaN


def test_metrics_reach_tensorboard(tiny_base, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import models

    base, data = tiny_base
    cfg = TrainConfig(steps=4, batch_size=4, eval_batches=1, log_every=2, warmup_steps=2, peak_flops=1e12)
    stats = fit(Trainer(models.from_pretrained(str(base)), cfg), data, logdir=tmp_path / "tb", label="ft")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"ft/loss", "ft/grad_norm", "ft/learning_rate", "ft/tokens_per_s", "ft/mfu"} <= tags
    assert [e.step for e in acc.Scalars("ft/loss")] == [2, 4]
    assert [e.value for e in acc.Scalars("ft/loss")] == pytest.approx([x for _, x in stats["train_losses"]])
    lr = [e.value for e in acc.Scalars("ft/learning_rate")]
    # step s (1-based) runs at the warmup-cosine rate of s: warmup 2 steps to the peak, cosine to 10% at step 4
    assert lr == pytest.approx([cfg.learning_rate, cfg.learning_rate * 0.1], rel=1e-6)
    assert 0 < stats["mfu"] < 1


@pytest.mark.parity
def test_load_balancing_loss_matches_transformers():
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from models.moe import load_balancing_loss

    logits = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32) * 2
    idx = jax.lax.top_k(jnp.asarray(logits), 2)[1]
    ours = float(load_balancing_loss(jnp.asarray(logits), idx, "softmax"))
    theirs = float(load_balancing_loss_func((torch.from_numpy(logits),), num_experts=8, top_k=2))
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_moe_aux_loss_is_reported_and_trains_the_router():
    from models import qwen3_moe

    build = lambda: qwen3_moe.Qwen3Moe(qwen3_moe.Qwen3MoeConfig.tiny(), rngs=nnx.Rngs(0))
    trainer = _trainer(TrainConfig(**BASE), build())
    stats = trainer.step(_batch())
    assert 1.0 < float(stats["aux_loss"]) < 8.0  # ~top_k (2) when balanced, E (8) when collapsed
    router = lambda params: np.asarray(params["layers"][0]["mlp"]["gate"]["weight"][...])
    plain, balanced = _trainer(TrainConfig(**BASE), build()), _trainer(TrainConfig(**BASE, aux_loss_coef=1.0), build())
    for t in (plain, balanced):  # Adam's first update is lr·sign(g): take a few steps
        for i in range(3):
            t.step(_batch(i))
    assert not np.allclose(router(plain.params), router(balanced.params), atol=1e-7)
    inference = balanced.model()
    inference(jnp.asarray(_batch()["input_ids"]))
    assert not jax.tree.leaves(nnx.state(inference, nnx.Intermediate))  # nothing sown outside training
