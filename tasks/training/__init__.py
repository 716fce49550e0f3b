"""The training package every training stage shares (base pretraining, fine-tuning, draft training).

    data (packed Parquet rows) -> global batch sharded over the mesh (each process reads only its rows)
    -> one compiled step (masked next-token cross entropy + optional MoE load-balancing loss,
    gradient accumulation, global-norm clipping, AdamW or Muon, donated buffers)
    -> orbax checkpoints (async, local, then uploaded to the store, then a `latest.json` pointer)
    -> resume from the newest committed checkpoint, bit-identical to a run that never stopped.

Parallelism is a mesh chosen in the recipe (`train.mesh`: data, fsdp, tensor, expert) plus the one
logical-axis rule table in models/sharding.py: parameters, gradients and optimizer state are placed
by their logical axes (FSDP = ZeRO-3: all three sharded over "fsdp"), the batch over (data, fsdp,
expert). The same code runs multi-host after `jax.distributed.initialize` (tasks/training/distributed.py).

Only the parameters selected by `trainable` (all `nnx.Param` for full fine-tuning, `nnx.LoRAParam`
for LoRA) are differentiated, updated and checkpointed; `nnx.RngState` (LoRA dropout) is threaded
through the step and checkpointed; the rest of the model (e.g. the frozen MoE router correction
bias, a `Buffer`) is a constant input. Batches are a pure function of the step number, so the step
is the data position.

Mixed precision (`compute_dtype: bfloat16`) keeps fp32 master weights and optimizer state and runs
the matmuls in bf16 (models.decoder.set_compute_dtype); `remat` recomputes each decoder layer in
the backward pass (models.decoder.REMAT_POLICIES).

Modules, in the order a step meets them:

    config.py        TrainConfig, MeshConfig, IndexerConfig (pydantic only: validated without importing JAX)
    data.py          PackedBatches: deterministic, per-process batches over packed Parquet rows
    losses.py        next-token cross entropy (+ the sown auxiliary losses: MoE balance, DSA indexer KL); LossFn
    indexer.py       a DSA model's indexer in fine-tuning: frozen, or trained by its KL (what trains)
    optimizers.py    the learning-rate schedule, AdamW and Muon, their masks
    trainer.py       Trainer: the mesh, the compiled train/eval steps, the split model state
    checkpoints.py   Checkpoints: orbax locally, uploaded to the store, committed by one pointer
    loop.py          fit(): the loop (resume, log, checkpoint, NaN checks) and its metrics
    methods.py       the fine-tune method registry (`finetune.method`; the methods: tasks/methods/)
    flops.py         model FLOPs per token (PaLM appendix B) and the measured matmul peak, for MFU
    tensorboard.py   TensorBoard event files written without TensorFlow
    progress.py      the terminal progress bar and per-step metrics
    distributed.py   multi-host `jax.distributed` initialisation from the environment

This file imports nothing, so `tasks.training.config` stays free of JAX.
"""
