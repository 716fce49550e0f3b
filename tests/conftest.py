"""Shared fixtures: a SeaweedFS S3 server and a Prefect test harness, both session-scoped because
each costs seconds to start on the 2-core CI machines."""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest_plugins = ["tests.crash_rerun"]  # a test whose xdist worker dies runs once more in a fresh one
# The test run's compile settings (below): LLVM -O0, and XLA:CPU's older loop emitters instead of its MLIR fusion
# emitters where this jaxlib still has them.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
# Local scratch (staging, training checkpoints keyed by stage fingerprint) of this test process alone: two
# pytest-xdist workers computing the same stage for different stores must not share a checkpoint folder
# (so not inherited from the controller process either).
os.environ["FORGELINE_WORKDIR"] = tempfile.mkdtemp(prefix="forgeline-work-")
atexit.register(shutil.rmtree, os.environ["FORGELINE_WORKDIR"], ignore_errors=True)

# Compiled programs, shared by every process of this test run. About half of a unit test's time is XLA compiling
# small programs, and the same programs come back: each test module drops its programs when it ends (below), the
# two pytest-xdist workers build the same models, and the command-line processes the tests start (stages,
# releases, the local stack's workers, 8-device children) compile what an earlier process already did. One JAX
# persistent compilation cache per run, created empty by the first pytest process (the controller, or a run
# without xdist) and inherited by everything it starts, turns each repeat into a read: a run starts as cold as a
# new machine and leaves nothing behind. Every program is cached (no minimum compile time). The cache has no size
# limit: a limit turns on JAX's LRU eviction, which lists and stats every entry under a file lock on each write
# (quadratic: with ~7,000 entries, a full run was slower than with no cache at all). Two processes compiling the
# same program at once may see the other's half-written entry; JAX then warns and compiles it itself.
# A compilation cache folder the user exported (`JAX_COMPILATION_CACHE_DIR`) is used as it is.
from tasks.cli import configure_jax  # noqa: E402
from tasks.host_memory import tuned_environ  # noqa: E402


def _known_xla_flags(flags: str) -> list[str]:
    """`flags` less those this jaxlib's XLA does not define (a short child process asks: XLA aborts naming
    them, "Unknown flag(s) in XLA_FLAGS: ...")."""
    wanted = flags.split()
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": " ".join(wanted), "JAX_PLATFORMS": "cpu"})
    named = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", probe.stderr.decode(errors="replace"))
    return wanted if probe.returncode == 0 or not named else [f for f in wanted if f not in named.group(1).split()]


if "FORGELINE_TEST_RUN" not in os.environ:  # the run's first process; its workers and children inherit all this
    os.environ["FORGELINE_TEST_RUN"] = tempfile.mkdtemp(prefix="forgeline-run-")
    atexit.register(shutil.rmtree, os.environ["FORGELINE_TEST_RUN"], ignore_errors=True)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["FORGELINE_TEST_RUN"], "jax"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    # XLA compiles at LLVM -O0 in the test run: a third less compile time, for programs whose run time is a few
    # milliseconds. XLA's CPU backend never enables fast math, but results can differ from the default level in
    # the last bits (which multiply-adds become FMAs); tolerances are for both levels. `users_xla_flags` gives
    # the default back to the one test that measures the README's release as users run it
    # (tests/integration/test_default_release.py).
    #
    # XLA:CPU's MLIR fusion emitters cost a fixed ~15 ms per compiled program and more per fusion: with the older
    # loop emitters (`--xla_cpu_use_fusion_emitters=false`) a one-op program compiles in 23 ms instead of 39 and
    # test_train + test_speculative take 77 s instead of 118 with an empty cache; the generated code runs ~40 %
    # slower, which programs that run for milliseconds do not feel. Same math; FMA contraction may differ, as at
    # -O0. XLA aborts the process on a flag it does not know, so the flag is kept only if this jaxlib accepts it.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {' '.join(_known_xla_flags(TEST_XLA_FLAGS))}".strip()
    # The host-memory setting the `forgeline` command runs under (tasks/host_memory.py: glibc backs XLA's large
    # temporaries with huge pages): the xdist workers and every process the tests start inherit it, so tests
    # run the programs as users do. This first process started without it (with `-n 0` it runs the tests so).
    os.environ.update(tuned_environ(os.environ) or {})


