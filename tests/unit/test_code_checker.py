"""tasks.checkers.code: the `code` checker applies to the corpus prompts of module-level stdlib functions with
doctest examples (and to no method, no function without examples, no other task's prompt), scores the
functions' own bodies and other correct bodies 1.0, wrong, broken, raising and runaway bodies 0.0, and gives
no reward to a completion that exits early, prints a success line, rebinds the name or patches doctest. `-s`
shows the share of functions whose own body passes (the checker's ceiling on the corpus)."""

from __future__ import annotations

import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tasks import checkers
from tasks.checkers import code
from tasks.checkers.sandbox import Limits
from tasks.data.corpora import function_pairs

pytestmark = pytest.mark.unit

REFERENCE_PASS_FLOOR = 0.85  # 70 of 76 on CPython 3.11.7; the rest start processes or servers, or cannot run


def corpus_prompt(group: str, function: str) -> tuple[str, str]:
    """(prompt, reference body) of `function` in the stdlib file `group`, as the corpus cuts them."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / group).read_text(encoding="utf-8")
    found = [d for d in function_pairs(source, group) if d.prompt.startswith(f"def {function}(")]
    assert len(found) == 1, f"{group}: {len(found)} prompts for {function}"
    return found[0].prompt, found[0].completion


def test_applies_to_module_level_functions_with_examples_only():
    for group, function in [
        ("textwrap.py", "shorten"),
        ("statistics.py", "median_low"),
        ("difflib.py", "get_close_matches"),
        ("heapq.py", "merge"),
    ]:
        prompt, _ = corpus_prompt(group, function)
        assert ">>>" in prompt and code.applies(prompt), function
        target = code.targets()[prompt]
        assert (target.group, target.function) == (group, function)
        assert target.module == group.removesuffix(".py")
    dedent, _ = corpus_prompt("textwrap.py", "dedent")  # a docstring without examples
    assert ">>>" not in dedent and not code.applies(dedent)
    method, _ = corpus_prompt("fractions.py", "limit_denominator")  # a method: its examples need its class
    assert ">>>" in method and not code.applies(method)
    assert not code.applies("12 + 34 =") and not code.applies("") and not code.applies("def f(x):\n")
    assert checkers.get("code").score is code.score
    assert checkers.applicable([dedent]) == [] and checkers.applicable(["3 + 4 ="]) == ["arithmetic"]
    shorten, _ = corpus_prompt("textwrap.py", "shorten")
    assert checkers.applicable([shorten]) == ["code"]
    assert code.module_name("json/__init__.py") == "json" and code.module_name("xml/dom/minidom.py") == (
        "xml.dom.minidom"
    )
    assert code.module_name("json/__main__.py") is None and code.module_name("lib2to3/a-b.py") is None


def test_the_index_is_cached_under_a_key_of_what_it_is_built_from(tmp_path, monkeypatch):
    built = dict(code.targets())  # this process's index
    monkeypatch.setenv("FORGELINE_CACHE", str(tmp_path))
    code.targets.cache_clear()
    try:
        assert code.targets() == built  # built again, and written
        (cached,) = (tmp_path / "checkers").glob("code-targets-*.json")
        code.targets.cache_clear()
        monkeypatch.setattr(code, "_build_targets", lambda files: pytest.fail("the cached index was not read"))
        assert code.targets() == built
        wrong_type = '{"p": {"group": 1, "module": "m", "function": "f", "docstring": "d", "reference": "r"}}'
        for damaged in ("{not json", wrong_type, '{"p": {"group": "g"}}', "[]"):
            cached.write_text(damaged)
            code.targets.cache_clear()
            monkeypatch.setattr(code, "_build_targets", lambda files: {"rebuilt": built[next(iter(built))]})
            assert set(code.targets()) == {"rebuilt"}, damaged  # never trusted: rebuilt and rewritten
            assert set(code._read_index(cached)) == {"rebuilt"}
    finally:
        code.targets.cache_clear()
    # the key follows each input file's size and modification time
    f = tmp_path / "mod.py"
    f.write_text("x = 1\n")
    key = code._index_key([("mod.py", f)])
    assert code._index_key([("mod.py", f)]) == key
    f.write_text("x = 22\n")
    assert code._index_key([("mod.py", f)]) != key


@pytest.mark.parametrize(
    "group, function",
    [("textwrap.py", "shorten"), ("statistics.py", "median_low"), ("difflib.py", "get_close_matches"),
     ("pickletools.py", "read_uint2"), ("doctest.py", "set_unittest_reportflags")],
)  # fmt: skip
def test_reference_bodies_pass_and_wrong_ones_fail(group, function):
    prompt, reference = corpus_prompt(group, function)
    outcome = code.check(prompt, reference)
    assert outcome is not None and outcome.passed and outcome.attempted > 0, outcome
    assert code.score(prompt, reference) == 1.0
    wrong = [
        "    return None\n",  # runs, wrong answers
        "    return (\n",  # syntax error (a truncated body)
        "",  # no body: the docstring alone returns None
        "return None\n",  # not indented: a return outside the function
        "  x = 1\n    return x\n",  # inconsistent indentation
        "    raise RuntimeError('no')\n",
        reference.split("\n", 1)[0] + "\n",  # cut after its first line
    ]
    for completion in wrong:  # below 1.0: the examples that happen to pass earn partial credit, no more
        outcome = code.check(prompt, completion)
        assert not outcome.passed and code.score(prompt, completion) < 1.0, completion
        if outcome.status == "ok" and outcome.attempted:  # the harness reported: the share that passed
            assert code.score(prompt, completion) == (outcome.attempted - outcome.failed) / outcome.attempted


def test_another_correct_body_passes():
    prompt, _ = corpus_prompt("statistics.py", "median_low")
    body = (
        "    data = sorted(data)\n"
        "    if not data:\n"
        "        raise StatisticsError('no median for empty data')\n"
        "    return data[(len(data) - 1) // 2]\n"
    )
    assert code.score(prompt, body) == 1.0
    assert code.score(prompt, body.replace("- 1", "+ 1")) < 1.0  # median_high's answer


def test_forgeries_earn_nothing(monkeypatch):
    prompt, reference = corpus_prompt("textwrap.py", "shorten")
    fake = '[["", null], ["", null]]'  # a report in the harness's format: two examples that printed nothing
    # the harness's frame, reached by walking up from the function (called by an example's code), by a caught
    # exception's traceback, by inspect: its locals hold the report's descriptor and the writer
    walk = "f = sys._getframe(1)\n    while f is not None and 'report_fd' not in f.f_locals:\n        f = f.f_back\n"
    trace = (
        "try:\n        raise RuntimeError\n    except RuntimeError as e:\n        f = e.__traceback__.tb_frame\n"
        "    while f is not None and 'report_fd' not in f.f_locals:\n        f = f.f_back\n"
    )
    insp = "f = next(i.frame for i in inspect.stack() if 'report_fd' in i.frame.f_locals)\n"
    forge = f"    os.write(f.f_locals['report_fd'], ({fake!r} + '\\n').encode())\n"
    forgeries = {
        "exit at once": "    import os; os._exit(0)\n",
        "exit when defined": "    return None\nimport os\nos._exit(0)\n",
        "print a report": f"    return None\nimport os, sys\nprint({fake!r})\nsys.stdout.flush()\nos._exit(0)\n",
        "write it to fd 1": f"    import os\n    os.write(1, b'{fake}\\n')\n    os._exit(0)\n",
        "print a report at exit": f"    return None\nimport atexit\natexit.register(print, {fake!r})\n",
        # the original function back under its name (reload re-executes textwrap in the same namespace)
        "rebind to the original": "    return None\nimport importlib, textwrap\nimportlib.reload(textwrap)\n",
        "name left unbound": "    return None\ndel shorten\n",
        # patch doctest's output checker: the child does not judge, the worker does
        "patch doctest": "    return None\nimport doctest\ndoctest.OutputChecker.check_output = lambda *a: True\n",
        # the frame walks of the issue: write a report on the harness's own descriptor, then exit 0 ...
        "frames: report, exit": f"    import os, sys\n    {walk}{forge}    os._exit(0)\n",
        "traceback: report, exit": f"    import os\n    {trace}{forge}    os._exit(0)\n",
        "inspect: report, exit": f"    import inspect, os\n    {insp}{forge}    os._exit(0)\n",
        # ... or early, then let the run go on (two reports) or fail
        "frames: report early, go on": f"    import os, sys\n    {walk}{forge}    return None\n",
        "frames: report early, fail": f"    import os, sys\n    {walk}{forge}    os._exit(1)\n",
        # the reference, and a report appended at exit on every descriptor that may be the report's
        "correct, plus a second report": reference
        + f"import atexit, os\natexit.register(lambda: [os.write(fd, b'{fake}\\n') for fd in range(3, 9)])\n",
        # gc, to reach the harness's objects (the audit hook refuses it; without the hook there is nothing to
        # forge: the verdict is not in the child)
        "gc: find the records": "    import gc\n    gc.get_objects()\n    return None\n",
    }
    for what, completion in forgeries.items():
        outcome = code.check(prompt, completion)
        assert outcome is not None and not outcome.passed, (what, outcome)
        assert code.score(prompt, completion) == 0.0, what
        if what.endswith("report, exit"):  # the walk reached the harness: its forged report was read, and judged
            assert (outcome.status, outcome.attempted, outcome.failed) == ("ok", 2, 2), (what, outcome)
    monkeypatch.setattr(code, "LIMITS", Limits(wall_s=3.0, cpu_s=1, memory_mb=512))  # runaway bodies, quickly
    runaway = {
        "spin": ("    while True:\n        pass\n", {"cpu_limit", "timeout"}),
        "sleep": ("    import time\n    time.sleep(60)\n", {"timeout"}),
        # a MemoryError is an exception like any other: doctest reports the example as failed
        "hold memory": ("    x = bytearray(10**10)\n", {"ok", "memory_limit"}),
    }
    for what, (completion, statuses) in runaway.items():
        outcome = code.check(prompt, completion)
        assert outcome is not None and outcome.status in statuses and not outcome.passed, (what, outcome)


def test_most_reference_bodies_pass():
    """The ceiling: the share of `applies` functions whose own body scores 1.0, over all of them."""
    prompts = sorted(code.targets())
    assert len(prompts) >= 50
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        passed = list(pool.map(code.reference_passes, prompts))
    took = time.monotonic() - start
    targets = [code.targets()[p] for p in prompts]
    failing = sorted(f"{t.module}.{t.function}" for t, ok in zip(targets, passed, strict=True) if not ok)
    rate = sum(passed) / len(prompts)
    print(f"\ncode checker: {sum(passed)}/{len(prompts)} reference bodies pass ({rate:.1%}) in {took:.1f} s; "
          f"failing: {', '.join(failing)}")  # fmt: skip
    assert rate >= REFERENCE_PASS_FLOOR, failing
