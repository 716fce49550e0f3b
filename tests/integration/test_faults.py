"""Faults survived, nothing lost: the smoke release (tests/recipes/smoke.yaml) run as `forgeline release`
processes that are killed, interrupted, raced and fed damaged bytes, against a file store and a real S3
server (SeaweedFS) that is itself killed. After every fault the rerun completes, no reader ever sees an
artifact without its manifest, and the bundle's digest equals the uninterrupted release's (the
`released` fixture, made in another process against another store: digests name content, not runs).

Heavy (~6 minutes on 2 cores): the slow tier, which CI runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import storage
from storage import Store
from tests.conftest import SMOKE
from tests.s3_server import exported

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STAGES = ["data_prep[base]", "base", "data_prep", "finetune", "quantize", "traces", "draft", "evaluate", "export"]
KINDS = {"data_prep[base]": "data_prep", "base": "base", "data_prep": "data_prep", "finetune": "finetune",
         "quantize": "quantize", "traces": "traces", "draft": "draft", "evaluate": "evaluate", "export": "export"}
MIDWAY = {  # a line each non-training stage logs part way through its work (the kill lands after it)
    "quantize": r"quantize: \S+ in [\d.]+s",  # the first of the recipe's variants is done, the next one is not
    "traces": r"traces: train-\d+: \d+ prompts ->",  # a shard committed (to resume from), the valid split not
    "evaluate": r"evaluate: task accuracy on",  # perplexities measured, the task and speculative runs ahead
}
STAGE_LINE = re.compile(r"^(\S+)\s+(ran|skipped \(committed\))\s")


def _server_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


class Release:
    """`forgeline release --recipe smoke` in its own process group, stderr collected line by line."""

    def __init__(self, store: str, *args: str, env: dict[str, str] | None = None, shared_server: bool = True,
                 tmp: Path | None = None):
        env = {**os.environ, **(env or {})}
        if tmp is not None:  # local scratch (staging, training checkpoints) shared by the reruns of one store
            env["FORGELINE_WORKDIR"] = str(tmp / "work")
        if shared_server:  # the session's Prefect test server: no ephemeral server to start per run
            env["PREFECT_API_URL"] = _server_url()
        else:
            env.pop("PREFECT_API_URL", None)
            env["PREFECT_HOME"] = str(tmp / "prefect-home")
        cmd = [sys.executable, "-m", "flows.cli", "release", "--recipe", SMOKE, "--store", store, *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.err: list[str] = []
        self.out: list[str] = []
        self._new = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stderr, self.err), (self.proc.stdout, self.out))]
        for r in self._readers:
            r.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._new:
                lines.append(line.rstrip("\n"))
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        """The first stderr line matching `pattern` (waits for it)."""
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        with self._new:
            while True:
                for line in self.err:
                    if m := rx.search(line):
                        return m
                if self.proc.poll() is not None and not any(r.is_alive() for r in self._readers):
                    raise AssertionError(f"exited {self.proc.returncode} before {pattern!r}:\n" + self.tail())
                if time.monotonic() > deadline:
                    raise AssertionError(f"no {pattern!r} within {timeout}s:\n" + self.tail())
                self._new.wait(0.2)

    def signal(self, sig: int, *, group: bool = True) -> None:
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 600) -> int:
        rc = self.proc.wait(timeout)
        for r in self._readers:
            r.join(10)
        return rc

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.err[-n:])

    def stage_lines(self) -> dict[str, str]:
        return {m.group(1): m.group(2) for line in self.err if (m := STAGE_LINE.match(line))}


@pytest.fixture(scope="module")
def reference(released) -> str:
    """The digest of the uninterrupted smoke release's bundle."""
    store, url, _ = released
    return Store(store).load(url).digest


def _visible_artifacts_are_whole(store: str) -> tuple[int, int]:
    """Every `<kind>/<fp>/` folder either has a manifest whose files all match, or is invisible to readers
    (lookup gives None). Returns (committed artifacts, folders without a manifest)."""
    st, committed, partial = Store(store), 0, 0
    for kind in set(KINDS.values()):
        try:
            files = storage.list_files(st.url(kind), hidden=True)
        except FileNotFoundError:
            continue
        for fp in sorted({f[len(st.url(kind)) + 1:].split("/", 1)[0] for f in files}):
            ref = st.lookup(kind, fp)
            if ref is None:
                partial += 1
            else:
                assert st.audit(ref) == [], (kind, fp)
                committed += 1
    return committed, partial


