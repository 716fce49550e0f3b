"""Training settings shared by every training stage: the optimisation schedule, the device mesh, and the
error a diverged run raises. Pydantic only -- a recipe is validated without importing JAX."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Progress = Callable[[int, int, dict[str, float]], None]  # (step, total steps, metrics): a stage's progress hook


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/Inf; the message names the step."""


class MeshConfig(BaseModel):
    """Device mesh for training: data x fsdp x tensor x expert must equal the number of devices
    (all processes together); `fsdp: null` takes whatever the other axes leave."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: int = Field(1, ge=1)
    fsdp: int | None = Field(None, ge=1)
    tensor: int = Field(1, ge=1)
    expert: int = Field(1, ge=1)
    rules: dict[str, str | list[str] | None] = {}  # overrides of models.sharding.RULES, logical -> mesh axes


class IndexerConfig(BaseModel):
    """How fine-tuning treats a DSA model's lightning indexer (DeepSeek-V3.2, GLM-5; `finetune.indexer`; a model
    without one ignores it). `frozen`: its parameters get no update (full fine-tuning leaves them out of the
    trained set; LoRA targets none of its projections). `kl`: trained by its own objective, the KL divergence
    between the main attention's distribution (summed over heads, L1-normalised) and the softmax of its index
    scores, with its inputs detached so that the KL updates the indexer alone (https://arxiv.org/abs/2512.02556,
    continued pre-training; in LoRA mode through adapters on its projections, which `lora_targets` must then
    name), added to the task loss with weight `kl_weight`. `form`: over the keys each query attends to, its
    top-k (`sparse`, the paper's sparse training stage, which fine-tuning a DSA model continues) or over every
    causal key (`dense`, the objective of its dense warm-up; the forward stays sparse)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["frozen", "kl"] = "frozen"
    form: Literal["sparse", "dense"] = "sparse"
    kl_weight: float = Field(1.0, gt=0)


class TrainConfig(BaseModel):
    """Optimisation settings shared by every training stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(200, ge=1)
    batch_size: int = Field(16, ge=1)  # sequences per optimizer step, all micro-batches and processes together
    grad_accum: int = Field(1, ge=1)  # micro-batches per step (batch_size must divide evenly)
    optimizer: Literal["adamw", "muon"] = "adamw"
    learning_rate: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    b1: float = 0.9
    b2: float = 0.95
    muon_rms: float = Field(0.2, gt=0)  # Muon update RMS matched to AdamW's (Kimi K2 / Moonlight: 0.2)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    aux_loss_coef: float = Field(0.0, ge=0)  # MoE load-balancing loss weight (0: reported only)
    # MoE expert parallelism: rows one device computes, x the average (None: dropless, every routed row)
    moe_capacity_factor: float | None = Field(None, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    eval_batches: int = Field(8, ge=1)
    log_every: int = Field(10, ge=1)
    peak_flops: float | None = Field(None, gt=0)  # per device, for MFU; None: this machine's measured matmul peak
    seed: int = 0
    mesh: MeshConfig = MeshConfig()

    @model_validator(mode="after")
    def _accum_divides(self) -> TrainConfig:
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of grad_accum {self.grad_accum}")
        return self
