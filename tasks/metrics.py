"""Training metrics: TensorBoard event files, model FLOPs per token, MFU, and a terminal progress bar.

    tb = TensorBoardWriter("runs/finetune")                     # events.out.tfevents.<time>.<host>.<pid>.<n>
    flops = train_flops_per_token(model.config, seq_len=T)      # PaLM appendix B: 6N + 12·L·H·Q·T
    metrics = StepMetrics(flops, matmul_peak_flops())           # peak: this machine's measured matmul FLOP/s
    with ProgressBar(steps, "finetune") as bar:
        for step in range(steps):
            out = trainer.step(batch)
            m = metrics(loss=out["loss"], grad_norm=out["grad_norm"], learning_rate=lr, tokens=B * T, seconds=dt)
            tb.scalars(step, m)
            bar.update(step + 1, m)
    tb.close()

TensorBoard files are written without TensorFlow: TFRecord framing (tensorflow `core/lib/io/record_writer.cc`:
uint64 length, masked CRC-32C of the length, the data, masked CRC-32C of the data) around hand-encoded
`tensorflow.Event` protobufs (`tensorboard/compat/proto/event.proto`, `summary.proto`): the first record
carries `file_version: "brain.Event:2"`, the next ones `Summary{Value{tag, simple_value}}`.
tensorboard's own EventAccumulator reads them back (tests/unit/test_metrics.py).

Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B): 6N per token for the matmul weights N a token
touches (forward 2N + backward 4N) plus 12·L·H·Q·T for attention scores and values; MoE counts only the
active experts (reference/architectures.md §12). The exact conventions are in `train_flops_per_token`.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from models.deepseek_v3 import DeepseekV3Config
from models.glm4_moe import Glm4MoeConfig
from models.gpt_oss import GptOssConfig
from models.llama import LlamaConfig
from models.qwen3_moe import Qwen3MoeConfig

# -- CRC-32C and TFRecord framing ------------------------------------------------------------------


def _crc32c_table() -> tuple[int, ...]:
    poly = 0x82F63B78  # Castagnoli, reflected
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, table-driven; crc32c(b"123456789") == 0xE3069283."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant (record_writer.cc)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: uint64 length, masked crc of the length, data, masked crc of the data (little endian)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


# -- protobuf wire encoding (just what Event and Summary need) --------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 negatives are ten-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _len_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int, *, file_version: str | None = None,
                 scalars: Mapping[str, float] | None = None) -> bytes:
    """A serialized `Event{wall_time=1 (double), step=2 (int64), file_version=3 | summary=5}`, where
    `Summary{value=1 (repeated Value)}` and `Value{tag=1 (string), simple_value=2 (float)}`."""
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _len_delimited(3, file_version.encode())
    if scalars:
        values = b"".join(
            _len_delimited(1, _len_delimited(1, tag.encode()) + _key(2, 5) + struct.pack("<f", float(v)))
            for tag, v in scalars.items()
        )
        out += _len_delimited(5, values)
    return out


class TensorBoardWriter:
    """Scalar summaries in a TensorBoard event file under `logdir` (created), no TensorFlow needed.

    The file is `events.out.tfevents.<unix time, 10 digits>.<host>.<pid>.<n>` (tensorboard's own
    naming), so several writers in one folder never collide; its first record is the file version.
    """

    _count = 0

    def __init__(self, logdir: str | os.PathLike[str]):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        TensorBoardWriter._count += 1
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{TensorBoardWriter._count}"
        self.path = self.logdir / name
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._file.write(tfrecord(encode_event(now, 0, file_version="brain.Event:2")))
        self._file.flush()

    def scalars(self, step: int, values: Mapping[str, Any], wall_time: float | None = None) -> None:
        """One event at `step` with a simple_value per tag; None values are skipped, others go through float()."""
        if self._file.closed:
            raise ValueError(f"{self.path}: the writer is closed")
        kept = {tag: float(v) for tag, v in values.items() if v is not None}
        if kept:
            t = time.time() if wall_time is None else wall_time
            self._file.write(tfrecord(encode_event(t, int(step), scalars=kept)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- peak FLOP/s -----------------------------------------------------------------------------------

_PEAK: dict[tuple[str, str, int], float] = {}


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
    """`measure_matmul_flops`, cached per (backend, dtype, n): measured once per process, so only
    compare MFU numbers taken in the same run; on a machine shared with other work the reading can be
    low (MFU then reads high)."""
    key = (jax.default_backend(), jnp.dtype(dtype).name, n)
    if key not in _PEAK:
        _PEAK[key] = measure_matmul_flops(dtype, n, repeats)
    return _PEAK[key]


# -- model FLOPs per token -------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerFlops:
    """What one decoder layer costs a token: matmul weights touched, attention widths, attended keys."""

    matmul_params: int  # attention projections + (dense MLP | router + top-k experts + shared experts)
    qk_width: int  # heads × query/key head dim
    v_width: int  # heads × value head dim
    window: int | None  # sliding-window keys per query (None: full causal attention)


def layer_flops(config: Any) -> list[LayerFlops]:
    """Per-layer accounting for the main stack of every family in models/ (MTP layers are not in it)."""
    c = config
    families = (LlamaConfig, Qwen3MoeConfig, GptOssConfig, Glm4MoeConfig, DeepseekV3Config)
    if not isinstance(c, families):
        raise TypeError(f"train_flops_per_token: unsupported config {type(c).__name__} "
                        f"(known: {', '.join(f.__name__ for f in families)})")
    D = c.hidden_size
    if isinstance(c, DeepseekV3Config):  # MLA, expanded (training) form
        N, P, R, Vd, C, Q = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                             c.kv_lora_rank, c.q_lora_rank)
        q_proj = D * N * (P + R) if Q is None else D * Q + Q * N * (P + R)
        attn = q_proj + D * (C + R) + C * N * (P + Vd) + N * Vd * D
        qk, v = N * (P + R), N * Vd
    else:  # GQA
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        attn = D * H * (N + 2 * K) + N * H * D
        qk = v = N * H

    def ffn(i: int) -> int:
        swiglu = lambda width: 3 * D * width  # gate, up [D, F] and down [F, D]
        if isinstance(c, LlamaConfig):
            return swiglu(c.intermediate_size)
        if isinstance(c, GptOssConfig):  # every layer is MoE, no shared expert
            return D * c.num_local_experts + c.num_experts_per_tok * swiglu(c.intermediate_size)
        if isinstance(c, Qwen3MoeConfig):
            if not c.is_moe_layer(i):
                return swiglu(c.intermediate_size)
            return D * c.num_experts + c.num_experts_per_tok * swiglu(c.moe_intermediate_size)
        # DeepSeek-V3 / GLM-4.5: sigmoid router + top-k routed + n_shared_experts × width shared
        if not c.is_moe_layer(i):
            return swiglu(c.intermediate_size)
        I = c.moe_intermediate_size
        return D * c.n_routed_experts + c.num_experts_per_tok * swiglu(I) + swiglu(I * c.n_shared_experts)

    window = getattr(c, "layer_window", lambda i: None)
    return [LayerFlops(attn + ffn(i), qk, v, window(i)) for i in range(c.num_hidden_layers)]


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


@dataclass(frozen=True)
class StepMetrics:
    """Turns one step's raw numbers into the logged dict. `peak_flops` is the summed peak FLOP/s of every
    device the step runs on (e.g. `matmul_peak_flops() * jax.device_count()`); None leaves mfu out."""

    flops_per_token: float
    peak_flops: float | None = None

    def __call__(self, *, loss: Any, grad_norm: Any, learning_rate: Any, tokens: float,
                 seconds: float) -> dict[str, float]:
        """loss, grad_norm, learning_rate: numbers or 0-d arrays; tokens processed in `seconds` of wall time."""
        if seconds <= 0:
            raise ValueError(f"seconds must be > 0 (got {seconds})")
        rate = float(tokens) / seconds
        out = {"loss": float(loss), "grad_norm": float(grad_norm), "learning_rate": float(learning_rate),
               "tokens_per_s": rate}
        if self.peak_flops:
            out["mfu"] = rate * self.flops_per_token / self.peak_flops
        return out


# -- terminal progress bar -------------------------------------------------------------------------


class ProgressBar:
    """A rich progress bar on stderr: step/total, loss, tokens/s and ETA. Does nothing when stderr is not
    a terminal (log lines carry the same numbers there). Usable as tasks.train's `progress` callback:
    `bar(step, total, metrics)`."""

    def __init__(self, total: int, label: str = "train", *, enabled: bool | None = None):
        self.total, self.label = total, label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress = self._task = None
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} tok/s"),
                TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(file=sys.stderr), transient=False,
            )
            self._task = self._progress.add_task(label, total=total, loss="-", rate="-")
            self._progress.start()

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move to `step` (completed steps) and show `loss` / `tokens_per_s` from `metrics` when present."""
        if self._progress is None:
            return
        m = metrics or {}
        fields = {}
        if m.get("loss") is not None:
            fields["loss"] = f"{float(m['loss']):.4f}"
        if m.get("tokens_per_s") is not None:
            fields["rate"] = f"{float(m['tokens_per_s']):,.0f}"
        self._progress.update(self._task, completed=step, **fields)

    def __call__(self, step: int, total: int, metrics: Mapping[str, Any]) -> None:
        if self._progress is not None and total != self.total:
            self.total = total
            self._progress.update(self._task, total=total)
        self.update(step, metrics)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
