"""The one way a stage runs: fingerprint -> skip if committed -> fetch inputs -> compute locally ->
commit (files first, manifest last).

Pipeline steps are plain functions at hashed paths, as in marin: a stage's output address is the
fingerprint of (stage kind, canonical config, code version, input manifest digests), so a re-run of
a release finds every finished stage already committed and skips it, and a failed stage leaves no
manifest behind, so nothing half-written is visible to readers.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import storage
from storage import ArtifactRef, Store, fingerprint

log = logging.getLogger("forgeline.stage")



@dataclass(frozen=True)
class StageContext:
    """What a stage's compute function sees: where to write, its inputs as local folders, and the
    store and fingerprint (for side state such as resumable training checkpoints)."""

    kind: str
    fingerprint: str
    out_dir: Path
    inputs: dict[str, Path]
    refs: dict[str, ArtifactRef]
    store: Store


Compute = Callable[[StageContext], dict[str, Any]]


def config_dict(config: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    return config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)


def stage_fingerprint(kind: str, config: BaseModel | Mapping[str, Any], inputs: Mapping[str, ArtifactRef]) -> str:
    return fingerprint(kind, config_dict(config), inputs.values())


def work_root() -> Path:
    """Local scratch space for staging outputs and training checkpoints."""
    root = Path(os.environ.get("FORGELINE_WORKDIR", Path(tempfile.gettempdir()) / "forgeline-work"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def run_stage(
    store: Store,
    kind: str,
    config: BaseModel | Mapping[str, Any],
    inputs: Mapping[str, ArtifactRef],
    compute: Compute,
    *,
    force: bool = False,
) -> ArtifactRef:
    """Run `compute(ctx) -> metadata` unless `<kind>/<fingerprint>` is already committed."""
    fp = stage_fingerprint(kind, config, inputs)
    if not force and (done := store.lookup(kind, fp)) is not None:
        log.info("%s: already committed at %s, skipping", kind, done.url)
        return done
    local_inputs = {name: store.fetch(ref) for name, ref in inputs.items()}
    staging = Path(tempfile.mkdtemp(prefix=f"{kind}-{fp[:8]}-", dir=work_root()))
    try:
        t0 = time.perf_counter()
        log.info("%s: computing %s", kind, fp)
        ctx = StageContext(kind, fp, staging, local_inputs, dict(inputs), store)
        metadata = compute(ctx) or {}
        metadata = {**metadata, "seconds": round(time.perf_counter() - t0, 2)}
        ref = store.commit(staging, kind, fp, config=config_dict(config), inputs=inputs.values(), metadata=metadata)
        # The committed artifact supersedes the stage's resumable side state (training checkpoints,
        # finished trace shards): without this, offline hidden states would sit in the store twice.
        storage.rm(store.url(f"checkpoints/{kind}/{fp}"))
        log.info("%s: committed %s in %.1fs", kind, ref.url, metadata["seconds"])
        return ref
    finally:
        shutil.rmtree(staging, ignore_errors=True)
