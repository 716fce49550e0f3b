"""Reward checkers for post-training: plain functions registered by name (`registry.py`), each scoring a
completion of a prompt in [0, 1] (the exact-answer `arithmetic` checker, `arithmetic.py`); `sandbox` runs
untrusted generated code."""

from tasks.checkers import arithmetic  # noqa: F401  (registers its checker)
from tasks.checkers.registry import CHECKERS, Checker, applicable, get, register

__all__ = ["CHECKERS", "Checker", "applicable", "get", "register"]
