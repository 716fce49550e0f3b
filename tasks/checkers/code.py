"""The `code` checker: does a generated function body pass the examples in its function's docstring?

The task is the `builtin://python-stdlib-functions` corpus (tasks/data/corpora.py `function_pairs`): the prompt
is a standard-library function's `def` line through the end of its docstring, dedented, and the completion is
its body. The checker judges the prompts of functions that can be checked on their own: module-level functions
(not methods, not nested functions; not decorated either, since the prompt carries no decorators) of an
importable module whose docstring holds doctest examples (`>>>`). It runs those examples, as written in the
prompt, against the generated function in its own module, in the sandbox (tasks/checkers/sandbox.py), judges
their output in the worker, and scores 1.0 when they all pass; the share that passed otherwise (partial credit,
a dense reward for RL); 0.0 when the run reported nothing.

Which prompts apply (`applies`, `targets`): an index from prompt text to `Target` (module, function, the
reference body), built from this interpreter's `stdlib_files()` (a few seconds: only files that contain `>>>`
are parsed), kept per process and in forgeline's cache folder under a key of what it is built from; `applies` is a
dict lookup. A prompt the corpus holds twice (two functions with the same `def` line and docstring) is left out,
as it names no one function. The index is
static: it runs nothing. Some of these functions cannot pass in the sandbox whatever the body (their examples
start processes or servers, which the sandbox refuses, or are sketches that do not run as written), so
`applies` is not a promise that a reward of 1.0 is reachable; `reference_passes(prompt)` runs the function's
own body through the checker (one sandbox run, cached) and tells, so that tests and evaluation can report the
ceiling (70 of the 76 functions `applies` accepts on CPython 3.11.7). The prompts come from the running
interpreter's standard library: a corpus packed under another Python version holds prompts this index may not
know (they do not apply).

What one `score` runs. The worker parses the prompt's docstring with `doctest.DocTestParser` and keeps its
examples (those not marked SKIP, each with its option flags: `OPTIONFLAGS`, doctest.testmod's default, none,
with the example's own directives such as `# doctest: +ELLIPSIS` merged in, as DocTestRunner does). Only their
sources go to a child process confined by `run_python` (standard library only; wall 10 s, CPU 5 s, 512 MB:
`LIMITS`), where the harness, `_harness` shipped as source:

1. moves the report to a descriptor of its own (a `dup` of fd 1) and points fd 1 at stderr, before anything
   untrusted runs: what the code prints outside the examples never reaches the report's channel;
2. imports the function's module and `exec`s the prompt + completion in the module's own namespace, so that the
   new function replaces the original there (the module attribute, which examples that call `module.func` and
   the module's other functions look up) and has the original's globals (a body with `global x` changes the
   module, as the original does; a copy of the namespace would swallow that). Then requires that the name holds
   the function the prompt's `def` made (line 1 of that source: a completion that rebinds the name, e.g. to
   the original, is refused);
3. runs each example as `doctest.DocTestRunner` does (compiled in "single" mode with the module's `__future__`
   flags, in globs = a copy of the module's namespace, as `doctest.testmod` does, plus the module's top-level
   package under its own name if the module has no global of that name: `textwrap.shorten`'s examples call
   `textwrap.shorten(...)`; stdout spoofed, the displayed value included; an exception caught and formatted as
   doctest formats it), and writes one JSON line: per example, what it printed and its exception message.

The worker judges: it scores only a run that exited 0 with exactly that one line, of the right shape and length,
and compares each example's output with its `want` (or the exception with the expected one) with
`doctest.OutputChecker` and DocTestRunner's rules: 1.0 when all match, the share that matched otherwise; a
syntax error, a wrong indentation, a truncated or empty body, a crash, a timeout, a refused operation, no report
or a malformed one: 0.0, never an exception (`run_python` raises OSError only when no confined child can be
started: that is the worker's failure, not the completion's, and it propagates).

Forgery, and what remains. Nothing in the child decides the score, and no secret is there to steal: the wants
and the comparison stay in the worker. A completion that exits early (no report), prints or writes a report of
its own (fd 1 is stderr; a second line on the report's descriptor voids the report), walks the frames, a
traceback or `inspect.stack()` up to the harness and writes a report there, patches `doctest` or rebinds the
name scores 0 (tests/unit/test_code_checker.py tries each). What no process boundary can stop: the examples are
in the prompt, so a body can special-case them (hard-code the outputs it was shown, or look its docstring up at
run time and print the expected output), and it can reach the reference implementation (a C accelerator,
re-executing the module's source, which the sandbox lets it read). That is the reward hacking any visible-test
reward allows; only held-out examples defeat it. An audit of high-reward samples for `__doc__`, `_getframe`,
`reload` and the like is cheap. The caller should cut generations at the function's end (stop sequences, as
human-eval does): the checker executes everything the completion holds, extra top-level code included.

References (mirrored in spirit, not copied): OpenAI human-eval's `execution.py` `check_correctness` (program =
prompt + completion + tests, run in a child process with a timeout, passed only on positive evidence that the
tests ran), and Python's `doctest` module docs and source (https://docs.python.org/3/library/doctest.html:
DocTestParser, DocTestRunner and its `__run`, OutputChecker, testmod's globs as a copy of the module's
`__dict__`, option flags)."""

