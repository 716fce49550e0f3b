"""The capacity planner (tasks/training/plan.py) against what training really uses, and its command line.

- Per-device bytes: the plan of a small dense full fine-tune and a small MoE LoRA fine-tune on 8 fake CPU
  devices, against the peak resident memory of the real Trainer running the same steps on the same mesh (a
  fresh process: VmHWM after `clear_refs`, over the baseline before the model existed, / 8 devices): within
  15%.
- The layer extrapolation against compiling every layer.
- The parameter count against the model's, the exact state bytes against the compiled program's arguments.
- The command line: `--json` keys, exit 1 when it does not fit, one `error:` line for a bad preset or flag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

# ~70M parameters: the state (16 bytes a parameter in fp32 AdamW) dwarfs the runtime's own memory
DENSE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192, hidden_size=768,
             intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, torch_dtype="float32")
MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=8192, hidden_size=512,
           intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024, rms_norm_eps=1e-6,
           rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")

MEASURE = textwrap.dedent("""
    import ctypes, gc, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from models import families, lora
    from models.sharding import make_mesh
    from tasks.training.config import TrainConfig
    from tasks.training.trainer import Trainer

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def settle():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)

    raw, mode, mesh, B, T = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5])
    jax.block_until_ready(jnp.ones((8,)) + 1)
    settle()
    base = status("VmRSS")
    config_cls, model_cls = families.resolve(raw)
    model = model_cls(config_cls.from_hf(raw), rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    if mode == "lora":
        lora.apply_lora(model, rank=16, alpha=32.0, rngs=nnx.Rngs(1))
    cfg = TrainConfig(batch_size=B, remat="none", compute_dtype="float32")  # XLA:CPU drops remat anyway
    trainer = Trainer(model, cfg, trainable=nnx.LoRAParam if mode == "lora" else nnx.Param, mesh=make_mesh(**mesh))
    del model
    rng = np.random.default_rng(0)
    ids = rng.integers(3, raw["vocab_size"], (B, T + 1)).astype(np.int32)
    batch = trainer.put({"input_ids": ids[:, :-1], "target_ids": ids[:, 1:],
                         "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
                         "segment_ids": np.ones((B, T), np.int32), "loss_mask": np.ones((B, T), np.int8)})
    trainer.compile(batch)
    settle()
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here on: state + the steps' temporaries
    for _ in range(2):
        jax.block_until_ready(trainer.step(batch))
    print(json.dumps({"peak": status("VmHWM") - base}))
""")


def _env() -> dict[str, str]:
    from tasks.training.plan import plan_env

    return {**plan_env(8), "PYTHONPATH": str(REPO)}


def _plan(config: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "tasks.training.plan", str(path), "--devices", "8", "--json", *args],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("config,mode,mesh", [
    (DENSE, "full", {"fsdp": 4, "tensor": 2}),
    (MOE, "lora", {"fsdp": 4, "expert": 2}),
], ids=["dense-full", "moe-lora"])
def test_the_plan_is_within_15_percent_of_what_training_uses(config, mode, mesh, tmp_path, measured):
    B, T = 16, 256
    mesh_arg = ",".join(f"{k}={v}" for k, v in mesh.items())
    proc = _plan(config, tmp_path, "--mode", mode, "--mesh", mesh_arg, "--global-batch", str(B), "--seq-len", str(T),
                 "--param-dtype", "float32", "--compute-dtype", "float32", "--remat", "none", "--device-memory", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    run = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(config), mode, json.dumps(mesh), str(B), str(T)],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads(run.stdout.strip().splitlines()[-1])["peak"] / 8
    planned = plan["bytes_per_device"]["total"]
    measured(f"  plan vs training, {mode} {mesh_arg} B={B} T={T}: planned {planned / 2**20:.1f} MiB/device, used "
             f"{used / 2**20:.1f} MiB/device (peak RSS / 8), ratio {planned / used:.3f}; "
             + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in plan["bytes_per_device"].items()))
    assert abs(planned / used - 1) <= 0.15, (planned, used, plan["bytes_per_device"])


@pytest.mark.slow
def test_extrapolated_depth_agrees_with_compiling_every_layer(tmp_path, measured):
    """A DeepSeek-style stack (1 dense layer, then MoE layers; MLA) compiled at depths 2 and 3 and extrapolated to
    8 layers, against all 8 compiled."""
    from models.deepseek_v3 import DeepseekV3Config

    config = DeepseekV3Config.tiny(vocab_size=1024, num_hidden_layers=8).to_hf("float32")
    common = ("--mode", "full", "--mesh", "fsdp=4,expert=2", "--global-batch", "8", "--seq-len", "128",
              "--compute-dtype", "float32", "--remat", "none")
    fast, full = (_plan(config, tmp_path, *common, *extra) for extra in ((), ("--full-depth",)))
    assert fast.returncode == 0 and full.returncode == 0, fast.stderr[-2000:] + full.stderr[-2000:]
    fast, full = json.loads(fast.stdout), json.loads(full.stdout)
    assert fast["candidates"][0]["compiled_depths"] == [2, 3] and full["candidates"][0]["compiled_depths"] == [8]
    a, b = fast["bytes_per_device"], full["bytes_per_device"]
    assert {k: a[k] for k in a if k != "temp" and k != "total"} == {k: b[k] for k in b if k != "temp" and k != "total"}
    measured(f"  plan depth extrapolation (DeepSeek-style, 8 layers from 2 and 3): temp {a['temp'] / 2**20:.2f} MiB vs "
             f"{b['temp'] / 2**20:.2f} MiB compiled whole")
    assert abs(a["total"] / b["total"] - 1) <= 0.05, (a, b)


def test_state_bytes_are_the_compiled_programs_arguments():
    """The exact per-device bytes of params + optimizer + frozen + batch equal what XLA says the step's
    arguments take (8 fake devices, in a subprocess)."""
    code = textwrap.dedent("""
        import json
        from models.llama import LlamaConfig
        from tasks.training.plan import MeshShape, Request, compile_step, family_config
        raw = LlamaConfig.tiny(vocab_size=512).to_hf("float32")
        cfg, cls = family_config(raw)
        out = {}
        for mode in ("full", "lora"):
            req = Request(config=raw, name="tiny", mode=mode, seq_len=64, global_batch=8, devices=8,
                          param_dtype="float32")
            run = compile_step(cfg, cls, req, MeshShape(data=1, fsdp=4, tensor=2, expert=1))
            out[mode] = {"argument": run["argument"], "exact": run["exact"]}
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mode, run in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        ex = run["exact"]
        args = ex["params"] + ex["optimizer"] + ex["frozen"] + ex["batch"]
        assert abs(run["argument"] - args) <= 4096, (mode, run)  # the RNG keys and the step counter


def test_parameter_count_matches_the_model():
    """The planner's count (abstract) equals the parameters of the model built for real."""
    import jax
    from flax import nnx

    from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
    from tasks.training.plan import Request, abstract_model, family_config, parameter_count

    raw = Qwen3MoeConfig.tiny().to_hf("float32")
    cfg, cls = family_config(raw)
    real = sum(x.size for x in jax.tree.leaves(nnx.state(Qwen3Moe(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    counts = parameter_count(abstract_model(cfg, cls, Request(config=raw, name="tiny", mode="lora", lora_rank=4)))
    assert counts["total"] == real and counts["lora"] > 0


def test_depth_pattern_follows_the_families_layer_kinds():
    from models.deepseek_v3 import DeepseekV3Config
    from models.gpt_oss import GptOssConfig
    from models.llama import LlamaConfig
    from tasks.training.plan import depth_pattern, with_depth

    assert depth_pattern(LlamaConfig.tiny()) == (0, 1)
    assert depth_pattern(DeepseekV3Config.deepseek_v3()) == (3, 1)  # 3 dense layers, then MoE
    assert depth_pattern(GptOssConfig.tiny(num_hidden_layers=6)) == (0, 2)  # sliding / full alternate
    cut = with_depth(GptOssConfig.tiny(num_hidden_layers=6), 4)
    assert cut.num_hidden_layers == 4 and len(cut.layer_types) == 4


def test_command_line_json_and_exit_status(tmp_path):
    from models.llama import LlamaConfig

    raw = LlamaConfig.tiny(vocab_size=512).to_hf("float32")
    ok = _plan(raw, tmp_path, "--global-batch", "8", "--seq-len", "64", "--compile", "1")
    assert ok.returncode == 0, ok.stderr[-2000:]
    plan = json.loads(ok.stdout)
    assert {"parameters", "mesh", "bytes_per_device", "fits"} <= plan.keys()
    assert {"params", "grads", "optimizer", "temp", "total"} <= plan["bytes_per_device"].keys()
    assert plan["fits"] is True and plan["parameters"]["total"] > 0
    assert sum(v for k, v in plan["bytes_per_device"].items() if k != "total") == plan["bytes_per_device"]["total"]
    tight = _plan(raw, tmp_path, "--global-batch", "8", "--seq-len", "64", "--compile", "1", "--device-memory",
                  "0.0001")
    assert tight.returncode == 1 and json.loads(tight.stdout)["fits"] is False


@pytest.mark.parametrize("args,message", [
    (["no-such-model"], "error: MODEL: 'no-such-model' is neither a preset"),
    (["deepseek-v3", "--devices", "0"], "error: --devices: must be >= 1"),
    (["deepseek-v3", "--mode", "qlora"], "error: argument --mode: invalid choice"),
    (["deepseek-v3", "--mesh", "fsdp=4,pipeline=2"], "error: --mesh: unknown axes ['pipeline']"),
])
def test_bad_input_is_one_error_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr


def test_a_recipe_whose_finetune_cannot_fit_fails_before_the_release(capsys):
    """`resources.finetune.accelerator_memory_gib` set: the preflight plans the stage's own step (mode, mesh,
    batch, sequence length) on as many fake devices and refuses a fine-tune that cannot fit, with the numbers."""
    import typer

    from flows.cli import _check_fits
    from tasks.recipe import load_release

    sets = ["resources.finetune.accelerators=4", "resources.finetune.hosts=2"]
    with pytest.raises(typer.Exit) as e:
        _check_fits(load_release("tiny", [*sets, "resources.finetune.accelerator_memory_gib=0.001"]))
    assert e.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: finetune does not fit: "), err
    assert "accelerator_memory_gib 0.001" in err[0] and "8 devices" in err[0] and "temp" in err[0]
    _check_fits(load_release("tiny", [*sets, "resources.finetune.accelerator_memory_gib=8"]))  # fits: no error
    _check_fits(load_release("tiny", sets))  # no accelerator memory given: nothing to check


def test_xla_cpu_drops_rematerialisation():
    """Why the planner credits remat itself (plan_mesh): XLA:CPU compiles a chain of checkpointed matmuls to the
    program and temporaries of the plain chain. If this starts failing, XLA:CPU keeps remat and the planner can
    compile remat'd steps as they are."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)

    def plain(x, w):
        for _ in range(16):
            x = jnp.tanh(x @ w)
        return x.sum()

    def remat(x, w):
        for _ in range(8):
            x = jax.checkpoint(lambda a, w: jnp.tanh(jnp.tanh(a @ w) @ w))(x, w)
        return x.sum()

    temps = [jax.jit(jax.grad(f)).lower(x, x).compile().memory_analysis().temp_size_in_bytes for f in (plain, remat)]
    assert "optimization_barrier" in jax.jit(jax.grad(remat)).lower(x, x).as_text()  # jax asks for it
    assert temps[1] >= temps[0], temps  # XLA:CPU does not keep it


def test_full_remat_keeps_only_each_layers_input(tmp_path):
    """With remat: full, layers past the first repetition cost their [rows, T, D] input, not their activations."""
    from models.llama import LlamaConfig

    raw = LlamaConfig.tiny(vocab_size=512, num_hidden_layers=8).to_hf("float32")
    common = ("--mode", "full", "--mesh", "fsdp=8", "--global-batch", "8", "--seq-len", "256", "--compute-dtype",
              "float32", "--compile", "1")
    full, none = (_plan(raw, tmp_path, *common, "--remat", r) for r in ("full", "none"))
    assert full.returncode == 0 and none.returncode == 0, full.stderr[-2000:] + none.stderr[-2000:]
    full, none = json.loads(full.stdout), json.loads(none.stdout)
    assert full["candidates"][0]["compiled_depths"] == [1, 2]  # depth 1 is the pattern's first repetition
    # 8 layers whose activations dwarf their inputs: keeping one layer's instead of eight's
    assert full["bytes_per_device"]["temp"] < none["bytes_per_device"]["temp"] / 2, (full, none)
    assert full["bytes_per_device"]["params"] == none["bytes_per_device"]["params"]


def test_full_remat_with_leading_dense_layers_keeps_a_layer(tmp_path):
    """DeepSeek-style (1 dense layer, then MoE): the remat credit counts the one-layer step plus one MoE layer's
    activations (it once subtracted more than depth 2 held and reported no temporaries at all)."""
    from models.deepseek_v3 import DeepseekV3Config

    raw = DeepseekV3Config.tiny(vocab_size=512, num_hidden_layers=6).to_hf("float32")
    common = ("--mode", "full", "--mesh", "fsdp=4,expert=2", "--global-batch", "8", "--seq-len", "128",
              "--compute-dtype", "float32", "--compile", "1")
    full, none = (_plan(raw, tmp_path, *common, "--remat", r) for r in ("full", "none"))
    assert full.returncode == 0 and none.returncode == 0, full.stderr[-2000:] + none.stderr[-2000:]
    full, none = json.loads(full.stdout), json.loads(none.stdout)
    assert full["candidates"][0]["compiled_depths"] == [1, 2, 3]
    assert 0 < full["bytes_per_device"]["temp"] < none["bytes_per_device"]["temp"], (full, none)
