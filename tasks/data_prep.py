"""Data prep: corpus -> tokenizer + packed Parquet shards + held-out prompts, in one local folder.

    python -m tasks.data_prep --corpus builtin://python-stdlib --out /tmp/dp
    python -m tasks.data_prep --corpus builtin://python-stdlib-functions --out /tmp/dpf \
        --tokenizer /tmp/dp/tokenizer.json --set seq_len=512

Output folder (the stage framework uploads it and writes the manifest; this module never does):

    tokenizer.json          HF `tokenizers` JSON: the base checkpoint's (copied) or a byte-level BPE
                            trained here on the train split (pad=0, bos=1, eos=2, <|user|>, <|assistant|>)
    special_tokens.json     {"pad", "bos", "eos": ids, "pad_token", ...: their spellings, "vocab_size"}
    tokenizer_config.json   the given one (or a new one), completed with bos/eos/pad and the chat template
                            the data was rendered with; copied into every model trained on the data
    train-00000.parquet ... packed rows, `shard_rows` per file, each column a list of exactly `seq_len`:
    valid-00000.parquet ...   input_ids int32, target_ids int32 (the next token), positions int32
                              (0.. within each segment), segment_ids int32 (1, 2, ... per segment in
                              the row, 0 = padding), loss_mask int8 (1 where target_ids is a real next
                              token of the same document and inside its loss region)
    prompts.parquet         held-out generation prompts from the valid split: prompt_ids (bos + prompt),
                            reference_ids (true continuation [+ eos]), prompt_text (the prompt, without
                            a leading bos)
    pairs-train-00000.parquet ...  preference corpora only (records with chosen / rejected answers): one
    pairs-valid-00000.parquet ...    pair per row, each side `bos + context + answer + eos` padded to
                              seq_len, loss on the final answer (tasks/data/rows.py PAIR_SCHEMA). The
                              chosen side is also packed into train/valid rows like any document, so
                              perplexity, calibration and traces read a preference corpus as they read
                              any other. A pair whose context alone fills seq_len is dropped (counted);
                              a longer answer is cut at seq_len (counted).

Documents are `bos + tokens + eos`. Plain text trains on every target; prompt/completion documents
train on the completion and its eos only. The split is a sha1 hash of the document's group
(`split_of`), unsalted so that every corpus and every run agrees.

Chat documents (a `messages` list, see tasks/data/corpora.py) are rendered with a chat template
(tasks/data/chat.py): `chat_template.jinja` beside the given tokenizer.json, else its tokenizer_config.json's
`chat_template` (a string, or the list entry named "default"), rendered in transformers' sandboxed
Jinja environment; without either (and always for a tokenizer trained here) `chat.DEFAULT_CHAT_TEMPLATE`,
the format this stage has always written (system and user messages share one block):

    <|bos|><|user|>\\n{system}\\n\\n{user}\\n<|assistant|>\\n{answer}<|eos|><|user|>\\n{user}\\n ...

The render is cut into context and answers by rendering prefixes (`messages[:i]` with the generation
prompt ends where answer i starts, `messages[:i+1]` where it stops, trailing whitespace excluded);
each piece is tokenized on its own (no post-processor) and only the answers -- every assistant
message's text and its end-of-turn marker -- are loss targets. Messages after the last assistant turn
are dropped. bos is put in front when the render does not start with it; when the last answer does
not end with the eos token (ChatML's `<|im_end|>` is not eos for a base tokenizer), eos is appended
and trained, together with the whitespace before it, so that generation stops. A template whose
prefix renders are not prefixes of the whole render is rejected (one error line naming the file and
field). The held-out prompt of a chat document is the conversation up to its last assistant message
rendered with the generation prompt; its reference is the last answer (+ eos).

Everything is streamed: the corpus is read lazily twice (once to train the tokenizer when none is
given, once to pack), documents are tokenized in small batches, at most `_OPEN_ROWS` partly filled
rows plus one shard of finished rows are held per split, and shards are written as they fill.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.cli import stage_cli
from tasks.configs import DataPrepConfig
from tasks.data import chat, corpora
from tasks.data.corpora import SPECIAL_TOKENS, Document
from tasks.data.rows import PAIR_COLUMNS, PAIR_SCHEMA, PROMPT_SCHEMA, ROW_SCHEMA, SPLITS, pairs_table, rows_table
from tasks.data.tokens import find_special_tokens
from tasks.layout import model_dir

log = logging.getLogger(__name__)


PROMPT_CAP = 64  # plain text prompts: first half of the document, at most this many tokens ...
REFERENCE_CAP = 64  # ... and the next at most this many tokens as the reference
_OPEN_ROWS = 8  # partly filled rows kept open per split for first-fit packing
_ENCODE_BATCH_DOCS = 64
_ENCODE_BATCH_CHARS = 4_000_000


def split_of(group: str, valid_fraction: float) -> str:
    """'valid' or 'train': a stable sha1 hash of the group, the same on every run, machine and corpus."""
    h = int.from_bytes(hashlib.sha1(group.encode("utf-8")).digest()[:8], "big") / 2.0**64
    return "valid" if h < valid_fraction else "train"


# ----------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (pad=0, bos=1, eos=2, then <|user|>, <|assistant|>) trained on a text stream."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, seen or not
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _read_bytes(location: str) -> bytes:
    if "://" in location:
        import storage

        with storage.open_url(location, "rb") as f:
            return f.read()
    return Path(location).read_bytes()


def _tokenizer_file(location: Path | str) -> str:
    loc = str(location)
    if "://" not in loc and Path(loc).is_dir():
        loc = str(Path(loc) / "tokenizer.json")
    return loc


def _beside(loc: str, name: str) -> str | None:
    return loc.rsplit("/", 1)[0] + "/" + name if "/" in loc else None


def load_tokenizer(location: Path | str) -> tuple[bytes, dict | None]:
    """The raw tokenizer.json (a file, or a checkpoint folder holding one) and its tokenizer_config.json."""
    loc = _tokenizer_file(location)
    try:
        raw = _read_bytes(loc)
    except FileNotFoundError:
        raise ValueError(f"tokenizer: no such file: {loc}") from None
    try:
        cfg = json.loads(_read_bytes(path)) if (path := _beside(loc, "tokenizer_config.json")) else None
    except (OSError, ValueError):
        cfg = None
    return raw, cfg if isinstance(cfg, dict) else None


def tokenizer_config(given: dict | None, sp: dict, template: chat.ChatTemplate) -> dict:
    """The tokenizer_config.json that travels with the data and every model trained on it: the given
    one, completed with the special tokens and the chat template the data was rendered with, so that
    transformers' `apply_chat_template` on a released model reproduces the training format."""
    out = dict(given or {})
    out.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key in ("bos_token", "eos_token", "pad_token"):
        if out.get(key) is None and sp.get(key) is not None:
            out[key] = sp[key]
    if out.get("chat_template") is None:
        out["chat_template"] = template.source
    return out


