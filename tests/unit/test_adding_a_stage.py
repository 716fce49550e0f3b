"""docs/adding-a-stage.md, performed: a copy of the repository gets the steps the page marks (`<!-- step ... -->`
before a code block: insert it before or after an anchor line of a file, create a file, or run a command), exactly
as written, and then the new stage (`inventory`) must run from its command line and through the commit protocol,
appear in the recipe schema and the resources, and own a deployment. A step that no longer fits the code fails here,
so the page cannot drift from it."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "adding-a-stage.md"
STEP = re.compile(r"<!-- step: (?P<how>.*?) -->\n(?P<indent>[ \t]*)```[a-z]*\n(?P<body>.*?)\n(?P=indent)```", re.S)


def steps(doc: str) -> list[tuple[dict[str, str | bool], str]]:
    """Every marked step of the page: ({file, insert-before | insert-after | create | run}, its code)."""
    found = []
    for m in STEP.finditer(doc):
        how: dict[str, str | bool] = {}
        for word in shlex.split(m["how"]):
            key, _, value = word.partition("=")
            how[key] = value or True
        indent = len(m["indent"])  # a block inside a list item: its lines are indented as its fence is
        found.append((how, "\n".join(line[indent:] for line in m["body"].split("\n")) + "\n"))
    return found


def perform(repo: Path, how: dict[str, str | bool], code: str, env: dict[str, str]) -> None:
    if how.get("run"):
        done = subprocess.run(code, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (code, done.stderr[-2000:])
        return
    path = repo / str(how["file"])
    if how.get("create"):
        assert not path.exists(), f"{how['file']} already exists"
        path.write_text(code)
        return
    text = path.read_text()
    anchor = str(how.get("insert-before") or how.get("insert-after"))
    assert text.count(anchor) == 1, f"{how['file']}: the anchor {anchor!r} is not there exactly once"
    at = text.index(anchor)
    if "insert-before" in how:
        at = text.rindex("\n", 0, at) + 1  # at the start of the anchor's line
    else:
        at = text.index("\n", at + len(anchor)) + 1  # after the anchor's line
    path.write_text(text[:at] + code + text[at:])


def test_the_page_adds_a_stage_that_runs(tmp_path):
    found = steps(DOC.read_text())
    assert [("run" if h.get("run") else h["file"]) for h, _ in found] == [
        "tasks/configs.py", "tasks/inventory.py", "tasks/configs.py", "run", "flows/release.py"]
    repo = tmp_path / "repo"
    for part in ("tasks", "models", "storage", "flows", "infra"):
        shutil.copytree(ROOT / part, repo / part, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"}

    def python(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert not check or done.returncode == 0, done.stderr[-3000:]
        return done

    for how, code in found[:3]:
        perform(repo, how, code, env)
    stale = python("-m", "flows.deploy", "--check", check=False)  # declared, not yet deployed: the check says so
    assert stale.returncode == 1 and stale.stderr.startswith("error: "), stale.stderr
    for how, code in found[3:]:
        perform(repo, how, code, env)
    python("-m", "flows.deploy", "--check")

    # a model artifact to list
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 3)

    # its command line, derived from the record: --model, --out, --pattern (a flag the record names), --set
    out = tmp_path / "out"
    done = python("-m", "tasks.inventory", "--model", str(model), "--out", str(out), "--pattern", "*.bin")
    assert json.loads(done.stdout[done.stdout.index("{"):]) == {"files": 1, "bytes": 768}
    rows = json.loads((out / "inventory.json").read_text())
    assert [r["file"] for r in rows] == ["sub/weights.bin"] and len(rows[0]["sha256"]) == 64
    bad = python("-m", "tasks.inventory", "--model", str(model), "--out", str(tmp_path / "o2"), "--set",
                 "digest=maybe", check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "digest" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "o2").exists()
    empty = python("-m", "tasks.inventory", "--model", str(model), "--out", str(tmp_path / "o3"), "--set",
                   "pattern='*.safetensors'", check=False)
    assert empty.returncode == 1 and empty.stderr.strip() == f"error: --model {model}: no file matches pattern " \
                                                            "'*.safetensors'", empty.stderr

    # the recipe section, its resources, the deployment, the commit protocol (a rerun is skipped), the release flow
    probe = f"""
import json, yaml
from storage import Store
from tasks import registry
from tasks.configs import InventoryConfig, ReleaseConfig, ResourcesConfig, STAGES
from tasks.recipe import load_release
from pathlib import Path

cfg = load_release("tiny", ["inventory.digest=false"])
assert cfg.inventory == InventoryConfig(digest=False), cfg.inventory
assert ResourcesConfig().of("inventory").accelerators == 0
deps = {{d["name"]: d for d in yaml.safe_load(Path("infra/prefect.yaml").read_text())["deployments"]}}
assert deps["inventory"]["work_pool"]["name"] == "forgeline-cpu", deps["inventory"]
store = Store("file://{tmp_path}/store")
model = store.commit(Path("{model}"), "model", "m" * 16, config={{}})
computed = []
first = registry.run_stage(store, "inventory", cfg.inventory, {{"model": model}}, on_compute=lambda: computed.append(1))
again = registry.run_stage(store, "inventory", cfg.inventory, {{"model": model}}, on_compute=lambda: computed.append(1))
assert first == again and computed == [1], (first, again, computed)
import flows.release  # the wiring of step 5 is valid Python in the flow
print(json.dumps(json.loads(store.fetch(first).joinpath("inventory.json").read_text())))
"""
    done = python("-c", probe)
    listed = json.loads(done.stdout.strip().splitlines()[-1])
    # the input as the stage saw it: the artifact's files (a file:// store's folder also holds its manifest.json)
    assert {"config.json", "sub/weights.bin"} <= {r["file"] for r in listed}
    assert all("sha256" not in r for r in listed)  # inventory.digest=false reached the stage
