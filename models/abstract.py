"""Building a model abstractly (`nnx.eval_shape`: shapes and dtypes, no arrays) in time linear in its size.

Under `nnx.eval_shape` every parameter draws a key from `nnx.Rngs`, which bumps the stream's counter, and flax's
`Variable.set_value` then compares the new (traced) counter's `sharding` with the old one's. On a tracer that
attribute raises an AttributeError whose message JAX builds by walking the whole trace so far to name where the
value came from (`DynamicJaxprTracer._origin_msg` -> `find_progenitors`), and `getattr(..., None)` throws the
message away. One walk per parameter over a trace that grows with every parameter is quadratic: 44 s of 46 to
build GLM-5 (78 layers, 256 experts each) abstractly on 2 cores, 2 s without it. `eval_shape` below skips that
message while the model is built (only the text of an error nobody reads changes); JAX versions without the hook
build as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from flax import nnx

T = TypeVar("T")
_LOCK = threading.Lock()
_DEPTH = 0


@contextlib.contextmanager
def _cheap_origin_messages() -> Iterator[None]:
    global _DEPTH
    try:
        from jax._src.interpreters import partial_eval as pe
    except ImportError:  # a JAX without the private module: nothing to skip
        yield
        return
    tracer = getattr(pe, "DynamicJaxprTracer", None)
    if tracer is None or not hasattr(tracer, "_origin_msg"):
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            tracer._fl_origin_msg = tracer._origin_msg  # type: ignore[attr-defined]
            tracer._origin_msg = lambda self: ""
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                tracer._origin_msg = tracer._fl_origin_msg  # type: ignore[attr-defined]
                del tracer._fl_origin_msg


def eval_shape(build: Callable[..., T], *args: Any) -> T:
    """`nnx.eval_shape(build, *args)`: the module `build` returns, abstract (every variable a ShapeDtypeStruct)."""
    with _cheap_origin_messages():
        return nnx.eval_shape(build, *args)