from __future__ import annotations

import ast
import collections
import dataclasses
import doctest
import functools
import hashlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import storage
from tasks.checkers.registry import register
from tasks.checkers.sandbox import Limits, run_python
from tasks.data import corpora
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


def _build_targets(files: list[tuple[str, Path]]) -> dict[str, Target]:
    seen: collections.Counter[str] = collections.Counter()
    found: dict[str, Target] = {}
    for group, path in files:
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


def _index_key(files: list[tuple[str, Path]]) -> str:
    """What the index is a function of: this interpreter, the code that builds it (this module and the corpus's),
    and every stdlib file's name, size and modification time (a stat each, no read)."""
    h = hashlib.sha256(sys.version.encode())
    for module in (__file__, corpora.__file__):
        h.update(Path(module).read_bytes())
    for group, path in files:
        st = Path(path).stat()
        h.update(f"{group}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _read_index(path: Path) -> dict[str, Target] | None:
    """A cached index, or None when it is missing or not exactly what `_write_index` writes (JSON, no pickle)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        out = {p: Target(**t) for p, t in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    fields = [f.name for f in dataclasses.fields(Target)]
    ok = all(isinstance(p, str) and all(isinstance(getattr(t, f), str) for f in fields) for p, t in out.items())
    return out if ok else None


def _write_index(path: Path, index: dict[str, Target]) -> None:
    """Best effort (a read-only cache folder only costs the next process the parse): written whole, then renamed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({p: dataclasses.asdict(t) for p, t in index.items()}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


@functools.cache
def targets() -> dict[str, Target]:
    """prompt text -> `Target`, for every prompt the checker applies to (built once per process). Parsing the
    stdlib takes 4-6 s on a 2-core CPU, and every evaluation process of every release needs the index, so it is
    kept in forgeline's cache folder (`$FORGELINE_CACHE/checkers/`) under a key of what it is built from
    (`_index_key`): a changed stdlib file, interpreter or checker builds a new one."""
    files = stdlib_files()
    path = storage.cache_root() / "checkers" / f"code-targets-{_index_key(files)}.json"
    index = _read_index(path)
    if index is None:
        index = _build_targets(files)
        _write_index(path, index)
    return index


def applies(prompt: str) -> bool:
    """Whether `prompt` is the corpus prompt of a module-level stdlib function with doctest examples (a prompt
    without `>>>` holds no example: no index is needed to say no, as for every prompt of other tasks)."""
    return ">>>" in prompt and prompt in targets()


# ----------------------------------------------------------------------------------------------------------
# scoring


def check(prompt: str, completion: str) -> Outcome | None:
    """Run the docstring examples of `prompt`'s function against `prompt + completion` in the sandbox and judge
    what they printed here, in the worker; None when the checker does not apply to `prompt`."""
    target = targets().get(prompt)
    if target is None:
        return None
    examples = _examples_of(target)
    config = {
        "module": target.module,
        "function": target.function,
        "source": prompt + completion,
        "filename": FILENAME,
        "examples": [example.source for example, _ in examples],
    }
    program = f"{_harness_source()}\n_harness({config!r})\n"
    result = run_python(program, limits=LIMITS)
    records = _report(result.stdout, len(examples))
    if records is None:  # no report, or not one of the harness's shape: nothing to judge
        return Outcome(result.status, None, None, result.wall_s, result.stderr)
    checker, failures = doctest.OutputChecker(), []
    for i, ((example, flags), (got, exc_msg)) in enumerate(zip(examples, records, strict=True)):
        if not _example_passes(checker, example, flags, got, exc_msg):
            failures.append(f"example {i}: {example.source.strip()}\n  expected: {example.exc_msg or example.want!r}\n"
                            f"  got: {exc_msg or got!r}\n")  # fmt: skip
    return Outcome(result.status, len(examples), len(failures), result.wall_s, result.stderr + "".join(failures))


@functools.cache
def _examples_of(target: Target) -> tuple[tuple[doctest.Example, int], ...]:
    """The examples of the target's docstring that doctest would run (not marked SKIP), each with its option
    flags (OPTIONFLAGS with the example's own directives merged in, as DocTestRunner does)."""
    out = []
    for example in doctest.DocTestParser().get_examples(target.docstring):
        flags = OPTIONFLAGS
        for flag, on in example.options.items():
            flags = flags | flag if on else flags & ~flag
        if not flags & doctest.SKIP:
            out.append((example, flags))
    return tuple(out)


def _report(stdout: str, count: int) -> list[tuple[str, str | None]] | None:
    """The harness's report: stdout is exactly one line, a JSON list of `count` [got, exception] pairs (got: what
    the example printed, with the displayed value; exception: doctest's exception message, or null); None for
    anything else (the completion wrote to the report's descriptor, the run ended before the report, ...)."""
    if not stdout.endswith("\n") or stdout.count("\n") != 1:
        return None
    try:
        records = json.loads(stdout)
    except ValueError:
        return None
    if not isinstance(records, list) or len(records) != count:
        return None
    out = []
    for record in records:
        if not (isinstance(record, list) and len(record) == 2 and isinstance(record[0], str)):
            return None
        if not (record[1] is None or isinstance(record[1], str)):
            return None
        out.append((record[0], record[1]))
    return out


def _example_passes(
    checker: doctest.OutputChecker, example: doctest.Example, flags: int, got: str, exc_msg: str | None
) -> bool:
    """Whether one example's output matches, decided as `doctest.DocTestRunner` decides it (its `__run`): the
    printed output against `want`, or the exception message against the expected one (IGNORE_EXCEPTION_DETAIL
    compares the exception's type only)."""
    if got and not got.endswith("\n"):  # doctest's spoofed stdout ends what it returns with a newline
        got += "\n"
    if exc_msg is None:
        return checker.check_output(example.want, got, flags)
    if example.exc_msg is None:  # an exception where none was expected
        return False
    if checker.check_output(example.exc_msg, exc_msg, flags):
        return True
    return bool(flags & doctest.IGNORE_EXCEPTION_DETAIL) and checker.check_output(
        _exception_type(example.exc_msg), _exception_type(exc_msg), flags
    )


def _exception_type(msg: str) -> str:
    """`module.Error: detail` -> `Error`, what IGNORE_EXCEPTION_DETAIL compares (doctest's
    `_strip_exception_details`)."""
    name = msg.split("\n", 1)[0].split(":", 1)[0]
    return name.rpartition(".")[2]


@register(
    "code",
    applies=applies,
    description="docstring examples of a stdlib function pass (builtin://python-stdlib-functions)",
    max_new_tokens=256,  # evaluation's budget for a body (the corpus keeps bodies up to 4,000 characters)
)
def score(prompt: str, completion: str) -> float:
    """1.0 when the generated body passes every example of the function's docstring; partial credit, the
    share of examples whose output matched, when the run exited 0 with a well-formed report; 0.0 otherwise
    (no report, a malformed one, a crash, a limit hit)."""
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
    """Put the generated function in place of the original, run each example as doctest runs it, and write
    one JSON line: per example, what it printed and the exception message, if any. It judges nothing."""
    import os
    import sys

    report_fd = os.dup(1)  # the report's own descriptor; fd 1 (print, sys.stdout) goes to stderr from here on
    os.dup2(2, 1)
    import __future__

    import importlib
    import io
    import json
    import traceback
    import types

    write, dumps, StringIO, format_exception_only = os.write, json.dumps, io.StringIO, traceback.format_exception_only
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
    flags = 0  # doctest's _extract_future_flags: the module's `from __future__ import ...` apply to its examples
    for feature_name in __future__.all_feature_names:
        feature = globs.get(feature_name)
        if feature is getattr(__future__, feature_name):
            flags |= feature.compiler_flag
    stdout, records = sys.stdout, []
    for source in cfg["examples"]:  # as doctest.DocTestRunner's __run does, without judging
        sys.stdout, sys.displayhook = StringIO(), sys.__displayhook__
        exc_msg = None
        try:
            exec(compile(source, "<example>", "single", flags, True), globs)  # a name that tells no index
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            lines = format_exception_only(type(e), e)
            if isinstance(e, SyntaxError):  # doctest compares from the `SyntaxError:` line on (no carets)
                prefixes = (f"{type(e).__qualname__}:", f"{type(e).__module__}.{type(e).__qualname__}:")
                lines = lines[next((k for k, line in enumerate(lines) if line.startswith(prefixes)), 0) :]
            exc_msg = "".join(lines)
        finally:
            got, sys.stdout = sys.stdout.getvalue(), stdout
        records.append([got, exc_msg])
    write(report_fd, (dumps(records) + "\n").encode())
