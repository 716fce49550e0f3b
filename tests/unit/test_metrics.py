"""tasks/training/ (tensorboard, flops, progress): TensorBoard event files read back by tensorboard's own
reader (values, steps, tags, CRCs), PaLM model FLOPs per token against counts taken from built models of
every family (active experts only), StepMetrics' arithmetic, the measured matmul peak and the progress bar."""

from __future__ import annotations

import io
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.decoder import build_context
from models.deepseek_v3 import DeepseekV3, DeepseekV3Config
from models.glm4_moe import Glm4Moe, Glm4MoeConfig
from models.gpt_oss import GptOss, GptOssConfig
from models.llama import Llama, LlamaConfig
from models.lora import apply_lora
from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from tasks.training.flops import attended_keys, matmul_params_per_token, matmul_peak_flops, train_flops_per_token
from tasks.training.progress import ProgressBar, StepMetrics
from tasks.training.tensorboard import TensorBoardWriter, crc32c, masked_crc32c

pytestmark = pytest.mark.unit

# -- TensorBoard event files ------------------------------------------------------------------------


def test_crc32c_check_values():
    """The CRC-32C check values of RFC 3720 (iSCSI) appendix B.4, and tensorboard's own implementation."""
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 300):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == tb_masked(data)


def test_event_file_roundtrip_through_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    rng = np.random.default_rng(1)
    steps = [0, 1, 2, 10, 999, 2**40]
    written = {s: {"loss": float(rng.normal()) * 10.0 ** int(rng.integers(-8, 8)), "learning_rate": 3e-4 * s,
                   "train/tokens_per_s": float(rng.uniform(0, 1e6))} for s in steps}
    with TensorBoardWriter(tmp_path) as tb:
        for s in steps:
            tb.scalars(s, {**written[s], "skipped": None})
        tb.scalars(5, {"mfu": jnp.float32(0.25)})  # 0-d arrays go through float()
    assert tb.path.name.startswith("events.out.tfevents.") and tb.path.parent == tmp_path

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert acc.file_version == 2.0
    assert set(acc.Tags()["scalars"]) == {"loss", "learning_rate", "train/tokens_per_s", "mfu"}
    for tag in ("loss", "learning_rate", "train/tokens_per_s"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == steps
        assert [e.value for e in events] == [float(np.float32(written[s][tag])) for s in steps]  # float32 exact
    assert [(e.step, e.value) for e in acc.Scalars("mfu")] == [(5, 0.25)]

    events = list(EventFileLoader(str(tb.path)).Load())  # every record's CRCs checked by tensorboard
    assert events[0].file_version == "brain.Event:2" and not events[0].HasField("summary")
    assert len(events) == 1 + len(steps) + 1
    assert all(e.wall_time > 1e9 for e in events)


def test_event_file_corruption_is_detected(tmp_path):
    """tensorboard's reader checks the data CRC: flipping one payload byte drops the record, so the
    roundtrip above could not pass with wrong checksums."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    with TensorBoardWriter(tmp_path) as tb:
        tb.scalars(1, {"loss": 1.0})
    raw = bytearray(tb.path.read_bytes())
    first = 8 + 4 + struct.unpack("<Q", raw[:8])[0] + 4  # end of the file_version record
    assert len(list(EventFileLoader(str(tb.path)).Load())) == 2
    raw[first + 12 + 3] ^= 0x01  # a byte inside the second record's payload
    tb.path.write_bytes(bytes(raw))
    assert len(list(EventFileLoader(str(tb.path)).Load())) == 1


def test_writer_rejects_writes_after_close(tmp_path):
    tb = TensorBoardWriter(tmp_path)
    tb.close()
    with pytest.raises(ValueError, match="closed"):
        tb.scalars(0, {"loss": 1.0})


def test_flush_puts_what_was_written_on_disk(tmp_path):
    """The file version is on disk once the writer opens, every event once flush() returns, while the writer
    stays open: a process killed after a flush has lost nothing written before it."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader  # events as written

    with TensorBoardWriter(tmp_path) as tb:
        assert [e.file_version for e in LegacyEventFileLoader(str(tb.path)).Load()] == ["brain.Event:2"]
        for s in range(3):
            tb.scalars(s, {"loss": 0.5 * s, "mfu": 0.25})
        tb.flush()
        events = list(LegacyEventFileLoader(str(tb.path)).Load())[1:]
        assert [(e.step, [(v.tag, v.simple_value) for v in e.summary.value]) for e in events] == [
            (s, [("loss", 0.5 * s), ("mfu", 0.25)]) for s in range(3)]


def test_writing_an_event_file_loads_neither_tensorboardx_nor_torch(tmp_path):
    """tensorboardX's package imports torch where it is installed (1.9 s measured in the test environment),
    which every training process paid when it opened its writer: a writer's whole life in a fresh process
    loads neither."""
    code = ("import sys; from tasks.training.tensorboard import TensorBoardWriter\n"
            f"with TensorBoardWriter({str(tmp_path)!r}) as tb: tb.scalars(1, {{'loss': 1.0}})\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorboardX', 'torch', 'tensorflow'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]" and len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


def test_values_past_float32_are_infinite_as_protobuf_stores_them(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardWriter(tmp_path) as tb:
        tb.scalars(3, {"big": 1e39, "small": -1e39, "nan": float("nan")})
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    values = {tag: acc.Scalars(tag)[0].value for tag in ("big", "small", "nan")}
    assert values["big"] == math.inf and values["small"] == -math.inf and math.isnan(values["nan"])


# -- FLOPs per token --------------------------------------------------------------------------------


def active_matmul_params(model: nnx.Module, config) -> float:
    """N counted from the built model: every >=2-d weight except the embedding table (its lookup is no
    matmul) and biases, main-stack layers only (no MTP), routed experts scaled by top-k / E, plus the
    LM head when it is tied to the embedding."""
    n_layers, k = config.num_hidden_layers, getattr(config, "num_experts_per_tok", 0)
    total = 0.0
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        if v[...].ndim < 2 or names[0] == "embed_tokens" or names[-1].endswith("bias"):
            continue
        if names[0] == "layers" and int(path[1]) >= n_layers:
            continue  # an MTP layer
        size = v[...].size
        if "experts" in names:  # stacked routed experts [E, ...]: a token touches k of them
            size *= k / v[...].shape[0]
        total += size
    if model.lm_head is None:
        total += model.embed_tokens.weight[...].size  # the tied head multiplies by the embedding table
    return total


def attention_flops(model: nnx.Module, config, seq_len: int, causal: bool) -> float:
    """6 × attended keys × (query/key width + value width) per layer, widths read off the built projections
    (q_proj or q_b_proj outputs, o_proj inputs) and keys counted from the model's own attention masks."""
    total = 0.0
    for layer in list(model.layers)[:config.num_hidden_layers]:
        attn = layer.self_attn
        q = attn.q_proj if getattr(attn, "q_proj", None) is not None else attn.q_b_proj
        qk_width, v_width = q.kernel[...].shape[1], attn.o_proj.kernel[...].shape[0]
        ctx, _ = build_context(seq_len, 1, positions=None, segment_ids=None, cache=None, windows={layer.window})
        mask = np.asarray(ctx.mask(layer.window))[0]  # [T, T], causal (and windowed)
        keys = mask.sum() / seq_len if causal else min(seq_len, layer.window or seq_len)
        total += 6 * keys * (qk_width + v_width)
    return total


FAMILIES = {
    "llama": (Llama, LlamaConfig.tiny()),
    "qwen3_tied": (Llama, LlamaConfig.qwen3_tiny()),
    "qwen3_moe": (Qwen3Moe, Qwen3MoeConfig.tiny()),
    "deepseek_v3": (DeepseekV3, DeepseekV3Config.tiny(num_mtp_layers=1)),
    "deepseek_v3_no_q_lora": (DeepseekV3, DeepseekV3Config.tiny(q_lora_rank=None, n_shared_experts=2)),
    "gpt_oss": (GptOss, GptOssConfig.tiny()),
    "glm4_moe": (Glm4Moe, Glm4MoeConfig.tiny(num_mtp_layers=1)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flops_per_token_match_built_models(family):
    cls, config = FAMILIES[family]
    model = cls(config, rngs=nnx.Rngs(0))
    n = active_matmul_params(model, config)
    assert matmul_params_per_token(config) == n
    for seq_len, causal in ((32, False), (32, True), (5, True)):
        want = 6 * n + attention_flops(model, config, seq_len, causal)
        assert train_flops_per_token(config, seq_len, causal=causal) == pytest.approx(want, rel=1e-12)


def test_palm_formula_for_a_dense_llama():
    """PaLM appendix B literally: 6N + 12·L·H·Q·T, N = the built model's parameters minus the embedding
    table and the norms (this Llama has no biases and an untied head)."""
    config = LlamaConfig.tiny(num_key_value_heads=4)
    model = Llama(config, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    N = sum(x.size for x in jax.tree.leaves(params)) - config.vocab_size * config.hidden_size \
        - config.hidden_size * (2 * config.num_hidden_layers + 1)
    L, H, Q, T = config.num_hidden_layers, config.num_attention_heads, config.head_dim, 128
    assert train_flops_per_token(config, T) == 6 * N + 12 * L * H * Q * T


def test_moe_counts_only_active_experts():
    """Doubling the number of experts leaves the per-token FLOPs unchanged except for the router;
    doubling top-k adds exactly k more expert SwiGLUs per MoE layer."""
    base = Qwen3MoeConfig.tiny()
    D, I = base.hidden_size, base.moe_intermediate_size
    moe_layers = sum(base.is_moe_layer(i) for i in range(base.num_hidden_layers))
    more_experts = Qwen3MoeConfig.tiny(num_experts=16)
    assert matmul_params_per_token(more_experts) - matmul_params_per_token(base) == moe_layers * D * 8
    more_k = Qwen3MoeConfig.tiny(num_experts_per_tok=4)
    assert matmul_params_per_token(more_k) - matmul_params_per_token(base) == moe_layers * 2 * 3 * D * I


def test_lora_convention():
    """trainable_only: 4 FLOPs per frozen base weight (forward + activation gradient), 6 per adapter weight;
    the attention term does not change."""
    config = LlamaConfig.tiny()
    model = Llama(config, rngs=nnx.Rngs(0))
    apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(1))
    adapters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    n = matmul_params_per_token(config)
    full = train_flops_per_token(config, 64)
    lora = train_flops_per_token(config, 64, trainable_only=True, adapter_params=adapters)
    assert adapters > 0 and lora == full - 2 * n + 6 * adapters


def test_attended_keys_and_bad_input():
    assert attended_keys(8, None, causal=False) == 8
    assert attended_keys(8, 3, causal=False) == 3
    assert attended_keys(8, None, causal=True) == 36 / 8
    assert attended_keys(8, 3, causal=True) == (1 + 2 + 3 * 6) / 8
    assert attended_keys(2, 16, causal=True) == 1.5
    with pytest.raises(ValueError, match="seq_len"):
        train_flops_per_token(LlamaConfig.tiny(), 0)
    with pytest.raises(TypeError, match="unsupported config"):
        train_flops_per_token(object(), 8)


# -- StepMetrics, peak, progress bar ----------------------------------------------------------------


def test_step_metrics():
    m = StepMetrics(flops_per_token=6e6, peak_flops=2e12)
    out = m(loss=jnp.float32(2.5), grad_norm=np.float32(0.75), learning_rate=1e-3, tokens=4096, seconds=0.5)
    assert out == {"loss": 2.5, "grad_norm": 0.75, "learning_rate": 1e-3, "tokens_per_s": 8192.0,
                   "mfu": pytest.approx(8192 * 6e6 / 2e12)}
    assert "mfu" not in StepMetrics(6e6)(loss=1, grad_norm=1, learning_rate=1, tokens=1, seconds=1)
    with pytest.raises(ValueError, match="seconds"):
        m(loss=1, grad_norm=1, learning_rate=1, tokens=1, seconds=0)


def test_matmul_peak_is_measured_once_per_machine(tmp_path, monkeypatch):
    """The reading is kept in the cache folder: a later process (here: the in-process memo cleared) reads it
    rather than measuring; another n or dtype, or a damaged file, is measured."""
    from tasks.training import flops

    monkeypatch.setenv("FORGELINE_CACHE", str(tmp_path))
    monkeypatch.setattr(flops, "_PEAK", {})
    measured = []
    real = flops.measure_matmul_flops
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda *a: measured.append(a) or real(*a))
    a = matmul_peak_flops(jnp.float32, n=128, repeats=2)
    assert math.isfinite(a) and a > 1e6 and len(measured) == 1
    assert matmul_peak_flops(jnp.float32, n=128, repeats=2) == a and len(measured) == 1  # this process's memo
    monkeypatch.setattr(flops, "_PEAK", {})  # a new process on the same machine
    assert matmul_peak_flops(jnp.float32, n=128, repeats=2) == a and len(measured) == 1
    matmul_peak_flops(jnp.float32, n=64, repeats=2)
    matmul_peak_flops(jnp.bfloat16, n=64, repeats=2)
    assert len(measured) == 3 and len(json.loads((tmp_path / "matmul_peak.json").read_text())) == 3
    (tmp_path / "matmul_peak.json").write_text("{not json")
    monkeypatch.setattr(flops, "_PEAK", {})
    assert matmul_peak_flops(jnp.float32, n=128, repeats=2) > 1e6 and len(measured) == 4
    assert not list(tmp_path.glob("*.tmp"))


def test_progress_bar(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    with ProgressBar(10, "finetune") as bar:  # not a TTY: draws nothing
        bar(4, 10, {"loss": 1.0, "tokens_per_s": 10.0})
    assert buf.getvalue() == ""
    with ProgressBar(10, "finetune", enabled=True) as bar:
        bar.update(3, {"loss": 1.23456, "tokens_per_s": 12345.6})
    text = buf.getvalue()
    assert "finetune" in text and "3/10" in text and "1.2346" in text and "12,346 tok/s" in text
