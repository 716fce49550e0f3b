"""The built-in string-transformation task, generated from a seed, and its exact-answer checker.

A problem is the prompt `"{op}: {letters} ="` and the completion `" {answer}"`, letters written one per
word (`reverse: c a t =` -> ` t a c`), so that with a byte-level BPE every letter is one token and the task
is about moving tokens, not about how a tokenizer split a word. `op` is `reverse` or `sort`, the string 3 to
5 letters from a-z. `problems(seed, n)` (tasks/data/synthetic.py) is the generator the `builtin://letters`
corpus packs; the checker `letters` recomputes the answer from the prompt itself, so it needs no
stored answer key, and scores a completion 1.0 when its first line holds exactly the answer's letters
(separated by single spaces, spaces around them allowed), as verifiable rewards are scored (DeepSeek-R1,
arXiv:2501.12948: rule-based accuracy rewards), and gives partial credit below 1.0 (the share of letters in
place): accuracy (pass@1) counts only exact answers, the reward is dense.

Why this task for the tiny default (3.3M parameters): the answer is a permutation of the prompt's own
tokens, which a small transformer learns by attention (copying), unlike the `arithmetic` task, whose digits
the tokenizer merges unevenly: 180 full-parameter SFT steps reach 25 % held-out accuracy here, where the
arithmetic task stayed near 2 %, so sampled groups mix right and wrong answers, the signal group-relative
advantages need (all-wrong or all-right groups carry none).
"""

from __future__ import annotations

import re

from tasks.checkers.registry import register
from tasks.data.synthetic import LETTER_OPS as OPS
from tasks.data.synthetic import letter_problems as problems

__all__ = ["OPS", "answer", "expected", "problems", "score"]

PROMPT = re.compile(rf"({'|'.join(OPS)}): ((?:[a-z] )*[a-z]) =")


def expected(prompt: str) -> list[str] | None:
    """The exact answer's letters for a prompt (the whole prompt, surrounding whitespace ignored), None if it
    is not one."""
    m = PROMPT.fullmatch(prompt.strip())
    return None if m is None else OPS[m.group(1)](m.group(2).split(" "))


def answer(completion: str) -> list[str] | None:
    """The letters a completion's first line holds (single letters separated by single spaces, spaces
    around the line allowed), None if the line holds anything else."""
    line = completion.split("\n", 1)[0].strip(" ")
    return line.split(" ") if re.fullmatch(r"(?:[a-z] )*[a-z]", line) else None


@register("letters", applies=lambda prompt: expected(prompt) is not None,
          description="`reverse|sort: c a t =` (builtin://letters): 1.0 for the exact answer, partial credit per "
                      "letter in place",
          max_new_tokens=16)
def score(prompt: str, completion: str) -> float:
    """1.0 when the completion's first line is the prompt's exact answer; otherwise the share of positions
    holding the right letter, over the longer of the two (`t a x` for `t a c`: 2/3; `t a c d`: 3/4), and 0.0
    for a line that is not letters. Accuracy counts only 1.0; the partial credit is the dense reward a small
    model's RL needs when few of its samples are exactly right."""
    want, got = expected(prompt), answer(completion)
    if want is None or got is None:
        return 0.0
    return sum(a == b for a, b in zip(got, want, strict=False)) / max(len(got), len(want))
