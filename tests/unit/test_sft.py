"""SFT data (tasks/data/chat.py through tasks/data_prep.py): chat templates as transformers renders them,
loss on the assistant turns only (checked against transformers' own `{% generation %}` assistant mask),
the default template, template errors, and packing parity -- a packed row's loss equals the sum of its
documents' losses computed one at a time without packing, so attention never crosses documents."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pyarrow.parquet as pq
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as bpe

import models
from tasks.data import chat, corpora
from tasks.data_prep import DataPrepConfig, load_chat_template, prepare, run_local

pytestmark = pytest.mark.unit

# Qwen2-Instruct's chat_template (tokenizer_config.json), ChatML with a default system message.
QWEN2_TEMPLATE = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same with transformers' assistant-mask markers around each answer and its <|im_end|>.
QWEN2_GENERATION_TEMPLATE = QWEN2_TEMPLATE.replace(
    r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
    r"{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    r"{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    r"{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}",
)
# Qwen3-style: only the final answer gets an (empty) think block, so earlier turns render differently
# once the conversation goes on -- prefix renders are not prefixes of the whole render.
LAST_TURN_THINK_TEMPLATE = (
    r"{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    r"{% if message['role'] == 'assistant' and loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    r"{{ message['content'] + '<|im_end|>\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}"
)

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def conversation(i: int) -> list[dict]:
    """1-3 exchanges; every third has a system message, every fifth ends with an unanswered user turn."""
    msgs = [{"role": "system", "content": f"You answer in {WORDS[i % 12]} style."}] if i % 3 == 0 else []
    for t in range(1 + i % 3):
        msgs.append({"role": "user", "content": f"Q{i}.{t}: what follows {WORDS[(i + t) % 12]}?"})
        msgs.append({"role": "assistant", "content": f"{WORDS[(i + t + 1) % 12]} then\n{WORDS[(i + t + 2) % 12]}."})
    if i % 5 == 4:
        msgs.append({"role": "user", "content": "thanks"})
    return msgs


CONVERSATIONS = [conversation(i) for i in range(16)]


def answered(msgs: list[dict]) -> list[dict]:
    """The conversation up to its last assistant message (what data_prep trains on)."""
    return msgs[: max(i for i, m in enumerate(msgs) if m["role"] == "assistant") + 1]


def cfg(**kw) -> DataPrepConfig:
    return DataPrepConfig(**{"seq_len": 256, "vocab_size": 320, "valid_fraction": 0.25, "shard_rows": 8,
                             "max_prompts": 64, **kw})


def write_jsonl(path: Path, convs: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n" for i, m in enumerate(convs)))
    return path


def chatml_tokenizer(folder: Path, config: dict | None) -> Path:
    """A byte-level BPE with the ChatML special tokens, plus tokenizer_config.json when `config` is given."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(bpe.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [" ".join(m["content"] for m in c) for c in CONVERSATIONS] * 4 + ["You are a helpful assistant."] * 8
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def documents(out: Path, split: str) -> list[dict]:
    """Every packed segment as {ids, trainable, row, slice}: ids are the document's tokens and
    trainable[j] says whether token j is a loss target (recovered from the shifted loss_mask)."""
    docs = []
    for f in sorted(out.glob(f"{split}-*.parquet")):
        t = pq.read_table(f)
        cols = {c: np.array(t.column(c).to_pylist()) for c in t.column_names}
        for r in range(len(cols["input_ids"])):
            seg = cols["segment_ids"][r]
            for s in range(1, seg.max() + 1):
                idx = np.flatnonzero(seg == s)
                sl = slice(idx[0], idx[-1] + 1)
                ids, mask = cols["input_ids"][r][sl], cols["loss_mask"][r][sl]
                assert (cols["target_ids"][r][sl][:-1] == ids[1:]).all() and mask[-1] == 0
                docs.append({"ids": ids, "trainable": np.concatenate([[False], mask[:-1] > 0]), "row": r, "slice": sl,
                             "file": f})
    return docs


