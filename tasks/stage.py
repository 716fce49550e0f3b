"""The one way a stage runs: fingerprint -> skip if committed -> take the stage's lease (or wait for the
process that holds it) -> fetch inputs (checked against their manifests) -> compute locally -> commit
(files first, manifest last, fenced by the lease: the store refuses it once the lease was taken over).
`run_once` is that protocol for any work function; tasks/registry.py runs the registered stages through it.

Pipeline steps are plain functions at hashed paths, as in marin: a stage's output address is the
fingerprint of (stage kind, canonical config, the version of the stage's own code -- tasks/code.py --,
input digests), so a re-run of a release
finds every finished stage already committed and skips it, a failed stage leaves no manifest behind
(nothing half-written is visible to readers), and two releases started together compute each stage
once: the second waits on the first's lease and then reads its commit.

Measurements of one run -- wall-clock timings and logs -- go in files matching `VOLATILE`: they are
committed and hashed like any file but stay out of the artifact's digest, so recomputing a stage that
yields the same bytes (after a crash, on another worker) keeps every downstream fingerprint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import storage
from storage import ArtifactRef, Lease, LeaseLost, Store
from tasks.code import code_version, source_version
from tasks.layout import checkpoint_prefix
from tasks.training.config import Progress

__all__ = ["Interrupted", "Progress", "StageContext", "fingerprint_of", "interrupt", "raise_if_interrupted",
           "read_report", "received", "record", "signals_recorded", "run_once", "work_root", "write_report"]

log = logging.getLogger("forgeline.stage")

# Files that record how a run went rather than what it computed (storage.artifacts: "volatile").
# A fine-tune's curves (training.json, curves.png; the bundle's training/) are the run's: a resumed run's begin
# where it resumed.
VOLATILE = ("tensorboard/*", "*timing.json", "*report.md", "README.md", "training.json", "curves.png", "training/*")
POLL_SECONDS = 2.0  # how often a stage waiting on another process's lease looks for its commit


class Interrupted(BaseException):
    """A signal (SIGINT, SIGTERM) stopped this process. A BaseException, like KeyboardInterrupt, so that
    `except Exception` in stage code does not catch it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_SIGNALS: list[int] = []  # the signals this process received, first one first


def interrupt(signum: int) -> None:
    """A signal handler's body: record the signal and raise `Interrupted` where the main thread is.

    The raise can be lost: a signal lands at whatever bytecode the main thread is at, and one that lands in
    a `__del__` (an asyncio transport collected mid-run) or in library code's `except BaseException` is
    swallowed. The record makes every later stage boundary and training step raise again
    (`raise_if_interrupted`), so an interrupted run stops before its next stage computes or commits."""
    record(signum)
    raise Interrupted(signum)


def record(signum: int) -> None:
    """Note that `signum` arrived (whoever's handler raised for it)."""
    _SIGNALS.append(signum)


def received() -> int | None:
    """The first signal this process received, if any."""
    return _SIGNALS[0] if _SIGNALS else None


def raise_if_interrupted() -> None:
    if (signum := received()) is not None:
        raise Interrupted(signum)


