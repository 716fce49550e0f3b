"""The built-in task with deterministic answers: small integer arithmetic, generated from a seed, and its
exact-answer checker.

A problem is the prompt `"{a} {op} {b} ="` and the completion `" {value}"` (a, b in [0, 99], op one of
+, -, *; products only with b < 10 so answers stay short). `problems(seed, n)` (tasks/data/synthetic.py) is the
generator the `builtin://arithmetic` corpus packs; the checker `arithmetic` recomputes the answer
from the prompt itself, so it needs no stored answer key, and scores a completion 1.0 when its first line is
the answer (an integer, spaces around it allowed, nothing else), else 0.0: exact match, as verifiable
rewards are scored (DeepSeek-R1, arXiv:2501.12948: rule-based accuracy rewards)."""

from __future__ import annotations

import re

from tasks.checkers.registry import register
from tasks.data.synthetic import ARITHMETIC_OPS as OPS
from tasks.data.synthetic import arithmetic_problems as problems

__all__ = ["OPS", "answer", "expected", "problems", "score"]

PROMPT = re.compile(r"(\d+) ([+\-*]) (\d+) =")
ANSWER = re.compile(r"\s*(-?\d+)\s*")


def expected(prompt: str) -> int | None:
    """The exact answer to an arithmetic prompt (the whole prompt, surrounding whitespace ignored), None if
    it is not one."""
    m = PROMPT.fullmatch(prompt.strip())
    return None if m is None else OPS[m.group(2)](int(m.group(1)), int(m.group(3)))


def answer(completion: str) -> int | None:
    """The integer a completion's first line holds (spaces around it allowed), None if the line holds
    anything else ("85 + 1", "85abc" and "" are no answer)."""
    m = ANSWER.fullmatch(completion.split("\n", 1)[0])
    return None if m is None else int(m.group(1))


@register("arithmetic", applies=lambda prompt: expected(prompt) is not None,
          description="exact answer to `a op b =` (builtin://arithmetic)",
          max_new_tokens=8)
def score(prompt: str, completion: str) -> float:
    """1.0 when the completion's first line is the prompt's exact answer, else 0.0."""
    want = expected(prompt)
    return float(want is not None and answer(completion) == want)
