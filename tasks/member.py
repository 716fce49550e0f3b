"""One process of a multi-host stage: `python -m tasks.member SPEC.json`, started N times by a gang launcher.

A stage with `resources.<stage>.hosts = N > 1` runs as one JAX job of N processes (flows/gang.py starts
them; on Kubernetes an indexed Job or JobSet does). Every process runs the same registered stage on the
same inputs: it joins the job from the standard variables (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`; tasks/training/distributed.py), so the trainer's mesh spans every process's devices,
and process 0 writes the outputs. The launcher, which holds the stage's lease, commits them.

The spec (JSON, written by the launcher, a local file or a URL in the store; never a pickle):

    {"kind": "finetune", "config": {...}, "fingerprint": "...", "store": "s3://...",
     "refs": {"base": {ArtifactRef}, ...}, "stats": "/local/stats.json or s3://.../stats.json",
     "inputs": {"base": "/local/folder", ...}, "out": "/local/staging/folder"}   # on the launcher's machine
     "out_url": "s3://.../staging/..."                                            # on other machines

On the launcher's machine (flows/gang.py) the members read the inputs the launcher fetched and process 0
writes straight into its staging folder. On other machines (a Kubernetes JobSet, flows/jobset.py) the spec
has no `inputs`: every host fetches the referenced artifacts itself (checked against their manifests), and
process 0 uploads its output folder to `out_url` for the launcher to commit. Process 0 writes the stage's
metadata to `stats` and prints its training progress as `@progress {json}` lines, which the launcher turns
into the stage's progress in the UI; every other process writes into a scratch folder of its own. A failure
is one `error:` line on stderr and exit 1, as in tasks/cli.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
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
    """One `@progress {json}` line, written whole in one call: with PYTHONUNBUFFERED, `print` writes the text and
    its newline separately, and a stderr line landing between the two (both go into the launcher's one pipe)
    joined the progress line."""
    line = PROGRESS_PREFIX + json.dumps({"step": step, "total": total, "metrics": metrics}, default=float)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def line_router(progress: Any, log: logging.Logger) -> Any:
    """The launcher's side of a gang's output: `on_line(i, line)` turns process 0's `@progress` lines into
    calls of `progress(step, total, metrics)` and logs every other line tagged with its process, `[p<i>]`."""

    def on_line(i: int, line: str) -> None:
        if line.startswith(PROGRESS_PREFIX):
            body = line[len(PROGRESS_PREFIX):]
            try:  # progress is for the UI: what the process's stderr joined to the line is logged, never fatal
                p, end = json.JSONDecoder().raw_decode(body)
                step, total, metrics = p["step"], p["total"], p["metrics"]
            except (ValueError, KeyError, TypeError):
                log.info("[p%d] %s", i, line)
                return
            if progress is not None and i == 0:
                progress(step, total, metrics)
            if body[end:].strip():
                log.info("[p%d] %s", i, body[end:].strip())
            return
        log.info("[p%d] %s", i, line)

    return on_line


def run_member(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Join the job, run the stage; the metadata on process 0, None on the others."""
    import storage
    from storage import ArtifactRef, Store
    from tasks import registry
    from tasks.cli import configure_jax
    from tasks.stage import StageContext, work_root
    from tasks.training.distributed import initialize_from_env, is_primary

    initialize_from_env()
    configure_jax()
    stage = registry.stage(spec["kind"])
    cfg = stage.parse(spec["config"])
    primary = is_primary()
    store = Store(spec["store"])
    refs = {k: ArtifactRef.from_dict(v) for k, v in spec["refs"].items()}
    if "inputs" in spec:  # the launcher's machine: its local copies
        inputs = {k: Path(v) for k, v in spec["inputs"].items()}
    else:  # another machine: fetch (and check) our own
        inputs = {k: store.fetch(ref) for k, ref in refs.items()}
    scratch = primary and "out" in spec
    out = Path(spec["out"]) if scratch else Path(tempfile.mkdtemp(prefix=f"{spec['kind']}-member-", dir=work_root()))
    ctx = StageContext(spec["kind"], spec["fingerprint"], out, inputs, refs, store)
    try:
        metadata = stage.load().run(cfg, ctx.inputs, out, progress=_progress if primary and stage.trains else None,
                                    context=ctx)
        if not primary:
            return None
        if "out_url" in spec:
            storage.upload_dir(out, spec["out_url"])
            # the hosts' shared checkpoint folder: the launcher, on another machine, cannot remove it once it
            # commits (the copies in the store are the ones a rerun resumes from)
            shutil.rmtree(ctx.checkpoint_dir, ignore_errors=True)
        storage.write_bytes(spec["stats"], json.dumps(metadata or {}, default=str).encode())
        return metadata
    finally:
        if not scratch:
            shutil.rmtree(out, ignore_errors=True)


def _read_spec(where: str) -> bytes:
    if "://" in where:
        import storage

        return storage.read_bytes(where)
    return Path(where).read_bytes()


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
        spec = json.loads(_read_spec(args[0]))
        run_member(spec)
    except Exception as e:
        logging.getLogger("forgeline").debug("member failed", exc_info=True)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"error: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
