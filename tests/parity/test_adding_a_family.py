"""docs/adding-a-family.md, performed: the page's worked example (the fenced `# models/my_llama.py` block) is
written as a family module, registered by the page's checklist steps, loaded from a tiny transformers checkpoint,
checked against transformers in fp32 and saved back; the checklist's records are checked to exist, the code steps
to be each necessary and together sufficient, and the code names the page mentions to exist.

The transformers reference is a `LlamaConfig` subclass under the example's `model_type` with the example's
default RoPE theta (`default_theta`, transformers 5 `modeling_rope_utils.py`), registered with `AutoConfig` /
`AutoModelForCausalLM` (https://huggingface.co/docs/transformers/custom_models); nothing is downloaded.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from parity_helpers import build_from_config, decode_logits, hf_logits, rel_err, tiny_configs
from safetensors.numpy import load_file

import models
from models import families, from_pretrained, save_pretrained

pytestmark = pytest.mark.parity
REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "adding-a-family.md"
PLACEHOLDER = "<family>"
CODE_DIRS = ("models", "tasks", "flows", "tests", "benchmarks")


class MyLlamaConfig(transformers.LlamaConfig):
    model_type = "my_llama"
    default_theta = 1e6


class MyLlamaForCausalLM(transformers.LlamaForCausalLM):
    config_class = MyLlamaConfig


transformers.AutoConfig.register(MyLlamaConfig.model_type, MyLlamaConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(MyLlamaConfig, MyLlamaForCausalLM, exist_ok=True)


# ------------------------------------------------------------------------------------------------
# What the page says
# ------------------------------------------------------------------------------------------------


def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def example() -> tuple[str, str]:
    """(module name, source) of the page's worked example: the ```python block opening `# models/<name>.py`."""
    blocks = re.findall(r"```python\n# models/(\w+)\.py\n(.*?)```", doc(), re.S)
    assert len(blocks) == 1, "docs/adding-a-family.md: one ```python block opening with '# models/<name>.py'"
    return blocks[0]