# -------------------------------------------------------------------------- tokenizer's chat template


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"])  # Qwen2-Instruct / Qwen2 base configs
def test_chatml_template_trains_exactly_the_assistant_turns(tmp_path, eos):
    import transformers

    tok_json = chatml_tokenizer(tmp_path / "tok", {"chat_template": QWEN2_TEMPLATE, "eos_token": eos,
                                                   "pad_token": "<|endoftext|>", "bos_token": None})
    corpus = write_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS)
    stats = run_local(cfg(corpus=str(corpus)), tmp_path / "out", tokenizer_json=tok_json)
    assert stats["chat_template"] == "tokenizer_config.json" and stats["chat_documents"] == len(CONVERSATIONS)
    assert stats["chunked_documents"] == {"train": 0, "valid": 0} and min(stats["documents"].values()) > 0

    tok = Tokenizer.from_file(str(tok_json))
    sp = json.loads((tmp_path / "out" / "special_tokens.json").read_text())
    assert sp["eos_token"] == eos and sp["bos_token"] == eos  # no bos in the config: eos opens documents
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    appended = eos != "<|im_end|>"  # the answers end with <|im_end|>; a different eos is appended after them

    def decode(ids) -> str:
        return tok.decode([int(i) for i in ids], skip_special_tokens=False)

    expected = {}  # whole document text -> (trained text, conversation)
    for msgs in CONVERSATIONS:
        render = hf.apply_chat_template(answered(msgs), tokenize=False)
        trained = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
        if appended:
            render, trained = render + eos, trained + "\n" + eos
        expected[eos + render] = (trained, msgs)
    docs = documents(tmp_path / "out", "train") + documents(tmp_path / "out", "valid")
    assert sorted(decode(d["ids"]) for d in docs) == sorted(expected)
    for d in docs:
        trained, msgs = expected[decode(d["ids"])]
        assert decode(d["ids"][d["trainable"]]) == trained
        # token for token the assistant mask transformers derives from {% generation %} blocks
        hf_out = hf.apply_chat_template(answered(msgs), chat_template=QWEN2_GENERATION_TEMPLATE, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
        want_ids = [sp["bos"], *hf_out["input_ids"]] + ([sp["eos"]] if appended else [])
        want_mask = [0, *hf_out["assistant_masks"]] + ([1] if appended else [])
        if appended:
            want_mask[-2] = 1  # the "\n" after the last <|im_end|> leads to the appended eos
        assert d["ids"].tolist() == want_ids
        assert d["trainable"].astype(int).tolist() == want_mask

    # held-out prompts: the conversation before its last answer, rendered with the generation prompt
    valid = [expected[decode(d["ids"])][1] for d in documents(tmp_path / "out", "valid")]
    prompts = pq.read_table(tmp_path / "out" / "prompts.parquet").to_pylist()
    assert len(prompts) == len(valid) == stats["prompts"]
    for rec in prompts:
        msgs = next(m for m in valid if rec["prompt_text"] == hf.apply_chat_template(
            answered(m)[:-1], add_generation_prompt=True, tokenize=False))
        assert rec["prompt_text"].endswith("<|im_start|>assistant\n")
        assert rec["prompt_ids"] == [sp["bos"]] + hf.encode(rec["prompt_text"], add_special_tokens=False)
        last = answered(msgs)[-1]["content"] + "<|im_end|>"
        assert decode(rec["reference_ids"]) == last + ("\n" + eos if appended else "")


def test_template_sources_and_environment(tmp_path):
    sp = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    msgs = CONVERSATIONS[1]
    base = {"eos_token": "<|im_end|>"}
    # a list of named templates: the "default" one, as transformers picks it
    listed = chat.load({**base, "chat_template": [{"name": "tool_use", "template": "x"},
                                                  {"name": "default", "template": QWEN2_TEMPLATE}]}, sp, folder="ck")
    assert listed.where == "ck/tokenizer_config.json: chat_template"
    assert listed.render(msgs) == chat.load({**base, "chat_template": QWEN2_TEMPLATE}, sp).render(msgs)
    with pytest.raises(ValueError, match=r"^ck/tokenizer_config\.json: chat_template: no template named 'default'"):
        chat.load({"chat_template": [{"name": "tool_use", "template": "x"}]}, sp, folder="ck")
    with pytest.raises(ValueError, match=r"chat_template: expected a string or a list"):
        chat.load({"chat_template": 3}, sp)
    # {% generation %} blocks render their body: same pieces as the untagged template
    tagged = chat.load({**base, "chat_template": QWEN2_GENERATION_TEMPLATE}, sp)
    assert tagged.pieces(msgs) == listed.pieces(msgs)
    assert listed.pieces(msgs)[1::2] == [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
    # sandbox and helpers as in transformers
    probe = chat.load({"chat_template": "{{ messages | tojson }}|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') }}"},
                      sp)
    assert probe.render([{"role": "user", "content": "<é>"}]).split("|")[:2] == [
        '[{"role": "user", "content": "<é>"}]', '{"a": 1}']
    with pytest.raises(ValueError, match=r"rendering failed \(SecurityError: .*__class__"):
        chat.load({"chat_template": "{{ ''.__class__.__mro__ }}"}, sp).render(msgs)
    with pytest.raises(ValueError, match=r"rendering failed \(SecurityError"):
        chat.load({"chat_template": "{% set ns = namespace() %}{% set ns._x = 1 %}"}, sp).render(msgs)
    with pytest.raises(ValueError, match=r"rendering failed \(TemplateError: roles must alternate\)"):
        chat.load({"chat_template": "{{ raise_exception('roles must alternate') }}"}, sp).render(msgs)
    with pytest.raises(ValueError, match=r"^x/tokenizer_config\.json: chat_template: not a valid Jinja template"):
        chat.load({"chat_template": "{% for m in messages %}"}, sp, folder="x")

    # through data_prep's loader: chat_template.jinja beside tokenizer.json wins over tokenizer_config.json
    tok_json = chatml_tokenizer(tmp_path / "tok", {**base, "chat_template": "{{ 'from the config' }}"})
    assert load_chat_template(tok_json.parent, {**base, "chat_template": "y"}, sp).where.endswith(
        "tokenizer_config.json: chat_template")
    (tmp_path / "tok" / "chat_template.jinja").write_text(QWEN2_TEMPLATE)
    t = load_chat_template(tok_json, base, sp)
    assert t.where == f"{tmp_path}/tok/chat_template.jinja" and t.variables == base
    assert t.render(msgs).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_template_errors_name_what_the_user_set_not_a_copy(tmp_path):
    """A base checkpoint's template that refuses a conversation: the corpus check (forgeline release's
    preflight) and the data_prep stage both name base.url's file and the document, never the store's or the
    work folder's copy of the checkpoint."""
    from types import SimpleNamespace

    from tasks import data_prep

    refusing = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system messages') }}"
                "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
    artifact = tmp_path / "store" / "base" / "0123" / "model"  # where a stage finds its tokenizer input
    chatml_tokenizer(artifact, {"chat_template": refusing, "eos_token": "<|im_end|>"})
    (artifact / "config.json").write_text("{}")  # what marks the checkpoint folder inside the artifact
    corpus = write_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS[:4])  # conversation(i) opens with a system turn
    context = SimpleNamespace(refs={"tokenizer": "ref"},
                              store=SimpleNamespace(manifest=lambda ref: {"config": {"url": "s3://bucket/ckpt"}}))
    with pytest.raises(ValueError) as e:
        data_prep.run(cfg(corpus=str(corpus)), {"tokenizer": artifact.parent}, tmp_path / "out", context=context)
    assert str(e.value).startswith("base.url: s3://bucket/ckpt/tokenizer_config.json: chat_template: rendering "
                                   "failed (TemplateError: no system messages) (document "), str(e.value)
    assert str(tmp_path) not in str(e.value)
    # the preflight renders them with the template check_base returns, named the same way
    sp = {"bos_token": None, "eos_token": "<|im_end|>"}
    template = chat.load({"chat_template": refusing}, sp, folder="base.url: s3://bucket/ckpt")
    with pytest.raises(ValueError, match=r"^base\.url: s3://bucket/ckpt/tokenizer_config\.json: chat_template: "
                                         r"rendering failed .*\(document 'c0'\)$"):
        data_prep.check_corpus(cfg(corpus=str(corpus)), template=template)
    assert data_prep.check_corpus(cfg(corpus=str(corpus))) == 4  # no template given: not rendered


def test_template_that_is_not_prefix_stable_is_rejected(tmp_path):
    tok_json = chatml_tokenizer(tmp_path / "tok", {"chat_template": LAST_TURN_THINK_TEMPLATE,
                                                   "eos_token": "<|im_end|>"})
    # one exchange is fine: the think block belongs to the (only) answer
    single = run_local(cfg(corpus=str(write_jsonl(tmp_path / "one.jsonl", [CONVERSATIONS[0]])), valid_fraction=0.0),
                       tmp_path / "one", tokenizer_json=tok_json)
    assert single["chat_documents"] == 1
    # a second exchange re-renders the first answer without its think block: no prefix, no masks
    corpus = write_jsonl(tmp_path / "two.jsonl", [CONVERSATIONS[0], CONVERSATIONS[1]])
    with pytest.raises(ValueError) as e:
        run_local(cfg(corpus=str(corpus)), tmp_path / "out", tokenizer_json=tok_json)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path}/tok/tokenizer_config.json: chat_template: not prefix-stable")
    assert msg.endswith("(document 'c1')") and "\n" not in msg
    assert not list((tmp_path / "out").iterdir())


