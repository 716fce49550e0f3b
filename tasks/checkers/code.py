"""The `code` checker: does a generated function body pass the examples in its function's docstring?

The task is the `builtin://python-stdlib-functions` corpus (tasks/data/corpora.py `function_pairs`): the prompt
is a standard-library function's `def` line through the end of its docstring, dedented, and the completion is
its body. The checker judges the prompts of functions that can be checked on their own: module-level functions
(not methods, not nested functions; not decorated either, since the prompt carries no decorators) of an
importable module whose docstring holds doctest examples (`>>>`). It runs those examples, as written in the
prompt, against the generated function in its own module, in the sandbox (tasks/checkers/sandbox.py), and
scores 1.0 when they all pass; the share that passed when the harness reported some failures (partial
credit, a dense reward for RL); 0.0 when it reported nothing.

Which prompts apply (`applies`, `targets`): an index from prompt text to `Target` (module, function, the
reference body), built once per process from this interpreter's `stdlib_files()` (a few seconds: only files
that contain `>>>` are parsed) and cached; `applies` is a dict lookup. A prompt the corpus holds twice (two
functions with the same `def` line and docstring) is left out, as it names no one function. The index is
static: it runs nothing. Some of these functions cannot pass in the sandbox whatever the body (their examples
start processes or servers, which the sandbox refuses, or are sketches that do not run as written), so
`applies` is not a promise that a reward of 1.0 is reachable; `reference_passes(prompt)` runs the function's
own body through the checker (one sandbox run, cached) and tells, so that tests and evaluation can report the
ceiling (70 of the 76 functions `applies` accepts on CPython 3.11.7). The prompts come from the running
interpreter's standard library: a corpus packed under another Python version holds prompts this index may not
know (they do not apply).

What one `score` runs, in a child process confined by `run_python` (standard library only; wall 10 s, CPU 5 s,
512 MB: `LIMITS`), the harness being `_harness` shipped as source:

1. read the parent's nonce (random, fresh per call) from stdin, the only reader of stdin, into a local of the
   harness's frame, before anything untrusted runs; take the runner's `doctest` module and drop it from
   `sys.modules`, so that generated code importing `doctest` gets a copy of its own, not the runner's classes;
2. import the function's module and `exec` the prompt + completion in the module's own namespace, so that the
   new function replaces the original there (the module attribute, which examples that call `module.func` and
   the module's other functions look up) and has the original's globals (a body with `global x` changes the
   module, as the original does; a copy of the namespace would swallow that). Then require that the name holds
   the function the prompt's `def` made (line 1 of that source: a completion that rebinds the name, e.g. to
   the original, is refused);
3. parse the prompt's docstring with `doctest.DocTestParser` and run its examples with `doctest.DocTestRunner`
   in globs = a copy of the module's namespace, as `doctest.testmod` does, plus the module's top-level package
   under its own name if the module has no global of that name (`textwrap.shorten`'s examples call
   `textwrap.shorten(...)`); option flags `OPTIONFLAGS`, doctest.testmod's default, none (directives in the
   examples, such as `# doctest: +ELLIPSIS`, still apply; every reference that passes with ELLIPSIS and
   NORMALIZE_WHITESPACE passes without them); the failure reports go to stderr;
4. as its last act, print `<nonce> <attempted> <failed>`.

The parent scores 1.0 only when the child exited 0 and the last line of its stdout is exactly that line, with
attempted > 0 and failed == 0 ((attempted - failed) / attempted with failures); a syntax error, a wrong
indentation, a truncated or empty body, an exception, a timeout, a refused operation: 0.0, never an exception
(`run_python` raises OSError only when no child can be started: that is the worker's failure, not the
completion's, and it propagates).

Forgery, and what remains. The generated code runs in the harness's process. It cannot earn a reward by
exiting early (`os._exit(0)`: no line), by printing a success line (it does not know the nonce; and a line
printed after the harness's, from a thread or an atexit handler, is not the last), by rebinding the name to
the reference function, or by patching `doctest` after importing it (its own copy). But same-process code
can in principle still tamper with the harness: walk the frames (`sys._getframe`, which the sandbox allows)
up to the harness's locals (the nonce, the runner), or patch the objects the runner hands it while an example
runs (the spoofed `sys.stdout` whose value the runner compares). The checker tests behaviour, not provenance
either: a body may reach the reference implementation (a C accelerator, re-executing the module's source,
which the sandbox lets it read). Generations that do such things are not learned by accident, but a reward
this process computes is evidence, not proof; an audit of high-reward samples for `_getframe`, `reload` and
the like is cheap. The caller should cut generations at the function's end (stop sequences, as human-eval
does): the checker executes everything the completion holds, extra top-level code included.

References (mirrored in spirit, not copied): OpenAI human-eval's `execution.py` `check_correctness` (program =
prompt + completion + tests, run in a child process with a timeout, passed only on positive evidence that the
tests ran), and Python's `doctest` module docs (https://docs.python.org/3/library/doctest.html:
DocTestParser, DocTestRunner, testmod's globs as a copy of the module's `__dict__`, option flags)."""

