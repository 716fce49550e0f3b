"""Every stage's config schema and its one declaration (`STAGES`), in one place and in the order of the
release DAG.

A recipe (tasks/recipe.py) composes these into `ReleaseConfig`, whose sections derive from `STAGES`; a stage
receives its own, typed and validated once. Each schema is frozen and forbids unknown keys, so a typo is an
error naming the key (MaxText keeps its config types apart from the code that uses them in the same way:
configs/types.py). Defaults live here and only here (the evaluation gates' in tasks/gates.py); recipes state
differences from them.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from models.draft_format import KINDS, draft_kind
from models.lora_targets import ALL_LINEAR
from models.objectives import check_objective
from models.quant.schemes import parse_scheme
from tasks.data.corpora import SPECIAL_TOKENS
from tasks.gates import Gates
from tasks.resources import CPU, GPU, ExecutionConfig, KubernetesGangConfig, StageResources  # noqa: F401 (re-exported)
from tasks.training.config import IndexerConfig, TrainConfig

T = TypeVar("T")


class DataPrepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: str = "builtin://python-stdlib"  # URL / path / glob read through `storage`, or builtin://NAME
    format: Literal["auto", "jsonl", "parquet", "text"] = "auto"  # auto: by file extension
    text_field: str = "text"
    messages_field: str = "messages"
    seq_len: int = Field(256, ge=8, le=1 << 20)
    vocab_size: int = Field(4096, ge=len(SPECIAL_TOKENS) + 256 + 1)  # only when training a tokenizer
    valid_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    max_documents: int | None = Field(None, ge=1)
    max_prompts: int = Field(64, ge=0)
    shard_rows: int = Field(2048, ge=1)
    seed: int = 0  # which valid documents become prompts (reservoir sample); the split is unseeded


class ModelShape(BaseModel):
    """The architecture of a scratch base; the vocabulary comes from the tokenizer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Literal["LlamaForCausalLM", "Qwen3ForCausalLM"] = "LlamaForCausalLM"
    hidden_size: int = Field(192, ge=8)
    intermediate_size: int = Field(512, ge=8)
    num_hidden_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(6, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    @model_validator(mode="after")
    def _grouped_query(self) -> ModelShape:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        return self
class BaseModelConfig(BaseModel):
    """Stage `base_model`: import `url`, or pretrain `model` on `data` (the demo default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str | None = None  # an HF checkpoint folder; None -> pretrain `model` on `data`
    data: DataPrepConfig = DataPrepConfig(corpus="builtin://python-stdlib")
    model: ModelShape = ModelShape()
    train: TrainConfig = TrainConfig(steps=400, batch_size=16, learning_rate=3e-3, warmup_steps=20,
                                     checkpoint_every=50)


class PreferenceConfig(BaseModel):
    """`finetune.method: dpo`: the loss on chosen / rejected pairs (tasks/training/preference.py). `loss: dpo`
    (Rafailov et al. 2023) against the starting model's stored log-probabilities, or `simpo` (Meng et al.
    2024), reference-free. `beta` defaults to each paper's: 0.1 for DPO, 2.0 for SimPO."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: Literal["dpo", "simpo"] = "dpo"
    beta: float | None = Field(None, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # conservative DPO's ε (0: the paper's loss)
    gamma: float = Field(1.0, ge=0)  # SimPO's target reward margin γ
    eval_batch_size: int = Field(32, ge=1)  # pairs per forward of the reference pass and held-out measurement

    @property
    def effective_beta(self) -> float:
        return self.beta if self.beta is not None else (0.1 if self.loss == "dpo" else 2.0)


class GRPOConfig(BaseModel):
    """`finetune.method: grpo` (tasks/training/grpo.py): `train.batch_size` completions per step, in groups of
    `group_size` per prompt, scored by the checker registered as `checker` (tasks/checkers/)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checker: str = "arithmetic"
    group_size: int = Field(8, ge=2)
    max_new_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)  # sampling temperature of the rollouts (and of the ratio's logits)
    top_p: float = Field(1.0, gt=0, le=1)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    beta: float = Field(0.04, ge=0)  # KL to the reference (the starting model); 0: no KL term (see monitor_kl)
    # with beta 0, still hold the reference and measure KL(policy || reference) at each held-out evaluation (on
    # the rollout the policy just sampled): the KL curve a run is watched by, for the reference's weights in
    # memory and one forward per evaluation; False: no reference at all (the curve is absent)
    monitor_kl: bool = True
    scale_rewards: bool = True  # divide by the group's std (GRPO); False: Dr. GRPO
    # sample this many times the step's prompts and train on the groups whose rewards differ (DAPO's dynamic
    # sampling: an all-right or all-wrong group has zero advantages); 1: train on every sampled group
    oversample: float = Field(1.0, ge=1.0)
    # update on the groups whose rewards differ only (verl's DAPO `filter_groups`): the others' advantages are 0,
    # so with beta 0 their rows add no gradient, only compute. The batch shrinks to the next multiple of an
    # eighth of train.batch_size (a few compiled shapes); each completion's weight becomes 1 / the kept ones.
    # With beta > 0 the dropped rows' KL term goes too.
    filter_groups: bool = False
    loss_agg: Literal["sequence", "token"] = "sequence"  # per completion then mean (GRPO), or per token (DAPO)
    # policy updates per rollout batch (DeepSeekMath's μ, TRL's num_iterations): train.steps counts updates, a
    # rollout every num_iterations of them; updates after the first see ρ != 1 against the rollout's log-probs, so
    # the clip acts. train.steps and train.checkpoint_every must be multiples of it (a resume starts a rollout).
    num_iterations: int = Field(1, ge=1)
    eval_every: int = Field(25, ge=1)  # held-out pass@1 every this many steps
    eval_prompts: int = Field(256, ge=1)  # held-out prompts (data_prep's prompts.parquet, capped at what it has)
    eval_batch_size: int = Field(64, ge=1)

    @property
    def needs_reference(self) -> bool:
        """Whether the run holds the reference model: for the KL term, or to measure the KL it would be."""
        return self.beta > 0 or self.monitor_kl

    @field_validator("checker")
    @classmethod
    def _registered(cls, v: str) -> str:
        from tasks.checkers import get

        get(v)  # an unknown checker: ValueError listing the known ones
        return v


class TracesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_prompts: int = Field(256, ge=1)  # training prompts to regenerate
    skip_prompts: int = Field(0, ge=0)  # start after this many (a refresh takes prompts the last draft never saw)
    num_valid_prompts: int = Field(32, ge=1)  # held-out prompts (the draft's validation split)
    max_prompt_len: int = Field(160, ge=2)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.8, ge=0)  # SpecForge regenerates at 0.8; 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    batch_size: int = Field(32, ge=1)  # generation and teacher-forcing batch (rows)
    seq_len: int = Field(256, ge=8)
    seed: int = 0
    shard_prompts: int = Field(64, ge=1)  # prompts per shard: the unit of work, persistence and resumption
    hidden_states: Literal["offline", "online"] = "offline"  # online: the draft trainer runs the target itself
    aux_layer_ids: list[int] | None = Field(None, min_length=1)  # None: models.eagle3.default_aux_layer_ids
    hidden_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    target: str = "finetuned"  # the model that answers: "finetuned" or a quantized scheme of a quantize artifact
    # > 0: also store the target's top-k next-token log-probabilities at every position (topk-*.safetensors), the
    # targets of a distilled student (finetune.method distill)
    top_k_logits: int = Field(0, ge=0)

    @field_validator("aux_layer_ids")
    @classmethod
    def _non_negative(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(i < 0 for i in ids):
            raise ValueError(f"aux_layer_ids {ids}: ids are 0-based decoder layer outputs, all >= 0")
        return ids

    @model_validator(mode="after")
    def _prompt_leaves_room(self) -> TracesConfig:
        if self.max_prompt_len >= self.seq_len:
            raise ValueError(f"max_prompt_len {self.max_prompt_len} must be < seq_len {self.seq_len} "
                             "(a prompt must leave room for its answer in a row)")
        return self


class DistillConfig(BaseModel):
    """`finetune.method: distill` (tasks/training/distill.py): the release's base is the teacher; the student is
    the teacher's decoder layers `student_layers` (depth pruning, models/pruning.py), trained on the teacher's
    answers to the data's prompts with their top-k log-probabilities (`traces`, a traces stage on the base run
    before finetune): KL(teacher || student) at temperature `temperature` (x T², Hinton et al. 2015) and
    `alpha` x cross entropy on the teacher's sampled tokens. `compare_sft`: the same student trained as long on the
    data's own rows with plain SFT, the baseline the report sets beside it and the teacher."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    student_layers: list[int] | None = Field(None, min_length=1)  # None: half the teacher's, evenly spaced
    temperature: float = Field(1.0, gt=0)
    alpha: float = Field(0.0, ge=0, le=1)
    compare_sft: bool = True
    checker: str | None = None  # pass@1 (T = 0) of teacher, student and SFT student on held-out prompts
    eval_prompts: int = Field(256, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    traces: TracesConfig = TracesConfig(num_prompts=2048, num_valid_prompts=64, temperature=0.0,
                                        hidden_states="online", top_k_logits=16, shard_prompts=512)

    @field_validator("checker")
    @classmethod
    def _registered(cls, v: str | None) -> str | None:
        if v is not None:
            from tasks.checkers import get

            get(v)
        return v

    @model_validator(mode="after")
    def _teacher_logits(self) -> DistillConfig:
        if self.traces.top_k_logits < 1:
            raise ValueError("traces.top_k_logits: the student learns the teacher's top-k log-probabilities (>= 1)")
        if self.traces.target != "finetuned":
            raise ValueError("traces.target: the teacher is the release's base (leave it 'finetuned')")
        return self


class FinetuneConfig(BaseModel):
    """`mode: lora` trains only adapters on the modules whose HF path fullmatches one of `lora_targets`
    (regexes; a bare name like `q_proj` matches that module in every layer; the default is every
    projection: attention incl. MLA, dense MLP, shared and routed experts, never routers or the head).
    `method: sft` trains next-token cross entropy on the packed rows; `dpo` preference optimisation on
    the data's chosen / rejected pairs (`preference`: DPO or SimPO); `grpo` RL with verifiable rewards on
    the data's prompts (`grpo`: group size, checker, clip, KL); `distill` a smaller student (the base's layers
    `distill.student_layers`) on the base's top-k logits over its own answers (`distill`: DistillConfig).
    `indexer`: a DSA model's (DeepSeek-V3.2, GLM-5) lightning indexer, frozen (the default) or trained by its KL
    objective (IndexerConfig); the default `lora_targets` leave its projections out (models/lora_targets.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = "sft"  # a registered fine-tune method (tasks/training/methods.py): sft, dpo, grpo, distill
    # dpo / grpo: first this many SFT steps on the data's packed rows (the `train` settings, its steps replaced),
    # the usual SFT -> preference / RL chain; the reference (DPO's stored log-probabilities, GRPO's KL) is then
    # the SFT model
    sft_steps: int = Field(0, ge=0)
    # the SFT phase's settings where they differ from `train`'s (batch, learning rate, schedule: a partial
    # TrainConfig, e.g. {learning_rate: 0.002}); its steps are sft_steps, its mesh train's. RL wants a far
    # smaller learning rate than the SFT that precedes it.
    sft_train: dict[str, Any] | None = None
    preference: PreferenceConfig = PreferenceConfig()
    grpo: GRPOConfig = GRPOConfig()
    distill: DistillConfig = DistillConfig()
    mode: Literal["lora", "full"] = "lora"
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: tuple[str, ...] = ALL_LINEAR
    indexer: IndexerConfig = IndexerConfig()  # a DSA model's lightning indexer: frozen, or trained by its KL
    train: TrainConfig = TrainConfig(steps=150, learning_rate=2e-3, warmup_steps=10, checkpoint_every=50)

    @property
    def sft_config(self) -> TrainConfig:
        """The SFT phase's settings: `train`'s, with `sft_train`'s keys over them and `sft_steps` steps."""
        return TrainConfig.model_validate({**self.train.model_dump(), **(self.sft_train or {}),
                                           "steps": self.sft_steps or self.train.steps})

    @field_validator("method")
    @classmethod
    def _registered(cls, v: str) -> str:
        from tasks.training.methods import get

        get(v)  # an unknown method: ValueError listing the known ones
        return v

    @model_validator(mode="after")
    def _method_rules(self) -> FinetuneConfig:
        from tasks.training.methods import get, sft_first

        method = get(self.method)
        if self.sft_steps and not method.sft_first:
            raise ValueError(f"sft_steps precedes method {' or '.join(sft_first())}; for method {self.method} set "
                             "train.steps")
        if self.sft_train is not None:
            if not self.sft_steps:
                raise ValueError("sft_train sets the SFT phase, which runs only with sft_steps > 0")
            for key in ("mesh", "steps"):
                if key in self.sft_train:
                    raise ValueError(f"sft_train.{key}: the SFT phase takes " + ("train.mesh" if key == "mesh"
                                                                                    else "sft_steps"))
            try:  # every key a TrainConfig field, of the right type
                _ = self.sft_config
            except ValidationError as e:
                err = e.errors()[0]
                raise ValueError(f"sft_train.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        method.check(self)  # the method's own rules (GRPO's groups fill the batch, distill trains in full, ...)
        return self


class CalibrationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    samples: int = Field(64, ge=1)  # packed rows of the train split (capped at the rows there are)
    batch_size: int = Field(8, ge=1)
    min_tokens: int = Field(2048, ge=1)  # fewer real (non-padding) calibration tokens is an error
    seed: int = 0
    expert_chunk: int = Field(8, ge=1)  # MoE: experts whose Hessians are built and held at once (chunk x in² floats)


class QuantizeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schemes: tuple[str, ...] = ("int8", "w4a16-gptq")
    ignore: tuple[str, ...] = ()  # more modules left in float: HF names or "re:" regexes (lm_head always is)
    calibration: CalibrationConfig = CalibrationConfig()
    dampening_frac: float = Field(0.01, gt=0)  # GPTQ: added to H's diagonal, x mean(diag H)
    expert_min_tokens: int = Field(16, ge=0)  # an expert with fewer routed tokens uses its layer's pooled stats
    awq_grid: int = Field(20, ge=2)
    smoothquant_alpha: float = Field(0.5, ge=0, le=1)  # int8-w8a8's SmoothQuant migration strength
    rotate: Literal["hadamard", "hadamard-block"] | None = None  # fold rotations first (models/quant/rotation.py)

    @field_validator("schemes")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            parse_scheme(name)
        if len(set(v)) != len(v):
            raise ValueError(f"schemes {list(v)} repeat a scheme")
        return v

    # KV cache of every scheme: null (the serving dtype) or "fp8" (E4M3, static scales calibrated on the quantized
    # model; models/quant/kv_cache.py), one scale per attention layer ("tensor") or per KV head ("attn_head")
    kv_cache: str | None = None
    kv_cache_strategy: str = "tensor"

    @field_validator("kv_cache")
    @classmethod
    def _kv_cache(cls, v: str | None) -> str | None:
        if v not in (None, "fp8"):  # models/quant/kv_cache.py KV_CACHE_KINDS (not imported: no JAX in schemas)
            raise ValueError(f"kv_cache must be null (the serving dtype) or 'fp8' (E4M3 with calibrated static "
                             f"scales), got {v!r}")
        return v

    @field_validator("kv_cache_strategy")
    @classmethod
    def _kv_strategy(cls, v: str) -> str:
        if v not in ("tensor", "attn_head"):  # models/quant/kv_cache.py KV_STRATEGIES
            raise ValueError(f"kv_cache_strategy must be 'tensor' (one scale per layer) or 'attn_head' (one per KV "
                             f"head), got {v!r}")
        return v


class DraftCandidate(BaseModel):
    """One draft the `draft` stage trains; `evaluate` measures every candidate and the release ships the
    fastest that passes the draft gates (docs/speculative-decoding.md, which drafter is which)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # mtp: fine-tune the target's own MTP layers (DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5 targets), FastMTP-style
    kind: Literal[KINDS] = "eagle3"  # models/draft_format.py: the kinds, listed once
    name: str | None = None  # its folder and report name; None: the kind, plus "-<loss>" for a non-default loss
    # per-position objective (models/draft_losses.py): kl_div, rkl, jsd, ce, tv, nla, lk_hybrid, or {name: weight}
    loss: str | dict[str, float] = "kl_div"
    # the serving temperature the objective is computed at; None: the traces' (the temperature the target answered at)
    temperature: float | None = Field(None, ge=0)
    steps: int | None = Field(None, ge=1)  # its optimizer steps; None: draft.train.steps (a block drafter's step
    # is several times cheaper than EAGLE-3's unrolled one, so equal wall-clock budgets differ in steps)
    num_depths: int | None = Field(None, ge=1)  # peagle: parallel depths trained; mtp: recursive steps; None: k
    step_weight_beta: float = Field(0.6, gt=0, le=1)  # mtp: step k's loss weight ∝ beta^k (FastMTP)
    block_size: int | None = Field(None, ge=2)  # dflash: slots per block (anchor + drafts); None: k + 1
    num_layers: int = Field(1, ge=1)  # dflash: draft decoder layers
    num_anchors: int = Field(32, ge=1)  # dflash: blocks per row per training step
    gamma: float = Field(4.0, gt=0)  # dflash: slot j's loss weight exp(-(j - 1) / gamma)

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str | dict[str, float]) -> str | dict[str, float]:
        check_objective(v)
        return v

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        if self.loss == "kl_div":
            return self.kind
        loss = self.loss if isinstance(self.loss, str) else "+".join(f"{k}{v:g}" for k, v in self.loss.items())
        return f"{self.kind}-{loss}"


class DraftConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    candidates: list[DraftCandidate] = Field([DraftCandidate()], min_length=1)
    k: int = Field(5, ge=1)  # draft tokens per verify forward the export recommends to engines
    ttt_steps: int = Field(7, ge=1)  # training-time-test unroll length (EAGLE-3: 7)
    ttt_decay: float = Field(0.8, gt=0, le=1)  # step k's loss weight = decay^k
    draft_vocab_size: int = Field(32000, ge=1)  # capped at the target's vocabulary
    intermediate_size: int | None = Field(None, ge=1)  # None: Eagle3Config.for_target's default
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    target: str = "finetuned"  # the model the draft serves with: "finetuned" or a quantized scheme (`serve`)
    seed: int = 0
    train: TrainConfig = TrainConfig(steps=300, batch_size=16, learning_rate=3e-3, warmup_steps=20,
                                     checkpoint_every=100)
    # checkpoint selection by measured acceptance: every `select_every` steps (0: off, the last step is exported)
    # the draft decodes `select_prompts` held-out trace prompts through the real speculative engine at the
    # serving temperature, and the draft exported is the one with the highest τ
    select_every: int = Field(0, ge=0)
    select_prompts: int = Field(8, ge=1)
    select_prompt_len: int = Field(48, ge=2)
    select_max_new_tokens: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _candidates(self) -> DraftConfig:
        labels = [c.label for c in self.candidates]
        if len(set(labels)) != len(labels):
            raise ValueError(f"candidates: names must be unique, got {labels} (set `name` to tell them apart)")
        for c in self.candidates:  # each kind's own rule (P-EAGLE: num_depths >= k; DFlash: block_size >= k + 1)
            problem = draft_kind(c.kind).check(c, self.k)
            if problem is not None:
                raise ValueError(f"candidates[{c.label}]: {problem}")
        return self

    def train_for(self, cand: DraftCandidate) -> TrainConfig:
        """The optimisation settings of one candidate: `train`, with the candidate's own `steps` if set."""
        return self.train if cand.steps is None else self.train.model_copy(update={"steps": cand.steps})


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(16, ge=1)
    eval_batches: int = Field(16, ge=1)
    spec_prompts: int = Field(16, ge=1)
    spec_prompt_len: int = Field(48, ge=2)
    spec_max_new_tokens: int = Field(64, ge=1)
    spec_k: int = Field(5, ge=1)  # draft tokens per verify forward (chain)
    spec_batch_size: int = Field(1, ge=1)  # rows decoded together, by both the plain and the speculative decoder
    spec_temperatures: list[float] = Field([0.0, 1.0], min_length=1)
    # the temperature the release serves at: the draft shipped is the fastest (memory-bound speedup) there
    serve_temperature: float = Field(0.0, ge=0)
    drafts: list[str] | None = None  # measure only these draft candidates (by name); None: every one
    spec_tree: bool = True  # also measure EAGLE-2 dynamic-tree drafting (temperature 0, batch 1)
    tree_top_k: int = Field(4, ge=1)
    tree_depth: int = Field(5, ge=1)
    tree_tokens: int = Field(16, ge=1)
    spec_target: str = "finetuned"  # the model the draft serves with: "finetuned" or a quantized scheme
    # task accuracy: per registered checker, up to this many of the data's held-out prompts it judges (from the
    # train split, said so in the report, when none of the held-out ones); 0 turns task accuracy off
    task_prompts: int = Field(64, ge=0)
    task_max_new_tokens: int | None = Field(None, ge=1)  # a cap on each checker's own answer budget (None: none)
    task_batch_size: int = Field(32, ge=1)
    seed: int = 0
    gates: Gates = Gates()
    # The recipe's own gates when the command line loosened them (`--allow-weaker-gates`): the report says
    # whether the release also passed the gates as declared.
    declared_gates: Gates | None = None
    # Set by forgeline (tasks/recipe.py `load_release`), never by a recipe: every gate of the release held below
    # its built-in default by the recipe (with the recipe's reason) or below the recipe by `--set`, as
    # {gate, from, to, source, reason}; the report lists them and export records them in lineage.json.
    waivers: tuple[dict[str, Any], ...] = ()

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if any(t < 0 for t in self.spec_temperatures):
            raise ValueError("spec_temperatures must be >= 0")
        if self.serve_temperature not in self.spec_temperatures:
            raise ValueError(f"serve_temperature {self.serve_temperature:g} must be one of spec_temperatures "
                             f"{self.spec_temperatures} (the draft is chosen by its speedup there)")
        if self.spec_tree and self.spec_batch_size != 1:
            raise ValueError("spec_tree needs spec_batch_size 1 (tree drafting decodes one sequence)")
        return self


class ExportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    recipe: dict[str, Any]
    enforce_gates: bool = True


# -- validation: one line per error ----------------------------------------------------------------


M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema."""


def _one_line(e: ValidationError, source: str) -> ConfigError:
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return ConfigError(f"{source}: unknown key '{key}'")
    got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":  # a validator's own message says what was wrong; the input is the section
        got = ""
    return ConfigError(f"{source}: {key + ': ' if key else ''}{msg}{got}{more}")


def validate(cls: type[M], data: dict[str, Any], source: str) -> M:
    """`data` as a `cls`, or a ConfigError whose one line names the key and what is wrong (`source` first)."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise _one_line(e, source) from None



# -- every stage, declared once -------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """A stage's one declaration. Everything else about a stage derives from it: its section of
    `ReleaseConfig` (`section`) and of `ResourcesConfig` (`resources`), its command line (`python -m
    tasks.<module>`: a flag per input, tasks/cli.py), its registry entry (tasks/registry.py: fingerprint,
    commit protocol) and its `stage/<name>` deployment (infra/prefect.yaml, flows/deploy.py).

    `tasks/<module>.py` exposes `run(config, inputs, output, *, progress, context)`: the only way a stage
    runs, from the release flow, a worker, a gang member or its command line. Nothing here imports it
    (nor JAX): the module is imported when the stage first runs."""

    name: str  # the stage kind: the store folder `<store>/<name>/<fingerprint>/`
    module: str
    config: type[BaseModel]
    inputs: tuple[str, ...]  # required input artifacts, by the name `run` receives them under
    optional: tuple[str, ...] = ()
    trains: bool = False  # shows training progress; resumes from checkpoints (`--checkpoints`, `--store`)
    resources: StageResources = GPU  # what one run needs unless `resources.<name>` says otherwise
    section: str | None = None  # its `ReleaseConfig` section; None: the release builds its config itself
    default: BaseModel | None = None  # the section's default where it differs from `config()`
    summary: str = ""  # one line: its command's --help and its deployment's description
    flags: tuple[str, ...] = ()  # config keys its command line also takes as `--<key> VALUE`, verbatim

    def load(self) -> Any:
        return importlib.import_module(f"tasks.{self.module}")

    def parse(self, config: BaseModel | Mapping[str, Any]) -> BaseModel:
        """The typed config: validated once (a dict from a Prefect parameter), or passed through. Mappings
        are read in sorted key order, so a config that travelled through a server that reorders keys (a
        Prefect parameter stored as PostgreSQL JSONB) is the same object, and writes the same files
        (export's lineage.json), as the one that never left the process."""
        if isinstance(config, self.config):
            return config
        data = config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)
        return validate(self.config, _sorted(data), self.name)

    def check_inputs(self, inputs: Mapping[str, Any]) -> None:
        missing = [n for n in self.inputs if n not in inputs]
        unknown = [n for n in inputs if n not in self.inputs + self.optional]
        if missing or unknown:
            raise ValueError(f"stage {self.name}: inputs {sorted(inputs)} (missing {missing}, unknown {unknown}; "
                             f"takes {list(self.inputs)} and optionally {list(self.optional)})")


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("data_prep", "data_prep", DataPrepConfig, (), optional=("tokenizer",), resources=CPU, section="data",
          default=DataPrepConfig(corpus="builtin://python-stdlib-functions"),
          summary="Tokenize and pack a corpus into Parquet shards.", flags=("corpus",)),
    Stage("base", "base_model", BaseModelConfig, (), optional=("data",), trains=True, section="base",
          summary="Import base.url, or pretrain a base from scratch.", flags=("url",)),
    Stage("finetune", "finetune", FinetuneConfig, ("base", "data"), optional=("traces",), trains=True,
          section="finetune", summary="LoRA or full-parameter fine-tune."),
    Stage("quantize", "quantize", QuantizeConfig, ("model", "data"), section="quantize",
          summary="Calibrated quantization into compressed-tensors checkpoints."),
    Stage("traces", "traces", TracesConfig, ("model", "data"), section="traces",
          summary="The served model regenerates answers (the draft's training data)."),
    Stage("draft", "draft", DraftConfig, ("target", "traces"), optional=("init",), trains=True, section="draft",
          summary="Train the speculative-decoding draft candidates (EAGLE-3, P-EAGLE, DFlash, MTP)."),
    Stage("evaluate", "evaluate", EvalConfig, ("finetune", "data"), optional=("base", "draft", "quant"),
          section="evaluate", summary="Perplexity, quantization loss, speculative acceptance; the gates."),
    Stage("export", "export", ExportConfig, ("base", "data", "finetune", "traces", "draft", "quant", "evaluate"),
          resources=CPU, summary="Assemble the release bundle."),
)}


