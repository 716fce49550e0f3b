"""tests/crash_rerun.py, on a suite written here: a test whose pytest-xdist worker dies (os.abort, as a native
crash inside XLA does) runs once more in a fresh worker and its verdict is that run; a test that crashes its
worker twice fails; an assertion failure is never rerun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SUITE = {
    "test_a.py": '''
import os
from pathlib import Path

def test_first():
    pass

def test_crashes_once():
    marker = Path(__file__).with_name("crashed-once")
    if not marker.exists():
        marker.write_text("")
        os.abort()

def test_after_the_crash():
    pass
''',
    "test_b.py": '''
import os
import time

def test_other_file():
    time.sleep(1)

def test_crashes_always():
    if os.environ.get("CRASH_ALWAYS"):
        os.abort()

def test_fails():
    assert os.environ.get("FAIL") is None
''',
}


def _run(tmp_path: Path, **env: str) -> tuple[int, str]:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.crash_rerun", "-p", "no:cacheprovider", "-n", "2",
           "--dist", "loadfile", "--max-worker-restart", "2", "-rA", "--rootdir", str(tmp_path),
           "-c", str(tmp_path / "pytest.ini"), str(tmp_path)]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env})
    return p.returncode, p.stdout + p.stderr


@pytest.mark.unit
def test_a_crashed_test_runs_again_in_a_fresh_worker(tmp_path):
    rc, out = _run(tmp_path)
    assert rc == 0, out
    assert "6 passed, 1 rerun" in out, out
    assert "test_a.py::test_crashes_once: its worker died; the rerun passed" in out, out


@pytest.mark.unit
def test_an_assertion_failure_is_not_rerun(tmp_path):
    rc, out = _run(tmp_path, FAIL="1")
    assert rc == 1, out
    assert "1 failed, 5 passed, 1 rerun" in out, out
    assert "test_fails: its worker died" not in out and "FAILED test_b.py::test_fails" in out, out


@pytest.mark.unit
def test_a_second_crash_of_the_same_test_fails_the_run(tmp_path):
    rc, out = _run(tmp_path, CRASH_ALWAYS="1")
    assert rc == 1, out
    assert "test_b.py::test_crashes_always: its worker died; the rerun failed" in out, out
    assert "FAILED test_b.py::test_crashes_always - worker" in out, out