def _pin_xdist_worker() -> None:
    """Give each pytest-xdist worker its own share of the CPUs (with 2 workers on 2 cores: one core each).

    Every test that trains or decodes keeps both cores busy with XLA's intra-op thread pool, so two workers
    side by side oversubscribe the machine: their threads meet at every parallel loop and wait for each other.
    XLA (and torch) size their thread pools from the process's CPU affinity when they start, so a worker pinned
    here, and everything it starts, runs single-threaded without that contention: measured on the 2-core machine,
    two tiny base pretrainings side by side made 3,367 tokens/s each unpinned and 3,563 pinned (+6 %), and two
    smoke releases side by side took 102 s unpinned and 95 s pinned. `FORGELINE_TEST_PIN=0` turns it off; a run
    with more workers than CPUs, or a single process (`-n 0`), is left as it is. The tests that run a recipe as
    users run it start that process on every CPU (`users_cpus`): fewer threads change XLA's floating-point
    reduction order, and the tiny-grpo recipe's RL gain did not survive that (see `users_cpus`)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or os.environ.get("FORGELINE_TEST_PIN", "1") == "0":
        return
    cpus = USERS_CPUS
    if not 1 < count <= len(cpus):
        return
    i = int(worker[2:]) % count
    os.sched_setaffinity(0, cpus[i * len(cpus) // count : (i + 1) * len(cpus) // count])


USERS_CPUS = sorted(os.sched_getaffinity(0))  # what a user's process gets on this machine
_pin_xdist_worker()  # before JAX starts its CPU client (configure_jax only sets options)


def users_cpus() -> None:
    """A `preexec_fn` that gives a test's child process the CPUs a user's process has (all of the machine's), not
    its pinned worker's share: for the tests that run a recipe as users run it and hold it to its measured
    targets. With one XLA thread instead of two, the tiny-grpo release (its recipe then: a 400-step base) ran on other
    floating-point sums, and its held-out greedy pass@1 went 29.3 % -> 31.6 % under RL (+2.3 points; the
    recipe's documented run, which the previous full test run here reproduced with two threads: 33.2 % -> 50.4 %)."""
    os.sched_setaffinity(0, USERS_CPUS)


configure_jax()


def users_xla_flags(env: dict[str, str]) -> dict[str, str]:
    """`env` with XLA_FLAGS as the user's (without the test run's compile level)."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f not in TEST_XLA_FLAGS.split()]
    return {**{k: v for k, v in env.items() if k != "XLA_FLAGS"}, **({"XLA_FLAGS": " ".join(flags)} if flags else {})}


# XLA:CPU maps each compiled program's code into the process (three memory mappings each) and keeps it while
# JAX's caches hold the program, which for a module-level `jax.jit` is for the life of the process. A pytest
# worker that kept every program of a full run held 56,980 mappings at its peak here (c444c14), near the
# kernel's `vm.max_map_count` (65,530), and crosses it under another file-to-worker schedule: the next mmap
# then fails inside XLA and the worker dies in whatever test is compiling or (de)serializing a program (three
# such crashes in earlier full runs). With this fixture the peak was 18,753. Each test module's programs are
# dropped when the module ends (`jax.clear_caches()`); a later module that needs one reads it back from the
# run's compilation cache (above).
@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    import jax  # imported already: configure_jax above

    jax.clear_caches()
    gc.collect()


# A command's `main` run in-process (the stage CLIs: tasks/cli.py `stage_main`) calls `logging.basicConfig(force=True)`,
# which puts a handler on the root logger writing to the sys.stderr of that moment: under `capsys`, a capture
# stream closed when the test ends. Every later test in the worker that logged through the root logger then
# wrote to a closed file (test_quant.py's stage-CLI test, then test_gang.py in one process: "ValueError: I/O
# operation on closed file" from Prefect's flow-run log). Each test gets the root logger back as it found it.
@pytest.fixture(autouse=True)
def _restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


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
def tiny_release_store(tmp_path_factory) -> str:
    """A file store that the tiny recipes' releases of this test run share, across the pytest-xdist workers: the
    default release (tests/integration/test_default_release.py) and the tiny-grpo one (test_grpo_release.py)
    start from the same scratch-pretrained base, whose stage fingerprint is the same in both, so the first of them
    to take the base's lease computes it and the other waits for its commit (storage's leases, as two users'
    releases on one store do) instead of training it again. Created empty for each run: nothing carries over."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # .../pytest-N/popen-gwK: the run's folder is the workers' parent
        root = root.parent
    return f"file://{root / 'tiny-releases'}/artifacts"


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


# Where the run's time went: each test's setup + call + teardown, summed per test and per file, printed at the end
# of every run (a report, not a check: timings on a loaded machine are not pass/fail).
_SECONDS: dict[str, float] = {}
SHOWN = 15


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)
    if _SECONDS:
        files: dict[str, float] = {}
        for nodeid, seconds in _SECONDS.items():
            files[nodeid.split("::", 1)[0]] = files.get(nodeid.split("::", 1)[0], 0.0) + seconds
        terminalreporter.section("where the time went (setup + call + teardown, summed over the workers)")
        terminalreporter.write_line(f"{sum(_SECONDS.values()):8.1f} s in {len(_SECONDS)} tests of {len(files)} files")
        terminalreporter.write_line(f"slowest files (of {len(files)}):")
        for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:SHOWN]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
        terminalreporter.write_line(f"slowest tests (of {len(_SECONDS)}):")
        for nodeid, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:SHOWN]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")