from __future__ import annotations

import ast
import collections
import doctest
import functools
import inspect
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from tasks.checkers.registry import register
from tasks.checkers.sandbox import Limits, run_python
from tasks.data.corpora import function_pairs, stdlib_files

LIMITS = Limits(wall_s=10.0, cpu_s=5, memory_mb=512)
OPTIONFLAGS = 0  # doctest.testmod's default: examples opt in to ELLIPSIS etc. with their own directives
FILENAME = "<completion>"  # the generated function's co_filename in the child


@dataclass(frozen=True)
class Target:
    """A function the checker can judge: where it lives, its docstring, and its own body."""

    group: str  # the corpus document group: the module's path relative to the stdlib (`json/__init__.py`)
    module: str  # its import name (`json`)
    function: str
    docstring: str  # as `__doc__` holds it (not cleaned): what the examples are parsed from
    reference: str  # the function's own body (the corpus completion)


@dataclass(frozen=True)
class Outcome:
    """What one check of a completion found. `attempted`/`failed` are None when the child gave no valid
    report line (it failed before the examples ran, or did not finish the harness)."""

    status: str  # the sandbox's (`sandbox.Result.status`)
    attempted: int | None
    failed: int | None
    wall_s: float
    stderr: str  # the doctest failure reports, or the traceback

    @property
    def passed(self) -> bool:
        return self.status == "ok" and bool(self.attempted) and self.failed == 0


# ----------------------------------------------------------------------------------------------------------
# which prompts apply


def module_name(group: str) -> str | None:
    """The import name of a stdlib file (`json/__init__.py` -> `json`), None for a script (`__main__.py`) or a
    path that is no module name."""
    parts = group.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or parts[-1] == "__main__" or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def _examples(docstring: str) -> bool:
    """Whether a docstring holds doctest examples that run (a `>>>` in prose is none, nor is an example
    marked `# doctest: +SKIP`, such as those with random output)."""
    try:
        examples = doctest.DocTestParser().get_examples(docstring)
    except ValueError:  # malformed examples (inconsistent indentation): doctest itself would refuse them
        return False
    return any(not e.options.get(doctest.SKIP) for e in examples)


