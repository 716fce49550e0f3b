"""Fingerprints follow meaning (tasks/code.py): a stage's code version changes when the code its import
closure runs changes, not when a comment, a docstring or a module it never imports does. Checked on copies
of the library tree edited in place, each read by a fresh interpreter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.code import LIBRARIES, closure, normalized
from tasks.registry import STAGES

ROOT = Path(__file__).resolve().parents[2]
MODULES = {name: f"tasks.{s.module}" for name, s in STAGES.items()}


def _versions(tree: Path) -> dict[str, str]:
    code = ("import json; from tasks.code import code_version; "
            f"print(json.dumps({{k: code_version(m) for k, m in {MODULES!r}.items()}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for pkg in LIBRARIES:
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _edited(tree: Path, rel: str, edit) -> Path:
    """A copy of `tree` with `rel` rewritten by `edit(text)`."""
    copy = tree.parent / f"{tree.name}-{rel.replace('/', '_')}-{abs(hash(edit))}"
    shutil.copytree(tree, copy)
    path = copy / rel
    path.write_text(edit(path.read_text()))
    return copy


def test_normalized_ignores_comments_and_docstrings_not_code():
    a = 'def f(x):\n    """Doubles."""\n    return 2 * x  # twice\n'
    assert normalized(a) == normalized("def f(x):\n    return 2 * x\n")
    assert normalized(a) != normalized("def f(x):\n    return 3 * x\n")
    assert normalized('"""Module."""\nX = 1\n') == normalized("X = 1\n")
    assert normalized('X = "a string, not a docstring"\n') != normalized("X = 'another'\n")


def test_closures_are_what_the_stages_import():
    assert "tasks.training.loop" in closure("tasks.finetune") and "models.lora" in closure("tasks.finetune")
    assert "tasks.finetune" not in closure("tasks.export")  # no stage imports another
    assert "tasks.training.loop" not in closure("tasks.data_prep")


def test_comments_and_docstrings_change_no_fingerprint(tree):
    base = _versions(tree)
    assert len(set(base.values())) == len(base)  # every stage its own version
    edited = _edited(tree, "tasks/training/trainer.py",
                     lambda s: s.replace('"""', '"""Reworded. ', 1) + "\n# a comment at the end\n")
    assert _versions(edited) == base


def test_a_code_change_recomputes_the_stages_that_import_it_and_no_other(tree):
    base = _versions(tree)
    export = _versions(_edited(tree, "tasks/export.py", lambda s: s + "\nVERSION_NOTE = 2\n"))
    assert {k for k in base if export[k] != base[k]} == {"export"}
    training = _versions(_edited(tree, "tasks/training/loop.py", lambda s: s + "\nVERSION_NOTE = 2\n"))
    assert {k for k in base if training[k] != base[k]} == {k for k, s in STAGES.items() if s.trains}


@pytest.mark.parametrize("rel, recomputed", [
    ("models/quant/driver.py", {"quantize"}),  # a quantization fix does not recompute the fine-tune
    ("models/eagle3/loss.py", {"draft"}),
    ("models/lora.py", {"finetune"}),
    ("tasks/training/checkpoints.py", {"base", "finetune", "draft"}),  # resumable training only
    ("models/llama.py", {"base", "finetune", "quantize", "traces", "draft", "evaluate"}),  # any model loader
    # a weight format's code (its registry loads it by name): every stage that quantizes or reads a quantized model
    ("models/quant/formats/int_formats.py", {"base", "finetune", "quantize", "traces", "draft", "evaluate"}),
])
def test_a_model_change_recomputes_only_the_stages_that_run_it(tree, rel, recomputed):
    base = _versions(tree)
    after = _versions(_edited(tree, rel, lambda s: s + "\nVERSION_NOTE = 2\n"))
    assert {k for k in base if after[k] != base[k]} == recomputed


def test_a_parse_disturbed_by_another_thread_is_run_again(monkeypatch):
    """CPython 3.11's AST constructor fails spuriously when two threads parse at once (its recursion counter
    is interpreter-wide): tasks/code.py parses again; any other SystemError is raised."""
    import ast

    from tasks import code

    real, calls = ast.parse, []

    def flaky(source, *a, **k):
        calls.append(1)
        if len(calls) < 3:
            raise SystemError("AST constructor recursion depth mismatch (before=63, after=64)")
        return real(source, *a, **k)

    monkeypatch.setattr(code.ast, "parse", flaky)
    assert code.normalized("x = 1\n") == code.normalized('"""doc"""\nx = 1\n') and len(calls) == 4

    def broken(source, *a, **k):
        raise SystemError("something else")

    monkeypatch.setattr(code.ast, "parse", broken)
    with pytest.raises(SystemError, match="something else"):
        code.normalized("x = 1\n")
