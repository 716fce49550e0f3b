"""Fine-tune methods are registered objects (tasks/training/methods.py, the built-in ones in tasks/methods/): a
method defined here, in the test, and registered with `@register` is a `finetune.method` the config accepts,
whose rules the config applies, and which tasks.finetune runs end to end with the method's own objective,
record and files, with no other file changed (docs/post-training.md, "Adding a fine-tune method", names these
steps)."""

from __future__ import annotations

import json
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

pytestmark = pytest.mark.unit


def _row_count(batch: dict[str, Any]) -> Any:
    """Rows holding at least one loss position: the toy divides its loss by these, not by target tokens."""
    return (batch["loss_mask"].sum(-1) > 0).astype(jnp.float32).sum()


@pytest.fixture
def toy_method():
    """`method: toy`: next-token cross entropy summed per row (not per token), reporting the answer tokens per
    row as a metric, full fine-tuning only, and a `toy.json` beside the model."""
    from tasks.training import methods
    from tasks.training.losses import xent_sum_and_aux

    @methods.register
    class Toy(methods.Method):
        name = "toy"

        @classmethod
        def check(cls, cfg):
            if cfg.mode != "full":
                raise ValueError("method toy trains in full: mode full")

        @classmethod
        def record(cls, cfg):
            return {"rows_per_step": cfg.train.batch_size}

        def trainer(self, model, trainable):
            def loss_fn(model, batch):
                ce_sum, aux = xent_sum_and_aux(model, batch)
                return ce_sum, aux, {"tokens_per_row": batch["loss_mask"].astype(jnp.float32).sum()}

            return self.run.trainer(model, trainable, loss_fn=loss_fn, count_fn=_row_count)

        def write(self, result):
            toy = {"first_loss": result["first_train_loss"], "steps": result["steps"]}
            (self.run.out_dir / "toy.json").write_text(json.dumps(toy) + "\n")

    yield Toy
    del methods.METHODS["toy"]


def test_method_code_is_the_fine_tunes_alone():
    """The config checks a method by name in a registry that imports no method: the methods' training code is
    in the fine-tune's code version (tasks/code.py) and in no other stage's, which all import the config."""
    from tasks.code import closure

    for module in ("tasks.methods.dpo", "tasks.methods.grpo", "tasks.training.preference", "tasks.training.grpo"):
        assert module in closure("tasks.finetune")
        assert module not in closure("tasks.quantize") and module not in closure("tasks.data_prep")
    assert "tasks.training.methods" in closure("tasks.data_prep")  # through tasks.configs


def test_an_unregistered_method_is_a_config_error():
    from tasks.configs import FinetuneConfig

    known = r"unknown fine-tune method 'toy' \(known: distill, dpo, grpo, sft"
    with pytest.raises(ValidationError, match=rf"method\n.*{known}"):
        FinetuneConfig(method="toy")


def test_a_method_registered_in_a_test_runs_through_finetune(toy_method, tiny_base, tmp_path):
    from flax import nnx

    import models
    from tasks.configs import FinetuneConfig
    from tasks.finetune import finetune
    from tasks.training.config import TrainConfig
    from tasks.training.data import PackedBatches
    from tasks.training.losses import xent_sum

    with pytest.raises(ValidationError, match="method toy trains in full"):  # the method's rule, in the config
        FinetuneConfig(method="toy")
    with pytest.raises(ValidationError, match="sft_steps precedes method dpo or grpo; for method toy"):
        FinetuneConfig(method="toy", mode="full", sft_steps=2)

    base, data = tiny_base
    train = TrainConfig(steps=2, batch_size=4, log_every=1, eval_batches=1, warmup_steps=1)
    out = finetune(FinetuneConfig(method="toy", mode="full", train=train), base, data, tmp_path / "out")

    # the first step's loss and metric are the toy's: the base's cross entropy summed over the batch's answer
    # tokens, divided by its rows, and the answer tokens per row, recomputed here from the same batch
    batch = {k: jnp.asarray(v) for k, v in PackedBatches(data, "train", 4, seed=train.seed).batch(0).items()}
    model = models.from_pretrained(str(base), dtype=jnp.float32)
    ce_sum, tokens = nnx.jit(xent_sum)(model, batch)
    rows = float(_row_count(batch))
    assert 0 < rows <= 4
    np.testing.assert_allclose(out["first_train_loss"], float(ce_sum) / rows, rtol=1e-4)
    assert out["train_metrics"]["tokens_per_row"][0] == [1, pytest.approx(float(tokens) / rows, rel=1e-6)]
    assert float(ce_sum) / rows > 1.5 * float(ce_sum) / float(tokens)  # per row is not per token here

    record = json.loads((tmp_path / "out" / "training.json").read_text())
    assert record["method"] == "toy" and record["rows_per_step"] == 4 and len(record["train_losses"]) == 2
    assert json.loads((tmp_path / "out" / "toy.json").read_text()) == {"first_loss": out["first_train_loss"],
                                                                     "steps": 2}
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "curves.png").is_file() and not (tmp_path / "out" / "adapter").exists()