def load_chat_template(location: Path | str | None, tokenizer_config: dict | None, sp: dict, *,
                       origin: str | None = None) -> chat.ChatTemplate:
    """The template chat documents are rendered with: chat_template.jinja beside the tokenizer.json at
    `location`, else tokenizer_config's chat_template, else chat.DEFAULT_CHAT_TEMPLATE (see tasks/data/chat.py).
    Errors name the files under `origin` (what the user gave, e.g. `base.url: s3://...`) when given, else
    under `location`'s folder."""
    loc = _tokenizer_file(location) if location is not None else None
    template_file = None
    if loc is not None and (path := _beside(loc, "chat_template.jinja")):
        try:
            template_file = _read_bytes(path).decode("utf-8")
        except (OSError, UnicodeDecodeError):
            template_file = None
    folder = origin or (loc.rsplit("/", 1)[0] if loc and "/" in loc else "")
    return chat.load(tokenizer_config, sp, template_file=template_file, folder=folder)


# ----------------------------------------------------------------------------------------------
# packing


class _ShardWriter:
    """Greedy first-fit packing of segments into rows; rows buffered one shard at a time."""

    def __init__(self, out_dir: Path, split: str, seq_len: int, shard_rows: int, pad_id: int):
        self.out_dir, self.split, self.T, self.shard_rows, self.pad = out_dir, split, seq_len, shard_rows, pad_id
        self.open: list[list] = []  # [fill, nseg, ids, tgt, pos, seg, mask]
        self.buf = {name: np.zeros((shard_rows, seq_len), np.int8 if name == "loss_mask" else np.int32)
                    for name in ROW_SCHEMA.names}
        self.n_buf = 0
        self.shards: list[str] = []
        self.rows = self.real_tokens = self.loss_tokens = 0

    def _new_row(self) -> list:
        T = self.T
        return [0, 0, np.full(T, self.pad, np.int32), np.full(T, self.pad, np.int32),
                np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int8)]

    def add_document(self, ids: np.ndarray, trainable: np.ndarray) -> int:
        """ids: bos + tokens + eos; trainable[i]: token i is a loss target. Returns the chunk count.

        A document longer than a row is cut into `seq_len` chunks; every chunk is its own segment
        with positions restarting at 0 (a row attends within its segments only, so a continuation
        chunk sees no earlier context anyway). Targets cross chunk boundaries: the last input of a
        chunk predicts the first token of the next, so every token after bos is a target once.
        """
        L, T = len(ids), self.T
        n_chunks = 0
        for a in range(0, L, T):
            b = min(a + T, L)
            self._place(ids, trainable, a, b)
            n_chunks += 1
        return n_chunks

    def _place(self, ids, trainable, a: int, b: int) -> None:
        n = b - a
        row = next((r for r in self.open if self.T - r[0] >= n), None)
        if row is None:
            if len(self.open) >= _OPEN_ROWS:
                fullest = max(self.open, key=lambda r: r[0])
                self.open.remove(fullest)
                self._finish(fullest)
            row = self._new_row()
            self.open.append(row)
        f = row[0]
        e = min(b + 1, len(ids))  # targets ids[a+1 : b+1]; the document's last token has none
        row[2][f : f + n] = ids[a:b]
        row[3][f : f + e - a - 1] = ids[a + 1 : e]
        row[4][f : f + n] = np.arange(n, dtype=np.int32)
        row[5][f : f + n] = row[1] + 1
        row[6][f : f + e - a - 1] = trainable[a + 1 : e]
        row[0] += n
        row[1] += 1
        self.real_tokens += n
        if row[0] == self.T:
            self.open.remove(row)
            self._finish(row)

    def _finish(self, row: list) -> None:
        for name, arr in zip(ROW_SCHEMA.names, row[2:], strict=True):
            self.buf[name][self.n_buf] = arr
        self.loss_tokens += int(row[6].sum())
        self.n_buf += 1
        self.rows += 1
        if self.n_buf == self.shard_rows:
            self._flush()

    def _flush(self) -> None:
        n = self.n_buf
        table = rows_table({name: self.buf[name][:n] for name in ROW_SCHEMA.names})
        name = f"{self.split}-{len(self.shards):05d}.parquet"
        with pq.ParquetWriter(self.out_dir / name, ROW_SCHEMA, compression="zstd") as w:
            w.write_table(table, row_group_size=min(n, 1024) or None)
        self.shards.append(name)
        self.n_buf = 0

    def close(self) -> dict:
        for row in self.open:
            self._finish(row)
        self.open = []
        if self.n_buf or not self.shards:  # an empty split still gets one (empty) shard with the schema
            self._flush()
        return {"rows": self.rows, "shards": len(self.shards), "loss_tokens": self.loss_tokens,
                "fill": round(self.real_tokens / max(1, self.rows * self.T), 4)}


