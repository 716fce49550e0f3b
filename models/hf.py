"""HF checkpoint I/O: config.json + (sharded) safetensors <-> NNX models, in the transformers layout.

Reference: docs/formats/hf-checkpoint.md (tied heads omit lm_head on disk, config spellings, tensor
names and [out, in] shapes) and docs/formats/compressed-tensors.md (compressed-tensors checkpoints).

    model = from_pretrained("ckpt/")            # or file:///abs/ckpt, or s3://... through storage/
    save_pretrained(model, "out/", max_shard_bytes=2**30)

The key map is structural: a module at nnx path ("layers", 3, "self_attn", "q_proj") is the HF
module "model.layers.3.self_attn.q_proj" (the LM head stays top-level "lm_head"); a Linear's
kernel [in, out] is the HF weight [out, in] transposed; Embed and RMSNorm weights are stored as is.

    model = from_pretrained("s3://bucket/ckpt", dtype=jnp.bfloat16, mesh=mesh)   # streamed onto a mesh

Only safetensors are read (never pickle; the file layer is models/safetensors_io.py, moving tensors between
hosts and devices models/transfer.py). Every header is
validated before a byte of data is read, so a corrupt or truncated file, a missing tensor or a wrong shape
raises a one-line ValueError naming the file and the tensor. Loading is streamed: the model is built
abstractly and each variable, a lazy view of the
checkpoint's tensors (models/views.py), is filled with only the slices this process's devices hold --
memory maps for local files, ranged reads for other URLs, never a full local copy. Saving streams one
tensor at a time into files planned from abstract shapes. docs/formats/hf-checkpoint.md, "Streamed,
sharded loading" and "Streamed saving", says how; the same approach as
levanter's and MaxText's sharded checkpoint loading (`jax.make_array_from_callback` over slices).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from models import abstract, families, pruning, quant, views
from models.config_schema import check_sizes
from models.layers import Buffer, Embed, Linear, QuantScale, RMSNorm, hf_name
from models.quant.formats import DequantizingCheckpoint
from models.quant.formats.deepseek_v4 import RenamedCheckpoint
from models.safetensors_io import (  # noqa: F401  (re-exported: callers import the file layer from here too)
    INDEX_FILE,
    NUMPY_DTYPES,
    SAFETENSORS_DTYPES,
    SAFETENSORS_TAGS,
    SINGLE_FILE,
    SafetensorsCheckpoint,
    SafetensorsWriter,
    _local_path,
    read_safetensors_header,
    readable_dir,
    writable_dir,
)
from models.transfer import (  # noqa: F401  (re-exported: callers import these from here too)
    Placer,
    _add,
    _gather,
    _host_parts,
    place_whole,
    sharded_placer,
    to_host,
)

log = logging.getLogger(__name__)

DTYPE_NAMES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16",
               jnp.dtype(jnp.float16): "float16"}


# ------------------------------------------------------------------------------------------------
# Model state <-> HF tensors
# ------------------------------------------------------------------------------------------------


def _named_modules(model: nnx.Module) -> list[tuple[str, tuple, nnx.Module]]:
    """(HF prefix, nnx path, module) for every module that owns HF tensors, in natural name order:
    Linear / Embed / RMSNorm, modules with their own `hf_export`/`hf_views` (their descendants are
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


def hf_tensors(
    model: nnx.Module, *, dtype: Any = None, skip_quantized: bool = False
) -> list[tuple[str, Callable[[], jax.Array]]]:
    """Every HF tensor of `model` as (name, a function computing it on the devices), in natural name order,
    so that a writer can plan the files from shapes alone (the function's `abstract` where it has one, else
    `jax.eval_shape`) and bring one tensor at a time to the host. [out, in] for Linear; LoRA factors are
    folded in, int8 layers dequantized (or skipped with `skip_quantized`, for the compressed-tensors
    writer). What transformers keeps in fp32 stays fp32 on disk whatever `dtype` is: buffers (DeepSeek's
    e_score_correction_bias) and the sigmoid routers' weights."""
    out: list[tuple[str, Callable[[], jax.Array]]] = []

    def emit(name: str, fn: Callable[[], Any], keep_dtype: bool = False, abstract: Any = None) -> None:
        def tensor() -> jax.Array:
            value = jnp.asarray(fn())
            return value if keep_dtype or dtype is None else value.astype(dtype)
        if abstract is not None:  # known already: planning need not trace a whole module export per tensor
            tensor.abstract = jax.ShapeDtypeStruct(  # type: ignore[attr-defined]
                abstract.shape, abstract.dtype if keep_dtype or dtype is None else jnp.dtype(dtype))
        out.append((name, tensor))

    for name, _, mod in _named_modules(model):
        if hasattr(mod, "hf_export"):
            if skip_quantized and getattr(mod, "quantized", False):
                continue  # quantized experts: written by models/quant/
            shapes = jax.eval_shape(mod.hf_export)
            # one module's tensors are computed together
            exported = _Together(lambda _m=mod: _on_devices(_hf_export, _m), list(shapes))
            for suffix, shape in shapes.items():
                emit(f"{name}.{suffix}", lambda _e=exported, _s=suffix: _e.take(_s), abstract=shape)
            continue
        if isinstance(mod, Linear):
            if not (mod.qweight is not None and skip_quantized):
                emit(f"{name}.weight", lambda _m=mod: _on_devices(_linear_weight_t, _m))  # [out, in]
                if mod.bias is not None:
                    emit(f"{name}.bias", lambda _m=mod: _m.bias[...])
        elif isinstance(mod, (Embed, RMSNorm)):  # norms transformers keeps in fp32 (DeepSeek-V4) set keep_fp32
            emit(f"{name}.weight", lambda _m=mod: _m.weight[...], keep_dtype=getattr(mod, "keep_fp32", False))
        int64 = getattr(mod, "hf_int64", ())  # integer tables stored as int64 on disk (JAX holds them as int32)
        for attr in getattr(mod, "hf_raw", ()):
            var = getattr(mod, attr)
            if var is not None:
                emit(f"{name}.{attr}", lambda _v=var: _v[...],  # scales (FP8 KV cache) stay float32
                     keep_dtype=isinstance(var, Buffer | QuantScale) or getattr(mod, "keep_fp32", False),
                     abstract=jax.ShapeDtypeStruct(var.get_value().shape, np.int64) if attr in int64 else None)
    extra = getattr(model, "hf_extra_export", None)
    if extra is not None:
        shapes = jax.eval_shape(extra)
        computed = _Together(lambda: _on_devices(_hf_extra_export, model), list(shapes))
        for name, shape in shapes.items():
            emit(name, lambda _c=computed, _n=name: _c.take(_n), abstract=shape)
    return out


class _Together:
    """A function returning a dict, called at the first `take` and its result dropped after the last key.
    Under a trace (planning with `jax.eval_shape`) nothing is kept: the abstract result is for that call."""

    def __init__(self, fn: Callable[[], dict[str, Any]], keys: list[str]):
        self.fn, self.keys, self.left, self.value = fn, list(keys), set(), None

    def take(self, key: str) -> Any:
        if self.value is None:
            computed = self.fn()
            if _abstract(computed):
                return computed[key]
            self.value, self.left = computed, set(self.keys)
        value = self.value[key]
        self.left.discard(key)
        if not self.left:
            self.value = None
        return value


def _abstract(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _hf_export(module: nnx.Module) -> dict[str, jax.Array]:
    return module.hf_export()


def _hf_extra_export(model: nnx.Module) -> dict[str, jax.Array]:
    return model.hf_extra_export()


def _linear_weight_t(module: Linear) -> jax.Array:
    return module.weight().T


_JITTED: dict[Callable, Callable] = {}


def _on_devices(fn: Callable[[nnx.Module], Any], module: nnx.Module) -> Any:
    """`fn(module)`: op by op in a single process; in a multi-process job one jitted program (compiled once
    per module structure: graph and shardings), finished before this returns. The computations of a sharded
    model's tensors can hold cross-process collectives (slicing one expert out of an expert-sharded stack
    does), and the CPU runtime's asynchronous dispatch runs independent programs in any order: two
    processes running two such programs in different orders deadlock (each waits in a collective the other
    has not reached). One program at a time, in the same order on every process, cannot."""
    if jax.process_count() == 1:
        return fn(module)
    if fn not in _JITTED:
        _JITTED[fn] = jax.jit(lambda graphdef, state: fn(nnx.merge(graphdef, state)), static_argnums=0)
    out = _JITTED[fn](*nnx.split(module))
    if not _abstract(out):
        jax.block_until_ready(out)
    return out


def state_to_hf(
    model: nnx.Module, *, dtype: Any = None, skip_quantized: bool = False
) -> dict[str, np.ndarray]:
    """HF-named host tensors of the whole model at once (tests, small models); `hf_tensors` streams them."""
    return {name: to_host(fn()) for name, fn in hf_tensors(model, dtype=dtype, skip_quantized=skip_quantized)}


MAX_LISTED = 12  # names per category in a mismatch error


def hf_to_state(
    model: nnx.Module, tensors: Mapping[str, np.ndarray], *, source: str = "<tensors>", place: Placer = place_whole,
    loaded: Callable[[nnx.Module], None] | None = None, check_only: bool = False,
) -> nnx.State:
    """Fill `model`'s variables in place from HF-named `tensors` (works on an `nnx.eval_shape`
    model) and return its state.

    Every variable is described as a lazy view of the tensors (models/views.py: a Linear's kernel is its HF
    weight transposed, stacked experts are a stack of per-expert views) and handed to `place`: all of it on
    one device (`place_whole`), or only this process's slices on a mesh (`sharded_placer`). Modules read
    by code of their own (compressed-tensors quantized layers) load whole, then `loaded(module)` runs.

    Every missing, unexpected and mis-shaped tensor is collected and reported in one ValueError
    naming the file (or folder). A model may accept extra names through `hf_accepts(name)` (e.g.
    MTP copies of the embeddings).

    `check_only`: match names and shapes only; nothing is read or placed (the model stays abstract), and the
    tensors of modules read by code of their own (quantized ones) are accepted unchecked.
    """
    where = getattr(tensors, "path_of", lambda _: source)
    lazy = getattr(tensors, "view", None)
    used: set[str] = set()
    missing: list[str] = []
    misshaped: list[str] = []
    unchecked: set[str] = set()  # check_only: modules whose tensors are not matched here

    def get(name: str, shape: tuple[int, ...]) -> views.View | None:
        if name not in tensors:
            missing.append(name)
            return None
        have = tuple(tensors.shape(name)) if hasattr(tensors, "shape") else tuple(np.shape(tensors[name]))
        used.add(name)
        if len(have) != len(shape) or any(s not in (-1, h) for s, h in zip(shape, have, strict=False)):
            misshaped.append(f"{name} {list(have)} (expected {list(shape)})")
            return None
        return lazy(name) if lazy is not None else views.Array(tensors[name])

    def get_array(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        view = get(name, shape)
        return None if view is None else view.full()

    clear = getattr(tensors, "clear_cache", lambda: None)

    def put(var: nnx.Variable, view: views.View | None) -> None:
        if view is not None and not check_only:
            place(var, view)
            clear()

    for name, _, mod in _named_modules(model):
        if check_only and (getattr(mod, "quantized", False) or getattr(mod, "qweight", None) is not None):
            unchecked.add(name)
            continue
        if hasattr(mod, "hf_views"):
            if getattr(mod, "quantized", False):
                quant.load_experts(lambda suffix, shape, _n=name: get_array(f"{_n}.{suffix}", shape), mod,
                                   model.quant_scheme)
                if loaded is not None:
                    loaded(mod)
            else:
                for attr, view in mod.hf_views(lambda suffix, shape, _n=name: get(f"{_n}.{suffix}", shape)).items():
                    put(getattr(mod, attr), view)
            continue
        if isinstance(mod, Linear):
            i, o = mod.in_features, mod.out_features
            if mod.qweight is not None:
                try:
                    quant.load_linear(get_array, name, mod, model.quant_scheme)
                except ValueError as e:
                    misshaped.append(str(e))
                if loaded is not None:
                    loaded(mod)
            else:
                w = get(f"{name}.weight", (o, i))
                put(mod.kernel, None if w is None else w.T)  # [in, out]
            if mod.bias is not None:
                put(mod.bias, get(f"{name}.bias", (o,)))
        elif isinstance(mod, (Embed, RMSNorm)):
            put(mod.weight, get(f"{name}.weight", tuple(mod.weight.get_value().shape)))
        for attr in getattr(mod, "hf_raw", ()):
            var = getattr(mod, attr)
            if var is not None:
                put(var, get(f"{name}.{attr}", tuple(var.get_value().shape)))
    accepts = getattr(model, "hf_accepts", lambda _name: False)

    def in_unchecked(n: str) -> bool:
        parts = n.split(".")
        return any(".".join(parts[:k]) in unchecked for k in range(1, len(parts)))

    unexpected = sorted((n for n in set(tensors) - used if not accepts(n) and not in_unchecked(n)), key=_natural_key)
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
    if check_only:
        return state
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
        raise ValueError(f"{source}: some variables were not loaded")  # a family/loader mismatch
    return state


# ------------------------------------------------------------------------------------------------
# from_pretrained / save_pretrained
# ------------------------------------------------------------------------------------------------


def load_config(folder: str) -> dict[str, Any]:
    """config.json of a local folder or a URL."""
    local = _local_path(folder)
    if local is not None:
        path = os.path.join(local, "config.json")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read config ({type(e).__name__}: {e})") from None
    from storage import join, read_bytes

    path = join(folder, "config.json")
    try:
        return json.loads(read_bytes(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read config ({type(e).__name__}: {e})") from None


def from_pretrained(path_or_url: str, *, dtype: Any = jnp.float32, mesh: Mesh | None = None,
                    rules: Mapping[str, Any] | None = None, stats: dict[str, Any] | None = None,
                    layers: Sequence[int] | None = None) -> nnx.Module:
    """Build the model named by config.json `architectures` and load its safetensors weights.

    Parameters and activations use `dtype`. The model is built abstractly (`nnx.eval_shape`, nothing
    allocated) and each tensor is read straight into place: without `mesh` whole onto the default device;
    with one, sharded by its logical axes (`rules`, default models/sharding.py: RULES), each process reading
    only the byte ranges of the slices its own devices hold. Local folders are read in place (`pread`),
    remote ones (s3://) with ranged reads, never copied whole. Peak host memory stays near the process's
    share of the model plus one slice.

    Published quantized checkpoints are dequantized on load (DeepSeek FP8 block weights, GPT-OSS MXFP4
    experts; models/quant/formats/), slice by slice; a compressed-tensors checkpoint (int4/int8
    pack-quantized, FP8 blocks; as `save_pretrained` writes a models/quant/ model) loads quantized,
    dequantizing in the forward, one module at a time, with its FP8 KV cache's `self_attn.k_scale` / `v_scale`
    when `kv_cache_scheme` names one (models/quant/kv_cache.py). `stats`, when given, receives `bytes_read`.
    `layers`: only these decoder layers, renumbered 0..n-1 (a depth-pruned student: models/pruning.py); the
    other layers' bytes are never read. With a mesh, `stats` also receives `seconds`: the load's wall time
    split into building the structure, reading (and dequantizing) slices, placing them on the devices and
    permuting layouts on the devices (what the reads did not hide), after waiting for every array.
    """
    t0, times = time.perf_counter(), {}
    local = _local_path(path_or_url)
    read = _read_config(path_or_url, layers)
    checkpoint = SafetensorsCheckpoint(path_or_url)
    try:
        model, tensors = _abstract_model(read, checkpoint, dtype, layers)
        times["structure"] = time.perf_counter() - t0
        if mesh is None:
            hf_to_state(model, tensors, source=local or path_or_url)
        else:
            from models.sharding import shard_model

            hf_to_state(model, tensors, source=local or path_or_url, place=sharded_placer(mesh, rules, times),
                        loaded=lambda module: shard_model(module, mesh, *(() if rules is None else (rules,))))
        if stats is not None:
            stats["bytes_read"] = checkpoint.bytes_read  # how much of the checkpoint this process read
            t = time.perf_counter()  # the permutations still running when the last slice was placed
            jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
            _add(times, "layout", t)
            stats["seconds"] = {**times, "total": time.perf_counter() - t0}
    finally:
        checkpoint.close()
    return model


def check_pretrained(path_or_url: str) -> nnx.Module:
    """Everything `from_pretrained` checks before it reads a weight, and nothing it reads: config.json (a
    supported family and settings), each safetensors file's header (well-formed, every tensor inside the
    file's bytes) and the tensors' names and shapes against the model's. Raises ValueError naming the file.
    Reads only config.json and the headers (ranged reads for s3://), so it is cheap on a terabyte checkpoint:
    what a command line runs before it starts any job. The contents of quantized modules (compressed-tensors)
    are left to the load. Returns the abstract model (`nnx.eval_shape`: its config, no arrays)."""
    read = _read_config(path_or_url, None)
    checkpoint = SafetensorsCheckpoint(path_or_url)
    try:
        model, tensors = _abstract_model(read, checkpoint, jnp.float32, None)
        hf_to_state(model, tensors, source=_local_path(path_or_url) or path_or_url, check_only=True)
    finally:
        checkpoint.close()
    return model


def _read_config(path_or_url: str, layers: Sequence[int] | None) -> tuple[str, dict[str, Any], Any, type]:
    """(config.json's path, its dict, the family's config, the model class) of a checkpoint folder."""
    local = _local_path(path_or_url)
    config_path = os.path.join(local, "config.json") if local is not None else f"{path_or_url.rstrip('/')}/config.json"
    cfg_dict = load_config(path_or_url)
    if layers is not None:
        cfg_dict = pruning.select_layers(cfg_dict, layers)
    config_cls, model_cls = families.resolve(cfg_dict, config_path)
    check_sizes(cfg_dict, config_path)  # what the user wrote, before any arithmetic on it
    try:
        config = config_cls.from_hf(cfg_dict)
    except KeyError as e:
        raise ValueError(f"{config_path}: missing key {e.args[0]!r}") from None
    except (TypeError, ZeroDivisionError) as e:
        raise ValueError(f"{config_path}: malformed config ({type(e).__name__}: {e})") from None
    except ValueError as e:  # the family's own checks, named by the file they read
        raise ValueError(f"{config_path}: {str(e).removeprefix('config.json: ')}") from None
    check_sizes(config, config_path)  # and what the family derived from it (head_dim, defaults)
    return config_path, cfg_dict, config, model_cls


def _abstract_model(read: tuple[str, dict[str, Any], Any, type], checkpoint: SafetensorsCheckpoint, dtype: Any,
                    layers: Sequence[int] | None) -> tuple[nnx.Module, Mapping[str, np.ndarray]]:
    """(abstract model, tensors as its loader reads them): the layer selection, the family's model built with
    `nnx.eval_shape`, on-load dequantization or the compressed-tensors structure."""
    config_path, cfg_dict, config, model_cls = read
    published_name = getattr(model_cls, "hf_published_name", None)  # a reference's own names (DeepSeek-V4's)
    stored = checkpoint if published_name is None else RenamedCheckpoint(checkpoint, published_name)
    tensors: Mapping[str, np.ndarray] = stored if layers is None else pruning.LayerSelection(stored, layers)
    for_checkpoint = getattr(config, "for_checkpoint", None)
    if for_checkpoint is not None:  # e.g. how many MTP layers the files actually hold
        config = for_checkpoint(set(tensors))
    model = abstract.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
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
        quant.prepare_kv_scales(model, quant.read_kv_cache_scheme(qcfg, config_path))  # FP8 KV cache
    return model, tensors


# The quantized layouts written whole (gpt-oss-mxfp4 streams its tensors: save_pretrained handles it), each
# model -> (quantization_config, tensors); each dispatches per weight to its registered format
# (models/quant/formats/registry.py). compressed-tensors scales stay fp32 whatever the save dtype is:
# transformers multiplies in the scale's dtype when it dequantizes, and bf16 scales would move the logits away.
QUANT_LAYOUTS: dict[str, Any] = {
    "compressed-tensors": lambda model: quant.to_compressed_tensors(model, quant.scheme_of(model),
                                                                    getattr(model, "quant_ignore", ())),
    "deepseek-fp8": lambda model: quant.to_deepseek_fp8(model),
}


def save_pretrained(
    model: nnx.Module, path_or_url: str, *, max_shard_bytes: int = 2**30, dtype: Any = None,
    layout: str | None = None,
) -> None:
    """Write config.json, generation_config.json and safetensors in the transformers layout.

    `dtype` (default: the model's param dtype) is the on-disk float dtype. More than
    `max_shard_bytes` of tensors are split into model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json. A tied model omits lm_head.weight; LoRA factors are merged into
    the written weights; a quantized model (models/quant/) is written in compressed-tensors
    (`pack-quantized` int, `float-quantized` FP8, FP4) or, for FP8 blocks, `layout="deepseek-fp8"`; a
    GPT-OSS model with mxfp4a16 experts in GPT-OSS's own MXFP4 layout (`gpt-oss-mxfp4`, their only one).
    `layout` None: the model's own (gpt-oss-mxfp4 for quantized GPT-OSS experts, else compressed-tensors).

    The files are planned from abstract shapes, then every tensor is computed on the devices, brought to
    the host alone (`to_host`) and streamed into its file (`SafetensorsWriter`), so the host never holds
    more than one tensor of the model at once.

    Multi-process (`jax.process_count() > 1`): a collective, which every process calls with the same model
    (sharded as it is: nothing is gathered up front). Every process computes and gathers every tensor in
    the same order; only the owner of the tensor's file writes it. When all processes write to the same
    place (one URL, or a folder they all see: `_shared_destination`), the files are spread over them,
    balanced by bytes; otherwise process 0 writes them all (the others write nothing). Process 0 removes
    stale weights first and writes the index, config.json and generation_config.json last, after a
    barrier, so that a reader never finds an index naming a missing file. The layout (file names, their
    contents) depends on `max_shard_bytes` only, never on the number of processes: byte-identical files.
    """
    dtype = jnp.dtype(dtype or getattr(model, "param_dtype", jnp.float32))
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported save dtype {dtype}")
    quantized = quant.is_quantized(model)
    fp8_kv = quant.kv_cache_strategy(model) is not None  # FP8 KV cache scales (models/quant/kv_cache.py)
    if fp8_kv and not quantized:
        raise ValueError("save_pretrained: an FP8 KV cache is written with a quantized model's compressed-tensors "
                         "config (kv_cache_scheme); quantize the weights too (models/quant/)")
    entries = hf_tensors(model, dtype=dtype, skip_quantized=quantized)
    config = model.config.to_hf(DTYPE_NAMES[dtype])
    if quantized:
        gpt_oss = quant.has_gpt_oss_mxfp4(model)
        layout = layout or ("gpt-oss-mxfp4" if gpt_oss else "compressed-tensors")
        if fp8_kv and layout != "compressed-tensors":
            raise ValueError(f"save_pretrained: layout {layout!r} has no place for FP8 KV cache scales (written only "
                             "in compressed-tensors, as its kv_cache_scheme)")
        if gpt_oss and layout != "gpt-oss-mxfp4":
            raise ValueError(f"save_pretrained: layout {layout!r}: GPT-OSS's quantized experts are written only in "
                             "GPT-OSS's own MXFP4 layout (layout='gpt-oss-mxfp4', the default for them)")
        if layout == "gpt-oss-mxfp4":  # streamed: each tensor computed from its module when its turn comes
            qconfig, specs = quant.to_gpt_oss_mxfp4(model, dtype)
            entries += [(name, _module_tensor(fn, mod, abstract)) for name, mod, fn, abstract in specs]
        else:
            if layout not in QUANT_LAYOUTS:
                raise ValueError(f"unknown quantized layout {layout!r} (compressed-tensors, deepseek-fp8, "
                                 "gpt-oss-mxfp4)")
            qconfig, qtensors = QUANT_LAYOUTS[layout](model)
            entries += [(name, lambda _a=array: _a) for name, array in qtensors.items()]
        config["quantization_config"] = qconfig
    entries.sort(key=lambda e: _natural_key(e[0]))
    shapes = {name: _abstract_of(fn) for name, fn in entries}
    files = _plan_files([(name, shapes[name]) for name, _ in entries], max_shard_bytes)
    cfg = model.config
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    gen = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": eos,
           "pad_token_id": cfg.pad_token_id}
    gen = {k: v for k, v in gen.items() if v is not None}
    total = sum(_nbytes(s) for s in shapes.values())
    meta = {"config.json": config, "generation_config.json": gen}
    if len(files) > 1:
        meta[INDEX_FILE] = {"metadata": {"total_size": total},
                            "weight_map": {n: fn for fn, names in files for n in names}}
    compute = dict(entries)
    processes, me = jax.process_count(), jax.process_index()
    with writable_dir(path_or_url) as folder:
        shared = processes > 1 and _shared_destination(path_or_url, folder)
        owners = _assign_files([sum(_nbytes(shapes[n]) for n in names) for _, names in files],
                               processes if shared else 1)
        if me == 0:  # stale weights from an earlier save would confuse loaders
            for fn in os.listdir(folder):
                if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", fn):
                    os.remove(os.path.join(folder, fn))
        _barrier("forgeline save_pretrained: stale files removed")
        for (fn, names), owner in zip(files, owners, strict=True):
            writer = None if owner != me else SafetensorsWriter(os.path.join(folder, fn), [
                (n, tuple(shapes[n].shape), np.dtype(shapes[n].dtype)) for n in names], {"format": "pt"})
            for name in names:  # every process: the tensor's computation and gather are collectives
                gathered = _gather(compute[name]())
                if writer is not None:
                    want = np.dtype(shapes[name].dtype)  # a planned int64 (hf_int64) is cast on the host
                    parts = (p if p.dtype == want else p.astype(want) for p in _host_parts(gathered))
                    writer.write_parts(name, shapes[name].shape, want, parts)
                del gathered
            if writer is not None:
                writer.close()
        if processes == 1:
            _write_meta(folder, meta)
    if processes > 1:  # every shard written (and uploaded) before the index that names it
        _barrier("forgeline save_pretrained: shards written")
        if me == 0:
            with writable_dir(path_or_url) as folder:
                _write_meta(folder, meta)
        _barrier("forgeline save_pretrained: saved")


def _module_tensor(fn: Callable[[nnx.Module], Any], module: nnx.Module, abstract: jax.ShapeDtypeStruct
                   ) -> Callable[[], jax.Array]:
    """`fn(module)` computed on the devices (`_on_devices`) in `abstract`'s dtype, with `abstract` recorded
    for planning (no trace)."""
    def tensor() -> jax.Array:
        return jnp.asarray(_on_devices(fn, module)).astype(abstract.dtype)

    tensor.abstract = abstract  # type: ignore[attr-defined]
    return tensor


def _abstract_of(fn: Callable[[], Any]) -> Any:
    """The shape and dtype `fn()` returns: as `hf_tensors` recorded it, else traced."""
    abstract = getattr(fn, "abstract", None)
    return jax.eval_shape(fn) if abstract is None else abstract


def _nbytes(s: Any) -> int:
    return math.prod(s.shape) * np.dtype(s.dtype).itemsize


def _write_meta(folder: str, meta: dict[str, Any]) -> None:
    """The index (when there is one), then config.json and generation_config.json."""
    for fn in (INDEX_FILE, "config.json", "generation_config.json"):
        if fn in meta:
            _write_json(os.path.join(folder, fn), meta[fn])


def _barrier(name: str) -> None:
    """Every process reaches this point before any goes on (nothing to do in a single process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _assign_files(sizes: list[int], processes: int) -> list[int]:
    """The process writing each file: in file order, the one with the fewest bytes so far (lowest index on a
    tie), so a single file, and the first of several, is process 0's."""
    loads = [0] * processes
    owners = []
    for size in sizes:
        owner = loads.index(min(loads))
        owners.append(owner)
        loads[owner] += size
    return owners


def _shared_destination(path_or_url: str, folder: str) -> bool:
    """Whether what every process writes under `path_or_url` ends up in one place (a collective). A URL
    (`folder` is then this process's staging folder, uploaded to it): the same URL on every process. A
    local folder: every process sees the marker file process 0 puts in it (a filesystem they share), which
    the same path on different machines, or different paths, do not."""
    from jax.experimental import multihost_utils

    url = str(path_or_url) if _local_path(path_or_url) is None else ""
    # int32 fields (JAX's default integer): the URL's digest (64 bits), a random token, whether it is a URL
    digest = np.frombuffer(hashlib.sha256(url.encode()).digest()[:8], np.int32)
    token = int.from_bytes(os.urandom(3), "little")
    mine = np.array([*digest, token, int(bool(url))], np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
    if gathered[:, 3].any():  # decided on what every process sees alike, so all take the same branch
        return bool(gathered[:, 3].all() and (gathered[:, :2] == gathered[0, :2]).all())
    marker = os.path.join(folder, f".forgeline-save-{int(gathered[0, 2]):x}")
    if jax.process_index() == 0:
        with open(marker, "w"):
            pass
    _barrier("forgeline save_pretrained: marker written")
    seen = multihost_utils.process_allgather(np.array(os.path.exists(marker), np.int32))
    if jax.process_index() == 0:  # every process has looked: the gather above needed them all
        os.remove(marker)
    return bool(seen.all())


def _plan_files(shapes: list[tuple[str, Any]], max_shard_bytes: int) -> list[tuple[str, list[str]]]:
    """Tensors (in order) grouped into files of at most `max_shard_bytes` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, s in shapes:
        nbytes = math.prod(s.shape) * np.dtype(s.dtype).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return [(SINGLE_FILE, groups[0])]
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
