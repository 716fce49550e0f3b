"""The tiny-grpo recipe, for real: `forgeline release --recipe tiny-grpo` in a fresh store (SFT on the built-in
`letters` task, then GRPO against its checker), held to its gate on what RL adds: the held-out pass@1 (T=0) after
RL minus at its SFT start, at least `evaluate.gates.min_rl_accuracy_gain`. Heavy (~12 minutes on 2 cores):
`pytest -m slow`. The store is the test run's `tiny_release_store`, shared with the default release
(test_default_release.py): the recipe starts from the default recipe's base, which one of the two trains and the
other waits for; every later stage is this recipe's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import storage
from tasks.evaluate import load_report
from tasks.recipe import load_recipe
from tests.conftest import users_cpus, users_xla_flags

# ~15 minutes alone on a 2-core machine, about twice that next to the other xdist worker
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

RL_GATE = "RL (letters): held-out pass@1 gain over its start (T=0)"


def test_tiny_grpo_release_passes_its_rl_gain_gate(tmp_path, tiny_release_store, measured):
    grpo, tiny = load_recipe("tiny-grpo"), load_recipe("tiny")
    floor = grpo.evaluate.gates.min_rl_accuracy_gain
    assert floor > 0, "tiny-grpo gates on its RL gain"
    assert grpo.base == tiny.base, "the recipe starts from the default recipe's base, which the two tests share"
    store = tiny_release_store
    # compiled at XLA's default level, as users run it (the rest of the test run compiles at -O0: tests/conftest.py)
    env = {
        **users_xla_flags(dict(os.environ)),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "FORGELINE_WORKDIR": str(tmp_path / "work"),
    }
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "release", "--recipe", "tiny-grpo", "--store", store],
        env=env,
        capture_output=True,
        text=True,
        timeout=3300,
        preexec_fn=users_cpus,  # every CPU, as users run it (tests/conftest.py)
    )
    seconds = time.perf_counter() - t
    assert done.returncode == 0, done.stderr[-4000:]
    url = done.stdout.strip().splitlines()[-1]
    assert url.startswith(store + "/export/"), done.stdout[-2000:]
    report = load_report(lambda name: storage.read_bytes(storage.join(url, f"eval/{name}")))
    rl = report["rl"]
    before, after = rl["accuracy_before"]["accuracy_t0"], rl["accuracy_after"]["accuracy_t0"]
    judged = {g["gate"]: g for g in report["gates"]}
    gate = judged[RL_GATE]  # the gate is on and judged what the fine-tune measured
    assert gate["threshold"] == floor and gate["value"] == pytest.approx(after - before), gate
    assert gate["passed"] and after - before >= floor, (before, after, floor)
    assert report["passed"] and report["passed_as_declared"], [g for g in report["gates"] if not g["passed"]]
    assert report["waivers"] == []  # tiny-grpo holds no gate below the built-in defaults
    verified = subprocess.run(
        [sys.executable, "-m", "flows.cli", "verify", url], capture_output=True, text=True, timeout=300
    )
    assert verified.returncode == 0 and verified.stdout.startswith("ok: "), verified.stderr[-2000:]
    assert "waiver:" not in verified.stdout
    measured(
        f"tiny-grpo release: {seconds:.0f} s; held-out pass@1 (T=0, {rl['checker']}) {100 * before:.1f}% after SFT "
        f"-> {100 * after:.1f}% after RL (gain {100 * (after - before):.1f} points, gate >= {100 * floor:.0f})"
    )