class _PairWriter:
    """Preference pairs, one per row (not packed), buffered one shard at a time."""

    def __init__(self, out_dir: Path, split: str, seq_len: int, shard_rows: int, pad_id: int):
        self.out_dir, self.split, self.T, self.shard_rows, self.pad = out_dir, split, seq_len, shard_rows, pad_id
        self.buf: dict[str, list[np.ndarray]] = {c: [] for c in PAIR_COLUMNS}
        self.shards: list[str] = []
        self.rows = self.dropped = self.cut = 0

    def _side(self, ids: np.ndarray, trainable: np.ndarray, start: int) -> dict[str, np.ndarray]:
        T = self.T
        n = min(len(ids) - 1, T)  # inputs ids[:n] predict ids[1:n+1]
        row = {"input_ids": np.full(T, self.pad, np.int32), "target_ids": np.full(T, self.pad, np.int32),
               "positions": np.zeros(T, np.int32), "segment_ids": np.zeros(T, np.int32),
               "loss_mask": np.zeros(T, np.int32)}
        row["input_ids"][:n] = ids[:n]
        row["target_ids"][:n] = ids[1 : n + 1]
        row["positions"][:n] = np.arange(n)
        row["segment_ids"][:n] = 1
        mask = trainable[1 : n + 1].astype(np.int32)
        mask[: max(start - 1, 0)] = 0  # the final answer only: earlier turns are context
        row["loss_mask"][:n] = mask
        return row

    def add(self, chosen: tuple[np.ndarray, np.ndarray, int], rejected: tuple[np.ndarray, np.ndarray, int]) -> None:
        """Each side as (ids, trainable, start of its final answer), as `_assemble` returns them."""
        if max(chosen[2], rejected[2]) >= self.T:  # the context fills the row: nothing to compare
            self.dropped += 1
            return
        self.cut += any(len(side[0]) - 1 > self.T for side in (chosen, rejected))
        for name, side in zip(("chosen", "rejected"), (chosen, rejected), strict=True):
            for c, v in self._side(*side).items():
                self.buf[f"{name}_{c}"].append(v)
        self.rows += 1
        if len(self.buf["chosen_input_ids"]) == self.shard_rows:
            self._flush()

    def _flush(self) -> None:
        n = len(self.buf["chosen_input_ids"])
        arrays = {c: np.stack(v) if v else np.zeros((0, self.T), np.int32) for c, v in self.buf.items()}
        name = f"pairs-{self.split}-{len(self.shards):05d}.parquet"
        with pq.ParquetWriter(self.out_dir / name, PAIR_SCHEMA, compression="zstd") as w:
            w.write_table(pairs_table(arrays), row_group_size=min(n, 1024) or None)
        self.shards.append(name)
        self.buf = {c: [] for c in PAIR_COLUMNS}

    def close(self) -> dict:
        if self.buf["chosen_input_ids"] or not self.shards:
            self._flush()
        return {"rows": self.rows, "dropped": self.dropped, "cut": self.cut}


