"""Shared fixtures: a SeaweedFS S3 server and a Prefect test harness, both session-scoped because
each costs seconds to start on the 2-core CI machines."""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest_plugins = ["tests.crash_rerun"]  # a test whose xdist worker dies runs once more in a fresh one

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
# Local scratch (staging, training checkpoints keyed by stage fingerprint) of this test process alone: two
# pytest-xdist workers computing the same stage for different stores must not share a checkpoint folder
# (so not inherited from the controller process either).
os.environ["FORGELINE_WORKDIR"] = tempfile.mkdtemp(prefix="forgeline-work-")
atexit.register(shutil.rmtree, os.environ["FORGELINE_WORKDIR"], ignore_errors=True)

# JAX's persistent compilation cache: the command-line processes the tests start (stages, releases, the local
# stack's workers) use it as the forgeline commands do, one folder per pytest-xdist worker. The pytest processes
# themselves run without it (it saved nothing measurable in a full run): a worker died inside XLA's
# (de)serialization of a CPU executable twice, and once more without the cache (CI at c444c14). The cause was
# the worker's count of memory mappings (`_drop_compiled_programs` below), not the cache.
from tasks.cli import cache_root, configure_jax  # noqa: E402

# (A worker inherits the controller's `jax-main` with its environment: that one is replaced, a folder the
# user chose is kept.)
if os.environ.get("JAX_COMPILATION_CACHE_DIR") in (None, str(cache_root() / "jax-main")):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache_root() / f"jax-{worker}")
configure_jax(compilation_cache=False)


# XLA:CPU maps each compiled program's code into the process (three memory mappings each) and keeps it while
# JAX's caches hold the program, which for a module-level `jax.jit` is for the life of the process. A pytest
# worker that kept every program of a full run held 56,980 mappings at its peak here (c444c14), near the
# kernel's `vm.max_map_count` (65,530), and crosses it under another file-to-worker schedule: the next mmap
# then fails inside XLA and the worker dies in whatever test is compiling or serializing a program -- the
# crashes described above. With this fixture the peak was 18,753. Each test module's programs are
# dropped when the module ends (`jax.clear_caches()`); a later module that needs one compiles it again.
@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    import jax  # imported already: configure_jax above

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def s3_env(tmp_path_factory):
    """A running SeaweedFS on 127.0.0.1; yields its AWS_* variables, which are also exported so that
    storage.fs (and therefore every stage) reaches it through the standard environment."""
    from tests.s3_server import exported, seaweedfs

    with seaweedfs(tmp_path_factory.mktemp("s3")) as env, exported(env):
        yield env


# The default recipe shrunk to a CPU smoke size (about a minute end to end), with its own declared gates.
SMOKE = str(ROOT / "tests" / "recipes" / "smoke.yaml")
SMOKE_MOE = str(ROOT / "tests" / "recipes" / "smoke-moe.yaml")


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (~10 s to start on 2 cores)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


def release_with_events(store: str, recipe: str = SMOKE) -> tuple[str, list]:
    """Run the release flow in this process and collect the stage events it announces."""
    from flows.release import release
    from flows.stages import LISTENERS

    events: list = []
    LISTENERS.append(events.append)
    try:
        return release(recipe=recipe, store=store), events
    finally:
        LISTENERS.remove(events.append)


@pytest.fixture(scope="session")
def released(s3_env, prefect_harness):
    """(store, bundle URL, stage events): the smoke release, uninterrupted, against the S3 server. The
    integration tests read its bundle; the fault tests compare their bundles' digests with it."""
    import uuid

    store = f"s3://forgeline/it-{uuid.uuid4().hex[:8]}"
    url, events = release_with_events(store)
    return store, url, events


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """(base checkpoint dir, data dir): a random tiny Llama with a BPE tokenizer trained on real text,
    and data_prep output over stdlib docstring->body pairs tokenized with it."""
    from flax import nnx

    import models
    from tasks import data_prep
    from tasks.finetune import save_model_dir

    root = tmp_path_factory.mktemp("tiny_base")
    tok = root / "tok"
    data_prep.run_local(data_prep.DataPrepConfig(corpus="builtin://python-stdlib", max_documents=40,
                                                 vocab_size=512), tok)
    data = root / "data"
    pairs = data_prep.DataPrepConfig(corpus="builtin://python-stdlib-functions", max_documents=300, seq_len=128,
                                     valid_fraction=0.3)
    data_prep.run_local(pairs, data, tokenizer_json=tok / "tokenizer.json")
    special = json.loads((data / "special_tokens.json").read_text())
    cfg = models.LlamaConfig.tiny(vocab_size=512, bos_token_id=special["bos"], eos_token_id=special["eos"],
                                  pad_token_id=special["pad"])
    base = root / "base"
    save_model_dir(models.Llama(cfg, rngs=nnx.Rngs(0)), base, data)
    return base, data


@pytest.fixture(scope="session")
def tiny_target(tiny_base, tmp_path_factory):
    """(target checkpoint, data dir): a random 3-layer tiny Llama on tiny_base's data and tokenizer
    (the target of the traces and draft stage tests)."""
    from flax import nnx

    import models
    from tasks.finetune import save_model_dir

    _, data = tiny_base
    special = json.loads((data / "special_tokens.json").read_text())
    cfg = models.LlamaConfig.tiny(vocab_size=512, num_hidden_layers=3, bos_token_id=special["bos"],
                                  eos_token_id=special["eos"], pad_token_id=special["pad"])
    path = tmp_path_factory.mktemp("tiny_target") / "model"
    save_model_dir(models.Llama(cfg, rngs=nnx.Rngs(0)), path, data)
    return path, data


# What the heavier tests measured (the fault table, the default release's numbers), printed at the end of
# the run so that every CI log carries them, not only a failing test's captured output.
_MEASURED: list[str] = []


@pytest.fixture
def measured(request):
    """`measured(line)` prints `line` in the run's closing "measured" section (carried in the test report's
    user properties, so it also reaches the summary from a pytest-xdist worker)."""
    return lambda line: request.node.user_properties.append(("measured", line))


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)


# No test is skipped silently: every tier runs every test it collects, so a skip (a missing dependency,
# a `pytest.skip` left in) fails the run instead of passing it with a footnote.
_SKIPPED: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _MEASURED.extend(v for k, v in report.user_properties if k == "measured")
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED and session.exitstatus == 0:
        print(f"\nerror: {len(_SKIPPED)} test(s) skipped, and no tier may skip one: " + ", ".join(_SKIPPED[:5]))
        session.exitstatus = 1
