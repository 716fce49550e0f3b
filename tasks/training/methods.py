"""The fine-tune method registry: a method (`finetune.method`) is one class registered under its name, with
one shape (`Method`): which inputs it reads beyond the base and the data, whether an SFT phase may precede
it, the rules its config section obeys, the model it trains (the base's layers), its trainer (loss, eval and
count functions), its training run and the numbers it reports, and the files it writes beside the model.
The built-in methods are tasks/methods/ (one module each); tasks/finetune.py looks the configured one up here
and runs the same steps for every method (load, LoRA, the SFT phase, train, save), as torchtune keeps its
recipes as records in one registry (https://github.com/pytorch/torchtune/blob/main/torchtune/_recipe_registry.py)
and TRL gives each method its own trainer over one base (https://huggingface.co/docs/trl).

This module imports nothing of the repository and no JAX: `FinetuneConfig` (tasks/configs.py, which every
stage imports) checks a recipe's method name and rules here, before any stage runs and on machines without
an accelerator. The built-in methods are imported on the first lookup (`_LAZY`, as a PEP 562 package imports
on first use: tasks/code.py then counts their code in the fine-tune's version, which imports tasks.methods,
and in no other stage's); their own modules import their training code inside the hooks that run it.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

# the built-in methods' package, imported (so registered) on the first lookup
_LAZY = {"builtin": "tasks.methods"}


class Method:
    """A fine-tune method. Subclass it, set `name`, override what differs from plain SFT, and `@register`
    the class. tasks/finetune.py runs, in this order: `check(cfg)` (when the config is validated),
    `Method(run)` (reads and checks the method's inputs, before the model loads; `run` is a
    tasks/methods/run.py `Run`), the model (the base's `layers`, LoRA when `mode: lora`, the SFT phase when
    `sft_first` and `sft_steps`), `trainer`, `fit`, and once the model is saved, on process 0, `write`
    (`record` adds to `training.json`)."""

    name: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]] = ()  # stage inputs read beyond `base` and `data` (distill: traces)
    sft_first: ClassVar[bool] = False  # whether `sft_steps` of SFT may run first (the reference is then that model)

    @classmethod
    def check(cls, cfg: Any) -> None:
        """The method's rules for a FinetuneConfig (raise ValueError naming the field)."""

    @classmethod
    def trains_twice(cls, cfg: Any) -> bool:
        """Whether the run trains two models one after the other, each resumed from its own checkpoints."""
        return bool(cfg.sft_steps)

    @classmethod
    def record(cls, cfg: Any) -> dict[str, Any]:
        """What `training.json` keeps beyond every method's keys (the curves, the SFT phase)."""
        return {}

    def __init__(self, run: Any) -> None:
        """Read and check the method's inputs (an error naming what is missing), before the model loads."""
        self.run = run

    @property
    def layers(self) -> tuple[int, ...] | None:
        """The base's decoder layers the trained model keeps (None: all of them)."""
        return None

    def trainer(self, model: Any, trainable: Any) -> Any:
        """The Trainer of `model` with the method's objective (default: next-token cross entropy)."""
        return self.run.trainer(model, trainable)

    def fit(self, trainer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Train; (the loop's metrics, the method's further numbers for the result). Default: on the data's
        packed rows."""
        return self.run.fit(trainer, self.run.data_dir, label=f"finetune[{self.run.cfg.mode}]"), {}

    def write(self, result: dict[str, Any]) -> None:
        """Files beside the model that later stages read (evaluate: GRPO's `rl.json`, `distill.json`)."""


METHODS: dict[str, type[Method]] = {}


def register(method: type[Method]) -> type[Method]:
    """Class decorator: register `method` under its `name` (a name registered twice is a programming error)."""
    if method.name in METHODS:
        raise ValueError(f"fine-tune method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def get(name: str) -> type[Method]:
    """The method registered as `name`; an unknown name is an error listing the known ones."""
    importlib.import_module(_LAZY["builtin"])
    if name not in METHODS:
        raise ValueError(f"unknown fine-tune method {name!r} (known: {', '.join(sorted(METHODS)) or 'none'})")
    return METHODS[name]


def sft_first() -> list[str]:
    """The methods that `sft_steps` of SFT may precede, by name."""
    importlib.import_module(_LAZY["builtin"])
    return sorted(n for n, m in METHODS.items() if m.sft_first)