def _doc_pieces(doc: Document) -> list[str]:
    pieces = [t for exchange in doc.history for t in exchange]
    if doc.prompt is not None:
        pieces.append(doc.prompt)
    pieces.append(doc.completion)
    return pieces


def _assemble(doc: Document, piece_ids: list[list[int]], sp: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """bos + pieces + eos as (ids, trainable, start of the final completion)."""
    bos, eos = sp["bos"], sp["eos"]
    ids: list[int] = [bos]
    mask: list[bool] = [False]
    if doc.prompt is None:
        ids += piece_ids[0]
        mask += [True] * len(piece_ids[0])
        start = 1
    else:
        for k in range(0, len(piece_ids) - 2, 2):  # earlier exchanges: prompt, completion + eos
            p, c = piece_ids[k], piece_ids[k + 1]
            ids += p + c + [eos]
            mask += [False] * len(p) + [True] * (len(c) + 1)
        p, c = piece_ids[-2], piece_ids[-1]
        ids += p
        mask += [False] * len(p)
        start = len(ids)
        ids += c
        mask += [True] * len(c)
    ids.append(eos)
    mask.append(True)
    return np.asarray(ids, np.int32), np.asarray(mask, np.bool_), start


def _chat_pieces(doc: Document, template: chat.ChatTemplate) -> list[str]:
    try:
        return template.pieces(doc.messages)
    except ValueError as e:
        raise ValueError(f"{e} (document {doc.group!r})") from None


def _assemble_chat(piece_ids: list[list[int]], sp: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """Chat pieces [context, answer, ..., answer, context] as (ids, trainable, start of the last answer).

    bos goes in front unless the template rendered it; eos is appended (trained, with the whitespace
    context before it) unless the last answer already ends with it.
    """
    bos, eos = sp["bos"], sp["eos"]
    ids: list[int] = []
    mask: list[bool] = []
    if not piece_ids[0] or piece_ids[0][0] != bos:
        ids.append(bos)
        mask.append(False)
    for k, p in enumerate(piece_ids):
        ids += p
        mask += [k % 2 == 1] * len(p)  # odd pieces are answers
    start = len(ids) - len(piece_ids[-1]) - len(piece_ids[-2])
    if not piece_ids[-2] or piece_ids[-2][-1] != eos:
        mask[len(ids) - len(piece_ids[-1]):] = [True] * len(piece_ids[-1])
        ids.append(eos)
        mask.append(True)
    return np.asarray(ids, np.int32), np.asarray(mask, np.bool_), start


def _prompt_record(doc: Document, pieces: list[str], ids: np.ndarray, trainable: np.ndarray, start: int, tok,
                   sp: dict, seq_len: int) -> dict | None:
    if doc.prompt is None:
        toks = ids[1:-1]
        n = min(len(toks) // 2, PROMPT_CAP)
        if n < 1:
            return None
        ref = toks[n : n + REFERENCE_CAP].tolist()
        if n + REFERENCE_CAP >= len(toks):
            ref.append(sp["eos"])
        return {"prompt_ids": ids[: n + 1].tolist(), "reference_ids": ref,
                "prompt_text": tok.decode(toks[:n].tolist(), skip_special_tokens=False)}
    if start >= seq_len:  # the prompt alone fills the trained context: useless for generation
        return None
    if doc.messages is not None:  # the conversation before its last answer, with the generation prompt
        text = "".join(pieces[:-2]).removeprefix(sp["bos_token"])
    else:
        text = "".join(p + c + sp["eos_token"] for p, c in doc.history) + doc.prompt
    stop = int(np.flatnonzero(trainable)[-1]) + 1  # the last answer ends at its last trained token
    return {"prompt_ids": ids[:start].tolist(), "reference_ids": ids[start:stop][: seq_len - start].tolist(),
            "prompt_text": text}


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += sum(len(p) for p in _doc_pieces(doc))
        if len(batch) >= _ENCODE_BATCH_DOCS or chars >= _ENCODE_BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encode_pieces(tok, pieces: list[str]) -> list[list[int]]:
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in encode(pieces, add_special_tokens=False)]


def _strip_markers(text: str) -> str:
    return text.replace(corpora.USER, "").replace(corpora.ASSISTANT, "")


# ----------------------------------------------------------------------------------------------
# the stage


def prepare(source: corpora.DocumentSource, cfg: DataPrepConfig, out_dir: Path, *,
            tokenizer_json: Path | str | None = None, corpus_name: str | None = None,
            tokenizer_origin: str | None = None) -> dict:
    """`run_local` on any document source (a callable returning a fresh iterator per pass)."""
    t0 = time.perf_counter()
    name = corpus_name or cfg.corpus
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".data_prep-", dir=out_dir))
    try:
        stats = _prepare(source, cfg, work, tokenizer_json, name, tokenizer_origin)
        _publish(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    log.info("data_prep done: %s", json.dumps(stats))
    return stats


def _documents(source: corpora.DocumentSource, cfg: DataPrepConfig) -> Iterator[Document]:
    return itertools.islice(source(), cfg.max_documents)


def _prepare(source, cfg: DataPrepConfig, work: Path, tokenizer_json, name: str, origin: str | None = None) -> dict:
    from tokenizers import Tokenizer

    # 1. tokenizer
    if tokenizer_json is not None:
        raw, tok_cfg = load_tokenizer(tokenizer_json)
        tok = Tokenizer.from_str(raw.decode("utf-8"))
        (work / "tokenizer.json").write_bytes(raw)
        sp = find_special_tokens(tok, tok_cfg)
        tokenizer_kind = "given"
    else:
        seen = {"documents": 0, "train": 0}

        def texts() -> Iterator[str]:
            for doc in _documents(source, cfg):
                seen["documents"] += 1
                if split_of(doc.group, cfg.valid_fraction) != "train":
                    continue
                seen["train"] += 1
                for piece in _doc_pieces(doc) + (_doc_pieces(doc.rejected) if doc.rejected else []):
                    yield _strip_markers(piece)

        t = time.perf_counter()
        tok = train_tokenizer(texts(), cfg.vocab_size)
        if seen["documents"] == 0:
            raise ValueError(f"corpus: {name} is empty (no documents)")
        if seen["train"] == 0:
            raise ValueError(f"corpus: {name} has no training documents (all {seen['documents']} hashed "
                             f"into the valid split at valid_fraction={cfg.valid_fraction})")
        log.info("trained a %d-token BPE on %d documents in %.1fs", tok.get_vocab_size(), seen["train"],
                 time.perf_counter() - t)
        tok.save(str(work / "tokenizer.json"))
        sp = find_special_tokens(tok)
        tok_cfg = None
        tokenizer_kind = "trained"
    sp["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    (work / "special_tokens.json").write_text(json.dumps(sp, indent=2) + "\n")
    template = load_chat_template(tokenizer_json, tok_cfg, sp, origin=origin)  # chat documents: module docstring
    (work / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok_cfg, sp, template), indent=2) + "\n")

    # 2. pack
    writers = {s: _ShardWriter(work, s, cfg.seq_len, cfg.shard_rows, sp["pad"]) for s in SPLITS}
    pair_writers: dict[str, _PairWriter] = {}  # opened at the first preference pair
    counts = {s: {"documents": 0, "tokens": 0, "chunked_documents": 0} for s in SPLITS}
    skipped_empty = n_chat = 0
    reservoir: list[tuple[int, dict]] = []
    rng = random.Random(cfg.seed)
    n_candidates = 0
    last_log = time.perf_counter()
    def pieces_of(d: Document) -> list[str]:
        return _doc_pieces(d) if d.messages is None else _chat_pieces(d, template)

    def assemble(d: Document, piece_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray, int]:
        return _assemble_chat(piece_ids, sp) if d.messages is not None else _assemble(d, piece_ids, sp)

    for batch in _batches(_documents(source, cfg)):
        pieces = [pieces_of(d) for d in batch]
        rejected = [pieces_of(d.rejected) if d.rejected is not None else [] for d in batch]
        flat = _encode_pieces(tok, [p for ps in pieces for p in ps] + [p for ps in rejected for p in ps])
        k, kr = 0, sum(len(ps) for ps in pieces)
        for doc, ps, rs in zip(batch, pieces, rejected, strict=True):
            piece_ids, k = flat[k : k + len(ps)], k + len(ps)
            rejected_ids, kr = flat[kr : kr + len(rs)], kr + len(rs)
            if doc.messages is None and not piece_ids[-1]:  # nothing to train on
                skipped_empty += 1
                continue
            n_chat += doc.messages is not None
            ids, trainable, start = assemble(doc, piece_ids)
            split = split_of(doc.group, cfg.valid_fraction)
            if doc.rejected is not None and (doc.rejected.messages is not None or rejected_ids[-1]):
                if not pair_writers:
                    pair_writers = {s: _PairWriter(work, s, cfg.seq_len, cfg.shard_rows, sp["pad"]) for s in SPLITS}
                pair_writers[split].add((ids, trainable, start), assemble(doc.rejected, rejected_ids))
            c = counts[split]
            c["documents"] += 1
            c["tokens"] += len(ids)
            c["chunked_documents"] += writers[split].add_document(ids, trainable) > 1
            if split == "valid" and cfg.max_prompts:
                rec = _prompt_record(doc, ps, ids, trainable, start, tok, sp, cfg.seq_len)
                if rec is not None:  # reservoir sample: bounded memory, seeded choice
                    if len(reservoir) < cfg.max_prompts:
                        reservoir.append((n_candidates, rec))
                    elif (j := rng.randint(0, n_candidates)) < cfg.max_prompts:
                        reservoir[j] = (n_candidates, rec)
                    n_candidates += 1
        if time.perf_counter() - last_log > 10:
            last_log = time.perf_counter()
            log.info("packed %d documents, %d tokens", sum(c["documents"] for c in counts.values()),
                     sum(c["tokens"] for c in counts.values()))
    n_docs = sum(c["documents"] for c in counts.values())
    if n_docs == 0:
        what = "no tokens" if skipped_empty else "no documents"
        raise ValueError(f"corpus: {name} is empty ({what})")
    if counts["train"]["documents"] == 0:
        raise ValueError(f"corpus: {name} has no training documents (all {n_docs} hashed into the valid "
                         f"split at valid_fraction={cfg.valid_fraction})")
    rows = {s: writers[s].close() for s in SPLITS}
    pairs = {s: w.close() for s, w in pair_writers.items()}

    # 3. prompts
    reservoir.sort(key=lambda x: x[0])
    prompts = pa.Table.from_pylist([r for _, r in reservoir], schema=PROMPT_SCHEMA)
    pq.write_table(prompts, work / "prompts.parquet", compression="zstd")

    return {
        "corpus": name,
        "tokenizer": tokenizer_kind,
        "vocab_size": sp["vocab_size"],
        "special_tokens": {k: sp[k] for k in ("pad", "bos", "eos")},
        "seq_len": cfg.seq_len,
        "documents": {s: counts[s]["documents"] for s in SPLITS},
        "skipped_empty_documents": skipped_empty,
        "chat_documents": n_chat,
        "chat_template": ("default" if template.where == chat.DEFAULT_WHERE  # or the file it came from
                          else template.where.rsplit("/", 1)[-1].split(":")[0]),
        "chunked_documents": {s: counts[s]["chunked_documents"] for s in SPLITS},
        "tokens": {s: counts[s]["tokens"] for s in SPLITS},
        "loss_tokens": {s: rows[s]["loss_tokens"] for s in SPLITS},
        "rows": {s: rows[s]["rows"] for s in SPLITS},
        "shards": {s: rows[s]["shards"] for s in SPLITS},
        "fill": {s: rows[s]["fill"] for s in SPLITS},
        "prompts": prompts.num_rows,
        **({"pairs": {s: pairs[s]["rows"] for s in SPLITS},
            "pairs_dropped_context_too_long": sum(p["dropped"] for p in pairs.values()),
            "pairs_answer_cut": sum(p["cut"] for p in pairs.values())} if pairs else {}),
    }


