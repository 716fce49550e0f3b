"""Tensors between hosts and devices for checkpoint I/O: placing a checkpoint's lazy views (models/views.py)
onto a mesh, each process reading only the slices its devices hold, and gathering sharded arrays back to a
host for saving. models/hf.py maps model variables to HF tensors on top of this.

Loading: `sharded_placer(mesh)` gives each variable the sharding of its logical axes (models/sharding.py);
every distinct slice this process's devices hold is read once, on a thread pool, into an aligned buffer that
XLA's CPU client then uses in place (`jax.make_array_from_callback`, as levanter's and MaxText's sharded
loading do); layouts that differ from the checkpoint's (a Linear's kernel is its HF weight transposed) are
read in the checkpoint's order and permuted on the devices. Saving: `to_host` / `_gather` bring a tensor
sharded across processes to each host with one jitted collective (docs/formats/hf-checkpoint.md, "Streamed,
sharded loading" and "Streamed saving").
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import views

# ------------------------------------------------------------------------------------------------
# devices -> hosts (saving)
# ------------------------------------------------------------------------------------------------


def to_host(x: jax.Array) -> np.ndarray:
    """All of `x` on this host: a copy of the local array, or, when other processes hold parts of it, the
    whole tensor gathered from them (a collective: every process must call it, in the same order)."""
    return _assemble(_gather(x))


def _gather(x: Any) -> np.ndarray | jax.Array:
    """`x` whole on this process: a host array, or (sharded across processes) a device array under which
    this process holds all of `x` exactly once, split over its own devices: one jitted identity into
    `_per_process_sharding`, a collective. `process_allgather` (the fallback) would replicate it on every
    local device (on CPU, host memory: one copy per device)."""
    if getattr(x, "is_fully_addressable", True):
        return np.ascontiguousarray(np.asarray(x))
    if x.is_fully_replicated:  # every process has all of it already
        return np.ascontiguousarray(np.asarray(x.addressable_data(0)))
    target = _per_process_sharding(x)
    if target is None:
        from jax.experimental import multihost_utils

        return np.ascontiguousarray(multihost_utils.process_allgather(x, tiled=True))
    if target not in _GATHERS:  # one jitted identity per target sharding: compiled once per shape
        _GATHERS[target] = jax.jit(_identity, out_shardings=target)
    return _GATHERS[target](x)


def _assemble(gathered: np.ndarray | jax.Array) -> np.ndarray:
    if isinstance(gathered, np.ndarray):
        return gathered
    out = np.empty(gathered.shape, gathered.dtype)
    for shard in gathered.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def _host_parts(gathered: np.ndarray | jax.Array) -> Iterator[np.ndarray]:
    """A `_gather` result's bytes in row-major order, as host arrays: its local shards one at a time when
    they split the first axis (the host then never holds the whole tensor), else the assembled array."""
    if isinstance(gathered, np.ndarray):
        yield gathered
        return
    spec = gathered.sharding.spec
    if all(a is None for a in spec):  # replicated on this process's devices: any one copy
        yield np.ascontiguousarray(np.asarray(gathered.addressable_data(0)))
        return
    if spec[0] is None or any(a is not None for a in spec[1:]):
        yield _assemble(gathered)
        return
    shards = {shard.index[0].start or 0: shard for shard in gathered.addressable_shards}
    for start in sorted(shards):
        yield np.ascontiguousarray(np.asarray(shards[start].data))


_GATHERS: dict[NamedSharding, Callable[[jax.Array], jax.Array]] = {}


def _identity(x: jax.Array) -> jax.Array:
    return x


def _per_process_sharding(x: jax.Array) -> NamedSharding | None:
    """A sharding over `x`'s devices, in `x`'s device order, under which each process holds the whole of `x`
    split across its local devices (the first axis they divide, else replicated on them); None when `x`'s
    devices, in order, are not grouped by process with the same number each (then: `process_allgather`)."""
    if not isinstance(x.sharding, NamedSharding) or not isinstance(x.sharding.mesh, Mesh):
        return None
    devices = np.asarray(x.sharding.mesh.devices).reshape(-1)
    processes = sorted({d.process_index for d in devices})
    if len(devices) % len(processes):
        return None
    grid = devices.reshape(len(processes), -1)
    if any(len({d.process_index for d in row}) != 1 for row in grid):
        return None
    local = grid.shape[1]
    axis = next((i for i, n in enumerate(x.shape) if n % local == 0), None)
    spec = PartitionSpec() if axis is None else PartitionSpec(*([None] * axis), "_local")
    return NamedSharding(Mesh(grid, ("_process", "_local")), spec)


# ------------------------------------------------------------------------------------------------
# views -> devices (loading)
# ------------------------------------------------------------------------------------------------


Placer = Callable[[nnx.Variable, views.View], None]


def place_whole(var: nnx.Variable, view: views.View) -> None:
    """Give `var` all of `view`, on the default device (a model nobody shards)."""
    var.set_value(jnp.asarray(view.full(), dtype=var.get_value().dtype))


def sharded_placer(mesh: Mesh, rules: Mapping[str, Any] | None = None,
                   times: dict[str, float] | None = None) -> Placer:
    """Give each variable its sharding from its logical axes (models/sharding.py), reading from its view only
    the slices this process's devices hold, each once, on a thread pool, straight into the buffers the devices
    then use. A variable whose view is a permutation of the checkpoint's layout (a Linear's kernel is its HF
    weight transposed) is read in the checkpoint's order and permuted on the devices; its checkpoint-order
    copy is freed before the next variable is read, so the load holds one variable beyond the model (letting
    the next reads overlap the permutation measured no faster on 2 cores and held two). `times`, when given,
    accumulates the seconds spent reading (dequantizing included), placing, and permuting."""
    from models.sharding import RULES, named_sharding

    rules = RULES if rules is None else rules
    times = {} if times is None else times

    def place(var: nnx.Variable, view: views.View) -> None:
        names = var.get_metadata().get("out_sharding")
        names = tuple(names) if names else (None,) * len(view.shape)
        sharding = named_sharding(mesh, names, rules, view.shape)
        dtype = np.dtype(var.get_value().dtype)
        if isinstance(view, views.Permuted):  # read in the checkpoint's order; permute on the devices
            spec = tuple(sharding.spec) + (None,) * (len(view.shape) - len(sharding.spec))
            inner = [None] * len(view.axes)
            for k, a in enumerate(view.axes):
                inner[a] = spec[k]
            raw = _from_view(view.base, NamedSharding(mesh, PartitionSpec(*inner)), dtype, times)
            t = time.perf_counter()
            out = _permute(view.axes, sharding)(raw)
            jax.block_until_ready(out)
            raw.delete()  # its host buffers go back to the system now
            var.set_value(out)
            _add(times, "layout", t)
        else:
            var.set_value(_from_view(view, sharding, dtype, times))

    return place


ALIGN = 64  # XLA's CPU client uses a host buffer this aligned in place (no copy) for a device's array
MAPPED_BYTES = 1 << 20  # buffers this large get pages of their own


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an `ALIGN`-byte boundary. A large one is an
    anonymous memory map, returned to the system the moment its last user lets go (from malloc, a freed 16 MB
    slice raises glibc's mmap threshold and the next ones come from heaps that keep their pages)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= MAPPED_BYTES:  # private (a shared one would be shmem, no huge pages: 15x slower to fault in)
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MB pages where the kernel does them on request (THP "madvise")
            mm.madvise(mmap.MADV_HUGEPAGE)
        return np.frombuffer(mm, dtype).reshape(shape)
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(2, min(16, os.cpu_count() or 2)), thread_name_prefix="forgeline-load")
    return _POOL


_POOL: ThreadPoolExecutor | None = None


def _add(times: dict[str, float], key: str, since: float) -> None:
    times[key] = times.get(key, 0.0) + time.perf_counter() - since


def _from_view(view: views.View, sharding: Any, dtype: np.dtype, times: dict[str, float]) -> jax.Array:
    """The array `view` describes, laid out by `sharding`: each distinct slice this process's devices hold read
    once (in parallel, into an aligned buffer), then handed to the devices holding it without another copy
    (XLA's CPU client uses an aligned host buffer in place). Slices that split the same leading rows by
    columns (an expert stack sharded on an axis that is the last on disk) are read together, `_read_tiles`."""
    t = time.perf_counter()
    shape = tuple(view.shape)
    keys = sorted({views.normalize(index, shape) for index in sharding.addressable_devices_indices_map(shape).values()})
    buffers = [aligned_empty(views.extent(index), dtype) for index in keys]
    tasks = _read_tasks(keys, dtype.itemsize)

    def fill(task: tuple[tuple[int, int], list[int]]) -> None:
        rows, members = task
        if rows is None:
            view.read_into(keys[members[0]], buffers[members[0]])
        else:
            _read_tiles(view, rows, [keys[m] for m in members], [buffers[m] for m in members])

    list(_pool().map(fill, tasks) if len(tasks) > 1 else map(fill, tasks))
    slices = dict(zip(keys, buffers, strict=True))
    _add(times, "read", t)
    t = time.perf_counter()
    out = jax.make_array_from_callback(shape, sharding, lambda index: slices[views.normalize(index, shape)])
    _add(times, "place", t)
    return out


TILE_BYTES = 4 << 20  # rows read at once when several devices' slices tile them


def _read_tasks(keys: list[views.Index], itemsize: int) -> list[tuple[tuple[int, int] | None, list[int]]]:
    """The reads that fill `keys`' buffers: (None, [k]) reads slice k by itself; (rows, members) reads rows
    `rows` of the box the members' slices tile (they share their leading range and split the other axes, as
    the devices of one expert group split an expert's columns) once, for all of them. Reading each slice by
    itself would read every row once per member, strided, each pass faulting in the pages the last let go."""
    groups: dict[tuple[int, int], list[int]] = {}
    for k, key in enumerate(keys):
        if key:  # a scalar has no rows
            groups.setdefault(key[0], []).append(k)
    tasks: list[tuple[tuple[int, int] | None, list[int]]] = []
    for k, key in enumerate(keys):
        members = groups.get(key[0], []) if key else []
        if len(members) < 2 or not _tiles([keys[m][1:] for m in members]):
            tasks.append((None, [k]))
        elif members[0] == k:  # the group's first slice stands for it
            box = _box([keys[m][1:] for m in members])
            row = math.prod(views.extent(box)) * itemsize
            (a, b), step = key[0], max(1, TILE_BYTES // max(1, row))
            tasks.extend(((lo, min(b, lo + step)), members) for lo in range(a, b, step))
    return tasks


def _box(indices: list[views.Index]) -> views.Index:
    return tuple((min(ix[d][0] for ix in indices), max(ix[d][1] for ix in indices)) for d in range(len(indices[0])))


def _tiles(indices: list[views.Index]) -> bool:
    """Whether distinct boxes `indices` cover their bounding box exactly (no gap; distinct device slices of
    one array either coincide or do not overlap)."""
    return bool(indices[0]) and sum(math.prod(views.extent(ix)) for ix in indices) == math.prod(
        views.extent(_box(indices)))


def _read_tiles(view: views.View, rows: tuple[int, int], keys: list[views.Index], buffers: list[np.ndarray]) -> None:
    """Rows `rows` of the box `keys` tile, read once into a scratch buffer of ~`TILE_BYTES` (2 MB pages: a
    couple of faults), then each key's part copied into its buffer from the cache."""
    box = _box([key[1:] for key in keys])
    tile = aligned_empty((rows[1] - rows[0], *views.extent(box)), buffers[0].dtype)
    view.read_into((rows, *box), tile)
    for key, buffer in zip(keys, buffers, strict=True):
        inside = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(key[1:], box, strict=True))
        buffer[rows[0] - key[0][0]: rows[1] - key[0][0]] = tile[(slice(None), *inside)]


@functools.lru_cache(maxsize=64)
def _permute(axes: tuple[int, ...], sharding: Any) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: jnp.transpose(x, axes), out_shardings=sharding)
