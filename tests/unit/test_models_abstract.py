"""models/abstract.py: an abstract build equals `nnx.eval_shape`'s and does none of the per-parameter trace walks
that made building a large model abstractly quadratic (44 s of 46 for GLM-5's 744B on 2 cores)."""

from __future__ import annotations

import jax
import pytest
from flax import nnx
from jax._src.interpreters import partial_eval as pe

from models import abstract
from models.deepseek_v3 import DeepseekV3, DeepseekV3Config

pytestmark = pytest.mark.unit


def _shapes(model: nnx.Module) -> dict:
    return {path: (v.shape, v.dtype) for path, v in nnx.to_flat_state(nnx.state(model))}


def test_abstract_build_equals_eval_shape_without_walking_the_trace(monkeypatch):
    walks = []
    find = pe.JaxprStackFrame.find_progenitors
    monkeypatch.setattr(pe.JaxprStackFrame, "find_progenitors",
                        lambda self, tracer: walks.append(1) or find(self, tracer))
    build = lambda: DeepseekV3(DeepseekV3Config.tiny(), rngs=nnx.Rngs(0))  # noqa: E731
    plain = nnx.eval_shape(build)
    assert len(walks) > 10  # one walk per parameter drawn: what the helper removes
    walks.clear()
    ours = abstract.eval_shape(build)
    assert walks == []
    assert _shapes(ours) == _shapes(plain)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(ours)))
    with pytest.raises(AttributeError, match="sharding"):  # the hook is put back: JAX's messages as before
        jax.jit(lambda x: x.sharding)(1.0)
    assert pe.DynamicJaxprTracer._origin_msg is not None and not hasattr(pe.DynamicJaxprTracer, "_fl_origin_msg")
