"""Packages that import on first use (PEP 562): a package's __init__ declares `_LAZY = {name: module}`
and takes its `__getattr__` and `__dir__` from `exports`. Nothing is imported until a name is used, so
importing one module of a package does not import the rest, and tasks/code.py can read from `_LAZY`
which module a `from package import name` depends on.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any


def exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`: a name of `table` comes from its module, any other name
    is tried as a submodule (`models.lora` after `import models`). A submodule named like one of the
    names (`models.generate`, the module, and `models.generate`, the function) does not replace the name
    on the package when it is imported: the package's attribute stays the exported object."""
    module = importlib.import_module(package)
    namespace = module.__dict__

    class LazyPackage(type(module)):
        def __setattr__(self, name: str, value: Any) -> None:
            if name in table and isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}":
                return  # the import system binding the submodule: the export keeps the name
            super().__setattr__(name, value)

    module.__class__ = LazyPackage

    def getattr_(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(table))

    return getattr_, dir_
