"""`finetune.method: distill`: a student of fewer layers (the base's `distill.student_layers`) trained on the
base's (the teacher's) answers and top-k logits from the `traces` input (tasks/training/distill.py: Hinton et
al. 2015, https://arxiv.org/abs/1503.02531), then measured beside the teacher, the pruned start and, with
`compare_sft`, the same student after as many steps of plain SFT. Writes `distill.json`, the comparison
evaluate reports."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from tasks.training.methods import Method, register

if TYPE_CHECKING:
    from tasks.methods.run import Run

log = logging.getLogger("forgeline.finetune")


@register
class Distill(Method):
    name = "distill"
    inputs = ("traces",)

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.mode == "lora":
            raise ValueError("method distill trains a depth-pruned student whole: mode full (LoRA adapters would "
                             "have no published base to load onto)")

    @classmethod
    def trains_twice(cls, cfg) -> bool:
        return cfg.distill.compare_sft  # the SFT student

    def __init__(self, run: Run) -> None:
        """The teacher's traces with top-k logits (an error naming what is missing) and the student's layers."""
        import models
        from tasks.training import distill

        super().__init__(run)
        traces_dir = run.inputs.get("traces")
        if traces_dir is None:
            raise ValueError("finetune.method: distill needs the teacher's traces with top-k logits (input `traces`: "
                             "the release runs traces on the base with finetune.distill.traces; `--traces DIR` by "
                             "hand)")
        meta = traces_dir / "traces.json"
        if not meta.exists() or not json.loads(meta.read_text()).get("top_k_logits"):
            raise ValueError(f"finetune.method: distill: {traces_dir} holds no top-k logits (traces.json "
                             "top_k_logits; run traces with top_k_logits > 0)")
        self.traces_dir = traces_dir
        teacher_layers = int(models.load_config(str(run.base_dir))["num_hidden_layers"])
        self.student = distill.student_layers(run.cfg.distill.student_layers, teacher_layers)
        log.info("finetune[distill]: student = layers %s of the teacher's %d", list(self.student), teacher_layers)

    @property
    def layers(self) -> tuple[int, ...]:
        return self.student

    def trainer(self, model, trainable):
        from tasks.training import distill

        d = self.run.cfg.distill
        return self.run.trainer(model, trainable, loss_fn=distill.distill_objective(d.temperature, d.alpha),
                                eval_fn=distill.distill_eval(d.temperature, d.alpha))

    def fit(self, trainer):
        from tasks.training import distill

        metrics = self.run.fit(trainer, self.traces_dir, label="finetune[distill]", loader=distill.TopkBatches)
        return metrics, self._report(trainer)

    def write(self, result):
        # what evaluate reports: teacher vs student vs the SFT student
        (self.run.out_dir / "distill.json").write_text(json.dumps(result["distill"], indent=1, sort_keys=True) + "\n")

    def _report(self, trainer) -> dict[str, Any]:
        """Teacher, the pruned student before training, the distilled student and (`compare_sft`) the same
        student trained as long with plain SFT on the data's rows, side by side on held-out data: the data's
        answers (cross entropy), the teacher's held-out answers (KL to its top-k, agreement with its top-1) and,
        with a `checker`, pass@1 at T = 0 on held-out prompts."""
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from tokenizers import Tokenizer

        import models
        from tasks import checkers
        from tasks.training import distill, grpo
        from tasks.training.trainer import mesh_rules

        run = self.run
        d, t, data_dir, layers = run.cfg.distill, run.cfg.train, run.data_dir, self.student
        rules = mesh_rules(t.mesh)
        if d.checker:
            tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
            special = json.loads((data_dir / "special_tokens.json").read_text())
            checker = checkers.get(d.checker)
            heldout = grpo.heldout_prompts(data_dir, d.eval_prompts)
            keep = [i for i, text in enumerate(heldout.text) if checker.applies(text)]
            if not keep:
                raise ValueError(f"finetune.distill.checker: {d.checker!r} judges none of the held-out prompts of "
                                 f"{data_dir}")
            heldout = grpo.PromptSet([heldout.ids[i] for i in keep], [heldout.text[i] for i in keep])
        rows: dict[str, dict[str, Any]] = {}

        def measure(name: str, model: nnx.Module) -> None:
            row: dict[str, Any] = {
                "layers": int(model.config.num_hidden_layers),
                "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
                "data_loss": distill.data_loss(model, data_dir, trainer.put, batch_size=t.batch_size,
                                               max_batches=t.eval_batches)}
            if name != "teacher":  # the teacher against its own top-k says nothing
                row |= distill.teacher_match(model, self.traces_dir, trainer.put, batch_size=t.batch_size,
                                             max_batches=t.eval_batches)  # at T = 1: the distribution served
            if d.checker:
                row["accuracy_t0"] = grpo.accuracy(
                    model, heldout, checker.score, lambda ids: tok.decode(ids, skip_special_tokens=True),
                    temperature=0.0, max_new_tokens=d.max_new_tokens, eos=special["eos"], pad=special["pad"],
                    prompt_len=max(len(p) for p in heldout.ids), batch_size=min(64, len(heldout)))
            rows[name] = {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}
            log.info("finetune[distill]: %s %s", name, json.dumps(rows[name]))

        # one model loaded at a time beside the student; the pruned start, once measured, is the SFT student's start
        def load(**kw: Any) -> nnx.Module:
            return models.from_pretrained(str(run.base_dir), dtype=jnp.float32, mesh=run.mesh, rules=rules, **kw)

        measure("teacher", load())
        pruned = load(layers=layers)
        measure("pruned", pruned)
        measure("student", trainer.model())
        extra: dict[str, Any] = {}
        if d.compare_sft:
            student, extra["sft"] = run.sft(pruned, t, nnx.Param, label="finetune[distill: SFT student]")
            measure("sft_student", student)
        extra["distill"] = {"teacher_layers": rows["teacher"]["layers"], "student_layers": list(layers),
                            "temperature": d.temperature, "alpha": d.alpha, "steps": t.steps, "checker": d.checker,
                            "prompts": len(heldout) if d.checker else 0, "models": rows}
        return extra
