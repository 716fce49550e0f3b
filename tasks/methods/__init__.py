"""The built-in fine-tune methods (`finetune.method`), one class in one module each, registered by name in
tasks/training/methods.py (the `Method` shape, `register`, `get`): `sft`, `dpo` (and SimPO), `grpo`,
`distill`. A method's module imports no JAX at its top (the config checks a method's name and rules before any
stage runs); `run.py` is what a method trains with, imported by tasks/finetune.py."""

from tasks.methods import distill, dpo, grpo, sft  # noqa: F401  (register their methods)
