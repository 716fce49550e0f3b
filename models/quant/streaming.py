"""Streaming post-training quantization of a safetensors checkpoint: tensor by tensor, without building the
model, so a checkpoint of any size (a 1 TB DeepSeek-V3 or Kimi K2) gets an FP8 or FP4 variant on a machine
that holds one tensor at a time. The same idea as llm-compressor's model-free PTQ
(`llmcompressor/entrypoints/model_free`), here with our quantizers and our compressed-tensors writer:

    report = quantize_checkpoint("s3://bucket/DeepSeek-V3", "file:///data/DeepSeek-V3-nvfp4a16",
                                 parse_scheme("nvfp4a16"))

1. The model is built abstractly from config.json (`nnx.eval_shape`: no weights) only to ask `quant_units`
   which tensors are quantized: exactly the modules the in-model quantizer (models/quant/driver.py) picks,
   `ignore` included, and `check_supported` refuses what it refuses. GPT-OSS's fused experts are refused
   here for every scheme: their one layout, GPT-OSS's MXFP4 (mxfp4a16), is written by the quantize stage
   (`quantize_model` + `save_pretrained`, models/quant/formats/mxfp4.py), not by this per-tensor writer.
2. Published quantized sources are read dequantized (DeepSeek FP8 blocks, GPT-OSS MXFP4:
   models/quant/formats/dequantizing.py); a compressed-tensors source is refused (already quantized).
3. NVFP4 only: a first pass reads each fused group's tensors (q/k/v, MLA q_a/kv_a, gate/up; each expert's
   gate/up) for their largest |w|, the group's shared global scale (`nvfp4_global_scales`' rule).
4. Each source shard becomes one output shard with the same name: its header planned from shapes alone
   (`tensor_specs`), then each tensor read (only its bytes: local memory maps or ranged GETs), quantized
   by round-to-nearest (`quantize_matrix`, the in-model quantizer's own code, so the output equals
   `quantize_model(model, scheme, [])` + `save_pretrained` tensor for tensor) and streamed into the file
   (`SafetensorsWriter`), a chunk of rows at a time (`chunk_bytes`, 8 MiB of float32: round-to-nearest is
   row-local, so a 2 GB expert stack or MLP weight costs no more memory than a small one); other tensors
   are copied in their own dtype. A finished shard goes to the
   destination at once (remote: uploaded, then deleted here), so local disk holds one shard.
5. The index, the other small files (tokenizer, generation config) and config.json (with compressed-tensors'
   `quantization_config`) are written last. A local destination is written into a sibling staging folder
   renamed into place at the end; a remote one gets config.json last and, on any failure, everything this
   run uploaded is removed: a reader never sees a half-written checkpoint.

Round-to-nearest schemes only (int8, w4a16/w8a16-rtn, fp8-block, fp8-dynamic, nvfp4a16, mxfp4a16, and
w4afp8 / mxfp4 whose activation scales are dynamic): GPTQ, AWQ, SmoothQuant and NVFP4 activations need
calibration activations, which need the model (the quantize stage). See docs/quantization.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from models import abstract, families
from models.layers import Linear
from models.moe import Experts
from models.quant.driver import fused_groups, quantize_matrix
from models.quant.formats.compressed_tensors import _tensors_for, compressed_tensors_config, tensor_specs
from models.quant.formats.dequantizing import DequantizingCheckpoint
from models.quant.schemes import Options, Scheme
from models.quant.targets import check_supported, float_by_default, is_gpt_oss_experts, quant_units

log = logging.getLogger("forgeline.quantize")

SMALL_FILES = re.compile(r"(tokenizer.*|special_tokens.*|generation_config\.json|.*\.model|vocab\..*|merges\.txt"
                         r"|chat_template.*)")
CHUNK_BYTES = 8 << 20  # float32 rows of a weight quantized at once: memory is bounded by this, not the tensor
CHECKPOINT_FILES = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|config\.json")


def quantized_tensors(model: nnx.Module, scheme: Scheme, ignore: Sequence[str]) -> dict[str, str]:
    """HF tensor name -> module name of every weight the in-model quantizer would quantize."""
    units = quant_units(model, ignore)
    if not units:
        raise ValueError("nothing to quantize: every Linear is ignored")
    if gpt_oss := [u.name for u in units if is_gpt_oss_experts(u.module)]:
        raise ValueError(f"quantize_checkpoint: {gpt_oss[0]}: GPT-OSS's fused experts are not quantized by "
                         "streaming quantization (their MXFP4 layout is written by quantize_model + save_pretrained "
                         "with mxfp4a16); add 're:.*mlp\\.experts' to ignore")
    check_supported(units, scheme)
    out = {}
    for u in units:
        if isinstance(u.module, Linear):
            out[f"{u.name}.weight"] = u.name
        elif isinstance(u.module, Experts):
            for e in range(u.module.num_experts):
                for proj in u.module.hf_names:
                    out[f"{u.name}.{e}.{proj}.weight"] = f"{u.name}.{e}.{proj}"
    return out


def _abstract_model(src: str, cfg_dict: dict[str, Any], names: set[str]) -> nnx.Module:
    config_cls, model_cls = families.resolve(cfg_dict, f"{src.rstrip('/')}/config.json")
    try:
        config = config_cls.from_hf(cfg_dict)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise ValueError(f"{src.rstrip('/')}/config.json: malformed config ({type(e).__name__}: {e})") from None
    for_checkpoint = getattr(config, "for_checkpoint", None)
    if for_checkpoint is not None:
        config = for_checkpoint(names)
    return abstract.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))


class _Destination:
    """Where the output goes: a local folder (written into a staging sibling, renamed at the end) or a
    URL (each finished file uploaded at once; `abort` removes what was uploaded)."""

    def __init__(self, url: str):
        from models.hf import _local_path
        from storage import exists, join

        self.url, self.local = url, _local_path(url)
        if self.local is not None:
            if os.path.exists(self.local) and os.listdir(self.local):
                raise ValueError(f"--out {url}: exists and is not empty")
            parent = os.path.dirname(os.path.abspath(self.local)) or "."
            os.makedirs(parent, exist_ok=True)
            self.staging = tempfile.mkdtemp(prefix=f".{os.path.basename(self.local)}.partial-", dir=parent)
            self.scratch = self.staging
        else:
            if exists(join(url, "config.json")):
                raise ValueError(f"--out {url}: a checkpoint is already there (config.json)")
            self.scratch = tempfile.mkdtemp(prefix="forgeline-qc-")
        self.uploaded: list[str] = []

    def path(self, fn: str) -> str:
        return os.path.join(self.scratch, fn)

    def done(self, fn: str) -> None:
        """`fn`, written under `path(fn)`, is complete."""
        if self.local is None:
            from storage import join, upload_file

            upload_file(self.path(fn), join(self.url, fn))
            self.uploaded.append(fn)
            os.remove(self.path(fn))

    def commit(self) -> None:
        if self.local is not None:
            if os.path.isdir(self.local):
                os.rmdir(self.local)  # empty (checked up front)
            os.rename(self.staging, self.local)
        else:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.local is None:
            from storage import join, rm

            for fn in reversed(self.uploaded):
                try:
                    rm(join(self.url, fn))
                except Exception:  # noqa: S112 - best effort; config.json (the commit point) was never written
                    continue


def quantize_checkpoint(src: str, out: str, scheme: Scheme, *, ignore: Sequence[str] = (),
                        progress: Callable[[str], None] | None = None, chunk_bytes: int = CHUNK_BYTES
                        ) -> dict[str, Any]:
    """Quantize the safetensors checkpoint at `src` (a folder or URL) into `out` with the round-to-nearest
    `scheme`, one tensor at a time and each weight `chunk_bytes` of float32 rows at a time (module
    docstring). Returns a report: tensors quantized and copied, bytes written, seconds."""
    from models.hf import SafetensorsCheckpoint, load_config

    if scheme.smooth or scheme.static_act:
        what = "SmoothQuant" if scheme.smooth else "its static activation scales (NVFP4 activations)"
        raise ValueError(f"scheme {scheme.name}: {what} need calibration activations, which need the model; "
                         "quantize it in the release's quantize stage instead")
    if scheme.method != "rtn":
        raise ValueError(f"scheme {scheme.name}: {scheme.method.upper()} needs calibration activations, which need "
                         "the model: use the quantize stage (streaming quantization is round-to-nearest)")
    t0 = time.perf_counter()
    say = progress or log.info
    cfg_dict = load_config(src)
    qcfg = cfg_dict.get("quantization_config") or {}
    if qcfg and qcfg.get("quant_method") not in ("fp8", "mxfp4"):
        raise ValueError(f"{src.rstrip('/')}/config.json: the checkpoint is already quantized "
                         f"({qcfg.get('quant_method')}); quantize its float original")
    base = SafetensorsCheckpoint(src)
    try:
        tensors = DequantizingCheckpoint(base) if qcfg else None  # published FP8 / MXFP4: read dequantized
        names = list(tensors if tensors is not None else base)
        abstract = _abstract_model(src, cfg_dict, set(names))
        targets = quantized_tensors(abstract, scheme, ignore)
        missing = sorted(set(targets) - set(names))
        if missing:
            raise ValueError(f"{base.path_of(missing[0])}: missing tensor {missing[0]} (one of {len(missing)} "
                             "weights the model quantizes)")
        plan = _plan(base, tensors, names)
        globals_ = _nvfp4_globals(tensors or base, targets, scheme, chunk_bytes) if scheme.format.shared_global else {}
        if globals_:
            say(f"nvfp4: the global scales of {len(globals_)} weights in {time.perf_counter() - t0:.1f}s")
        dest = _Destination(out)
        try:
            report = _write(tensors or base, plan, targets, globals_, scheme, dest, say, t0, chunk_bytes)
            _finish(src, dest, cfg_dict, scheme, (*float_by_default(abstract), *ignore), report,
                    sharded=base.sharded)
            dest.commit()
        except BaseException:
            dest.abort()
            raise
    finally:
        base.close()
    report["seconds"] = time.perf_counter() - t0
    return report


def _plan(base: Any, tensors: DequantizingCheckpoint | None, names: list[str]) -> dict[str, list[tuple[str, Any]]]:
    """Source file -> [(tensor name, dtype it is copied in)] in the file's own order. A tensor the source
    stores quantized (DeepSeek FP8, GPT-OSS MXFP4) is read dequantized: float32."""
    files: dict[str, list[tuple[str, Any]]] = {}
    for name in names:
        sources = tensors.source_names(name) if tensors is not None else (name,)
        dtype = np.dtype(np.float32) if len(sources) > 1 else _numpy_dtype(base, name)
        files.setdefault(base.file_of[sources[0]], []).append((name, dtype))
    for fn, entries in files.items():
        header = base.headers[fn]
        entries.sort(key=lambda e: header[(tensors.source_names(e[0]) if tensors is not None else (e[0],))[0]]
                     ["data_offsets"][0])
    return dict(sorted(files.items()))


def chunk_rows(n_in: int, chunk_bytes: int) -> int:
    """Rows of a [out, in] weight read and quantized at once: about `chunk_bytes` of float32, a multiple of 128
    (FP8 tiles, and the 8 rows an int4 zero-point word packs, never straddle two chunks)."""
    return max(128, chunk_bytes // (4 * n_in) // 128 * 128)


def _rows(tensors: Any, name: str, shape: tuple[int, int], chunk_bytes: int):
    """(first row, float32 rows [r, in]) of a weight, chunk by chunk; only the chunk's bytes are read and
    nothing is kept once the next chunk is asked for."""
    view = tensors.view(name)
    out_dim, n_in = shape
    step = chunk_rows(n_in, chunk_bytes)
    for r0 in range(0, out_dim, step):
        rows = np.asarray(view.read(((r0, min(out_dim, r0 + step)), (0, n_in))), np.float32)
        getattr(tensors, "clear_cache", lambda: None)()
        yield r0, rows


def _nvfp4_globals(tensors: Any, targets: dict[str, str], scheme: Scheme, chunk_bytes: int) -> dict[str, np.ndarray]:
    """Tensor name -> its global scale (NVFP4's: the weight format's `global_scale`), shared within each fused
    group (one chunked read of each weight)."""
    by_module = {m: n for n, m in targets.items()}
    out: dict[str, np.ndarray] = {}
    for group in fused_groups(list(by_module)):
        amax = 0.0
        for m in group:
            name = by_module[m]
            for _, rows in _rows(tensors, name, _shape(tensors, name), chunk_bytes):
                amax = max(amax, float(np.abs(rows).max(initial=0.0)))
        g = scheme.format.global_scale(amax)
        out.update({by_module[m]: g for m in group})
    return out


def _write_quantized(writer: Any, tensors: Any, name: str, module: str, scheme: Scheme, g: np.ndarray | None,
                     chunk_bytes: int) -> list[str]:
    """One weight quantized chunk of rows by chunk of rows (round-to-nearest is row-local: the same codes and
    scales as the whole tensor at once). The codes tensor streams into the file as its rows come; the
    small ones after it (scales, zero points: 1/16 or less of it) are gathered, then written."""
    out_dim, n_in = _shape(tensors, name)
    first, *rest = tensor_specs(module, out_dim, n_in, scheme, np.float32)
    held: dict[str, list[np.ndarray]] = {n: [] for n, _, _ in rest}

    def codes():
        for _, rows in _rows(tensors, name, (out_dim, n_in), chunk_bytes):
            qm, _ = quantize_matrix(rows, None, scheme, Options(), g)
            parts = _tensors_for(module, qm, scheme, np.float32)
            for n in held:
                held[n].append(parts[n])
            yield parts[first[0]]

    writer.write_parts(first[0], first[1], first[2], codes())
    for n, shape, dtype in rest:
        if n.endswith(".weight_shape"):
            whole = np.asarray([out_dim, n_in], np.int32)
        elif n.endswith(".weight_global_scale"):
            whole = held[n][0]  # one per tensor: every chunk carries the same
        else:  # per output row (scales; int4 zero points packed 8 rows a word): the chunks stacked
            whole = np.concatenate(held[n], axis=0)
        writer.write(n, np.asarray(whole, dtype).reshape(shape))
    return [first[0], *held]


def _shape(tensors: Mapping[str, np.ndarray], name: str) -> tuple[int, ...]:
    return tuple(tensors.shape(name)) if hasattr(tensors, "shape") else tuple(np.shape(tensors[name]))


def _write(tensors: Any, plan: dict[str, list[tuple[str, Any]]], targets: dict[str, str],
           globals_: dict[str, np.ndarray], scheme: Scheme, dest: _Destination, say: Callable[[str], None], t0: float,
           chunk_bytes: int) -> dict[str, Any]:
    from models.hf import SafetensorsWriter

    report: dict[str, Any] = {"scheme": scheme.name, "quantized": 0, "copied": 0, "bytes_written": 0,
                              "weight_map": {}}
    for k, (fn, entries) in enumerate(plan.items()):
        specs: list[tuple[str, tuple[int, ...], Any]] = []
        for name, dtype in entries:  # the header, from shapes alone
            if name in targets:
                specs += tensor_specs(targets[name], *_shape(tensors, name), scheme, np.float32)
            else:
                specs.append((name, _shape(tensors, name), dtype))
        writer = SafetensorsWriter(dest.path(fn), specs, {"format": "pt"})
        for name, dtype in entries:
            if name in targets:
                for tname in _write_quantized(writer, tensors, name, targets[name], scheme, globals_.get(name),
                                              chunk_bytes):
                    report["weight_map"][tname] = fn
                report["quantized"] += 1
            else:  # copied as it is (only this tensor's bytes are read)
                writer.write(name, np.asarray(tensors[name], dtype))
                getattr(tensors, "clear_cache", lambda: None)()
                report["weight_map"][name] = fn
                report["copied"] += 1
        writer.close()
        report["bytes_written"] += os.path.getsize(dest.path(fn))
        dest.done(fn)
        say(f"{fn}: {len(entries)} tensors ({k + 1}/{len(plan)} files) at {time.perf_counter() - t0:.0f}s")
    return report


def _finish(src: str, dest: _Destination, cfg_dict: dict[str, Any], scheme: Scheme, ignore: Sequence[str],
            report: dict[str, Any], *, sharded: bool) -> None:
    """The index (when the source was sharded), the small files, and config.json last."""
    from models.hf import INDEX_FILE
    from storage import read_bytes

    weight_map = report.pop("weight_map")
    if sharded:
        index = {"metadata": {"total_size": report["bytes_written"]}, "weight_map": dict(sorted(weight_map.items()))}
        with open(dest.path(INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
        dest.done(INDEX_FILE)
    for name, url in _small_files(src):
        with open(dest.path(name), "wb") as f:
            f.write(read_bytes(url))
        dest.done(name)
    config = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
    config["quantization_config"] = compressed_tensors_config(scheme, ignore)
    with open(dest.path("config.json"), "w") as f:
        json.dump(config, f, indent=2)
    dest.done("config.json")


def _numpy_dtype(base: Any, name: str) -> np.dtype:
    from models.hf import NUMPY_DTYPES

    return np.dtype(NUMPY_DTYPES[base.dtype(name)])


def _small_files(src: str) -> list[tuple[str, str]]:
    """(name, URL) of the tokenizer and generation files beside the weights (copied as they are)."""
    from storage import list_files, normalize_url

    root = normalize_url(src) + "/"
    out = []
    for url in list_files(src):
        name = url[len(root):] if url.startswith(root) else ""
        if name and "/" not in name and SMALL_FILES.fullmatch(name) and not CHECKPOINT_FILES.fullmatch(name):
            out.append((name, url))
    return out
