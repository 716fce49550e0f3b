"""Lazy tensor views: how a model variable is made of checkpoint tensors, read one slice at a time.

A `View` has a `shape`, a `dtype`, and `read(index)`: the values of `view[index]` for an index of one
`(start, stop)` range per dimension, computing only what that slice needs. The loader (models/hf.py) gives
every variable a view of the checkpoint and, on a mesh, asks each view only for the slices this process's
devices hold (`jax.make_array_from_callback`), so a process reads about its own share of the bytes.

    Tensor       one tensor of a checkpoint (`SafetensorsCheckpoint.read`: only the slice's bytes)
    Array        an in-memory array (a test's dict of tensors)
    Computed     an array computed whole on first read (a dequantised FP8 / MXFP4 tensor)
    Permuted     axes permuted: a Linear's kernel [in, out] from the HF weight [out, in] (`.T`)
    Stacked      MoE experts [E, ...] from one tensor per expert
    Concat       along one axis (gate and up projections side by side)
    Deinterleaved  [gate | up] from GPT-OSS's interleaved gate_up (even, odd), reading whole pairs

The same idea as safetensors' `safe_open(...).get_slice(name)[...]` and the slice callbacks levanter and
MaxText load sharded checkpoints with; these views compose, so the layout transforms between transformers'
tensors and ours (transposes, stacking, de-interleaving) never need the whole tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Index = tuple[tuple[int, int], ...]  # one (start, stop) per dimension


def normalize(index: Any, shape: Sequence[int]) -> Index:
    """A tuple of slices (jax's callback index: `slice(None)` for a whole dimension) as (start, stop) pairs."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided index {s} (only contiguous slices)")
        out.append((start, max(start, stop)))
    return tuple(out)


def whole(shape: Sequence[int]) -> Index:
    return tuple((0, n) for n in shape)


def extent(index: Index) -> list[int]:
    return [b - a for a, b in index]


class View:
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, index: Index) -> np.ndarray:
        raise NotImplementedError

    def read_into(self, index: Index, out: np.ndarray) -> None:
        """Write `view[index]` into `out` (its shape, any dtype, any strides): the loader reads each device's
        slice straight into the buffer the device then uses. Views that can do it without an intermediate
        array (a checkpoint tensor, a stack, a concatenation) override this."""
        out[...] = self.read(index)

    def full(self) -> np.ndarray:
        return self.read(whole(self.shape))

    @property
    def T(self) -> View:  # noqa: N802 (numpy's name)
        return Permuted(self, tuple(reversed(range(len(self.shape)))))

class Array(View):
    def __init__(self, array: Any):
        self.array = np.asarray(array)
        self.shape, self.dtype = tuple(self.array.shape), self.array.dtype

    def read(self, index: Index) -> np.ndarray:
        return self.array[tuple(slice(a, b) for a, b in index)]


class Computed(View):
    """An array computed whole on the first read (a dequantised tensor), then sliced."""

    def __init__(self, compute: Any, shape: Sequence[int], dtype: Any):
        self.compute, self.shape, self.dtype = compute, tuple(shape), np.dtype(dtype)
        self._array: np.ndarray | None = None

    def read(self, index: Index) -> np.ndarray:
        if self._array is None:
            self._array = np.asarray(self.compute())
        return self._array[tuple(slice(a, b) for a, b in index)]


class Tensor(View):
    """One tensor of a checkpoint with a `read(name, index)` method."""

    def __init__(self, checkpoint: Any, name: str, shape: Sequence[int], dtype: Any):
        self.checkpoint, self.name, self.shape, self.dtype = checkpoint, name, tuple(shape), np.dtype(dtype)

    def read(self, index: Index) -> np.ndarray:
        return self.checkpoint.read(self.name, index)

    def read_into(self, index: Index, out: np.ndarray) -> None:
        read_into = getattr(self.checkpoint, "read_into", None)
        if read_into is None:
            out[...] = self.read(index)
        else:
            read_into(self.name, index, out)


