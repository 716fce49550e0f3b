"""A multi-host stage as one step: the fine-tune stage with `resources.finetune.hosts=2` runs as a gang of
two JAX processes on 127.0.0.1 (flows/gang.py + tasks/member.py) inside the stage's own Prefect flow run,
trains like one process, and puts both processes' lines in the run's logs; a gang whose second process
fails is stopped within a bounded time, naming the process and its last line."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest

import storage
from storage import Store

pytestmark = pytest.mark.integration

FINETUNE = {"mode": "full", "train": {"steps": 4, "batch_size": 4, "log_every": 1, "eval_batches": 1,
                                      "warmup_steps": 0, "checkpoint_every": 2}}


def _store_with_inputs(tiny_base, tmp_path) -> tuple[str, dict]:
    base, data = tiny_base
    store = f"file://{tmp_path / 'store'}"
    refs = {name: Store(store).commit(folder, f"fixture-{name}", f"{name:0>20}", config={"fixture": name})
            for name, folder in (("base", base), ("data", data))}
    return store, refs


def _losses(ref) -> list[float]:
    return json.loads(storage.read_bytes(ref.file("manifest.json")))["metadata"]["train_losses"]


def _weights(ref) -> dict[str, np.ndarray]:
    import safetensors.numpy

    return safetensors.numpy.load(storage.read_bytes(ref.file("model/model.safetensors")))


def _logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    time.sleep(2.5)  # Prefect ships log records in batches every 2 s
    out: list[str] = []
    with get_client(sync_client=True) as client:
        while True:  # the API pages by at most 200
            page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200,
                                    offset=len(out))
            out += [entry.message for entry in page]
            if len(page) < 200:
                return out


@pytest.mark.slow
def test_two_process_finetune_through_the_launcher_equals_one_process(tiny_base, tmp_path, prefect_harness,
                                                                     monkeypatch):
    from flows.stages import stage_flow
    from tasks import registry

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "1")  # each gang process: one CPU device
    gang_store, refs = _store_with_inputs(tiny_base, tmp_path / "gang")
    inputs = {k: r.to_dict() for k, r in refs.items()}
    t0 = time.monotonic()
    state = stage_flow("finetune", "finetune", FINETUNE, inputs, gang_store, resources={"hosts": 2},
                       return_state=True)
    gang_seconds = time.monotonic() - t0
    assert state.is_completed(), state.message
    gang = Store(gang_store).load(state.result()["url"])

    one_store, one_refs = _store_with_inputs(tiny_base, tmp_path / "one")
    one = registry.run_stage(Store(one_store), "finetune", FINETUNE, one_refs)  # in this process, one device
    assert gang.url.rsplit("/", 1)[-1] == one.url.rsplit("/", 1)[-1]  # hosts is not part of the fingerprint

    gang_losses, one_losses = _losses(gang), _losses(one)
    assert len(gang_losses) == 4
    np.testing.assert_allclose(gang_losses, one_losses, rtol=1e-5)
    w_gang, w_one = _weights(gang), _weights(one)
    assert w_gang.keys() == w_one.keys()
    # 2x1 vs 1 device: sums reduce in another order, and Adam's m/sqrt(v) turns the last-bit differences of a
    # near-zero gradient into up to a whole step (<= lr) on that element (measured: 1 element in 8192 off by
    # 3e-5); the tensors as a whole agree to float32 roundoff.
    lr = 2e-3  # FinetuneConfig's default learning rate
    for k in w_one:
        diff = np.abs(w_gang[k] - w_one[k])
        assert diff.max() <= 4 * lr, (k, diff.max())
        assert np.linalg.norm(diff) <= 1e-4 * np.linalg.norm(w_one[k]), (k, np.linalg.norm(diff))

    lines = _logs(state.state_details.flow_run_id)
    tagged = {i: [m for m in lines if m.startswith(f"[p{i}] ")] for i in (0, 1)}
    assert tagged[0] and tagged[1], lines[-20:]
    assert any("joined" in m for m in tagged[1]), tagged[1]  # process 1's own distributed-init line
    assert any("step" in m and "loss" in m for m in tagged[0]), tagged[0][-10:]
    print(f"gang: 2-process fine-tune stage {gang_seconds:.1f}s, {len(tagged[0])} + {len(tagged[1])} log lines; "
          f"loss max relative difference to one process "
          f"{np.max(np.abs(np.subtract(gang_losses, one_losses)) / np.abs(one_losses)):.2e}")


def test_a_failing_process_fails_the_gang_fast_naming_it(tmp_path):
    """Process 1 dies with an error after process 0 has started waiting for it in the JAX runtime: the
    launcher stops process 0 and reports process 1's last line, well within 60 s."""
    from flows.gang import GangFailed, run_gang

    script = tmp_path / "member.py"
    script.write_text(
        "import os, sys, time\n"
        "from tasks.training.distributed import initialize_from_env\n"
        "if os.environ['JAX_PROCESS_ID'] == '1':\n"
        "    print('loading shard 1', flush=True)\n"
        "    print('error: ValueError: shard 1 is unreadable', file=sys.stderr, flush=True)\n"
        "    sys.exit(3)\n"
        "initialize_from_env()  # process 0 waits here for process 1, which never joins\n"
        "time.sleep(600)\n")
    seen: list[tuple[int, str]] = []
    t0 = time.monotonic()
    with pytest.raises(GangFailed) as failure:
        run_gang([sys.executable, str(script)], 2, on_line=lambda i, line: seen.append((i, line)),
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
    seconds = time.monotonic() - t0
    assert seconds < 60, seconds
    e = failure.value
    assert e.process == 1 and e.returncode == 3
    assert "process 1 of 2 exited with status 3" in str(e)
    assert "error: ValueError: shard 1 is unreadable" in str(e)
    assert (1, "loading shard 1") in seen
    print(f"gang: process 1 failed -> gang stopped in {seconds:.1f}s: {e}")


def test_a_process_that_hangs_after_the_others_finished_is_stopped(tmp_path):
    from flows.gang import GangFailed, run_gang

    script = tmp_path / "member.py"
    script.write_text("import os, time\n"
                      "if os.environ['JAX_PROCESS_ID'] == '1':\n"
                      "    print('waiting for the coordinator', flush=True); time.sleep(600)\n")
    t0 = time.monotonic()
    with pytest.raises(GangFailed, match="process 1 of 2 was still running 2s after the others finished") as e:
        run_gang([sys.executable, str(script)], 2, finish_grace=2.0)
    assert time.monotonic() - t0 < 30
    assert e.value.last_line == "waiting for the coordinator"


@pytest.mark.slow
def test_two_host_finetune_as_a_jobset_equals_one_process(tiny_base, tmp_path, monkeypatch, caplog):
    """The fine-tune stage with `hosts: 2` on a Kubernetes pool: rendered as a JobSet, created through the
    Kubernetes client against tests/kube_fake.py (whose pods are local processes with their own scratch
    folders and one shared checkpoint claim), each host fetching its own inputs from the store and process 0
    uploading the output, which the launcher commits. Trains like one process."""
    import logging

    from flows.jobset import jobset_runner
    from tasks import registry
    from tasks.configs import KubernetesGangConfig, StageResources
    from tests.kube_fake import FakeCluster

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "1")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    caplog.set_level(logging.INFO, logger="forgeline.gang")
    store, refs = _store_with_inputs(tiny_base, tmp_path / "k8s-store")
    progress: list[int] = []
    with FakeCluster(tmp_path / "cluster") as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        runner = jobset_runner(StageResources(hosts=2),
                               KubernetesGangConfig(namespace="ml", checkpoint_claim="ckpt", secret=None), 900,
                               poll=0.5)
        t0 = time.monotonic()
        ref = registry.run_stage(Store(store), "finetune", FINETUNE, refs, runner=runner,
                                 progress=lambda step, total, metrics: progress.append(step))
        seconds = time.monotonic() - t0
        assert len(cluster.created) == 1 and cluster.jobsets == {} and cluster.pods == {}  # deleted after
        claim = [p for p in (tmp_path / "cluster").iterdir() if p.name.startswith("claim-ckpt-")]
        assert len(claim) == 1 and (claim[0] / "finetune").is_dir()  # both hosts checkpointed into the claim
    with pytest.raises(FileNotFoundError):  # the staging prefix went with the commit
        storage.list_files(Store(store).url("staging/gang"))

    one_store, one_refs = _store_with_inputs(tiny_base, tmp_path / "one")
    one = registry.run_stage(Store(one_store), "finetune", FINETUNE, one_refs)
    assert ref.url.rsplit("/", 1)[-1] == one.url.rsplit("/", 1)[-1]
    np.testing.assert_allclose(_losses(ref), _losses(one), rtol=1e-5)
    w_k8s, w_one = _weights(ref), _weights(one)
    for k in w_one:
        diff = np.abs(w_k8s[k] - w_one[k])
        assert np.linalg.norm(diff) <= 1e-4 * np.linalg.norm(w_one[k]), (k, np.linalg.norm(diff))
    assert progress and progress[-1] == 4  # process 0's progress lines became the stage's progress
    lines = [r.getMessage() for r in caplog.records if r.name == "forgeline.gang"]
    assert any(m.startswith("[p0] ") for m in lines) and any(m.startswith("[p1] ") for m in lines), lines[-10:]
    print(f"jobset: 2-host fine-tune stage through the Kubernetes client {seconds:.1f}s, "
          f"{len(lines)} log lines; loss max relative difference to one process "
          f"{np.max(np.abs(np.subtract(_losses(ref), _losses(one))) / np.abs(_losses(one))):.2e}")
