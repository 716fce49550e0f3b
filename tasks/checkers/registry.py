"""The checker registry: a checker is a plain function `(prompt text, completion text) -> reward in [0, 1]`,
1.0 exactly when the completion is right (what pass@1 counts), anything below it partial credit (the reward
GRPO trains on), registered under a name with a predicate saying which prompts it can judge. The reward depends
on the pair alone (the same pair, the same reward), so evaluation judges each distinct pair once. Rewards for RL
with verifiable rewards and task accuracy in evaluation both look checkers up here by name (as TRL's GRPO
takes reward functions, and OpenAI's human-eval a `check_correctness`), so a new task is one module and one
`@register`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

Score = Callable[[str, str], float]  # (prompt text, completion text) -> reward in [0, 1]; 1.0: correct


@dataclass(frozen=True)
class Checker:
    name: str
    score: Score
    applies: Callable[[str], bool]  # whether this checker can judge a prompt
    description: str = ""
    max_new_tokens: int = 64  # how long an answer may be: what evaluation generates per prompt


CHECKERS: dict[str, Checker] = {}


def register(name: str, *, applies: Callable[[str], bool], description: str = "",
             max_new_tokens: int = 64) -> Callable[[Score], Score]:
    """Decorator: register `score` under `name` (a name registered twice is a programming error)."""

    def add(score: Score) -> Score:
        if name in CHECKERS:
            raise ValueError(f"checker {name!r} is registered twice")
        CHECKERS[name] = Checker(name, score, applies, description or (score.__doc__ or "").strip(), max_new_tokens)
        return score

    return add


def get(name: str) -> Checker:
    """The checker registered as `name`; an unknown name is an error listing the known ones."""
    if name not in CHECKERS:
        raise ValueError(f"unknown checker {name!r} (known: {', '.join(sorted(CHECKERS)) or 'none'})")
    return CHECKERS[name]


def judged(prompts: Iterable[str]) -> dict[str, list[int]]:
    """For every checker that can judge some of `prompts`: the indices of those it can, by name."""
    prompts = list(prompts)
    found = {n: [i for i, p in enumerate(prompts) if c.applies(p)] for n, c in sorted(CHECKERS.items())}
    return {n: idx for n, idx in found.items() if idx}


def score_all(score: Score, prompts: list[str], completions: list[str]) -> list[float]:
    """`score` of each (prompt, completion), on a thread pool: a checker that runs code (the sandbox of
    `code`) waits on a child process per call, so calls overlap."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions")
    with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), os.cpu_count() or 1))) as pool:
        return list(pool.map(score, prompts, completions))


def applicable(prompts: Iterable[str]) -> list[str]:
    """The checkers that can judge every one of `prompts` (none for an empty list), by name."""
    prompts = list(prompts)
    return sorted(n for n, c in CHECKERS.items() if prompts and all(c.applies(p) for p in prompts))
