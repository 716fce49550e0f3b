"""A gang member's progress lines (tasks/member.py): process 0 prints `@progress {json}` lines into the pipe it
shares with its stderr, and the launcher (flows/gang.py) turns them into the stage's progress. A stderr write
that lands inside a progress line must neither break the line nor fail the stage (it did: a full test run failed
`test_gang.py` with `JSONDecodeError: Extra data`, the line and a stderr message joined)."""

from __future__ import annotations

import io
import json
import logging

import pytest

from tasks import member

pytestmark = pytest.mark.unit


class Writes(io.StringIO):
    """stdout that records each `write` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_a_progress_line_is_one_write(monkeypatch):
    out = Writes()
    monkeypatch.setattr("sys.stdout", out)
    member._progress(3, 10, {"loss": 1.5})
    assert len(out.calls) == 1 and out.calls[0].endswith("\n") and out.calls[0].count("\n") == 1, out.calls
    assert json.loads(out.calls[0][len(member.PROGRESS_PREFIX):]) == {"step": 3, "total": 10, "metrics": {"loss": 1.5}}


def test_the_launcher_keeps_progress_and_logs_what_was_joined_to_it(caplog):
    seen = []
    on_line = member.line_router(lambda *a: seen.append(a), logging.getLogger("forgeline.test"))
    line = member.PROGRESS_PREFIX + json.dumps({"step": 4, "total": 10, "metrics": {"loss": 1.25}})
    with caplog.at_level(logging.INFO, logger="forgeline.test"):
        on_line(0, line + "W1207 12:00:00 a stray stderr message")  # what the failed run received
        on_line(0, member.PROGRESS_PREFIX + '{"step": 5, "tot')  # cut short: logged, not raised
        on_line(1, line)  # another process's progress: not the stage's
    assert seen == [(4, 10, {"loss": 1.25})]
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["[p0] W1207 12:00:00 a stray stderr message", f'[p0] {member.PROGRESS_PREFIX}{{"step": 5, "tot']