def checklist() -> list[tuple[str, str, str]]:
    """(file, record, when) rows of the page's "## Checklist" table."""
    section = doc().split("## Checklist", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in ("file", "---"):
            rows.append((cells[0], cells[1], cells[2]))
    assert rows, "docs/adding-a-family.md: no rows in the ## Checklist table"
    return rows


def top_level(path: Path) -> set[str]:
    """Names a Python file defines at top level, plus Class.attribute for class-body fields."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{n.target.id}" for n in node.body
                          if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return names


def without(source: str, record: str) -> str:
    """`source` with its top-level assignment to `record` removed."""
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == record for t in node.targets):
            return "".join(lines[:node.lineno - 1] + lines[node.end_lineno:])
    raise AssertionError(f"the worked example defines no {record}")


# ------------------------------------------------------------------------------------------------
# The steps, performed
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def add_family(tmp_path, monkeypatch):
    """add(name, source, register=True): the checklist's code steps -- `source` written as `models/<name>.py`
    (in a folder added to the `models` package's path, so the working tree is left alone) and, with `register`,
    `models.<name>` appended to `families.MODULES` as it was before the test (one added family at a time).
    Undone after the test."""
    overlay = tmp_path / "models_overlay"
    overlay.mkdir()
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(overlay)])
    listed = tuple(families.MODULES)
    added: list[str] = []

    def add(name: str, source: str, register: bool = True) -> str:
        (overlay / f"{name}.py").write_text(source, encoding="utf-8")
        module = f"models.{name}"
        added.append(module)
        if register:
            monkeypatch.setattr(families, "MODULES", (*listed, module))
        return module

    yield add
    for module in added:
        sys.modules.pop(module, None)


def tiny_reference(path: Path, theta_in_config: bool) -> transformers.PreTrainedModel:
    """A perturbed tiny MyLlamaForCausalLM saved at `path`; without `theta_in_config` config.json loses its
    rope parameters, so both sides fall back on their default theta. Returns the model as transformers
    reloads it from `path`."""
    config = MyLlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           rms_norm_eps=1e-5)
    build_from_config(config, seed=0).save_pretrained(path)
    if not theta_in_config:
        cfg = json.loads((path / "config.json").read_text())
        del cfg["rope_parameters"]
        (path / "config.json").write_text(json.dumps(cfg))
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


IDS = np.random.default_rng(0).integers(0, 128, (2, 24)).astype(np.int32)


def test_the_worked_example_loads_matches_transformers_and_saves_back(add_family, tmp_path):
    name, source = example()
    add_family(name, source)
    hf = tiny_reference(tmp_path / "theirs", theta_in_config=False)
    assert hf.config.rope_parameters["rope_theta"] == MyLlamaConfig.default_theta
    assert families.MODEL_TYPES[MyLlamaConfig.model_type] == MyLlamaForCausalLM.__name__

    ours = from_pretrained(str(tmp_path / "theirs"))
    assert type(ours).__module__ == f"models.{name}"
    assert ours.config.rope_theta == MyLlamaConfig.default_theta  # the family's default, not Llama's
    ref = hf_logits(hf, IDS)
    assert rel_err(ours(jnp.asarray(IDS)), ref) <= 1e-4
    assert rel_err(decode_logits(ours, IDS, split=10), ref) <= 1e-4

    # the twist matters: the same files read as a plain Llama (theta 10000) are another model
    plain = tmp_path / "as_llama"
    shutil.copytree(tmp_path / "theirs", plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (plain / "config.json").write_text(json.dumps(cfg))
    assert rel_err(from_pretrained(str(plain))(jnp.asarray(IDS)), ref) > 1e-3

    out = tmp_path / "ours"
    save_pretrained(ours, str(out))
    saved = json.loads((out / "config.json").read_text())
    assert (saved["architectures"], saved["model_type"]) == ([MyLlamaForCausalLM.__name__], MyLlamaConfig.model_type)
    theirs, mine = load_file(tmp_path / "theirs" / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(mine) == sorted(theirs)
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and np.array_equal(mine[key], value), key
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert type(back) is MyLlamaForCausalLM
    assert rel_err(hf_logits(back.eval(), IDS), ref) <= 1e-4
    assert from_pretrained(str(out)).config == ours.config


def test_the_checklist_code_steps_are_each_needed(add_family, tmp_path):
    """The checklist's `always` steps in models/ are exactly the ones this file performs (a module holding
    FAMILY and REGISTRY, listed in MODULES), and leaving out any one of them makes loading fail."""
    name, source = example()
    steps = {(file, record) for file, record, when in checklist() if file.startswith("models/")
             and when.startswith("always")}
    assert steps == {(f"models/{PLACEHOLDER}.py", "FAMILY"), (f"models/{PLACEHOLDER}.py", "REGISTRY"),
                     ("models/families.py", "MODULES")}
    tiny_reference(tmp_path / "ckpt", theta_in_config=True)
    path = str(tmp_path / "ckpt")

    add_family(f"{name}_unlisted", source, register=False)
    with pytest.raises(ValueError, match=r"MyLlamaForCausalLM'\] is not supported"):
        from_pretrained(path)
    for record in ("REGISTRY", "FAMILY"):
        add_family(f"{name}_without_{record.lower()}", without(source, record))
        with pytest.raises(ValueError, match=f"no (top-level )?{record}"):
            from_pretrained(path)


def test_the_checklist_names_records_that_exist():
    for file, record, _ in checklist():
        matches = sorted(REPO.glob(file.replace(PLACEHOLDER, "*")))
        assert matches, f"docs/adding-a-family.md checklist: no file {file}"
        if record != "-":
            assert any(record in top_level(m) for m in matches if m.suffix == ".py"), \
                f"docs/adding-a-family.md checklist: {file} defines no {record}"


def test_the_tests_the_checklist_names_fail_until_they_know_the_family(add_family, monkeypatch):
    from tests.unit import test_models_hf

    name, source = example()
    test_models_hf.test_registry_keys()
    assert set(tiny_configs()) == set(families.ARCHITECTURES)
    add_family(name, source)
    # what its `from models import ARCHITECTURES` reads once the family's module is in MODULES
    monkeypatch.setattr(test_models_hf, "ARCHITECTURES", families.ARCHITECTURES)
    with pytest.raises(AssertionError):
        test_models_hf.test_registry_keys()
    assert set(tiny_configs()) != set(families.ARCHITECTURES)  # test_families_io's first check fails


def code_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py")))


def test_every_code_name_the_page_mentions_exists():
    """Every file the page's `code spans` name exists, and every snake_case or CamelCase name in the other
    spans (outside the worked example and the placeholders) is a word of the code: a renamed hook, record,
    file or test leaves the page wrong."""
    text = re.sub(r"```.*?```", "", doc(), flags=re.S)
    spans = [s for s in re.findall(r"`([^`\n]+)`", text) if "<" not in s]
    files = [s for s in spans if re.fullmatch(r"[\w./-]+\.(py|md)", s)]
    for file in set(files) - {f"models/{example()[0]}.py"}:  # the worked example's own path
        found = (REPO / file).exists() or (REPO / "docs" / file).exists() if "/" in file else \
            any(any((REPO / d).rglob(file)) for d in (*CODE_DIRS, "docs"))
        assert found, f"docs/adding-a-family.md names a file that does not exist: {file}"
    name = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    wanted = {n for s in spans if s not in files for n in name.findall(s)
              if "_" in n.strip("_") or re.search(r"[a-z][A-Z]", n)}
    words = set(name.findall(code_text()))
    missing = sorted(wanted - words)
    assert not missing, f"docs/adding-a-family.md mentions names no code has: {missing}"
