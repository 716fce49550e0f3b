"""Bad input: one clear line naming the field or file, a non-zero exit, and no committed artifact.

The CLI runs as a real subprocess (exit code and stderr as a user sees them), pointed at the
session's Prefect test server when a flow has to start. (An in-process CliRunner swaps sys.stderr,
and Prefect re-binds its logging handlers to the swapped stream when a flow starts.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_RELEASE

pytestmark = pytest.mark.integration


def _manifests(root: Path) -> list[Path]:
    return list(root.rglob("manifest.json")) if root.exists() else []


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    try:  # inside the prefect_harness fixture: use its server instead of starting an ephemeral one
        from prefect.settings import PREFECT_API_URL

        if PREFECT_API_URL.value():
            env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    except ImportError:
        pass
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def _release(store: Path, *sets: str) -> subprocess.CompletedProcess:
    args = ["release", "--store", f"file://{store}"]
    for s in (*TINY_RELEASE, *sets):
        args += ["--set", s]
    return _cli(*args)


def _error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_unknown_recipe_key(tmp_path):
    result = _release(tmp_path / "store", "finetune.lora_rnak=8")
    assert result.returncode == 2
    assert "finetune.lora_rnak" in _error_line(result) and "unknown key" in _error_line(result)
    assert not (tmp_path / "store").exists()


def test_ill_typed_recipe_key(tmp_path):
    result = _release(tmp_path / "store", "finetune.train.steps=many")
    assert result.returncode == 2
    assert "finetune.train.steps" in _error_line(result)


def test_unknown_recipe_name(tmp_path):
    result = _cli("release", "--recipe", "nope", "--store", f"file://{tmp_path}/s")
    assert result.returncode == 2 and "unknown recipe 'nope'" in _error_line(result)


def test_quantize_group_that_does_not_divide(tmp_path, tiny_base):
    """Checked against the base's widths before anything runs: the recipe's scratch base (d=64 here) and a
    base.url checkpoint's config.json."""
    result = _release(tmp_path / "store", "quantize.schemes=[int8,w4a16-gptq]")
    assert result.returncode == 2
    line = _error_line(result)
    assert "quantize: scheme w4a16-gptq: group size 128 does not divide" in line and "quantize.ignore" in line
    base, _ = tiny_base
    result = _release(tmp_path / "store", f"base.url=file://{base}", "quantize.schemes=[int8,w4a16-rtn-g48]")
    assert result.returncode == 2 and "group size 48 does not divide" in _error_line(result)
    assert not (tmp_path / "store").exists()
    # a shipped scheme without a perplexity gate limit: refused up front too, not after the evaluation
    recipe = tmp_path / "recipe.yaml"
    text = (Path(__file__).parents[2] / "tasks" / "recipes" / "tiny.yaml").read_text()
    recipe.write_text(re.sub(r"max_quant_ppl_increase: \{.*\}", "max_quant_ppl_increase: {int8: 0.01}", text))
    result = _cli("release", "--recipe", str(recipe), "--store", f"file://{tmp_path}/store",
                  *(a for s in TINY_RELEASE for a in ("--set", s)))
    assert result.returncode == 2 and "no limit for scheme 'w4a16-gptq-g64'" in _error_line(result)
    assert not (tmp_path / "store").exists()


def test_missing_corpus_url(tmp_path):
    missing = tmp_path / "nowhere" / "corpus.jsonl"
    result = _release(tmp_path / "store", f"data.corpus=file://{missing}")
    assert result.returncode == 1
    line = _error_line(result)
    assert "data.corpus" in line and str(missing) in line
    assert _manifests(tmp_path / "store") == []


def test_empty_corpus(tmp_path, prefect_harness):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = _release(tmp_path / "store", f"base.data.corpus=file://{empty}", f"data.corpus=file://{empty}")
    assert result.returncode == 1
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
    assert result.returncode == 1
    assert weights.name in _error_line(result)
    assert _manifests(tmp_path / "store") == []
