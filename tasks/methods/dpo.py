"""`finetune.method: dpo`: preference optimisation on the data's chosen / rejected pairs, DPO against the
starting model's stored log-probabilities or the reference-free SimPO (`finetune.preference.loss`; the losses
and the held-out measurements are tasks/training/preference.py's), as TRL's DPOTrainer
(https://huggingface.co/docs/trl/dpo_trainer) trains and reports them."""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from tasks.training.methods import Method, register

if TYPE_CHECKING:
    from tasks.methods.run import Run

log = logging.getLogger("forgeline.finetune")


@register
class DPO(Method):
    name = "dpo"
    sft_first = True

    def __init__(self, run: Run) -> None:
        """The pair loader and the loss's settings; a data folder without preference pairs is an error naming
        it."""
        from tasks.training import preference as pm

        super().__init__(run)
        for split in ("train", "valid"):
            if pm.count_pairs(run.data_dir, split) == 0:
                raise ValueError(f"finetune.method: dpo needs preference pairs, and {run.data_dir} has no {split} "
                                 f"pairs (pairs-{split}-*.parquet: data_prep writes them for a corpus of "
                                 "chosen/rejected records, e.g. builtin://python-stdlib-preferences)")
        p = run.cfg.preference
        self.settings = {"loss": p.loss, "beta": p.effective_beta, "gamma": p.gamma}
        self.loader: Any = pm.PairBatches

    def trainer(self, model, trainable):
        from tasks.training import preference as pm

        p = self.run.cfg.preference
        objective = pm.preference_objective(p.loss, p.effective_beta, p.label_smoothing, p.gamma)
        return self.run.trainer(model, trainable, loss_fn=objective, eval_fn=pm.preference_eval(objective),
                                count_fn=pm.pair_count)

    def fit(self, trainer):
        from tasks.training import preference as pm

        run, cfg = self.run, self.run.cfg
        extra = self._before(trainer)
        metrics = run.fit(trainer, run.data_dir, label=f"finetune[{cfg.method},{cfg.mode}]", loader=self.loader)
        valid = self.loader(run.data_dir, "valid", cfg.preference.eval_batch_size, shuffle=False)
        extra["preference_after"] = pm.preference_metrics(trainer.model(), valid, trainer.put, **self.settings)
        log.info("finetune[dpo]: held-out %s", json.dumps(extra["preference_after"]))
        return metrics, extra

    def _before(self, trainer) -> dict[str, Any]:
        """DPO: the starting model's log-probabilities of every pair, written once under `out_dir/reference/`
        (the model before any step: the base, or the base with its zero-initialised LoRA adapters, i.e. with
        them off), and the held-out preference numbers before training."""
        from tasks.training import preference as pm

        run, extra = self.run, {}
        eval_batch_size = run.cfg.preference.eval_batch_size
        start = trainer.model()
        if self.settings["loss"] == "dpo":
            t = time.perf_counter()
            ref = pm.write_reference(start, run.data_dir, run.out_dir / "reference", trainer.put, eval_batch_size)
            extra["reference"] = {**ref, "seconds": round(time.perf_counter() - t, 2)}
            log.info("finetune[dpo]: reference log-probabilities of %d pairs in %.1fs", ref["pairs"],
                     extra["reference"]["seconds"])
            self.loader = functools.partial(pm.PairBatches, reference_dir=run.out_dir / "reference")
        valid = self.loader(run.data_dir, "valid", eval_batch_size, shuffle=False)
        extra["preference_before"] = pm.preference_metrics(start, valid, trainer.put, **self.settings)
        log.info("finetune[dpo]: held-out before training %s", json.dumps(extra["preference_before"]))
        return extra