class Permuted(View):
    """`np.transpose(base, axes)`: a Linear's kernel [in, out] is its HF weight [out, in] permuted (1, 0)."""

    def __init__(self, base: View, axes: Sequence[int]):
        self.base, self.axes = base, tuple(axes)
        self.shape, self.dtype = tuple(base.shape[a] for a in self.axes), base.dtype

    def read(self, index: Index) -> np.ndarray:
        inner = [None] * len(self.axes)
        for k, a in enumerate(self.axes):
            inner[a] = index[k]
        return np.transpose(self.base.read(tuple(inner)), self.axes)


class Stacked(View):
    """`np.stack(parts)` along a new leading axis; parts share one shape and dtype."""

    def __init__(self, parts: Sequence[View]):
        if not parts or any(p.shape != parts[0].shape for p in parts):
            raise ValueError("Stacked: parts of different shapes")
        self.parts = list(parts)
        self.shape, self.dtype = (len(parts), *parts[0].shape), np.result_type(*(p.dtype for p in parts))

    def read(self, index: Index) -> np.ndarray:
        out = np.empty(extent(index), self.dtype)
        self.read_into(index, out)
        return out

    def read_into(self, index: Index, out: np.ndarray) -> None:
        (a, b), rest = index[0], index[1:]
        for i, e in enumerate(range(a, b)):
            self.parts[e].read_into(rest, out[i])


class Concat(View):
    """`np.concatenate(parts, axis)`; parts agree on every other dimension."""

    def __init__(self, parts: Sequence[View], axis: int = -1):
        ndim = len(parts[0].shape)
        self.axis = axis % ndim
        others = [tuple(n for k, n in enumerate(p.shape) if k != self.axis) for p in parts]
        if any(o != others[0] for o in others):
            raise ValueError("Concat: parts differ outside the concatenated axis")
        self.parts = list(parts)
        self.shape = tuple(sum(p.shape[self.axis] for p in parts) if k == self.axis else n
                           for k, n in enumerate(parts[0].shape))
        self.dtype = np.result_type(*(p.dtype for p in parts))

    def read(self, index: Index) -> np.ndarray:
        out = np.empty(extent(index), self.dtype)
        self.read_into(index, out)
        return out

    def read_into(self, index: Index, out: np.ndarray) -> None:
        """Each part's overlap with the slice straight into its place in `out` (no concatenation copy)."""
        a, b = index[self.axis]
        offset = 0
        for p in self.parts:
            lo, hi = max(a, offset), min(b, offset + p.shape[self.axis])
            if lo < hi:
                sub = list(index)
                sub[self.axis] = (lo - offset, hi - offset)
                where = [slice(None)] * len(index)
                where[self.axis] = slice(lo - a, hi - a)
                p.read_into(tuple(sub), out[tuple(where)])
            offset += p.shape[self.axis]


class Deinterleaved(View):
    """`concatenate([base[..., 0::2], base[..., 1::2]], -1)`: GPT-OSS stores gate and up interleaved. A slice
    reads whole (even, odd) pairs of `base`, so the devices holding the gate half and the up half of the same
    rows ask the checkpoint for the same bytes (read once: `SafetensorsCheckpoint` keeps its last slice)."""

    def __init__(self, base: View):
        if base.shape[-1] % 2:
            raise ValueError(f"Deinterleaved: odd last axis {base.shape}")
        self.base, self.shape, self.dtype = base, base.shape, base.dtype

    def read(self, index: Index) -> np.ndarray:
        (a, b), lead = index[-1], index[:-1]
        half = self.shape[-1] // 2
        gate, up = (a, min(b, half)), (max(a, half) - half, b - half)
        pairs = [r for r in (gate, up) if r[0] < r[1]]
        if not pairs:
            return np.empty([hi - lo for lo, hi in index], self.dtype)
        p0, p1 = min(r[0] for r in pairs), max(r[1] for r in pairs)
        raw = self.base.read((*lead, (2 * p0, 2 * p1)))
        parts = [raw[..., 2 * (lo - p0): 2 * (hi - p0): 2] for lo, hi in [gate] if lo < hi]
        parts += [raw[..., 2 * (lo - p0) + 1: 2 * (hi - p0): 2] for lo, hi in [up] if lo < hi]
        return np.concatenate(parts, axis=-1) if len(parts) > 1 else np.ascontiguousarray(parts[0])

