"""Bad input: one clear line naming the field or file, a non-zero exit, and no committed artifact."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.conftest import TINY_RELEASE

pytestmark = pytest.mark.integration


def _manifests(root: Path) -> list[Path]:
    return list(root.rglob("manifest.json")) if root.exists() else []


def _release(store: Path, *sets: str):
    args = ["release", "--store", f"file://{store}"]
    for s in (*TINY_RELEASE, *sets):
        args += ["--set", s]
    return CliRunner().invoke(app, args)


def _error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_unknown_recipe_key(tmp_path):
    result = _release(tmp_path / "store", "finetune.lora_rnak=8")
    assert result.exit_code == 2
    assert "finetune.lora_rnak" in _error_line(result) and "unknown key" in _error_line(result)
    assert not (tmp_path / "store").exists()


def test_ill_typed_recipe_key(tmp_path):
    result = _release(tmp_path / "store", "finetune.train.steps=many")
    assert result.exit_code == 2
    assert "finetune.train.steps" in _error_line(result)


def test_unknown_recipe_name(tmp_path):
    result = CliRunner().invoke(app, ["release", "--recipe", "nope", "--store", f"file://{tmp_path}/s"])
    assert result.exit_code == 2 and "unknown recipe 'nope'" in _error_line(result)


def test_missing_corpus_url(tmp_path):
    missing = tmp_path / "nowhere" / "corpus.jsonl"
    result = _release(tmp_path / "store", f"data.corpus=file://{missing}")
    assert result.exit_code == 1
    line = _error_line(result)
    assert "data.corpus" in line and str(missing) in line
    assert _manifests(tmp_path / "store") == []


def test_empty_corpus(tmp_path, prefect_harness):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = _release(tmp_path / "store", f"base.data.corpus=file://{empty}", f"data.corpus=file://{empty}")
    assert result.exit_code == 1
    line = _error_line(result)
    assert "empty" in line and "empty.jsonl" in line
    assert _manifests(tmp_path / "store") == []


def test_corrupt_safetensors_base(tmp_path, tiny_base, prefect_harness):
    base, _ = tiny_base
    bad = tmp_path / "bad-base"
    shutil.copytree(base, bad)
    weights = next(bad.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated download
    result = _release(tmp_path / "store", f"base.url=file://{bad}")
    assert result.exit_code == 1
    assert weights.name in _error_line(result)
    assert _manifests(tmp_path / "store") == []
