"""Resumable training checkpoints: orbax on local disk, uploaded to the store, committed by one pointer."""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

import storage
from storage import Store

if TYPE_CHECKING:
    from tasks.stage import StageContext

log = logging.getLogger("forgeline.train")


class Checkpoints:
    """Orbax checkpoints saved asynchronously to local disk, then uploaded to
    `<store>/checkpoints/<name>/<step>/`, then committed by rewriting `latest.json` (one object).
    Orbax cannot write s3:// itself (docs/orchestration.md, training checkpoints), and S3 has no atomic rename, hence
    this order; a kill at any moment leaves either the previous or the new checkpoint committed.
    The last `keep` checkpoints are kept, locally and in the store. Multi-host: every process saves
    its shards into `local_dir`, which must be one folder shared by all hosts (orbax's requirement:
    NFS/Lustre/Filestore); orbax commits once all processes have written, then process 0 uploads."""

    def __init__(self, local_dir: Path, store: Store | None, name: str, keep: int = 2):
        self.local_dir = Path(local_dir)
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.remote = store.url(f"checkpoints/{name}") if store is not None else None
        self.keep = keep
        self.manager = ocp.CheckpointManager(
            self.local_dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                 enable_async_checkpointing=True)
        )
        self._uploader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._pending: concurrent.futures.Future | None = None
        self._committed: list[int] = []

    @classmethod
    def for_stage(cls, context: StageContext, keep: int, sub: str | None = None) -> Checkpoints:
        """A stage run's checkpoints: local under its `checkpoint_dir`, uploaded under its checkpoint URL in
        the store, resumed from there by a rerun of the same fingerprint. `sub` separates the models of a
        stage that trains several (the draft stage's candidates)."""
        name = f"{context.kind}/{context.fingerprint}" + (f"/{sub}" if sub else "")
        local = context.checkpoint_dir / sub if sub else context.checkpoint_dir
        return cls(local, context.store, name, keep=keep)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start saving `state` as `step`; returns once the arrays are copied off the devices."""
        self._raise_pending()
        self.manager.save(step, args=ocp.args.StandardSave(state))
        if self.remote is not None and jax.process_index() == 0:
            # in the caller's context: its log line goes to the Prefect run that trains (a thread without it
            # made Prefect print a UserWarning on the user's terminal at every first commit of a stage)
            self._pending = self._uploader.submit(contextvars.copy_context().run, self._upload, step)

    def _upload(self, step: int) -> None:
        self.manager.wait_until_finished()
        storage.upload_dir(self.local_dir / str(step), storage.join(self.remote, str(step)))
        storage.write_bytes(storage.join(self.remote, "latest.json"), json.dumps({"step": step}).encode())
        log.info("checkpoint step %d committed to %s", step, self.remote)
        self._committed.append(step)
        for old in self._committed[:-self.keep]:
            storage.rm(storage.join(self.remote, str(old)))
        self._committed = self._committed[-self.keep:]

    def _raise_pending(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises an upload error here, in the training thread
            self._pending = None

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self._raise_pending()

    def restore_latest(self, target: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest committed checkpoint, local or remote; None when there is none."""
        local_step = self.manager.latest_step()
        remote_step = None
        if self.remote is not None:
            try:
                remote_step = json.loads(storage.read_bytes(storage.join(self.remote, "latest.json")))["step"]
            except FileNotFoundError:
                pass
        if remote_step is not None and (local_step is None or remote_step > local_step):
            if jax.process_index() == 0:
                dest = self.local_dir / str(remote_step)
                shutil.rmtree(dest, ignore_errors=True)
                storage.download_dir(storage.join(self.remote, str(remote_step)), dest)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("forgeline-checkpoint-download")
            self.manager.reload()
            local_step = remote_step
        if local_step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return local_step, self.manager.restore(local_step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._uploader.shutdown(wait=True)
            self.manager.close()
