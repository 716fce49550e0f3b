"""`finetune.method: grpo`: RL with verifiable rewards on the data's prompts, completions scored by the checker
`finetune.grpo.checker` (tasks/checkers/), GRPO's objective and loop (tasks/training/grpo.py), as TRL's
GRPOTrainer (https://huggingface.co/docs/trl/grpo_trainer) takes reward functions. Writes `rl.json`: the held-out
accuracy at the start of RL and at its end, which evaluate reports and gates."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from tasks.training.methods import Method, register

if TYPE_CHECKING:
    from tasks.methods.run import Run

log = logging.getLogger("forgeline.finetune")


@register
class GRPO(Method):
    name = "grpo"
    sft_first = True

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.train.batch_size % cfg.grpo.group_size:
            raise ValueError(f"train.batch_size {cfg.train.batch_size} (completions per step) is not a multiple of "
                             f"grpo.group_size {cfg.grpo.group_size}")
        mu = cfg.grpo.num_iterations
        if mu > 1:
            for key in ("steps", "checkpoint_every"):
                if getattr(cfg.train, key) % mu:
                    raise ValueError(f"train.{key} {getattr(cfg.train, key)} is not a multiple of "
                                     f"grpo.num_iterations {mu} (updates per rollout)")

    @classmethod
    def record(cls, cfg) -> dict[str, Any]:
        return {"checker": cfg.grpo.checker}

    def __init__(self, run: Run) -> None:
        """The data: (train prompts, held-out prompts, the checker's score, decode) and eos/pad as `fit_grpo`
        takes them. The checker must judge every held-out prompt (an error naming the checker and the data
        otherwise); train prompts it does not judge are dropped."""
        from tokenizers import Tokenizer

        from tasks import checkers
        from tasks.training import grpo

        super().__init__(run)
        g, data_dir = run.cfg.grpo, run.data_dir
        tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
        special = json.loads((data_dir / "special_tokens.json").read_text())

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True)

        heldout = grpo.heldout_prompts(data_dir, g.eval_prompts)
        checker = checkers.get(g.checker)
        judged = [t for t in heldout.text if checker.applies(t)]
        if not heldout or len(judged) < len(heldout):
            raise ValueError(f"finetune.grpo.checker: {g.checker!r} judges {len(judged)} of the {len(heldout)} "
                             f"held-out prompts of {data_dir} ({checker.description}); pick a checker for this data")
        train = grpo.train_prompts(data_dir, decode, special["bos"])
        keep = [i for i, t in enumerate(train.text) if checker.applies(t)]
        train = grpo.PromptSet([train.ids[i] for i in keep], [train.text[i] for i in keep])
        if not len(train):
            raise ValueError(f"finetune.grpo: no train prompt of {data_dir} is one {g.checker!r} judges")
        log.info("finetune[grpo]: %d train prompts, %d held-out, checker %s, %d completions per step in groups of "
                 "%d", len(train), len(heldout), g.checker, run.cfg.train.batch_size, g.group_size)
        self.data = (train, heldout, checker.score, decode, special["eos"], special["pad"])

    def trainer(self, model, trainable):
        from tasks.training import grpo

        g = self.run.cfg.grpo
        return self.run.trainer(model, trainable,
                                loss_fn=grpo.grpo_objective(clip_eps=g.clip_eps, beta=g.beta, loss_agg=g.loss_agg,
                                                            temperature=g.temperature, width=g.max_new_tokens),
                                count_fn=grpo.grpo_count(g.loss_agg))

    def fit(self, trainer):
        from tasks.training import grpo

        run = self.run
        # the KL reference: the model RL starts from (the SFT model, or the base; LoRA: its adapters as they
        # start, the base weights shared with the trainer)
        reference = trainer.snapshot() if run.cfg.grpo.needs_reference else None
        metrics = grpo.fit_grpo(trainer, reference, run.cfg.grpo, *self.data, checkpoints=run.checkpoints,
                                progress=run.progress, logdir=run.out_dir / "tensorboard",
                                label=f"finetune[grpo,{run.cfg.mode}]")
        return metrics, {}

    def write(self, result):
        # what evaluate reports and gates: deterministic, so hashed with the model
        cfg = self.run.cfg
        rl = {"checker": cfg.grpo.checker, "steps": result["steps"], "sft_steps": cfg.sft_steps,
              "accuracy_before": result["accuracy_before"], "accuracy_after": result["accuracy_after"]}
        (self.run.out_dir / "rl.json").write_text(json.dumps(rl, indent=1, sort_keys=True) + "\n")