def _bundle(run: Release, store: str) -> str:
    url = run.out[-1] if run.out else ""
    assert url.startswith(store + "/export/"), run.tail()
    return url


def test_sigkill_inside_each_stage_then_rerun(tmp_path, prefect_harness, reference, measured):
    """`forgeline release` is SIGKILLed (with everything it started) inside each stage in turn; each rerun
    completes the stage the previous run died in -- training stages resume from their last checkpoint --
    and the last rerun's bundle is the uninterrupted run's, digest for digest."""
    store = f"file://{tmp_path}/store"
    table = []
    for i, stage in enumerate(STAGES):
        run = Release(store, tmp=tmp_path)
        kind = KINDS[stage]
        fp = run.wait_for(rf"forgeline\.stage {re.escape(kind)}: computing (\w+)").group(1)
        if kind in ("base", "finetune", "draft"):  # die as the first checkpoint is committed, mid-training
            step = run.wait_for(rf"checkpoint step (\d+) committed to \S+/checkpoints/{kind}/{fp}").group(1)
            where = f"after checkpoint step {step}"
        elif kind in ("data_prep", "export"):  # die while the files go up, before the manifest
            run.wait_for(rf"forgeline\.storage {re.escape(kind)}: uploading")
            where = "during the upload"
        else:  # die mid-compute, at a line the stage logs part way (a fixed sleep outlasts a cached-compile stage)
            run.wait_for(MIDWAY[kind])
            where = f"at {MIDWAY[kind]!r}"
        run.signal(signal.SIGKILL)
        assert run.finish() == -signal.SIGKILL
        committed, partial = _visible_artifacts_are_whole(store)
        if i > 0:  # this run completed the stage the previous run was killed in
            assert table[-1]["stage"] in run.stage_lines(), run.tail()
            table[-1]["rerun"] = run.stage_lines()[table[-1]["stage"]]
            table[-1]["resumed"] = any("resumed from checkpoint" in ln for ln in run.err)
        if where != "during the upload":  # (a small upload may finish before the signal lands)
            assert Store(store).lookup(kind, fp) is None, f"{stage} committed before the kill"
        table.append({"stage": stage, "killed": where, "committed": committed, "without_manifest": partial,
                      "died_committed": Store(store).lookup(kind, fp) is not None})
    final = Release(store, tmp=tmp_path)
    assert final.finish() == 0, final.tail()
    table[-1]["rerun"] = final.stage_lines()[STAGES[-1]]
    url = _bundle(final, store)
    digest = Store(store).load(url).digest
    measured("faults: SIGKILL of `forgeline release` inside each stage, then a rerun")
    for r in table:
        measured(f"  {r['stage']:<15} killed {r['killed']:<25} rerun: {r['rerun']}"
                 f"{' (resumed from its checkpoint)' if r.get('resumed') else ''}; folders without manifest after "
                 f"the kill: {r['without_manifest']}")
    measured(f"  final bundle digest {digest[:16]}, uninterrupted {reference[:16]}: "
             f"{'equal' if digest == reference else 'DIFFERENT'}")
    assert digest == reference
    assert sum(1 for r in table if r.get("resumed")) >= 2  # base and finetune (and draft) resumed mid-training
    verify = subprocess.run([sys.executable, "-m", "flows.cli", "verify", url], capture_output=True, text=True)
    assert verify.returncode == 0 and verify.stdout.startswith("ok: "), verify.stderr


@pytest.fixture(scope="module")
def raced(tmp_path_factory, prefect_harness) -> tuple[str, list[Release]]:
    """Two identical releases started at the same moment against one fresh store."""
    tmp = tmp_path_factory.mktemp("raced")
    store = f"file://{tmp}/store"
    runs = [Release(store, tmp=tmp), Release(store, tmp=tmp)]
    for r in runs:
        r.finish()
    return store, runs


