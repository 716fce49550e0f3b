"""The checker registry: a checker is a plain function `(prompt text, completion text) -> reward in [0, 1]`,
registered under a name with a predicate saying which prompts it can judge. Rewards for RL with verifiable
rewards and task accuracy in evaluation both look checkers up here by name (as TRL's GRPO takes reward
functions, and OpenAI's human-eval a `check_correctness`), so a new task is one module and one
`@register`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

Score = Callable[[str, str], float]  # (prompt text, completion text) -> reward in [0, 1]


@dataclass(frozen=True)
class Checker:
    name: str
    score: Score
    applies: Callable[[str], bool]  # whether this checker can judge a prompt
    description: str = ""


CHECKERS: dict[str, Checker] = {}


def register(name: str, *, applies: Callable[[str], bool], description: str = "") -> Callable[[Score], Score]:
    """Decorator: register `score` under `name` (a name registered twice is a programming error)."""

    def add(score: Score) -> Score:
        if name in CHECKERS:
            raise ValueError(f"checker {name!r} is registered twice")
        CHECKERS[name] = Checker(name, score, applies, description or (score.__doc__ or "").strip())
        return score

    return add


def get(name: str) -> Checker:
    """The checker registered as `name`; an unknown name is an error listing the known ones."""
    if name not in CHECKERS:
        raise ValueError(f"unknown checker {name!r} (known: {', '.join(sorted(CHECKERS)) or 'none'})")
    return CHECKERS[name]


def applicable(prompts: Iterable[str]) -> list[str]:
    """The checkers that can judge every one of `prompts` (none for an empty list), by name."""
    prompts = list(prompts)
    return sorted(n for n, c in CHECKERS.items() if prompts and all(c.applies(p) for p in prompts))