# No test is skipped silently: every tier runs every test it collects, so a skip (a missing dependency,
# a `pytest.skip` left in) fails the run instead of passing it with a footnote.
_SKIPPED: list[str] = []


def pytest_runtest_logreport(report):
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        _MEASURED.extend(v for k, v in report.user_properties if k == "measured")
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED and session.exitstatus == 0:
        print(f"\nerror: {len(_SKIPPED)} test(s) skipped, and no tier may skip one: " + ", ".join(_SKIPPED[:5]))
        session.exitstatus = 1


# -- scheduling -------------------------------------------------------------------------------------------------
# pytest-xdist hands each worker whole files (`--dist loadfile`, module fixtures build once) in collection order,
# two files each to start with. The longest files go first, so that one worker takes the longest while the other
# takes the rest, instead of the longest starting last and running alone (measured durations of a full run, longest
# first). Files that share a session fixture too costly to build twice run on one worker: the smoke release of
# `released` (test_release_flow reads it, test_faults compares its bundles' digests with it) is built once.
LONGEST_FIRST = [
    "tests/integration/test_default_release.py",  # the README's release, then its cached rerun
    "tests/integration/test_grpo_release.py",  # the tiny-grpo release and its RL gain gate
    "tests/integration/test_faults.py",  # with test_release_flow.py: the `released` smoke release
    "tests/integration/test_release_flow.py",
    "tests/integration/test_workers.py",  # the local stack and a release on its workers
    "tests/integration/test_moe_release.py",
    "tests/unit/test_plan.py",
    "tests/integration/test_bad_input.py",
]
SAME_WORKER = {"tests/integration/test_faults.py": "released", "tests/integration/test_release_flow.py": "released"}


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        """Whole files per worker, the files of a SAME_WORKER group as one unit."""

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SAME_WORKER.get(path, path)

    return Scheduling(config, log)