_OUTPUT_GLOBS = ("train-*.parquet", "valid-*.parquet", "pairs-*.parquet", "prompts.parquet", "tokenizer.json",
                 "special_tokens.json", "tokenizer_config.json")


def _publish(work: Path, out_dir: Path) -> None:
    """Move the finished files into out_dir, first clearing outputs of an earlier run (stale shards)."""
    for pattern in _OUTPUT_GLOBS:
        for p in out_dir.glob(pattern):
            p.unlink()
    for p in sorted(work.iterdir()):
        p.replace(out_dir / p.name)


PREFLIGHT_DOCUMENTS = 10_000


def check_corpus(cfg: DataPrepConfig, limit: int = PREFLIGHT_DOCUMENTS, *, needs_pairs: bool = False,
                 template: chat.ChatTemplate | None = None) -> int:
    """Read and validate the first `limit` documents of the corpus, without tokenizing: an unknown builtin,
    an unreadable file, a malformed record or an empty corpus raises ValueError naming the file (and line)
    before any stage runs. The stage itself still reads everything; a bad record past `limit` fails there.
    `needs_pairs` (preference optimisation): a corpus without chosen/rejected records among them is an error
    too. `template` (the base checkpoint's chat template): its conversations are rendered with it as the
    stage will, so a template that refuses one (a role it does not take, not prefix-stable) is an error
    naming the template's file and the document. Returns the number of documents read."""
    source = corpora.resolve(cfg.corpus, format=cfg.format, text_field=cfg.text_field,
                             messages_field=cfg.messages_field)
    if cfg.corpus.startswith("builtin://"):  # shipped with Python or a package: known good
        if needs_pairs and cfg.corpus.removeprefix("builtin://") not in corpora.PREFERENCE_BUILTINS:
            raise ValueError(f"corpus: finetune.method dpo needs preference pairs (chosen/rejected records), and "
                             f"{cfg.corpus} has none (the built-in one: builtin://python-stdlib-preferences)")
        return 0
    docs = list(itertools.islice(source(), min(limit, cfg.max_documents or limit)))
    if not any(d.messages or d.completion.strip() for d in docs):
        raise ValueError(f"corpus: {cfg.corpus} is empty ({'no text in ' if docs else 'no '}documents)")
    if needs_pairs and not any(d.rejected is not None for d in docs):
        raise ValueError(f"corpus: finetune.method dpo needs preference pairs (chosen/rejected records), and the "
                         f"first {len(docs)} documents of {cfg.corpus} hold none")
    if template is not None:
        for d in docs:
            for one in (d, d.rejected):
                if one is not None and one.messages is not None:
                    _chat_pieces(one, template)
    return len(docs)