def test_two_identical_releases_at_once_compute_each_stage_once(raced, reference, measured):
    store, runs = raced
    assert [r.proc.returncode for r in runs] == [0, 0], [r.tail() for r in runs]
    urls = {_bundle(r, store) for r in runs}
    assert len(urls) == 1
    for stage in STAGES:
        outcomes = sorted(r.stage_lines()[stage] for r in runs)
        assert outcomes == ["ran", "skipped (committed)"], (stage, outcomes)  # computed by exactly one
    assert any("waiting for its commit" in ln for r in runs for ln in r.err)  # one really waited on the other
    committed, partial = _visible_artifacts_are_whole(store)
    assert committed == len(STAGES) and partial == 0
    digest = Store(store).load(urls.pop()).digest
    measured(f"faults: two identical releases at once: each of {len(STAGES)} stages ran once and was reused once, "
             f"one bundle URL, digest {'equal' if digest == reference else 'DIFFERENT'}")
    assert digest == reference


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _gone(pids: set[int], timeout: float = 15) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {p for p in pids if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}
        if not alive:
            return set()
        time.sleep(0.2)
    return alive


def test_interrupts_leave_nothing_running_and_the_rerun_resumes(tmp_path, prefect_harness, reference, measured):
    """Each interrupted run starts its own ephemeral Prefect server (no PREFECT_API_URL) -- the process a
    terminated release used to leave behind. Ctrl-C goes to the whole process group, as a terminal sends it;
    SIGTERM to the CLI alone, as a supervisor sends it; SIGKILL to the CLI alone, which cannot unwind at all.
    The interrupted CLI exits within seconds (it once spent 80 s to minutes retrying to report its crash to
    a server the terminal's Ctrl-C had already stopped), with one `error:` line and nothing left running."""
    store = f"file://{tmp_path}/store"
    cases = ((signal.SIGINT, True, "base"), (signal.SIGTERM, False, "finetune"), (signal.SIGKILL, False, "quantize"))
    for sig, group, stage in cases:
        run = Release(store, shared_server=False, tmp=tmp_path)
        run.wait_for(rf"forgeline\.stage {stage}: computing")
        started = _descendants(run.proc.pid)
        assert started, "the ephemeral Prefect server should be a child of the CLI"
        time.sleep(1.0)
        t0 = time.monotonic()
        run.signal(sig, group=group)
        rc = run.finish(120)
        seconds = time.monotonic() - t0
        name = signal.Signals(sig).name
        if sig == signal.SIGKILL:
            assert rc == -sig, run.tail()
        else:
            assert rc == 128 + sig, run.tail()
            errors = [ln for ln in run.err if ln.startswith("error: ")]
            assert len(errors) == 1 and name in errors[0], run.tail()
            assert not any("Traceback" in ln for ln in run.err + run.out), run.tail()
            assert seconds < 30, f"{name}: the CLI took {seconds:.0f}s to exit:\n{run.tail()}"
        assert _gone(started) == set(), f"{name} left processes behind"
        _, partial = _visible_artifacts_are_whole(store)
        measured(f"faults: {name} {'to the process group' if group else 'to the CLI alone'} in {stage}: exit "
                 f"{rc} in {seconds:.1f}s, {len(started)} child process(es) all gone, {partial} folder(s) without "
                 f"manifest")
    final = Release(store, tmp=tmp_path)
    assert final.finish() == 0, final.tail()
    digest = Store(store).load(_bundle(final, store)).digest
    measured(f"  rerun: {sum(v == 'ran' for v in final.stage_lines().values())} stage(s) ran, digest "
             f"{'equal' if digest == reference else 'DIFFERENT'}")
    assert digest == reference


