"""Built-in synthetic tasks with deterministic answers, generated from a seed: what the `builtin://arithmetic`
and `builtin://letters` corpora pack (tasks/data/corpora.py). Their checkers (tasks/checkers/arithmetic.py,
letters.py) recompute each answer from the prompt with the same operations, so no answer key is stored.

- arithmetic: the prompt `"{a} {op} {b} ="`, the completion `" {value}"` (a, b in [0, 99], op one of +, -, *;
  products only with b < 10 so answers stay short).
- letters: the prompt `"{op}: {letters} ="`, the completion `" {answer}"`, letters written one per word
  (`reverse: c a t =` -> ` t a c`; `sort`), 3 to 5 letters from a-z.
"""

from __future__ import annotations

import operator
import random
import string
from collections.abc import Callable, Iterator

ARITHMETIC_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
LETTER_OPS: dict[str, Callable[[list[str]], list[str]]] = {
    "reverse": lambda xs: xs[::-1],
    "sort": sorted,
}


def arithmetic_problems(seed: int = 0, n: int = 20000) -> Iterator[tuple[str, str]]:
    """`n` (prompt, completion) pairs, the same for the same seed on every machine."""
    rng = random.Random(seed)
    for _ in range(n):
        op = rng.choice("+-*")
        a, b = rng.randint(0, 99), rng.randint(0, 9 if op == "*" else 99)
        yield f"{a} {op} {b} =", f" {ARITHMETIC_OPS[op](a, b)}"


def letter_problems(seed: int = 0, n: int = 20000, *, min_len: int = 3,
                    max_len: int = 5) -> Iterator[tuple[str, str]]:
    """`n` (prompt, completion) pairs, the same for the same seed on every machine."""
    rng = random.Random(seed)
    ops = sorted(LETTER_OPS)
    for _ in range(n):
        op = rng.choice(ops)
        xs = rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len))
        yield f"{op}: {' '.join(xs)} =", " " + " ".join(LETTER_OPS[op](xs))
