"""One process of a multi-host stage: `python -m tasks.member SPEC.json`, started N times by a gang launcher.

A stage with `resources.<stage>.hosts = N > 1` runs as one JAX job of N processes (flows/gang.py starts
them; on Kubernetes an indexed Job or JobSet does). Every process runs the same registered stage on the
same inputs: it joins the job from the standard variables (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`; tasks/training/distributed.py), so the trainer's mesh spans every process's devices,
and process 0 writes the outputs. The launcher, which holds the stage's lease, commits them.

The spec (JSON, written by the launcher; never a pickle):

    {"kind": "finetune", "config": {...}, "fingerprint": "...", "store": "s3://...",
     "inputs": {"base": "/local/folder", ...}, "refs": {"base": {ArtifactRef}, ...},
     "out": "/local/staging/folder", "stats": "/local/stats.json"}

Process 0 writes the stage's metadata to `stats` and prints its training progress as `@progress {json}`
lines, which the launcher turns into the stage's progress in the UI; every other process writes into a
scratch folder of its own. A failure is one `error:` line on stderr and exit 1, as in tasks/cli.py.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PROGRESS_PREFIX = "@progress "


def die_with_launcher() -> None:
    """SIGKILL this process when the launcher that started it dies (Linux `PR_SET_PDEATHSIG`), so that a
    SIGKILLed stage process leaves no gang behind; exit at once if the launcher is already gone."""
    parent = os.environ.get("FORGELINE_GANG_PARENT")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        sys.exit(1)


def _progress(step: int, total: int, metrics: dict[str, float]) -> None:
    print(PROGRESS_PREFIX + json.dumps({"step": step, "total": total, "metrics": metrics}, default=float),
          flush=True)


def run_member(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Join the job, run the stage; the metadata on process 0, None on the others."""
    from storage import ArtifactRef, Store
    from tasks import registry
    from tasks.cli import configure_jax
    from tasks.stage import StageContext
    from tasks.training.distributed import initialize_from_env, is_primary

    initialize_from_env()
    configure_jax()
    stage = registry.stage(spec["kind"])
    cfg = stage.parse(spec["config"])
    primary = is_primary()
    out = Path(spec["out"]) if primary else Path(tempfile.mkdtemp(prefix=f"{spec['kind']}-member-"))
    ctx = StageContext(spec["kind"], spec["fingerprint"], out, {k: Path(v) for k, v in spec["inputs"].items()},
                       {k: ArtifactRef.from_dict(v) for k, v in spec["refs"].items()}, Store(spec["store"]))
    metadata = stage.load().run(cfg, ctx.inputs, out, progress=_progress if primary and stage.trains else None,
                                context=ctx)
    if not primary:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        return None
    Path(spec["stats"]).write_text(json.dumps(metadata or {}, default=str))
    return metadata


def main(argv: list[str] | None = None) -> None:
    die_with_launcher()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tasks.member SPEC.json", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True,
                        stream=sys.stdout)
    for noisy in ("jax", "absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        spec = json.loads(Path(args[0]).read_text())
        run_member(spec)
    except Exception as e:
        logging.getLogger("forgeline").debug("member failed", exc_info=True)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"error: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