# ------------------------------------------------------------------------------------ default template


def test_default_template_is_the_corpora_format():
    """DEFAULT_CHAT_TEMPLATE renders exactly the exchanges corpora.chat_document builds (+ bos, eos)."""
    t = chat.load(None, {"bos_token": "<B>", "eos_token": "<E>"})
    assert t.where == chat.DEFAULT_WHERE and corpora.USER in chat.DEFAULT_CHAT_TEMPLATE
    odd = [{"role": "assistant", "content": "first"}, {"role": "user", "content": "u1"},
           {"role": "system", "content": "s1"}, {"role": "user", "content": "u2"},
           {"role": "assistant", "content": "second"}]
    for msgs in [*CONVERSATIONS, odd]:
        doc = corpora.chat_document("g", msgs, "w")
        exchanges = [*doc.history, (doc.prompt, doc.completion)]
        assert t.render(answered(msgs)) == "<B>" + "".join(p + c + "<E>" for p, c in exchanges)
        pieces = []
        for k, (p, c) in enumerate(exchanges):
            pieces += [("<B>" if k == 0 else "") + p, c + "<E>"]
        assert t.pieces(msgs) == [*pieces, ""]
        assert t.prompt(msgs) == "<B>" + "".join(p + c + "<E>" for p, c in doc.history) + doc.prompt
    assert t.render(odd) == ("<B><|assistant|>\nfirst<E><|user|>\nu1\n\ns1\n\nu2\n<|assistant|>\nsecond<E>")
    assert t.render(odd[:2], add_generation_prompt=True).endswith("<E><|user|>\nu1\n<|assistant|>\n")
    with pytest.raises(ValueError, match=r"rendering failed \(TemplateError: chat roles must be .* got tool\)"):
        t.render([{"role": "tool", "content": "x"}])


