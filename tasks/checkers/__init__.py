"""Reward checkers for post-training: plain functions registered by name (`registry.py`), each scoring a
completion of a prompt in [0, 1] (the exact-answer `arithmetic` and `letters` checkers; the `code` checker,
`code.py`, which runs a stdlib function's docstring examples against a generated body); `sandbox` runs
untrusted generated code."""

from tasks.checkers import arithmetic, code, letters  # noqa: F401  (register their checkers)
from tasks.checkers.registry import CHECKERS, Checker, applicable, get, judged, register, score_all

__all__ = ["CHECKERS", "Checker", "applicable", "get", "judged", "register", "score_all"]
