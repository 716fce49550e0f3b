"""Code versions that follow meaning: which source a stage's computation depends on, and a hash of it
that ignores comments and docstrings.

A stage's fingerprint includes `code_version(stage module)`: sha256 over the normalised syntax tree
(`ast.dump`, docstrings removed; the parser drops comments) of every module in the stage module's
import closure inside the repository's libraries (`models/`, `tasks/`, `storage/`), the imports inside
functions included, plus the Python version (the built-in corpora ship with Python). So:

- editing a comment or a docstring anywhere changes no fingerprint;
- editing the code of `tasks/export.py` changes the export stage's fingerprint and no other;
- editing `models/lora.py` changes every stage that imports it, directly or through other modules;
- `flows/`, `tests/`, `benchmarks/`, `infra/` and docs never enter a fingerprint.

The rule is conservative: a stage that imports a module is taken to depend on all of it (a change to
a function the stage never calls still recomputes it). The whole tree's version (`source_version`)
and the git SHA are recorded in every manifest beside the stage's own.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import threading
import time
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("models", "tasks", "storage")  # what computes artifacts; flows/ only orchestrates


@cache
def modules(packages: tuple[str, ...] = LIBRARIES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` (a package is its __init__.py)."""
    out = {}
    for pkg in packages:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            out[".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


# CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state, so a parse that runs while
# another thread parses too can fail with "SystemError: AST constructor recursion depth mismatch" (seen when a
# workers-mode release fingerprints independent stages at once, and in stage processes whose background threads
# format tracebacks, which parses source lines in 3.11). The check only guards that counter: a parse that
# succeeds built the right tree. So our own parses take this lock, and a parse that another thread disturbed
# is run again.
_AST = threading.RLock()


def _parse(source: str) -> ast.Module:
    for attempt in range(20):
        try:
            with _AST:
                return ast.parse(source)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 19:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


@cache
def _tree(path: Path) -> ast.Module:
    return _parse(path.read_text())


@cache
def lazy_exports(package: str, packages: tuple[str, ...] = LIBRARIES) -> dict[str, str]:
    """A package's `_LAZY = {"name": "package.module", ...}` table: the names its __init__ imports on
    first use (PEP 562 `__getattr__`) rather than at import time."""
    path = modules(packages).get(package)
    if path is None or path.name != "__init__.py":
        return {}
    for node in _tree(path).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if isinstance(getattr(node, "value", None), ast.Dict) and any(
                isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values, strict=True)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


@cache
def imports(module: str, packages: tuple[str, ...] = LIBRARIES) -> frozenset[str]:
    """The modules of `packages` that `module` imports anywhere in its body (imports inside functions
    included, and a module named in a string, as a registry imports it by name). Through a package whose
    __init__ defers its imports (a `_LAZY` table of name -> module, PEP 562), only what is used counts:
    `from models import from_pretrained` is models.hf, and after `import models`, `models.lora.apply_lora`
    is models.lora."""
    known = modules(packages)
    path = known[module]
    out: set[str] = set()
    bound: dict[str, str] = {}  # local name -> the package or module an `import` statement bound to it
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (r := _resolve(a.name, known)):
                    out.add(r)
                    if a.asname:
                        bound[a.asname] = r
                    else:  # `import a.b.c` binds `a`
                        bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in known:
                    out.add(full)
                    bound[a.asname or a.name] = full
                elif (lazy := lazy_exports(base, packages).get(a.name)) is not None:
                    out.add(lazy)
                elif (r := _resolve(base, known)):
                    out.add(r)
    lazy_table = {id(c) for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "_LAZY" for t in n.targets) for c in ast.walk(n)}
    for node in ast.walk(tree):  # a module named in a string is imported by name (a registry): counts
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known \
                and id(node) not in lazy_table:
            out.add(node.value)
    for node in ast.walk(tree):  # attribute chains on bound names: models.lora.x, quant.parse_scheme
        if isinstance(node, ast.Attribute):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id in bound:
                name = bound[node.id]
                for attr in reversed(chain):
                    if f"{name}.{attr}" in known:
                        name = f"{name}.{attr}"
                        out.add(name)
                    else:
                        if (lazy := lazy_exports(name, packages).get(attr)) is not None:
                            out.add(lazy)
                        break
    # importing a.b.c runs a/__init__.py and a/b/__init__.py first
    out |= {p for m in list(out) for p in _parents(m) if p in known}
    out.discard(module)
    return frozenset(out)


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def closure(module: str, packages: tuple[str, ...] = LIBRARIES) -> list[str]:
    """`module` and everything it imports, transitively, within `packages`; sorted."""
    seen = {module} | {p for p in _parents(module) if p in modules(packages)}
    todo = list(seen)
    while todo:
        for dep in imports(todo.pop(), packages):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return sorted(seen)


def normalized(source: str) -> str:
    """The syntax tree of `source` without docstrings, as text: what the code does, not how it reads."""
    tree = _parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False)


@cache
def _module_hash(path: Path) -> bytes:
    return hashlib.sha256(normalized(path.read_text()).encode()).digest()


@cache
def code_version(module: str) -> str:
    """The version of the code `module` runs: see the module docstring."""
    known = modules()
    h = hashlib.sha256(f"python{sys.version_info[0]}.{sys.version_info[1]}".encode())
    for name in closure(module):
        h.update(name.encode() + b"\0" + _module_hash(known[name]))
    return h.hexdigest()[:16]


@cache
def source_version() -> str:
    """The whole library tree's version (every module of LIBRARIES, normalised): recorded, not fingerprinted."""
    h = hashlib.sha256(f"python{sys.version_info[0]}.{sys.version_info[1]}".encode())
    for name, path in modules().items():
        h.update(name.encode() + b"\0" + _module_hash(path))
    return h.hexdigest()[:16]
