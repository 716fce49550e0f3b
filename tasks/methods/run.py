"""One fine-tune as its method sees it (`Run`): the config, the local folders, the mesh, where training
checkpoints and reports progress, and the three ways a method trains on them (a Trainer on the run's mesh,
the training loop with the run's checkpoints, and a plain SFT run checkpointed apart). tasks/finetune.py makes
one per run and hands it to the method (tasks/training/methods.py: `Method`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from tasks.configs import FinetuneConfig
from tasks.training.checkpoints import Checkpoints
from tasks.training.config import Progress, TrainConfig
from tasks.training.loop import fit
from tasks.training.trainer import Trainer

# what the result keeps of an SFT run (the SFT phase, distill's SFT student)
SFT_SUMMARY = ("steps", "valid_loss_before", "valid_loss_after", "final_train_loss", "train_losses")


@dataclass(frozen=True)
class Run:
    """`inputs` holds the further stage inputs given (`traces`); `sft_checkpoints` a second training's (the
    SFT phase, distill's SFT student)."""

    cfg: FinetuneConfig
    base_dir: Path
    data_dir: Path
    out_dir: Path
    mesh: Mesh
    inputs: Mapping[str, Path] = field(default_factory=dict)
    checkpoints: Checkpoints | None = None
    sft_checkpoints: Checkpoints | None = None
    progress: Progress | None = None

    def trainer(self, model: nnx.Module, trainable: Any, **objective: Any) -> Trainer:
        """A Trainer on this run's mesh with `train`'s settings and the DSA indexer's treatment (`indexer`);
        `objective`: its loss_fn / eval_fn / count_fn."""
        return Trainer(model, self.cfg.train, trainable=trainable, mesh=self.mesh, indexer=self.cfg.indexer,
                       **objective)

    def fit(self, trainer: Trainer, data_dir: Path, *, label: str, **kwargs: Any) -> dict[str, Any]:
        """`tasks.training.loop.fit` with this run's checkpoints, progress and TensorBoard folder (`kwargs`:
        its `loader`)."""
        return fit(trainer, data_dir, checkpoints=self.checkpoints, progress=self.progress, label=label,
                   logdir=self.out_dir / "tensorboard", **kwargs)

    def sft(self, model: nnx.Module, cfg: TrainConfig, trainable: Any, *,
            label: str) -> tuple[nnx.Module, dict[str, Any]]:
        """Plain SFT of `model` on the data's packed rows with `cfg`, checkpointed apart (`sft_checkpoints`,
        TensorBoard under `sft/`): (the trained model, its summary, `SFT_SUMMARY`)."""
        sft = Trainer(model, cfg, trainable=trainable, mesh=self.mesh, indexer=self.cfg.indexer)
        m = fit(sft, self.data_dir, checkpoints=self.sft_checkpoints, progress=self.progress, label=label,
                logdir=self.out_dir / "tensorboard" / "sft")
        return sft.model(), {k: m[k] for k in SFT_SUMMARY}
