"""The repository's layout promises (docs/architecture.md), checked on the source itself:

- imports point one way: no circle among the modules of models/, tasks/, storage/ and flows/ (an AST scan
  of every import, the lazy ones inside functions included), and models/ and storage/ never import tasks/
  or flows/, tasks/ never imports flows/;
- no stage imports another stage: what stages share lives in tasks/layout.py, tasks/configs.py,
  tasks/data/ and tasks/training/;
- the repository stands on its own: no tracked file cites a path outside it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tasks.code import imports, modules

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("models", "tasks", "storage", "flows")
STAGE_MODULES = ("tasks.data_prep", "tasks.base_model", "tasks.finetune", "tasks.quantize", "tasks.traces",
                 "tasks.draft", "tasks.evaluate", "tasks.export")


def import_graph() -> dict[str, set[str]]:
    """module -> the repository modules it imports (anywhere in its body; tasks/code.py's reading), less its
    own enclosing packages (a submodule runs its package's __init__ first; that is not a circle)."""
    return {m: {d for d in imports(m, PACKAGES) if not m.startswith(d + ".")} for m in modules(PACKAGES)}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_scan_finds_a_circle_when_there_is_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_imports_point_one_way():
    graph = import_graph()
    assert {"tasks.training.trainer", "tasks.configs", "models.decoder"} <= set(graph)  # the scan saw the tree
    assert circles(graph) == []
    layer = {"storage": 0, "models": 0, "tasks": 1, "flows": 2}
    upward = sorted((m, d) for m, deps in graph.items() for d in deps
                    if layer[d.split(".")[0]] > layer[m.split(".")[0]])
    assert upward == []


def test_no_stage_imports_another_stage():
    graph = import_graph()
    assert set(STAGE_MODULES) <= set(graph)
    crossing = sorted((s, d) for s in STAGE_MODULES for d in graph[s] if d in STAGE_MODULES)
    assert crossing == []


def test_the_repository_cites_nothing_outside_itself():
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True,
                           check=True).stdout.split()
    # an absolute path into the development machine, or the team's notes beside the repository
    outside = re.compile("|".join(["/" + "work/", r"\.\./" + "shared", "shared/" + "reference", "/" + "root/",
                                   "/tmp/" + r"h\d"]))
    hits = []
    for rel in files:
        path = ROOT / rel
        if path.suffix in (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".cfg") or path.name in (
                "Dockerfile", "run"):
            try:
                text = path.read_text()
            except (UnicodeDecodeError, FileNotFoundError):
                continue
            hits += [f"{rel}:{i}" for i, line in enumerate(text.splitlines(), 1) if outside.search(line)]
    assert hits == []
