"""HF checkpoint I/O: config.json + (sharded) safetensors <-> NNX models, in the transformers layout.

Reference: docs/formats/hf-checkpoint.md (tied heads omit lm_head on disk, config spellings, tensor
names and [out, in] shapes) and docs/formats/compressed-tensors.md (compressed-tensors checkpoints).

    model = from_pretrained("ckpt/")            # or file:///abs/ckpt, or s3://... through storage/
    save_pretrained(model, "out/", max_shard_bytes=2**30)

The key map is structural: a module at nnx path ("layers", 3, "self_attn", "q_proj") is the HF
module "model.layers.3.self_attn.q_proj" (the LM head stays top-level "lm_head"); a Linear's
kernel [in, out] is the HF weight [out, in] transposed; Embed and RMSNorm weights are stored as is.

Only safetensors are read (safetensors.numpy; never pickle). Every header is validated before a
byte of data is read, so a corrupt or truncated file, a missing tensor or a wrong shape raises a
one-line ValueError naming the file and the tensor. Local paths and file:// URLs are used
directly; any other scheme goes through `storage.download_dir` / `storage.upload_dir`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from typing import IO, Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from models import families, quant
from models.layers import Buffer, Embed, Linear, RMSNorm, hf_name
from models.quant.formats import DequantizingCheckpoint

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {  # safetensors dtype tag -> bytes per element
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
NUMPY_DTYPES = {  # safetensors dtype tag -> numpy dtype (ml_dtypes supplies bf16 / fp8 / e8m0)
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "E8M0": ml_dtypes.float8_e8m0fnu, "I16": np.int16, "U16": np.uint16,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
    "I64": np.int64, "U64": np.uint64, "F64": np.float64,
}
DTYPE_NAMES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16",
               jnp.dtype(jnp.float16): "float16"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ------------------------------------------------------------------------------------------------
# URLs: local paths and file:// directly, anything else through storage/
# ------------------------------------------------------------------------------------------------


def _local_path(path_or_url: str) -> str | None:
    parsed = urlparse(str(path_or_url))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return str(path_or_url)
    if parsed.scheme == "file":
        return url2pathname(parsed.netloc + parsed.path) if parsed.netloc else url2pathname(parsed.path)
    return None


@contextlib.contextmanager
def readable_dir(path_or_url: str) -> Iterator[str]:
    """A local folder holding the contents of `path_or_url` for the duration of the block."""
    local = _local_path(path_or_url)
    if local is not None:
        yield local
        return
    from storage import download_dir  # lazy: local paths must not depend on storage/

    with tempfile.TemporaryDirectory(prefix="forgeline-dl-") as tmp:
        download_dir(path_or_url, tmp)
        yield tmp


@contextlib.contextmanager
def writable_dir(path_or_url: str) -> Iterator[str]:
    """A local folder whose contents end up at `path_or_url` when the block exits without error."""
    local = _local_path(path_or_url)
    if local is not None:
        os.makedirs(local, exist_ok=True)
        yield local
        return
    from storage import upload_dir

    with tempfile.TemporaryDirectory(prefix="forgeline-ul-") as tmp:
        yield tmp
        upload_dir(tmp, path_or_url)


# ------------------------------------------------------------------------------------------------
# Reading safetensors with validation
# ------------------------------------------------------------------------------------------------


def read_safetensors_header(path: str, f: IO[bytes] | None = None,
                            size: int | None = None) -> dict[str, dict[str, Any]]:
    """Parse and validate a safetensors header: {name: {dtype, shape, data_offsets}}; ValueError naming
    `path` if bad. Reads only the header: from the local file `path`, or from the open binary file `f` of
    `size` bytes (a ranged read of a remote object)."""
    try:
        with contextlib.ExitStack() as stack:
            if f is None:
                size = os.path.getsize(path)
                f = stack.enter_context(open(path, "rb"))
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: corrupt safetensors: {size} bytes, too short for a header")
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                raise ValueError(f"{path}: corrupt or truncated safetensors: {n}-byte header in {size} bytes")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    header["__data_start__"] = 8 + n  # type: ignore[assignment]  # popped by the caller
    data_bytes = size - 8 - n
    for name, info in header.items():
        if name == "__data_start__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        if end - begin != expected or begin < 0:
            raise ValueError(f"{path}: corrupt safetensors: tensor {name} spans {end - begin} bytes, "
                             f"{dtype}{shape} needs {expected}")
        if end > data_bytes:
            raise ValueError(f"{path}: truncated safetensors: tensor {name} ends at byte {end} of the data "
                             f"section but the file holds {data_bytes}")
    return header


class SafetensorsCheckpoint(Mapping):
    """Lazy {tensor name: np.ndarray} over a folder's model.safetensors or index + shards."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, INDEX_FILE)
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ValueError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(folder, SINGLE_FILE)):
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise ValueError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
        self.sharded = weight_map is not None
        self.headers = {fn: read_safetensors_header(os.path.join(folder, fn)) for fn in files}
        self.data_start = {fn: h.pop("__data_start__") for fn, h in self.headers.items()}
        self.file_of: dict[str, str] = {}
        for fn, header in self.headers.items():
            for name in header:
                self.file_of[name] = fn
        if weight_map is not None:
            for name, fn in weight_map.items():
                if name not in self.headers[fn]:
                    path = os.path.join(folder, fn)
                    raise ValueError(f"{path}: missing tensor {name} (listed in {INDEX_FILE})")

    def path_of(self, name: str) -> str:
        """The file holding `name`, or for a missing tensor the file that should have (the index)."""
        if name in self.file_of:
            return os.path.join(self.folder, self.file_of[name])
        return os.path.join(self.folder, INDEX_FILE if self.sharded else SINGLE_FILE)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.headers[self.file_of[name]][name]["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype tag of `name` ("BF16", "F8_E4M3", ...)."""
        return self.headers[self.file_of[name]][name]["dtype"]

    def __getitem__(self, name: str) -> np.ndarray:
        """Read one tensor straight from its validated byte range (bf16 and fp8 through ml_dtypes)."""
        if name not in self.file_of:
            raise KeyError(name)
        fn = self.file_of[name]
        info = self.headers[fn][name]
        begin, end = info["data_offsets"]
        path = os.path.join(self.folder, fn)
        try:
            with open(path, "rb") as f:
                f.seek(self.data_start[fn] + begin)
                raw = f.read(end - begin)
        except OSError as e:
            raise ValueError(f"{path}: cannot read tensor {name} ({type(e).__name__}: {e})") from None
        if len(raw) != end - begin:
            raise ValueError(f"{path}: truncated safetensors: tensor {name} is cut short")
        return np.frombuffer(raw, dtype=NUMPY_DTYPES[info["dtype"]]).reshape(info["shape"]).copy()

    def __iter__(self):
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


# ------------------------------------------------------------------------------------------------
# Model state <-> HF tensors
# ------------------------------------------------------------------------------------------------


def _named_modules(model: nnx.Module) -> list[tuple[str, tuple, nnx.Module]]:
    """(HF prefix, nnx path, module) for every module that owns HF tensors, in natural name order:
    Linear / Embed / RMSNorm, modules with their own `hf_export`/`hf_import` (their descendants are
    theirs), and modules listing raw parameters in `hf_raw`."""
    custom: list[tuple] = []
    mods = []
    for p, n in nnx.iter_graph(model):
        if not isinstance(n, nnx.Module) or any(p[: len(c)] == c for c in custom):
            continue
        if hasattr(n, "hf_export"):
            custom.append(p)
            mods.append((hf_name(p), p, n))
        elif isinstance(n, (Linear, Embed, RMSNorm)) or getattr(n, "hf_raw", ()):
            mods.append((hf_name(p), p, n))
    return sorted(mods, key=lambda m: _natural_key(m[0]))


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _np(x: jax.Array, dtype: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(jnp.asarray(x).astype(dtype)))


def state_to_hf(
    model: nnx.Module, *, dtype: Any = None, skip_quantized: bool = False
) -> dict[str, np.ndarray]:
    """HF-named float tensors ([out, in] for Linear). LoRA factors are folded in, int8 layers are
    dequantized (or skipped with `skip_quantized`, for the compressed-tensors writer). What
    transformers keeps in fp32 stays fp32 on disk whatever `dtype` is: buffers (DeepSeek's
    e_score_correction_bias) and the sigmoid routers' weights (`keep_fp32`)."""
    out: dict[str, np.ndarray] = {}

    def emit(name: str, value: Any, keep_dtype: bool = False) -> None:
        value = jnp.asarray(value)
        out[name] = _np(value, value.dtype if keep_dtype or dtype is None else dtype)

    for name, _, mod in _named_modules(model):
        if hasattr(mod, "hf_export"):
            if skip_quantized and getattr(mod, "quantized", False):
                continue  # quantized experts: written by models/quant/
            for suffix, value in mod.hf_export().items():
                emit(f"{name}.{suffix}", value)
            continue
        if isinstance(mod, Linear):
            if not (mod.qweight is not None and skip_quantized):
                emit(f"{name}.weight", mod.weight().T)  # [out, in]
                if mod.bias is not None:
                    emit(f"{name}.bias", mod.bias[...])
        elif isinstance(mod, (Embed, RMSNorm)):
            emit(f"{name}.weight", mod.weight[...])
        for attr in getattr(mod, "hf_raw", ()):
            var = getattr(mod, attr)
            if var is not None:
                emit(f"{name}.{attr}", var[...], keep_dtype=isinstance(var, Buffer) or getattr(mod, "keep_fp32", False))
    extra = getattr(model, "hf_extra_export", None)
    if extra is not None:
        for name, value in extra().items():
            emit(name, value)
    return out


MAX_LISTED = 12  # names per category in a mismatch error


def hf_to_state(
    model: nnx.Module, tensors: Mapping[str, np.ndarray], *, source: str = "<tensors>"
) -> nnx.State:
    """Fill `model`'s variables in place from HF-named `tensors` (works on an `nnx.eval_shape`
    model) and return its state.

    Every missing, unexpected and mis-shaped tensor is collected and reported in one ValueError
    naming the file (or folder). A model may accept extra names through `hf_accepts(name)` (e.g.
    MTP copies of the embeddings).
    """
    where = getattr(tensors, "path_of", lambda _: source)
    used: set[str] = set()
    missing: list[str] = []
    misshaped: list[str] = []

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        if name not in tensors:
            missing.append(name)
            return None
        have = tuple(tensors.shape(name)) if hasattr(tensors, "shape") else tuple(np.shape(tensors[name]))
        used.add(name)
        if len(have) != len(shape) or any(s not in (-1, h) for s, h in zip(shape, have, strict=False)):
            misshaped.append(f"{name} {list(have)} (expected {list(shape)})")
            return None
        return tensors[name]

    def put(var: nnx.Variable, arr: np.ndarray | None) -> None:
        if arr is not None:
            var.set_value(jnp.asarray(arr, dtype=var.get_value().dtype))

    for name, _, mod in _named_modules(model):
        if hasattr(mod, "hf_import"):
            scoped = lambda suffix, shape, _n=name: get(f"{_n}.{suffix}", shape)  # noqa: E731
            if getattr(mod, "quantized", False):
                quant.load_experts(scoped, mod, model.quant_scheme)
            else:
                mod.hf_import(scoped)
            continue
        if isinstance(mod, Linear):
            i, o = mod.in_features, mod.out_features
            if mod.qweight is not None:
                try:
                    quant.load_linear(get, name, mod, model.quant_scheme)
                except ValueError as e:
                    misshaped.append(str(e))
            else:
                w = get(f"{name}.weight", (o, i))
                put(mod.kernel, None if w is None else np.asarray(w).T)
            if mod.bias is not None:
                put(mod.bias, get(f"{name}.bias", (o,)))
        elif isinstance(mod, (Embed, RMSNorm)):
            put(mod.weight, get(f"{name}.weight", tuple(mod.weight.get_value().shape)))
        for attr in getattr(mod, "hf_raw", ()):
            var = getattr(mod, attr)
            if var is not None:
                put(var, get(f"{name}.{attr}", tuple(var.get_value().shape)))
    accepts = getattr(model, "hf_accepts", lambda _name: False)
    unexpected = sorted((n for n in set(tensors) - used if not accepts(n)), key=_natural_key)
    if missing or unexpected or misshaped:
        parts = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if names:
                more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
                parts.append(f"{len(names)} {label}: {', '.join(names[:MAX_LISTED])}{more}")
        files = sorted({where(n.split(" ")[0]) for n in missing + unexpected + misshaped})
        place = files[0] if len(files) == 1 else source
        arch = type(model).__name__
        raise ValueError(f"{place}: tensors do not match {arch}: " + "; ".join(parts))
    state = nnx.state(model)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
        raise ValueError(f"{source}: some variables were not loaded")  # a family/loader mismatch
    return state


# ------------------------------------------------------------------------------------------------
# from_pretrained / save_pretrained
# ------------------------------------------------------------------------------------------------


def load_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read config ({type(e).__name__}: {e})") from None


def from_pretrained(path_or_url: str, *, dtype: Any = jnp.float32) -> nnx.Module:
    """Build the model named by config.json `architectures` and load its safetensors weights.

    Parameters and activations use `dtype`. Published quantized checkpoints are dequantized on load
    (DeepSeek FP8 block weights, GPT-OSS MXFP4 experts; models/quant/formats/); a compressed-tensors
    checkpoint (int4/int8 pack-quantized, FP8 blocks; as `save_pretrained` writes a models/quant/ model)
    loads quantized, dequantizing in the forward.
    """
    with readable_dir(path_or_url) as folder:
        config_path = os.path.join(folder, "config.json")
        cfg_dict = load_config(folder)
        config_cls, model_cls = families.resolve(cfg_dict, config_path)
        try:
            config = config_cls.from_hf(cfg_dict)
        except KeyError as e:
            raise ValueError(f"{config_path}: missing key {e.args[0]!r}") from None
        except (TypeError, ZeroDivisionError) as e:
            raise ValueError(f"{config_path}: malformed config ({type(e).__name__}: {e})") from None
        tensors: Mapping[str, np.ndarray] = SafetensorsCheckpoint(folder)
        for_checkpoint = getattr(config, "for_checkpoint", None)
        if for_checkpoint is not None:  # e.g. how many MTP layers the files actually hold
            config = for_checkpoint(set(tensors))
        model = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
        qcfg = cfg_dict.get("quantization_config") or {}
        method = qcfg.get("quant_method")
        if method in ("fp8", "mxfp4"):
            block = tuple(qcfg.get("weight_block_size") or (128, 128))
            if method == "fp8" and block != (128, 128):
                raise ValueError(f"{config_path}: quantization_config.weight_block_size {list(block)} "
                                 "(only [128, 128] is supported)")
            tensors = DequantizingCheckpoint(tensors)
        elif qcfg:
            quant.prepare_for_load(model, quant.read_scheme(qcfg, config_path), set(tensors))
        hf_to_state(model, tensors, source=folder)
    return model


def _shards(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors, key=_natural_key):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def save_pretrained(
    model: nnx.Module, path_or_url: str, *, max_shard_bytes: int = 2**30, dtype: Any = None,
    layout: str = "compressed-tensors",
) -> None:
    """Write config.json, generation_config.json and safetensors in the transformers layout.

    `dtype` (default: the model's param dtype) is the on-disk float dtype. More than
    `max_shard_bytes` of tensors are split into model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json. A tied model omits lm_head.weight; LoRA factors are merged into
    the written weights; a quantized model (models/quant/) is written in compressed-tensors
    (`pack-quantized` int, `float-quantized` FP8) or, for FP8 blocks, `layout="deepseek-fp8"`.
    """
    dtype = jnp.dtype(dtype or getattr(model, "param_dtype", jnp.float32))
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported save dtype {dtype}")
    quantized = quant.is_quantized(model)
    tensors = state_to_hf(model, dtype=dtype, skip_quantized=quantized)
    config = model.config.to_hf(DTYPE_NAMES[dtype])
    if quantized:
        if layout == "deepseek-fp8":
            qconfig, qtensors = quant.to_deepseek_fp8(model)
        elif layout == "compressed-tensors":
            # scales stay fp32 whatever `dtype` is: transformers multiplies in the scale's dtype when it
            # dequantizes, and bf16 scales would move the logits away from ours
            qconfig, qtensors = quant.to_compressed_tensors(model, quant.scheme_of(model),
                                                            getattr(model, "quant_ignore", ()))
        else:
            raise ValueError(f"unknown quantized layout {layout!r} (compressed-tensors, deepseek-fp8)")
        tensors.update(qtensors)
        config["quantization_config"] = qconfig
    shards = _shards(tensors, max_shard_bytes)
    cfg = model.config
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    gen = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": eos,
           "pad_token_id": cfg.pad_token_id}
    gen = {k: v for k, v in gen.items() if v is not None}
    meta = {"format": "pt"}
    with writable_dir(path_or_url) as folder:
        for fn in os.listdir(folder):  # stale weights from an earlier save would confuse loaders
            if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", fn):
                os.remove(os.path.join(folder, fn))
        if len(shards) == 1:
            safetensors.numpy.save_file(shards[0], os.path.join(folder, SINGLE_FILE), metadata=meta)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                safetensors.numpy.save_file(shard, os.path.join(folder, fn), metadata=meta)
                weight_map.update({name: fn for name in shard})
            total = sum(t.nbytes for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_json(os.path.join(folder, INDEX_FILE), index)
        _write_json(os.path.join(folder, "config.json"), config)
        _write_json(os.path.join(folder, "generation_config.json"), gen)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
