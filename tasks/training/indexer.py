"""A DSA model's lightning indexer in fine-tuning (`finetune.indexer`, tasks/training/config.py `IndexerConfig`):
which parameters train, checked against the model and the LoRA adapters.

DeepSeek-V3.2 (https://arxiv.org/abs/2512.02556, continued pre-training) trains the indexer only by its own KL
objective, on detached inputs, and the main model only by the language-modelling loss; the top-k selection gives
the task loss no gradient into the indexer either. So:

* `frozen`: full fine-tuning differentiates every `nnx.Param` but the indexer's (else weight decay alone would
  move them); LoRA must adapt none of its projections (they would stay at their init, B = 0).
* `kl`: full fine-tuning trains every parameter (the indexer's by its KL); LoRA trains the adapters, which must
  include the indexer's projections (`models/lora_targets.py` INDEXER), the only way its KL reaches a weight.

DeepSeek-V4's CSA indexer (models/deepseek_v4.py `V4Indexer`) is frozen the same way; it has no KL objective
here, so `kl` refuses a V4 base.

The objective itself is models/deepseek_v32.py `DSAttention.kl_objective`, weighted in the train step
(tasks/training/trainer.py).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from models.deepseek_v4 import V4Indexer
from models.deepseek_v32 import DSAttention
from models.lora import lora_modules
from models.lora_targets import INDEXER
from tasks.training.config import IndexerConfig


def has_indexer(model: nnx.Module) -> bool:
    """Whether any layer of `model` runs a DSA indexer (a GLM-5 shared layer has none)."""
    return any(isinstance(m, DSAttention) and hasattr(m, "indexer") for _, m in nnx.iter_graph(model))


def has_any_indexer(model: nnx.Module) -> bool:
    """A DSA indexer, or DeepSeek-V4's CSA indexer (models/deepseek_v4.py `V4Indexer`: the same top-k
    selection over compressed entries, with its own compressor): either way a module the task loss never
    reaches, which `frozen` keeps as published."""
    return has_indexer(model) or any(isinstance(m, V4Indexer) for _, m in nnx.iter_graph(model))


def trainable(model: nnx.Module, mode: str, indexer: IndexerConfig) -> Any:
    """The nnx filter of what fine-tuning trains, for `mode` (lora / full) and the indexer's treatment, after any
    LoRA adapters are attached; a ValueError naming the `finetune.*` key when they contradict each other."""
    dsa, any_indexer = has_indexer(model), has_any_indexer(model)
    if indexer.mode == "kl" and not dsa:
        if any_indexer:
            raise ValueError(f"finetune.indexer.mode: kl trains a DSA lightning indexer (DeepSeek-V3.2, GLM-5); "
                             f"{type(model).__name__}'s compressed-attention indexer has no KL objective here "
                             "(leave it frozen)")
        raise ValueError(f"finetune.indexer.mode: kl trains a DSA lightning indexer; {type(model).__name__} has "
                         "none (leave it frozen)")
    on_indexer = [".".join(map(str, p)) for p, _ in lora_modules(model) if "indexer" in p]
    if mode == "lora":
        if indexer.mode == "frozen" and on_indexer:
            raise ValueError(f"finetune.lora_targets: match the DSA indexer's projections ({on_indexer[0]}, ...), "
                             "which finetune.indexer.mode frozen keeps frozen (set it to kl to train them)")
        if indexer.mode == "kl" and not on_indexer:
            raise ValueError("finetune.lora_targets: match none of the DSA indexer's projections, so "
                             f"finetune.indexer.mode kl would train nothing (add the INDEXER preset: {INDEXER[0]})")
        return nnx.LoRAParam
    if any_indexer and indexer.mode == "frozen":
        return nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))
    return nnx.Param
