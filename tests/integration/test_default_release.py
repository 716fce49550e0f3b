"""The README's first command, for real: `forgeline release` on the built-in default recipe, then again (every
stage skipped). Its store is the test run's `tiny_release_store`, empty when the run starts: the tiny-grpo
release (test_grpo_release.py) starts from the same scratch-pretrained base, and whichever of the two reaches the
base stage first trains it while the other waits for its commit. Heavy (~10 minutes on 2 cores): `pytest -m slow`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import storage
from tasks.evaluate import load_report
from tests.conftest import users_cpus, users_xla_flags

# the release takes 15 minutes alone on a slow 2-core machine and 30 next to the other xdist worker (measured at
# afc758b: base 587 s, finetune 243 s, draft 715 s), then a second (cached) run: bounds well past both
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]


def _release(store: str, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    # compiled at XLA's default level, as users run it (the rest of the test run compiles at -O0: tests/conftest.py)
    env = {**users_xla_flags(dict(os.environ)), "PREFECT_HOME": str(tmp_path / "prefect"),
           "FORGELINE_WORKDIR": str(tmp_path / "work")}
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "release", "--store", store], env=env,
                          capture_output=True, text=True, timeout=2700, preexec_fn=users_cpus)  # every CPU, as users
    return done, time.perf_counter() - t


def test_default_release_meets_its_targets(tmp_path, tiny_release_store, measured):
    store = tiny_release_store  # shared with the tiny-grpo release, which starts from the same base (conftest.py)
    done, first = _release(store, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    # the user's terminal shows the stage lines and logs, never a Python warning (two came from our own code:
    # Prefect's "logs without a flow run id" from the checkpoint upload thread, JAX's fork warning from the
    # ephemeral server's launch)
    warned = re.findall(r"^\S+:\d+: \w*Warning: .*$", done.stderr, re.M)
    assert not warned, warned
    url = done.stdout.strip().splitlines()[-1]
    assert url.startswith(store + "/export/")
    # report.json holds what was measured about the models, timing.json the wall-clock numbers (speedup)
    report = load_report(lambda name: storage.read_bytes(storage.join(url, f"eval/{name}")))
    ppl = report["perplexity"]
    assert ppl["finetuned"] < 0.9 * ppl["base"], ppl  # clearly below, not by noise
    assert ppl["int8"] <= 1.005 * ppl["finetuned"], ppl  # issue #6's aims: int8 <= +0.5%, int4 GPTQ <= +2%
    assert ppl["w4a16-gptq-g64"] <= 1.02 * ppl["finetuned"], ppl
    assert report["quantization"]["w4a16-gptq-g64"]["weight_bytes_ratio_vs_bf16"] <= 0.30, report["quantization"]
    draft = report["draft"]
    # the shipped draft on held-out prompts, k=5, greedy: lossless and τ >= 3.0 (issue #5's target); both
    # candidates (EAGLE-3, DFlash) measured, the shipped one the best memory-bound speedup of those passing
    assert set(report["drafts"]) == {"eagle3", "dflash-lk_hybrid"}, list(report["drafts"])
    assert draft["lossless"] and draft["acceptance_length"] >= 3.0 and draft["speedup"] > 0, draft
    assert draft["runs"]["chain_t1"]["acceptance_length"] > 1, draft
    assert report["drafts"]["eagle3"]["runs"]["tree_t0"]["lossless"], report["drafts"]["eagle3"]
    passing = {n: r["speedup_memory_bound"] for n, r in report["drafts"].items()
               if r["lossless"] and r["acceptance_length"] >= 3.0}
    assert draft["name"] == max(passing, key=passing.get), (draft["name"], passing)
    assert report["passed"]
    # task accuracy for every variant (issue 19): the `code` checker, the doctest examples of the documented
    # stdlib functions (all in the train split here: the report says so), and the ceiling the data's own bodies
    # reach (rows cut the longest bodies)
    code = report["tasks"]["code"]
    assert set(code["accuracy"]) == {"base", "finetuned", "int8", "w4a16-gptq-g64"}, code
    assert code["split"] == "train" and code["prompts"] >= 20 and code["reference"] >= 0.5, code
    assert storage.exists(storage.join(url, "training/curves.png")), "the fine-tune's curves are in the bundle"
    taus = ", ".join(f"{n} {r['acceptance_length']:.2f} (memory-bound {r['speedup_memory_bound']:.2f}x, wall "
                     f"{r['speedup']:.2f}x)" for n, r in report["drafts"].items())
    measured(f"default release: {first:.0f} s; perplexity base {ppl['base']:.2f} -> fine-tuned {ppl['finetuned']:.2f}, "
             f"int8 {ppl['int8']:.2f}, int4 GPTQ {ppl['w4a16-gptq-g64']:.2f}; draft tau at k=5: {taus}; shipped "
             f"{draft['name']}, lossless {draft['lossless']}; code pass@1 (T=0) "
             + ", ".join(f"{m} {100 * a['t0']:.1f}%" for m, a in code["accuracy"].items())
             + f" (reference {100 * code['reference']:.1f}%)")

    again, second = _release(store, tmp_path)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == url
    stage_lines = [ln for ln in again.stderr.splitlines() if re.match(r"^\S+\s+(ran|skipped \(committed\))\s", ln)]
    assert len(stage_lines) == 9 and all("skipped (committed)" in ln for ln in stage_lines), stage_lines
    measured(f"default release again: {second:.0f} s, all {len(stage_lines)} stages skipped")
    assert second < 60, second