def _module_targets(group: str, source: str) -> tuple[list[str], dict[str, Target]]:
    """Every corpus prompt of one module (to find prompts the corpus holds twice), and its targets by prompt."""
    module = module_name(group)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return [], {}
    lines = source.splitlines()
    top: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}  # prompt -> module-level function
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.decorator_list:
            doc = ast.get_docstring(node, clean=False)
            if doc is not None and _examples(doc):
                # the prompt function_pairs cuts for it (at column 0 its dedent changes nothing)
                top["\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]) + "\n"] = node
    prompts, found = [], {}
    for d in function_pairs(source, group):
        prompts.append(d.prompt)
        node = top.get(d.prompt)
        if node is not None and module is not None:
            found[d.prompt] = Target(group, module, node.name, ast.get_docstring(node, clean=False), d.completion)
    return prompts, found


@functools.cache
def targets() -> dict[str, Target]:
    """prompt text -> `Target`, for every prompt the checker applies to (built once per process)."""
    seen: collections.Counter[str] = collections.Counter()
    found: dict[str, Target] = {}
    for group, path in stdlib_files():
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # the corpus skips these too
            continue
        if ">>>" not in source:  # no examples in it, and no prompt it shares with a file that has some
            continue
        prompts, module_found = _module_targets(group, source)
        seen.update(prompts)
        found.update(module_found)
    return {p: t for p, t in found.items() if seen[p] == 1}


def applies(prompt: str) -> bool:
    """Whether `prompt` is the corpus prompt of a module-level stdlib function with doctest examples."""
    return prompt in targets()


# ----------------------------------------------------------------------------------------------------------
# scoring


def check(prompt: str, completion: str) -> Outcome | None:
    """Run the docstring examples of `prompt`'s function against `prompt + completion` in the sandbox; None
    when the checker does not apply to `prompt`."""
    target = targets().get(prompt)
    if target is None:
        return None
    nonce = secrets.token_hex(16)
    config = {
        "module": target.module,
        "function": target.function,
        "docstring": target.docstring,
        "source": prompt + completion,
        "filename": FILENAME,
        "optionflags": OPTIONFLAGS,
    }
    program = f"{_harness_source()}\n_harness({config!r})\n"
    result = run_python(program, limits=LIMITS, stdin=nonce + "\n")
    attempted = failed = None
    last = result.stdout.rstrip("\n").rpartition("\n")[2] if result.stdout.endswith("\n") else ""
    m = re.fullmatch(rf"{nonce} (\d+) (\d+)", last)
    if m is not None:
        attempted, failed = int(m.group(1)), int(m.group(2))
    return Outcome(result.status, attempted, failed, result.wall_s, result.stderr)


@register(
    "code",
    applies=applies,
    description="docstring examples of a stdlib function pass (builtin://python-stdlib-functions)",
    max_new_tokens=256,  # evaluation's budget for a body (the corpus keeps bodies up to 4,000 characters)
)
def score(prompt: str, completion: str) -> float:
    """1.0 when the generated body passes every example of the function's docstring; partial credit, the
    share of examples that passed, when the harness reported its (nonce-signed) counts with some failures;
    0.0 otherwise (no report, a crash, a limit hit)."""
    outcome = check(prompt, completion)
    if outcome is None:
        return 0.0
    if outcome.passed:
        return 1.0
    if outcome.status != "ok" or not outcome.attempted or outcome.failed is None:
        return 0.0
    return (outcome.attempted - outcome.failed) / outcome.attempted  # < 1: some failed


@functools.cache
def reference_passes(prompt: str) -> bool:
    """Whether the function's own body scores 1.0 here (one sandbox run, cached): the ceiling of `score` on
    this prompt. False when the checker does not apply."""
    target = targets().get(prompt)
    return target is not None and score(prompt, target.reference) == 1.0


@functools.cache
def _harness_source() -> str:
    return inspect.getsource(_harness)


# ----------------------------------------------------------------------------------------------------------
# The child side, shipped as source (the sandbox runs it as __main__): standard library only, imports inside.


def _harness(cfg: dict) -> None:
    """Read the nonce, put the generated function in place of the original, run the docstring's examples,
    and print `<nonce> <attempted> <failed>` as the last act (the module docstring says why each step)."""
    import os
    import sys

    nonce = sys.stdin.read().strip()  # before anything untrusted runs; it lives in this frame only
    write, stdout, report = os.write, sys.stdout, sys.stderr.write
    import doctest
    import importlib
    import types

    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(verbose=False, optionflags=cfg["optionflags"])
    del sys.modules["doctest"]  # generated code that imports doctest gets its own copy, not these classes
    module = importlib.import_module(cfg["module"])
    name = cfg["function"]
    exec(compile(cfg["source"], cfg["filename"], "exec"), vars(module))  # the original's globals: its module's
    func = getattr(module, name, None)
    code = getattr(func, "__code__", None) if type(func) is types.FunctionType else None
    if code is None or (code.co_filename, code.co_firstlineno, code.co_name) != (cfg["filename"], 1, name):
        raise SystemExit(f"the completion does not leave {name} bound to the function its prompt defines")
    globs = dict(vars(module))  # what doctest.testmod runs a module's examples in: a copy of its namespace
    package = cfg["module"].partition(".")[0]
    globs.setdefault(package, importlib.import_module(package))  # so that examples may call `module.func`
    test = parser.get_doctest(cfg["docstring"], globs, f"{cfg['module']}.{name}", "<docstring>", 0)
    results = runner.run(test, out=report)
    try:
        stdout.flush()  # what the code printed outside the examples comes before the report line
    except BaseException:
        pass
    write(1, f"\n{nonce} {results.attempted} {results.failed}\n".encode())