class _Resources(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def of(self, kind: str) -> StageResources:
        return getattr(self, kind)


# `resources.<stage>` for every stage (`Stage.resources` by default: data prep and export on CPU nodes, the
# rest on one GPU each).
ResourcesConfig = create_model("ResourcesConfig", __base__=_Resources,
                               **{s.name: (StageResources, s.resources) for s in STAGES.values()})


# -- the release: every stage's section, and what ties them together -----------------------------


class RefreshConfig(BaseModel):
    """The scheduled draft refresh: fresh prompts -> traces -> retrained draft -> promote if no worse."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: DataPrepConfig = DataPrepConfig(corpus="builtin://python-stdlib-functions")
    traces: TracesConfig = TracesConfig()
    draft: DraftConfig = DraftConfig()
    min_acceptance_ratio: float = 1.0  # promote only if new acceptance >= ratio * current
    # why a recipe sets the ratio below its default (required then; recorded as a waiver): {min_acceptance_ratio: ...}
    reasons: dict[str, str] = {}

    @field_validator("reasons")
    @classmethod
    def _reasons_name_gates(cls, v: dict[str, str]) -> dict[str, str]:
        for name, why in v.items():
            if name != "min_acceptance_ratio":
                raise ValueError(f"'{name}' is not a gate of the refresh (its gate: min_acceptance_ratio)")
            if not why.strip():
                raise ValueError(f"{name}: empty (say why the gate is lowered)")
        return v


class _Named(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "forgeline-tiny"


# The release's name, then a section per stage that has one (`Stage.section`, typed by `Stage.config`).
_StageSections = create_model("_StageSections", __base__=_Named, **{
    s.section: (s.config, s.default if s.default is not None else s.config())
    for s in STAGES.values() if s.section is not None})


class ReleaseConfig(_StageSections):
    """A whole release: every stage's section (from `STAGES`), the draft refresh, which model is served,
    and where the stages run."""

    refresh: RefreshConfig = RefreshConfig()
    # The model the release serves and the draft is trained and measured against: the fine-tuned
    # weights or one of `quantize.schemes` (a quantized target shifts the distribution the draft must match).
    serve: str = "finetuned"
    # Where the stages run (not part of any fingerprint: a stage committed by one mode is reused by the other).
    execution: ExecutionConfig = ExecutionConfig()
    resources: ResourcesConfig = ResourcesConfig()

    @field_validator("execution", mode="before")
    @classmethod
    def _execution_mode(cls, v: Any) -> Any:
        return {"mode": v} if isinstance(v, str) else v  # `execution: workers` is short for `execution.mode`
    # Gates held weaker than their built-in defaults by the recipe (source: its file, with its reason) or than
    # the recipe by `--set` (`load_release(..., allow_weaker_gates=True)`; source: "--set"); set by forgeline,
    # never by a recipe: {gate, from, to, source, reason} each.
    waivers: tuple[dict[str, Any], ...] = ()

    @model_validator(mode="after")
    def _serve_known(self) -> ReleaseConfig:
        if self.serve != "finetuned" and self.serve not in self.quantize.schemes:
            raise ValueError(f"serve {self.serve!r} is neither 'finetuned' nor one of quantize.schemes "
                             f"{list(self.quantize.schemes)}")
        if not self.evaluate.gates.enabled(self.quantize.schemes):
            raise ValueError("evaluate.gates: no gate is enabled, so nothing would stand between a release and its "
                             "users (enable finetune_improves, speculative_lossless, min_acceptance_length > 0 or "
                             "ship a quantize scheme)")
        return self

    def recorded(self) -> dict[str, Any]:
        """The recipe as the bundle records it (export's config, hence its fingerprint): everything that
        decides what the release computes, without the execution settings that only decide where."""
        return self.model_dump(mode="json", exclude={"execution", "resources"})

    def refresh_ratio_declared(self) -> float:
        """The draft refresh's promotion threshold as the recipe declares it (a `--set` waiver may lower the one in
        force; the recipe's own, reasoned, is the declared one)."""
        for w in self.waivers:
            if w["gate"] == "refresh.min_acceptance_ratio" and w["source"] == "--set":
                return float(w["from"])
        return self.refresh.min_acceptance_ratio

    def served_model(self, finetuned: T, quantized: T) -> T:
        """Whichever of the two the release serves (`serve`): the fine-tuned weights, or the quantize
        artifact that holds the scheme `serve` names."""
        return finetuned if self.serve == "finetuned" else quantized

    def served(self, section: str) -> BaseModel:
        """A stage's config with its served-model field set from `serve`."""
        field = {"traces": "target", "draft": "target", "evaluate": "spec_target"}[section]
        return getattr(self, section).model_copy(update={field: self.serve})
