"""flows/stages.py: the Prefect cache key follows the committed artifact, not just the fingerprint."""

from __future__ import annotations

import pytest

import storage
from storage import Store
from tasks import registry

pytestmark = pytest.mark.unit


def _commit(store: Store, tmp_path, name: str):
    fp = registry.fingerprint("quantize", {"schemes": ["int8"]}, {})
    d = tmp_path / name
    d.mkdir()
    (d / "x.bin").write_bytes(name.encode())
    return store.commit(d, "quantize", fp, config={})


def test_cache_key_is_per_store_and_per_commit(tmp_path):
    from flows.stages import cache_key

    a, b = Store(f"file://{tmp_path}/a"), Store(f"file://{tmp_path}/b")
    params = lambda st: {"kind": "quantize", "config": {"schemes": ["int8"]}, "inputs": {}, "store": st.root}
    # not committed yet: a fresh key each time, so Prefect can never answer from an old record
    assert cache_key(None, params(a)) != cache_key(None, params(a))
    ref_a = _commit(a, tmp_path, "a1")
    _commit(b, tmp_path, "b1")
    key_a = cache_key(None, params(a))
    assert key_a == cache_key(None, params(a))  # committed: stable
    assert key_a != cache_key(None, params(b))  # same fingerprint, other store: other key
    assert ref_a.fingerprint in key_a
    storage.rm(ref_a.url)  # deleted and committed again: a new manifest digest, a new key
    _commit(a, tmp_path, "a2")
    assert cache_key(None, params(a)) != key_a
