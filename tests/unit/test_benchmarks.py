"""The benchmarks cannot rot unnoticed: every module imports and parses its command line here, in the
default tier; the slow tier runs the cheap ones end to end on the smoke release
(tests/integration/test_release_flow.py)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import benchmarks

pytestmark = pytest.mark.unit

MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))


def test_every_benchmark_is_here():
    assert {"load", "moe", "parity", "quant", "run", "speculative", "train"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports_and_parses_its_command_line(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main) and module.__doc__
    if "argv" in module.main.__code__.co_varnames[: module.main.__code__.co_argcount]:
        with pytest.raises(SystemExit) as e:
            module.main(["--help"])
        assert e.value.code == 0 and "usage:" in capsys.readouterr().out
