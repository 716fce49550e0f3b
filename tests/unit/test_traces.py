"""tasks/traces.py: offline hidden states equal the target's own forward, shards resume (locally and
through a store) byte-identical to an uninterrupted sampled run, online mode, and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

import storage
from storage import Store
from tasks import registry
from tasks import traces as tr
from tasks.data import features
from tasks.data import rows as row_files

pytestmark = pytest.mark.unit

# 6 train prompts in 3 shards, 2 held-out prompts in 1 shard; sampled (temperature > 0)
CFG = tr.TracesConfig(num_prompts=6, num_valid_prompts=2, shard_prompts=2, batch_size=2, max_new_tokens=8,
                      max_prompt_len=48, seq_len=64, temperature=0.9, aux_layer_ids=[0, 1, 2],
                      hidden_dtype="float32")
OUTPUTS = ("train-00000.parquet", "train-00001.parquet", "train-00002.parquet", "valid-00000.parquet",
           "hidden-train-00000.safetensors", "hidden-train-00001.safetensors", "hidden-train-00002.safetensors",
           "hidden-valid-00000.safetensors", "samples.jsonl", "tokenizer.json", "special_tokens.json",
           "tokenizer_config.json", "traces.json")  # traces.json too: a resumed run records the same result
GENERATE_SHARD = tr.generate_shard


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory):
    """An uninterrupted offline run of CFG: (output dir, returned metadata)."""
    model, data = target
    out = tmp_path_factory.mktemp("traces_ref")
    return out, tr.traces(CFG, model, data, out)


class Calls:
    """Wraps tasks.traces.generate_shard: records (split, index) and raises on `fail_at`."""

    def __init__(self, monkeypatch, fail_at: tuple[str, int] | None = None):
        self.seen: list[tuple[str, int]] = []
        self.fail_at = fail_at
        monkeypatch.setattr(tr, "generate_shard", self)

    def __call__(self, model, prompts, cfg, eos, pad, split, index):
        if (split, index) == self.fail_at:
            raise RuntimeError(f"injected failure at {split} shard {index}")
        self.seen.append((split, index))
        return GENERATE_SHARD(model, prompts, cfg, eos, pad, split, index)


def _same_outputs(a: Path, b: Path) -> None:
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_offline_hidden_states_are_the_models_forward(target, reference):
    import models

    out, meta = reference
    model = models.from_pretrained(str(target[0]))
    report = json.loads((out / "traces.json").read_text())
    D = model.config.hidden_size
    assert report["aux_layer_ids"] == [0, 1, 2] and report["target_hidden_size"] == D
    assert meta["train_prompts"] == 6 and meta["valid_prompts"] == 2 and meta["reused_shards"] == 0
    assert not list(out.glob(".*.tmp"))
    forward = jax.jit(lambda ids, pos, seg: model(ids, positions=pos, segment_ids=seg, return_hidden=(0, 1, 2, -1)))
    total_rows = 0
    for split, n in (("train", 3), ("valid", 1)):
        assert report["shards"][split] == [f"{split}-{i:05d}.parquet" for i in range(n)]
        for i in range(n):
            rows = row_files.read_rows(out / f"{split}-{i:05d}.parquet")
            hidden = features.load_hidden(out / f"hidden-{split}-{i:05d}.safetensors")
            R, T = rows["input_ids"].shape
            total_rows += R
            assert T == CFG.seq_len and hidden["aux"].shape == (R, T, 3 * D) and hidden["final"].shape == (R, T, D)
            logits, hs = forward(rows["input_ids"], rows["positions"], rows["segment_ids"])
            real = rows["segment_ids"] != 0  # [R, T]
            want_aux = np.concatenate([np.asarray(h) for h in hs[:3]], axis=-1)
            np.testing.assert_array_equal(hidden["aux"][real], want_aux[real])
            np.testing.assert_array_equal(hidden["final"][real], np.asarray(hs[3])[real])
            assert not hidden["aux"][~real].any() and not hidden["final"][~real].any()  # zeros at padding
            # the target's logits come back from `final` through its LM head
            np.testing.assert_allclose(np.asarray(model.lm_logits(jnp.asarray(hidden["final"])))[real],
                                       np.asarray(logits)[real], rtol=1e-5, atol=1e-5)
            # answers are the target's own: prompt tokens carry no loss, answer tokens and eos do
            assert rows["loss_mask"].sum() > 0 and (rows["loss_mask"][~real] == 0).all()
    assert total_rows == meta["train_rows"] + meta["valid_rows"]
    assert report["storage"]["hidden_bytes"] == sum(
        p.stat().st_size for p in out.glob("hidden-*.safetensors"))
    assert report["storage"]["hidden_bytes"] > total_rows * CFG.seq_len * 4 * D * 4  # 3 aux + final, fp32
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["split"] for s in samples] == ["train"] * 2 + ["valid"] * 2  # 2 prompts per first shard

    # bfloat16: what hidden_for_rows stores is the fp32 features rounded to bf16, read back by load_hidden
    rows = row_files.read_rows(out / "train-00000.parquet")
    bf16 = features.hidden_for_rows(model, rows, [0, 1, 2], "bfloat16", batch_size=4)
    assert bf16["aux"].dtype.name == "bfloat16"
    features.write_hidden(out.parent / "bf16.safetensors", bf16, [0, 1, 2])
    raw = (out.parent / "bf16.safetensors").read_bytes()
    assert b'"dtype":"BF16"' in raw[:400]
    back = features.load_hidden(out.parent / "bf16.safetensors")
    ref = features.load_hidden(out / "hidden-train-00000.safetensors")
    for k in ("aux", "final"):
        assert back[k].dtype == np.float32
        np.testing.assert_allclose(back[k], ref[k], rtol=2**-8, atol=1e-6)


def test_resume_after_failure_is_byte_identical(target, reference, tmp_path, monkeypatch):
    model, data = target
    out = tmp_path / "out"
    calls = Calls(monkeypatch, fail_at=("train", 2))
    with pytest.raises(RuntimeError, match="injected failure"):
        tr.traces(CFG, model, data, out)
    assert calls.seen == [("train", 0), ("train", 1)]
    assert (out / "train-00001.parquet").exists() and (out / "hidden-train-00001.safetensors").exists()
    assert not (out / "train-00002.parquet").exists()

    calls = Calls(monkeypatch)
    meta = tr.traces(CFG, model, data, out)
    assert calls.seen == [("train", 2), ("valid", 0)]  # shards 0 and 1 were not regenerated
    assert meta["reused_shards"] == 2
    _same_outputs(reference[0], out)

    # sampling is real: another seed gives other answers; the same (seed, split, shard) the same ones
    import models

    m = models.from_pretrained(str(model))
    sp = json.loads((data / "special_tokens.json").read_text())
    prompts = tr.load_prompts(CFG, data, sp["bos"])["train"][:2]
    one = tr.generate_shard(m, prompts, CFG, sp["eos"], sp["pad"], "train", 0)
    assert one == tr.generate_shard(m, prompts, CFG, sp["eos"], sp["pad"], "train", 0)
    assert one != tr.generate_shard(m, prompts, CFG.model_copy(update={"seed": 1}), sp["eos"], sp["pad"], "train", 0)


def test_resume_through_a_store(target, reference, tmp_path, monkeypatch):
    model, data = target
    store = Store(f"file://{tmp_path}/store", cache_dir=tmp_path / "cache")
    inputs = {"model": store.commit(model, "finetune", "m0", config={}),
              "data": store.commit(data, "data_prep", "d0", config={})}
    ckpt = store.url(f"checkpoints/traces/{registry.fingerprint('traces', CFG, inputs)}")

    calls = Calls(monkeypatch, fail_at=("train", 2))
    with pytest.raises(RuntimeError, match="injected failure"):
        registry.run_stage(store, "traces", CFG, inputs)
    assert store.lookup("traces", registry.fingerprint("traces", CFG, inputs)) is None
    assert storage.exists(storage.join(ckpt, "train-00001.done.json"))
    # a shard uploaded without its marker (killed mid-upload) is not taken as done
    storage.rm(storage.join(ckpt, "train-00001.done.json"))
    storage.write_bytes(storage.join(ckpt, "train-00001.parquet"), b"half an upload")

    calls = Calls(monkeypatch)  # a fresh staging folder: everything reused comes from the store
    ref = registry.run_stage(store, "traces", CFG, inputs)
    assert calls.seen == [("train", 1), ("train", 2), ("valid", 0)]
    assert ref.metadata["reused_shards"] == 1 and ref.metadata["hidden_states"] == "offline"
    out = store.fetch(ref)
    assert not (out / tr.PROGRESS_DIR).exists()  # progress markers stay out of the committed artifact
    _same_outputs(reference[0], out)


def test_online_mode_writes_no_hidden_states_and_reports_their_cost(target, reference, tmp_path):
    model, data = target
    cfg = CFG.model_copy(update={"hidden_states": "online", "hidden_dtype": "bfloat16"})
    meta = tr.traces(cfg, model, data, tmp_path)
    assert not list(tmp_path.glob("hidden-*")) and meta["hidden_states"] == "online"
    report = json.loads((tmp_path / "traces.json").read_text())
    rows = report["splits"]["train"]["rows"] + report["splits"]["valid"]["rows"]
    D = report["target_hidden_size"]
    assert report["storage"]["hidden_states"] == "online" and report["storage"]["hidden_bytes_estimated"]
    assert report["storage"]["hidden_bytes"] == rows * CFG.seq_len * 4 * D * 2 == meta["hidden_bytes"]
    # the estimate is the offline payload: the fp32 reference files hold twice as many bytes, plus headers
    offline = json.loads((reference[0] / "traces.json").read_text())["storage"]["hidden_bytes"]
    assert 0 < offline - 2 * report["storage"]["hidden_bytes"] < 4 * 1024
    for name in OUTPUTS[:4]:  # the same token shards as offline
        assert (tmp_path / name).read_bytes() == (reference[0] / name).read_bytes()
    assert report["storage"]["ids_bytes"] == sum(p.stat().st_size for p in tmp_path.glob("*-0000*.parquet"))


def test_errors_are_one_line_and_name_the_field(target, tmp_path):
    model, data = target
    with pytest.raises(ValueError) as e:
        tr.traces(CFG.model_copy(update={"aux_layer_ids": [0, 1, 3]}), model, data, tmp_path / "a")
    assert "aux_layer_ids" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "a").exists()  # nothing generated
    with pytest.raises(ValidationError, match="aux_layer_ids"):
        tr.TracesConfig(aux_layer_ids=[-1, 2])
    with pytest.raises(ValidationError, match="max_prompt_len"):
        tr.TracesConfig(max_prompt_len=64, seq_len=64)
    with pytest.raises(ValueError) as e:
        tr.traces(CFG.model_copy(update={"max_prompt_len": 3}), model, data, tmp_path / "b")
    assert str(data) in str(e.value) and "max_prompt_len" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="no target checkpoint"):
        tr.traces(CFG, tmp_path / "missing", data, tmp_path / "c")
    assert tr.resolve_aux_layer_ids(None, 32) == (1, 15, 28)  # EAGLE-3's defaults (Llama-3.1-8B)
