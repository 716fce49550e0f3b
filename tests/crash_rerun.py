"""A pytest plugin: a test whose pytest-xdist worker process dies is run once more, in a fresh worker.

A worker that dies (a native crash inside XLA's CPU runtime: three so far, in full runs that compile thousands
of programs per process, each in a test that passes alone, traced to the process running out of memory
mappings, which tests/conftest.py now prevents; or a kill) takes the test it was running with it. pytest-xdist
replaces the worker and hands the dead worker's unfinished tests, the crashed one first, to the fresh process
(its `loadfile` scheduler re-queues the unfinished part of the file).
This plugin marks the *first* crash of a test "rerun" instead of failed, so the test's verdict is its run in
the fresh worker, and lists every crash at the end of the run. A second crash of the same test fails it, as
does a crash once `--max-worker-restart` is spent, and a crashed test that never ran again fails the
session. Assertion failures are never rerun.

Uses pytest-xdist's `pytest_handlecrashitem` hook (the one pytest-rerunfailures builds on).
"""

from __future__ import annotations

import pytest

_CRASHED: dict[str, str] = {}  # nodeid -> the outcome of its run after the crash ("" until it reports)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    restarts = sched.config.getoption("maxworkerrestart")
    if crashitem not in _CRASHED and (restarts is None or len(_CRASHED) < int(restarts)):
        _CRASHED[crashitem] = ""
        report.outcome = "rerun"  # type: ignore[assignment]


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN (worker crashed)"
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid in _CRASHED and report.outcome != "rerun" and (report.when == "call" or report.failed):
        _CRASHED[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter) -> None:
    if _CRASHED:
        terminalreporter.section("worker crashes (each test rerun once in a fresh worker)")
        for nodeid, outcome in _CRASHED.items():
            terminalreporter.write_line(f"{nodeid}: its worker died; the rerun {outcome or 'NEVER RAN'}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _CRASHED and not all(_CRASHED.values()) and session.exitstatus == 0:
        print("\nerror: a test whose worker crashed was not run again")
        session.exitstatus = 1
