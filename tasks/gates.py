"""The release's evaluation gates: the schema a recipe declares under `evaluate.gates`, how a scheme's limit
is looked up, which gates are on, and how a weaker set differs from a stricter one (the waivers).

Part of the config schemas (tasks/configs.py, whose `EvalConfig.gates` this is); kept apart because the gates
are their own subsystem: tasks/evaluate.py judges a report against them and tasks/recipe.py records the ways
a release loosens them. Defaults and their sources are in the comments below and in docs/quantization.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Gates(BaseModel):
    """What a release must pass before it is exported. A recipe declares them; one it sets weaker than the
    default below (a lower floor, a higher limit, a check turned off) needs its reason under `reasons` and is
    recorded as a waiver; `forgeline release --set` may make one stricter, while loosening or disabling one
    takes `--allow-weaker-gates` and is recorded as a waiver too (tasks/recipe.py). At least one gate must
    be enabled."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    finetune_improves: bool = True  # fine-tuned held-out perplexity below the base's
    # scheme ppl <= (1 + limit) x fine-tuned ppl; one number for every scheme, or limits keyed by scheme name
    # or by its family (the name's first part: int8, w8a16, w4a16, fp8, nvfp4a16, mxfp4a16); the defaults are
    # the issues' aims (6 and 18: NVFP4 <= 3 %); MXFP4 has no aim of its own and is held to NVFP4's
    max_quant_ppl_increase: float | dict[str, float] = Field(
        default_factory=lambda: {"int8": 0.005, "w8a16": 0.005, "fp8": 0.003, "w4a16": 0.02, "nvfp4a16": 0.03,
                                 "mxfp4a16": 0.03, "fp8-dynamic": 0.005, "int8-w8a8": 0.01, "w4afp8": 0.03,
                                 "nvfp4": 0.06, "mxfp4": 0.1})
    # Perplexity and mean KL can hide answers that change. The 99th percentile of per-token KL(fine-tuned ||
    # quantized) and the share of held-out tokens whose top-1 flips, keyed the same way. No public standard
    # sets these; the defaults are 2-4x the worst round-to-nearest scheme of each width on the default
    # release (8-bit: fp8-block 1.0 % flips, KL p99 5.5e-4; 4-bit: mxfp4a16 4.7 %, 1.2e-2; docs/quantization.md),
    # so they stop a broken quantizer or a badly calibrated scheme, not a fine regression. Schemes that also
    # quantize activations (fp8-dynamic, int8-w8a8, w4afp8, W4A4 nvfp4 / mxfp4) get wider limits in all three
    # gates, set before any measurement on the default release: provisional (docs/quantization.md).
    max_quant_kl_p99: float | dict[str, float] = Field(
        default_factory=lambda: {"int8": 0.002, "w8a16": 0.002, "fp8": 0.002, "w4a16": 0.025, "nvfp4a16": 0.025,
                                 "mxfp4a16": 0.025, "fp8-dynamic": 0.005, "int8-w8a8": 0.01, "w4afp8": 0.03,
                                 "nvfp4": 0.06, "mxfp4": 0.1})
    max_quant_flip_rate: float | dict[str, float] = Field(
        default_factory=lambda: {"int8": 0.02, "w8a16": 0.02, "fp8": 0.02, "w4a16": 0.1, "nvfp4a16": 0.1,
                                 "mxfp4a16": 0.1, "fp8-dynamic": 0.03, "int8-w8a8": 0.05, "w4afp8": 0.1,
                                 "nvfp4": 0.2, "mxfp4": 0.25})
    speculative_lossless: bool = True
    min_acceptance_length: float = Field(1.2, ge=0)  # 0 disables the gate
    # preference data (chosen/rejected pairs in the release's data): the share of held-out pairs on which the
    # fine-tuned model moved toward the chosen answer relative to the base (DPO's implicit reward, positive
    # margin); 0 disables the gate. A DPO release gates on this instead of `finetune_improves` (preference
    # optimisation does not aim at the chosen answers' perplexity, and often raises it).
    min_preference_accuracy: float = Field(0.0, ge=0, le=1)
    # task accuracy (every registered checker that judges some of the data's prompts, tasks/checkers/): the
    # fine-tuned model's pass@1 at temperature 0 on each task, at least this (0 disables the gate) ...
    min_task_accuracy: float = Field(0.0, ge=0, le=1)
    # ... and each quantized variant's pass@1 at temperature 0 at most this far below the fine-tuned model's
    # (absolute, on the same prompts: a paired comparison; 1 disables the gate)
    max_task_accuracy_drop: float = Field(0.05, ge=0, le=1)
    # finetune.method grpo: held-out pass@1 (T=0) after RL minus before it (the SFT start), as the finetune stage
    # measured it on its checker's prompts (its training.json); 0 disables the gate
    min_rl_accuracy_gain: float = Field(0.0, ge=0, le=1)
    # why each gate this recipe sets weaker than its default above is lowered, keyed by the gate's name
    # (`{finetune_improves: "..."}`; one reason covers every scheme of a gate keyed by scheme); required for each
    # such gate, and recorded with it as a waiver. Judges nothing.
    reasons: dict[str, str] = {}

    QUANT_GATES: ClassVar[tuple[str, ...]] = ("max_quant_ppl_increase", "max_quant_kl_p99", "max_quant_flip_rate")

    @field_validator("reasons")
    @classmethod
    def _reasons_name_gates(cls, v: dict[str, str]) -> dict[str, str]:
        gates = sorted(set(cls.model_fields) - {"reasons"})
        for name, why in v.items():
            if name not in gates:
                raise ValueError(f"'{name}' is not a gate (gates: {', '.join(gates)})")
            if not why.strip():
                raise ValueError(f"{name}: empty (say why the gate is lowered)")
        return v

    def quant_limit(self, scheme: str, gate: str = "max_quant_ppl_increase") -> float:
        limits = getattr(self, gate)
        if not isinstance(limits, dict):
            return float(limits)
        parts = scheme.split("-")
        for key in ("-".join(parts[:k]) for k in range(len(parts), 0, -1)):  # the longest prefix with a limit
            if key in limits:
                return float(limits[key])
        raise ValueError(f"evaluate.gates.{gate} has no limit for scheme {scheme!r} (keys: {sorted(limits)})")

    def enabled(self, schemes: list[str] | tuple[str, ...]) -> list[str]:
        """The gates that will judge a release shipping `schemes` (empty: nothing would be checked)."""
        on = [name for name in ("finetune_improves", "speculative_lossless") if getattr(self, name)]
        on += ["min_acceptance_length"] if self.min_acceptance_length > 0 else []
        on += ["min_preference_accuracy"] if self.min_preference_accuracy > 0 else []
        on += ["min_task_accuracy"] if self.min_task_accuracy > 0 else []
        on += ["min_rl_accuracy_gain"] if self.min_rl_accuracy_gain > 0 else []
        on += [f"max_task_accuracy_drop[{s}]" for s in schemes] if self.max_task_accuracy_drop < 1 else []
        return on + [f"{gate}[{s}]" for gate in self.QUANT_GATES for s in schemes]

    def waivers(self, stricter: Gates, schemes: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
        """Every way these gates are weaker than `stricter` (the built-in defaults, or the recipe's own gates):
        a check switched off, a lower floor, a larger perplexity, KL, flip or accuracy-drop allowance for a
        shipped scheme, each as {gate, from: its value in `stricter`, to: its value here}. [] when these are as
        strict or stricter. A scheme without a limit on either side is skipped (a new limit loosens nothing;
        a missing one is an error of its own, before the release starts)."""
        out = []
        for name in ("finetune_improves", "speculative_lossless"):
            if getattr(stricter, name) and not getattr(self, name):
                out.append({"gate": f"evaluate.gates.{name}", "from": True, "to": False})
        for name in ("min_acceptance_length", "min_preference_accuracy", "min_task_accuracy", "min_rl_accuracy_gain"):
            if getattr(self, name) < getattr(stricter, name):
                out.append({"gate": f"evaluate.gates.{name}", "from": getattr(stricter, name),
                            "to": getattr(self, name)})
        if self.max_task_accuracy_drop > stricter.max_task_accuracy_drop:
            out.append({"gate": "evaluate.gates.max_task_accuracy_drop", "from": stricter.max_task_accuracy_drop,
                        "to": self.max_task_accuracy_drop})
        for gate in self.QUANT_GATES:
            for scheme in schemes:
                try:
                    was, now = stricter.quant_limit(scheme, gate), self.quant_limit(scheme, gate)
                except ValueError:
                    continue
                if now > was:
                    out.append({"gate": f"evaluate.gates.{gate}[{scheme}]", "from": was, "to": now})
        return out