def test_default_template_through_data_prep(tmp_path):
    corpus = write_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS)
    # a tokenizer trained here: <|bos|>/<|eos|> and the <|user|>/<|assistant|> special tokens
    stats = run_local(cfg(corpus=str(corpus), valid_fraction=0.0), tmp_path / "trained")
    assert stats["chat_template"] == "default" and stats["chat_documents"] == len(CONVERSATIONS)
    # a given tokenizer without tokenizer_config.json: the default template with its eos spelling
    tok_json = chatml_tokenizer(tmp_path / "tok", None)
    given = run_local(cfg(corpus=str(corpus), valid_fraction=0.0), tmp_path / "given", tokenizer_json=tok_json)
    assert given["chat_template"] == "default"
    for out, bos, eos in ((tmp_path / "trained", "<|bos|>", "<|eos|>"),
                          (tmp_path / "given", "<|endoftext|>", "<|endoftext|>")):
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        got = sorted((tok.decode(d["ids"].tolist(), skip_special_tokens=False),
                      tok.decode(d["ids"][d["trainable"]].tolist(), skip_special_tokens=False))
                     for d in documents(out, "train"))
        want = []
        for msgs in CONVERSATIONS:
            doc = corpora.chat_document("g", msgs, "w")
            exchanges = [*doc.history, (doc.prompt, doc.completion)]
            want.append((bos + "".join(p + c + eos for p, c in exchanges), "".join(c + eos for _, c in exchanges)))
        assert got == sorted(want)


# ------------------------------------------------------------------------------------ packing parity


def _build(kind: str, vocab_size: int):
    if kind == "llama":
        return models.Llama(models.LlamaConfig.tiny(vocab_size=vocab_size), rngs=nnx.Rngs(0))
    from models.gpt_oss import GptOss, GptOssConfig

    # a sliding layer (window 8) then a full one, attention sinks, top-2 of 8 experts
    return GptOss(GptOssConfig.tiny(vocab_size=vocab_size, num_hidden_layers=2), rngs=nnx.Rngs(0))


@nnx.jit
def _token_losses(model, ids, positions, segment_ids, targets, mask):
    """Per-token next-token cross entropy [B, T] in fp32, 0 off `mask`."""
    logits = model(ids, positions=positions, segment_ids=segment_ids).astype(jnp.float32)  # [B, T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask


