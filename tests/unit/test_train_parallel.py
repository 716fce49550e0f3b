"""Sharded training equals single-device training: on 8 fake CPU devices, DP, FSDP (ZeRO-3), TP, EP
and FSDP+TP give the single-device loss trajectory and parameters, for a dense (Llama) and an MoE
(DeepSeek-V3: MLA, sigmoid router, shared + routed experts) model, and every layout actually shards
what it claims to (parameters and Adam moments over fsdp/tensor/expert, the batch over data/fsdp)."""

from __future__ import annotations

import textwrap

import pytest

from tests.devices import run_on_8_devices

pytestmark = pytest.mark.unit


CHILD = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from models import llama, deepseek_v3
    from models.sharding import make_mesh
    from tasks.training.config import MeshConfig, TrainConfig
    from tasks.training.trainer import Trainer

    assert jax.device_count() == 8, jax.devices()
    B, T, V = 8, 24, 256
    rng = np.random.default_rng(0)
    ids = rng.integers(3, V, (2, B, T + 1)).astype(np.int32)[[0, 1, 0]]  # batch 0 again: the loss must drop
    seg = np.ones((B, T), np.int32); seg[:, T // 2:] = 2          # two packed documents per row
    pos = np.concatenate([np.arange(T // 2), np.arange(T - T // 2)]).astype(np.int32)[None].repeat(B, 0)
    mask = np.ones((B, T), np.int32); mask[:, T // 2 - 1] = 0       # no target across the boundary
    batches = [{"input_ids": i[:, :-1], "target_ids": i[:, 1:], "positions": pos, "segment_ids": seg,
                "loss_mask": mask} for i in ids]
    MODELS = {
        "llama": lambda: llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0)),
        "deepseek_v3": lambda: deepseek_v3.DeepseekV3(deepseek_v3.DeepseekV3Config.tiny(), rngs=nnx.Rngs(0)),
    }
    LAYOUTS = {"single": None, "dp": dict(data=8, fsdp=1), "fsdp": dict(fsdp=8), "tp": dict(fsdp=1, tensor=4, data=2),
               "ep": dict(fsdp=1, expert=8), "fsdp_tp": dict(fsdp=4, tensor=2)}
    report = {}
    for name, build in MODELS.items():
        for layout, mesh in LAYOUTS.items():
            if name == "llama" and layout == "ep":
                continue  # no experts to shard
            cfg = TrainConfig(steps=10, batch_size=B, learning_rate=1e-2, warmup_steps=0,
                              mesh=MeshConfig(**(mesh or {})))
            devices = [jax.devices()[0]] if mesh is None else None
            trainer = Trainer(build(), cfg, mesh=make_mesh(devices=devices, **(mesh or dict(fsdp=1))))
            losses = [float(trainer.step(b)["loss"]) for b in batches]
            leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(trainer.params)}
            mu = jax.tree.leaves(trainer.opt_state[1][0].mu)
            report[f"{name}/{layout}"] = {
                "losses": losses,
                "params": {k: np.asarray(v).ravel()[:64].tolist() for k, v in leaves.items()},
                "param_axes": sorted({a for v in leaves.values() for a in v.sharding.spec if a is not None}
                                     | {x for v in leaves.values() for a in v.sharding.spec if isinstance(a, tuple)
                                        for x in a}),
                "mu_axes": sorted({str(a) for v in mu for a in v.sharding.spec if a is not None}),
                "batch_spec": str(trainer.batch_sh.spec),
            }
    print("REPORT" + json.dumps(report))
""")


@pytest.fixture(scope="module")
def report():
    return run_on_8_devices(CHILD)


@pytest.mark.parametrize("model, layout", [
    (m, layout) for m in ("llama", "deepseek_v3") for layout in ("dp", "fsdp", "tp", "ep", "fsdp_tp")
    if (m, layout) != ("llama", "ep")])
def test_sharded_training_matches_single_device(report, model, layout):
    import numpy as np

    ref, got = report[f"{model}/single"], report[f"{model}/{layout}"]
    assert ref["losses"][2] < ref["losses"][0]  # the same batch again, after two steps: it trains
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=2e-5, atol=0)
    for name, values in ref["params"].items():
        np.testing.assert_allclose(got["params"][name], values, rtol=1e-3, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_layouts_shard_what_they_claim(report, model):
    assert report[f"{model}/single"]["param_axes"] == []
    assert report[f"{model}/dp"]["param_axes"] == [] and "data" in report[f"{model}/dp"]["batch_spec"]
    for layout, axis in [("fsdp", "fsdp"), ("tp", "tensor"), ("fsdp_tp", "fsdp"), ("fsdp_tp", "tensor")]:
        assert axis in report[f"{model}/{layout}"]["param_axes"], (layout, report[f"{model}/{layout}"])
        assert axis in report[f"{model}/{layout}"]["mu_axes"], (layout, "optimizer state is not sharded")
    if model == "deepseek_v3":
        assert "expert" in report[f"{model}/ep"]["param_axes"]
        assert "expert" in report[f"{model}/ep"]["mu_axes"]