def test_a_corrupt_input_fails_the_stage_that_reads_it_once_and_is_not_recomputed(tmp_path, raced, measured):
    """A flipped byte in a committed model: the stage that reads it fails with one line naming the file in the
    store, at once (not retried as if the network had failed), and the damaged artifact is not recomputed
    over; `forgeline verify` names the file."""
    import shutil

    from prefect import get_client

    src, runs = raced
    store = f"file://{tmp_path}/store"  # a copy of a committed release (the raced one stays intact)
    shutil.copytree(storage.local_path(src), storage.local_path(store))
    run = runs[0]
    st = Store(store)
    bundle = _bundle(run, src).replace(src, store)
    lineage = json.loads(storage.read_bytes(storage.join(bundle, "lineage.json")))
    finetune = st.load(st.url(lineage["stages"]["finetune"]["key"]))
    weights = finetune.file("model/model.safetensors")
    data = bytearray(storage.read_bytes(weights))
    data[len(data) // 2] ^= 0x40
    storage.write_bytes(weights, bytes(data))

    t0 = time.monotonic()
    # evaluate must read the model again
    again = Release(store, "--set", "evaluate.spec_max_new_tokens=12", tmp=tmp_path)
    assert again.finish() == 1, again.tail()
    errors = [ln for ln in again.err if ln.startswith("error: ")]
    assert len(errors) == 1 and weights in errors[0] and "sha256" in errors[0], again.tail()
    assert not any("Traceback" in ln for ln in again.err), again.tail()
    assert again.stage_lines().get("finetune") == "skipped (committed)"  # not recomputed over
    assert st.lookup("finetune", finetune.fingerprint) == finetune and storage.read_bytes(weights) == bytes(data)

    with get_client(sync_client=True) as client:  # the evaluate task ran once: no retry of an integrity error
        from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
        from prefect.client.schemas.sorting import TaskRunSort

        runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["evaluate"])),
                                     sort=TaskRunSort.EXPECTED_START_TIME_DESC, limit=1)
    assert runs and runs[0].run_count == 1 and runs[0].state.is_failed(), runs
    measured(f"faults: a flipped byte in the committed fine-tuned model: exit 1 in {time.monotonic() - t0:.0f}s, "
             f"evaluate ran once, finetune not recomputed: {errors[0].replace(store, '<store>')}")

    verify = subprocess.run([sys.executable, "-m", "flows.cli", "verify", finetune.url], capture_output=True,
                            text=True)
    assert verify.returncode == 1 and f"altered: {weights}" in verify.stderr, verify.stderr


@pytest.fixture
def own_s3(tmp_path):
    """A SeaweedFS of this test's own: the test kills it."""
    from tests.s3_server import SeaweedFS

    server = SeaweedFS(tmp_path)
    env = server.start()
    try:
        yield server, env
    finally:
        server.stop()


def test_s3_server_killed_mid_upload_and_restarted(own_s3, prefect_harness, reference, tmp_path, measured):
    """SeaweedFS is SIGKILLed while a stage uploads its files and started again on its data: readers never see
    the half-uploaded artifact (no manifest, so lookup finds nothing), the stage's retry recomputes and
    commits it, and the bundle is the uninterrupted one."""
    server, env = own_s3
    store = "s3://forgeline/faults"
    run = Release(store, env=env, tmp=tmp_path)
    fp = run.wait_for(r"forgeline\.stage quantize: computing (\w+)").group(1)
    run.wait_for(r"forgeline\.storage quantize: uploading")
    server.kill()
    # down for longer than s3fs's own retries: the stage fails (and cannot give its lease back), Prefect retries it
    run.wait_for(r"lease .*quantize.* could not release", timeout=120)
    server.start()
    with exported(env):
        st = Store(store)
        seen_partial = len(storage.list_files(st.prefix("quantize", fp), hidden=True)) \
            if storage.exists(st.prefix("quantize", fp)) else 0
        assert st.lookup("quantize", fp) is None  # whatever was uploaded before the kill is invisible
        assert run.finish() == 0, run.tail()
        assert sum("quantize: computing" in ln for ln in run.err) == 2, run.tail()  # the retry recomputed it
        digest = st.load(_bundle(run, store)).digest
        committed, partial = _visible_artifacts_are_whole(store)
    measured(f"faults: SeaweedFS SIGKILLed during quantize's upload, restarted: {seen_partial} file(s) of it "
             f"were up without a manifest (invisible), the retry recomputed and committed it, bundle digest "
             f"{'equal' if digest == reference else 'DIFFERENT'}")
    assert digest == reference and partial == 0
    assert env["AWS_SECRET_ACCESS_KEY"] not in "\n".join(run.err + run.out)  # the canary stays in the environment