@pytest.fixture(scope="module")
def packed_row(tmp_path_factory):
    """Three chat documents of different lengths (1, 2 and 3 exchanges) packed into one row."""
    tmp = tmp_path_factory.mktemp("packed")
    tok_json = chatml_tokenizer(tmp / "tok", {"chat_template": QWEN2_TEMPLATE, "eos_token": "<|im_end|>"})
    corpus = write_jsonl(tmp / "three.jsonl", [CONVERSATIONS[3], CONVERSATIONS[1], CONVERSATIONS[2]])
    stats = run_local(cfg(corpus=str(corpus), valid_fraction=0.0, seq_len=320), tmp / "out", tokenizer_json=tok_json)
    assert stats["rows"]["train"] == 1
    row = {c: np.array(v[0]) for c, v in pq.read_table(tmp / "out" / "train-00000.parquet").to_pydict().items()}
    assert row["segment_ids"].max() == 3 and (row["segment_ids"] == 0).any()  # three documents + padding
    assert len({int((row["segment_ids"] == s).sum()) for s in (1, 2, 3)}) == 3  # of three lengths
    return row, json.loads((tmp / "out" / "special_tokens.json").read_text())["vocab_size"]


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_packed_loss_equals_unpacked_loss(packed_row, kind):
    row, vocab_size = packed_row
    seg = row["segment_ids"]  # [T]
    T = len(seg)
    # one batch, one compile: row 0 the packed row as data_prep wrote it; rows 1-3 each document alone at
    # the start of its own sequence, unpacked (positions 0.., one segment over the row: what the model
    # does without positions/segment ids; the padding after it is invisible to a causal model and
    # carries no loss); row 4 the packed row as one segment (documents see the ones before them)
    ids, tgt, mask = (np.zeros((5, T), np.int32) for _ in range(3))
    pos, segs = np.tile(np.arange(T, dtype=np.int32), (5, 1)), np.ones((5, T), np.int32)
    for r in (0, 4):
        ids[r], tgt[r], mask[r], pos[r] = row["input_ids"], row["target_ids"], row["loss_mask"], row["positions"]
    segs[0], segs[4] = seg, seg > 0
    for s in (1, 2, 3):
        where = seg == s
        n = int(where.sum())
        assert (row["positions"][where] == np.arange(n)).all() and row["loss_mask"][where].sum() > 0
        ids[s, :n], tgt[s, :n], mask[s, :n] = row["input_ids"][where], row["target_ids"][where], row["loss_mask"][where]
    ce = np.asarray(_token_losses(_build(kind, vocab_size), ids, pos, segs, tgt, mask.astype(np.float32)))  # [5, T]
    packed, leaky = ce[0], ce[4]
    for s in (1, 2, 3):
        n = int((seg == s).sum())
        np.testing.assert_allclose(packed[seg == s].sum(), ce[s].sum(), rtol=1e-5)  # token-summed CE
        np.testing.assert_allclose(packed[seg == s], ce[s, :n], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(packed.sum(), ce[1:4].sum(), rtol=1e-5)
    # the check has teeth: without the segment ids, documents 2 and 3 attend to the ones before them
    for s in (2, 3):
        assert abs(leaky[seg == s].sum() - packed[seg == s].sum()) > 1e-4 * packed[seg == s].sum()


def test_prepare_accepts_chat_documents_from_any_source(tmp_path):
    """chat_document Documents handed to prepare() directly (no reader) take the same template path."""
    docs = [corpora.chat_document(f"g{i}", m, f"g{i}") for i, m in enumerate(CONVERSATIONS[:4])]
    tok_json = chatml_tokenizer(tmp_path / "tok", {"chat_template": QWEN2_TEMPLATE, "eos_token": "<|im_end|>"})
    stats = prepare(lambda: iter(docs), cfg(valid_fraction=0.0), tmp_path / "out", tokenizer_json=tok_json)
    assert stats["chat_documents"] == 4 and stats["loss_tokens"]["train"] > 0
    tok = Tokenizer.from_file(str(tok_json))
    texts = {tok.decode(d["ids"].tolist(), skip_special_tokens=False) for d in documents(tmp_path / "out", "train")}
    assert all(t.startswith("<|im_end|><|im_start|>system\n") for t in texts)


def test_released_tokenizer_config_reproduces_the_training_format(tmp_path):
    """transformers' apply_chat_template on the data's tokenizer_config.json (what every trained model
    ships) renders conversations exactly as data_prep trained on them."""
    import transformers

    corpus = write_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS)
    run_local(cfg(corpus=str(corpus), valid_fraction=0.0), tmp_path / "trained")
    out = tmp_path / "trained"
    sp = json.loads((out / "special_tokens.json").read_text())
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (sp["bos_token"], sp["eos_token"], sp["pad_token"])
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    rendered = sorted(tok.decode(d["ids"].tolist(), skip_special_tokens=False) for d in documents(out, "train"))
    want = sorted(hf.apply_chat_template(answered(msgs), tokenize=False) for msgs in CONVERSATIONS)
    assert rendered == want
