"""Fixtures for parity tests; the builders live in parity_helpers.py."""

from __future__ import annotations

import pytest
from parity_helpers import build_hf


@pytest.fixture
def hf_checkpoint(tmp_path):
    """(variant) -> (hf_model, path): a saved random checkpoint."""

    def make(variant: str, seed: int = 0):
        model = build_hf(variant, seed)
        path = tmp_path / variant
        model.save_pretrained(path)
        return model, str(path)

    return make