@contextlib.contextmanager
def signals_recorded() -> Iterator[None]:
    """While a stage computes: SIGINT and SIGTERM are recorded before whatever handler is in force runs
    (Prefect swaps SIGTERM for its own, raising TerminationSignal, for the length of a flow run). Only in
    the main thread, the one that receives signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wrapped = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        if not callable(previous):  # SIG_DFL / SIG_IGN: keep the default behaviour
            continue

        def handler(signum, frame, _previous=previous):
            record(signum)
            _previous(signum, frame)

        wrapped[sig] = (previous, handler)
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, (previous, handler) in wrapped.items():
            if signal.getsignal(sig) is handler:  # never undo a handler someone installed after ours
                signal.signal(sig, previous)


@dataclass(frozen=True)
class StageContext:
    """What a stage's compute function sees: where to write, its inputs as local folders, and the
    store and fingerprint (for side state such as resumable training checkpoints).

    A stage's command line (tasks/cli.py) builds one too, for `--checkpoints DIR [--store URL]`: fingerprint
    `cli`, no input references (inputs are named by their local paths), checkpoints in DIR, and uploaded to
    the store only when one is given."""

    kind: str
    fingerprint: str
    out_dir: Path
    inputs: dict[str, Path]
    refs: dict[str, ArtifactRef]
    store: Store | None
    local_checkpoints: Path | None = None  # overrides `checkpoint_dir` (the command line's --checkpoints)

    @property
    def checkpoint_dir(self) -> Path:
        """Local folder for this stage's resumable training checkpoints (uploaded to the store as they are
        made; removed once the stage commits)."""
        if self.local_checkpoints is not None:
            return self.local_checkpoints
        return checkpoint_dir(self.kind, self.fingerprint)

    @property
    def checkpoint_url(self) -> str:
        """Where in the store this stage keeps its resumable side state (training checkpoints, trace shards)."""
        if self.store is None:
            raise ValueError(f"{self.kind}: resumable side state needs a store (--store URL)")
        return self.store.url(checkpoint_prefix(self.kind, self.fingerprint))

    def key_of(self, name: str, sub: str = ".") -> str:
        """Input `name` (or the folder `sub` inside it) by its key in the store: the same bytes wherever the
        store lives (a bundle's lineage, an adapter's base model name). An input that did not come from the
        store (the command line's) is named by its absolute local path."""
        if name not in self.refs or self.store is None:
            return str((self.inputs[name] / sub).resolve())
        url = self.refs[name].url if sub == "." else storage.join(self.refs[name].url, sub)
        return self.store.key_of(url)


Work = Callable[[StageContext], dict[str, Any]]


def is_measurement(key: str) -> bool:
    """What describes one run rather than its result: wall-clock numbers (seconds, rates, speedups) and the
    work it reused from an interrupted attempt (`reused_*`), which a clean run would not list."""
    return key.endswith(("speedup", "seconds", "_per_s")) or key.startswith("reused_")


def split_measurements(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, timings): the same nested mappings with every wall-clock measurement moved to the second."""
    results, timings = {}, {}
    for key, value in report.items():
        if is_measurement(key):
            timings[key] = value
        elif isinstance(value, dict):
            results[key], inner = split_measurements(value)
            if inner:
                timings[key] = inner
        else:
            results[key] = value
    return results, timings


def with_measurements(results: dict[str, Any], timings: dict[str, Any]) -> dict[str, Any]:
    """`split_measurements` undone."""
    out = dict(results)
    for key, value in timings.items():
        out[key] = with_measurements(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def write_report(path: Path, report: dict[str, Any]) -> None:
    """`path` (JSON) gets the results, `timing.json` beside it the timings (a volatile file)."""
    results, timings = split_measurements(report)
    path.write_text(json.dumps(results, indent=1) + "\n")
    if timings:
        (path.parent / "timing.json").write_text(json.dumps(timings, indent=1) + "\n")


def read_report(read: Callable[[str], bytes], name: str) -> dict[str, Any]:
    """A report written by `write_report`, timings merged back; `read(file name)` reads from its folder."""
    results = json.loads(read(name))
    try:
        timings = json.loads(read("timing.json"))
    except FileNotFoundError:
        return results
    return with_measurements(results, timings)


def config_dict(config: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    return config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)


def fingerprint_of(kind: str, config: BaseModel | Mapping[str, Any], inputs: Mapping[str, ArtifactRef],
                   code: str | None = None) -> str:
    """The address of `kind` computed from `config` and `inputs` by the code of module `code` (its import
    closure, tasks/code.py; None: the whole library tree)."""
    return storage.fingerprint(kind, config_dict(config), inputs.values(), _code(code))


def _code(module: str | None) -> str:
    return code_version(module) if module is not None else source_version()


def checkpoint_dir(kind: str, fp: str) -> Path:
    """`$FORGELINE_CHECKPOINT_ROOT/<kind>/<fp>` when set (a multi-host stage's folder shared by all of its
    hosts: orbax writes one checkpoint from every process into one folder), else under the work root."""
    shared = os.environ.get("FORGELINE_CHECKPOINT_ROOT")
    return (Path(shared) if shared else work_root() / "ckpt") / kind / fp


def work_root() -> Path:
    """Local scratch space for staging outputs and training checkpoints."""
    root = Path(os.environ.get("FORGELINE_WORKDIR", Path(tempfile.gettempdir()) / "forgeline-work"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def run_once(
    store: Store,
    kind: str,
    config: BaseModel | Mapping[str, Any],
    inputs: Mapping[str, ArtifactRef],
    work: Work,
    *,
    code: str | None = None,
    force: bool = False,
    on_compute: Callable[[], None] | None = None,
) -> ArtifactRef:
    """Run `work(ctx) -> metadata` unless `<kind>/<fingerprint>` is already committed; while another
    process holds the stage's lease, wait for its commit (or for its lease to lapse) instead. `code` names
    the module whose import closure versions the work (see `fingerprint_of`)."""
    fp = fingerprint_of(kind, config, inputs, code)
    while True:
        raise_if_interrupted()
        if not force and (done := store.lookup(kind, fp)) is not None:
            log.info("%s: already committed at %s, skipping", kind, done.url)
            return done
        lease = store.lease(kind, fp)
        if not _take(lease, lambda: not force and store.lookup(kind, fp) is not None):
            continue  # another process committed it while we waited: return its artifact
        try:
            if not force and (done := store.lookup(kind, fp)) is not None:
                lease.release(remove=True)
                return done
            if on_compute is not None:
                on_compute()
            with signals_recorded():
                ref = _compute_and_commit(store, kind, fp, config, inputs, work, lease, _code(code))
        except LeaseLost as e:  # we stalled past the expiry and another process took over: wait for it
            log.warning("%s: %s", kind, e)
            lease.release()
            continue
        except BaseException:
            lease.release()
            raise
        lease.release(remove=True)
        return ref


def _take(lease: Lease, committed: Callable[[], bool]) -> bool:
    """Take `lease`, waiting while another process holds it; False as soon as `committed()` says that
    the other process finished the work."""
    if lease.try_acquire():
        return True
    log.info("%s is held by %s; waiting for its commit", lease.folder, lease.describe(lease.current()[1]))
    while not lease.try_acquire():
        if committed():
            return False
        time.sleep(POLL_SECONDS)
    return True


def _compute_and_commit(store: Store, kind: str, fp: str, config: BaseModel | Mapping[str, Any],
                        inputs: Mapping[str, ArtifactRef], work: Work, lease: Lease, code: str) -> ArtifactRef:
    local_inputs = {name: store.fetch(ref) for name, ref in inputs.items()}
    staging = Path(tempfile.mkdtemp(prefix=f"{kind}-{fp[:8]}-", dir=work_root()))
    try:
        t0 = time.perf_counter()
        log.info("%s: computing %s", kind, fp)
        ctx = StageContext(kind, fp, staging, local_inputs, dict(inputs), store)
        metadata = work(ctx) or {}
        metadata = {**metadata, "seconds": round(time.perf_counter() - t0, 2)}
        raise_if_interrupted()  # an interrupt the work's own code swallowed: nothing is committed after it
        ref = store.commit(staging, kind, fp, config=config_dict(config), inputs=inputs.values(), metadata=metadata,
                           volatile=VOLATILE, lease=lease, code_version=code,
                           source_version=source_version())
        # The committed artifact supersedes the stage's resumable side state (training checkpoints,
        # finished trace shards), in the store and on local disk: without this, offline hidden states would
        # sit in the store twice and every fine-tune would leave a full checkpoint behind on the worker.
        storage.rm(store.url(checkpoint_prefix(kind, fp)))
        shutil.rmtree(checkpoint_dir(kind, fp), ignore_errors=True)
        log.info("%s: committed %s in %.1fs", kind, ref.url, metadata["seconds"])
        return ref
    finally:
        shutil.rmtree(staging, ignore_errors=True)
