"""`finetune.method: sft` (the default): next-token cross entropy on the data's packed rows
(tasks/training/losses.py), TRL's SFTTrainer (https://huggingface.co/docs/trl/sft_trainer). Every hook is
`Method`'s default: plain SFT is what the other methods change."""

from __future__ import annotations

from tasks.training.methods import Method, register


@register
class SFT(Method):
    name = "sft"