def run_local(cfg: DataPrepConfig, out_dir: Path, *, tokenizer_json: Path | str | None = None,
              tokenizer_origin: str | None = None) -> dict:
    """The whole stage into a local folder; returns small JSON-able stats. Raises ValueError on bad input,
    naming the tokenizer's files under `tokenizer_origin` when given (what the user set, not a local copy)."""
    source = corpora.resolve(cfg.corpus, format=cfg.format, text_field=cfg.text_field,
                             messages_field=cfg.messages_field)
    return prepare(source, cfg, out_dir, tokenizer_json=tokenizer_json, tokenizer_origin=tokenizer_origin)


def run(config: DataPrepConfig, inputs: Mapping[str, Path], output: Path, *, progress: Any = None,
        context: Any = None) -> dict:
    """The stage: optional input `tokenizer` (a checkpoint artifact whose tokenizer.json the data must use, or
    that tokenizer.json itself; without it a tokenizer is trained on the corpus)."""
    tok = inputs.get("tokenizer")
    if tok is None:
        return run_local(config, output)
    tokenizer_json = tok if tok.is_file() else model_dir(tok) / "tokenizer.json"  # the command line's may be the file
    return run_local(config, output, tokenizer_json=tokenizer_json, tokenizer_origin=_tokenizer_origin(context))


def _tokenizer_origin(context: Any) -> str | None:
    """How errors name the `tokenizer` input's files: `base.url: <url>` when it is an imported checkpoint (the
    setting, and the user's own files, rather than the store's or the work folder's copy), `base` when it is a
    pretrained one (its tokenizer is data_prep's own); None without a stage context."""
    if context is None or "tokenizer" not in getattr(context, "refs", {}):
        return None
    try:
        config = context.store.manifest(context.refs["tokenizer"]).get("config") or {}
    except (OSError, ValueError):
        return None
    url = config.get("url") if isinstance(config, dict) else None
    if not isinstance(url, str) or not url:
        return "base"
    import storage

    return f"base.url: {storage.normalize_url(url)}"


main = stage_cli(__name__)  # `python -m tasks.data_prep`: the command line its declaration implies (tasks/cli.py)


if __name__ == "__main__":
    main()
