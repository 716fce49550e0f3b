"""HF checkpoint I/O without transformers: config spellings, round trips, URLs, corrupt files."""

from __future__ import annotations

import json
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from models import ARCHITECTURES, Llama, LlamaConfig, check_pretrained, from_pretrained, save_pretrained, state_to_hf

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = Llama(LlamaConfig.tiny(64, num_hidden_layers=1), rngs=nnx.Rngs(0))
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, str(path))
    return model, path


def copy_ckpt(src, dst):
    os.makedirs(dst, exist_ok=True)
    for fn in os.listdir(src):
        with open(os.path.join(src, fn), "rb") as f, open(os.path.join(dst, fn), "wb") as g:
            g.write(f.read())
    return dst


def test_config_legacy_and_v5_spellings_agree():
    v5 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
          "dtype": "bfloat16", "eos_token_id": [5, 6]}
    legacy = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
    legacy.update(rope_theta=5e5, torch_dtype="bfloat16", rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    a, b = LlamaConfig.from_hf(v5), LlamaConfig.from_hf(legacy)
    assert a == b and hash(a) == hash(b)
    assert a.head_dim == 8 and a.rope_scaling["rope_type"] == "llama3" and a.eos_token_id == (5, 6)
    assert LlamaConfig.from_hf(a.to_hf()) == a
    with pytest.raises(NotImplementedError, match="longrope"):
        LlamaConfig.from_hf({**v5, "rope_parameters": {"rope_type": "longrope", "factor": 4.0}})


def test_registry_keys():
    assert set(ARCHITECTURES) == {"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                  "DeepseekV3ForCausalLM", "GptOssForCausalLM", "Glm4MoeForCausalLM",
                                  "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV4ForCausalLM"}
    cfg = LlamaConfig.qwen3_tiny(64)
    d = cfg.to_hf()
    assert d["model_type"] == "qwen3" and d["architectures"] == ["Qwen3ForCausalLM"]
    assert LlamaConfig.from_hf(d) == cfg


def test_round_trip_and_file_url(saved):
    model, path = saved
    files = sorted(os.listdir(path))
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    ids = jnp.arange(12, dtype=jnp.int32)[None] % 64
    for where in (str(path), path.as_uri()):
        loaded = from_pretrained(where)
        np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(model(ids)))
    tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert set(tensors) == set(state_to_hf(model))


def test_sharded_save_and_tied_omits_lm_head(tmp_path):
    model = Llama(LlamaConfig.qwen3_tiny(64), rngs=nnx.Rngs(1))
    save_pretrained(model, str(tmp_path), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "lm_head.weight" not in index["weight_map"]
    assert "model.layers.1.self_attn.q_norm.weight" in index["weight_map"]
    ids = jnp.arange(5, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(from_pretrained(str(tmp_path))(ids)), np.asarray(model(ids)))
    save_pretrained(model, str(tmp_path))  # re-save unsharded into the same folder: stale shards go
    assert not any(fn.startswith("model-") for fn in os.listdir(tmp_path))


def test_a_module_export_is_computed_once_per_save_and_planned_without_tracing_it_again(tmp_path, monkeypatch):
    """Streamed saving computes one MoE layer's expert tensors together (all of them, once), and plans the
    files from the shapes `hf_tensors` recorded: one abstract evaluation per module, not one per tensor."""
    from models.moe import Experts
    from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

    calls: list[bool] = []  # True: abstract (traced), False: concrete
    export = Experts.hf_export

    def counted(self):
        out = export(self)
        calls.append(isinstance(next(iter(out.values())), jax.core.Tracer))
        return out

    monkeypatch.setattr(Experts, "hf_export", counted)
    model = Qwen3Moe(Qwen3MoeConfig.tiny(), rngs=nnx.Rngs(0))
    layers = sum(isinstance(m, Experts) for _, m in nnx.iter_graph(model))
    save_pretrained(model, str(tmp_path), max_shard_bytes=50_000)
    assert layers == 2 and calls.count(False) == layers and calls.count(True) == layers
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_files_are_spread_over_the_writing_processes_by_bytes():
    """In file order, each file to the process with the fewest bytes so far: one file is process 0's."""
    from models.hf import _assign_files

    assert _assign_files([5], 2) == [0]
    assert _assign_files([10, 10, 10, 10], 2) == [0, 1, 0, 1]
    assert _assign_files([100, 10, 10, 10], 2) == [0, 1, 1, 1]
    assert _assign_files([10, 10, 10], 1) == [0, 0, 0]


def test_a_tensor_written_in_row_blocks_is_the_tensor_written_whole(tmp_path):
    """`SafetensorsWriter.write_parts` (a gathered tensor's shards along its first axis, in order) writes the
    bytes `write` does, and refuses parts that do not add up to the tensor."""
    from models.hf import SafetensorsWriter

    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    entries = [("a", (6, 4), np.dtype(np.float32))]
    whole = SafetensorsWriter(str(tmp_path / "whole.safetensors"), entries, {"format": "pt"})
    whole.write("a", a)
    whole.close()
    parts = SafetensorsWriter(str(tmp_path / "parts.safetensors"), entries, {"format": "pt"})
    parts.write_parts("a", (6, 4), np.float32, iter([a[:2], a[2:4], a[4:]]))
    parts.close()
    assert (tmp_path / "whole.safetensors").read_bytes() == (tmp_path / "parts.safetensors").read_bytes()
    short = SafetensorsWriter(str(tmp_path / "short.safetensors"), entries, {"format": "pt"})
    with pytest.raises(ValueError, match="a: 32 bytes never written"):
        short.write_parts("a", (6, 4), np.float32, iter([a[:2], a[2:4]]))
    with pytest.raises(ValueError, match="expected a float32"):
        SafetensorsWriter(str(tmp_path / "x.safetensors"), entries, {"format": "pt"}).write_parts(
            "a", (6, 4), np.float16, iter([a.astype(np.float16)]))


def test_slices_that_split_the_same_rows_are_read_once_per_row_block():
    """Device slices that share their leading rows and split the other axes (an expert stack sharded on its
    on-disk last axis) are filled from one read of each block of rows, then scattered; slices that do not
    tile a box are read one by one. Either way every buffer holds its slice."""
    from models import views
    from models.transfer import _read_tasks, _read_tiles

    full = np.arange(6 * 8 * 10, dtype=np.float32).reshape(6, 8, 10)

    class Counted(views.Array):
        reads: list = []

        def read_into(self, index, out):
            Counted.reads.append(index)
            out[...] = full[tuple(slice(a, b) for a, b in index)]

    view = Counted(full)
    for keys, grouped in (
        ([((0, 3), (0, 8), (0, 5)), ((0, 3), (0, 8), (5, 10)), ((3, 6), (0, 8), (0, 5)), ((3, 6), (0, 8), (5, 10))],
         True),
        ([((0, 6), (0, 4), (0, 10)), ((0, 6), (4, 8), (0, 10))], True),
        ([((0, 6), (0, 8), (0, 4)), ((0, 6), (0, 8), (6, 10))], False),  # a gap: no box to read once
        ([((0, 3), (0, 8), (0, 10)), ((3, 6), (0, 8), (0, 10))], False),  # rows split already: contiguous
    ):
        Counted.reads = []
        buffers = [np.zeros([b - a for a, b in key], np.float32) for key in keys]
        tasks = _read_tasks(keys, 4)
        for rows, members in tasks:
            if rows is None:
                view.read_into(keys[members[0]], buffers[members[0]])
            else:
                _read_tiles(view, rows, [keys[m] for m in members], [buffers[m] for m in members])
        for key, buffer in zip(keys, buffers, strict=True):
            np.testing.assert_array_equal(buffer, full[tuple(slice(a, b) for a, b in key)])
        assert all(rows is not None for rows, _ in tasks) == grouped
        assert len(Counted.reads) == (len({k[0] for k in keys}) if grouped else len(keys))


def test_remote_checkpoints_are_read_by_ranges_never_copied_whole(saved, tmp_path, monkeypatch):
    """A checkpoint at a URL (memory:// here, s3:// in tests/integration) loads through ranged reads of its
    files: no download of the folder, and every byte counted once. Saving goes through storage.upload_dir."""
    import storage

    model0, path = saved
    url = f"memory://ckpt-{uuid.uuid4().hex}"
    storage.upload_dir(path, url)

    def no_download(*args, **kwargs):
        raise AssertionError("a remote checkpoint was copied whole")

    monkeypatch.setattr(storage, "download_dir", no_download)
    stats: dict = {}
    model = from_pretrained(url, stats=stats)
    for a, b in zip(jax.tree.leaves(nnx.state(model0)), jax.tree.leaves(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert stats["bytes_read"] == (path / "model.safetensors").stat().st_size  # header + every tensor, once
    save_pretrained(model, f"{url}-out")
    assert sorted(p.rsplit("/", 1)[-1] for p in storage.list_files(f"{url}-out")) == \
        ["config.json", "generation_config.json", "model.safetensors"]


def test_truncated_file_names_file_and_tensor(saved, tmp_path):
    _, path = saved
    bad = copy_ckpt(path, tmp_path / "bad")
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated.*tensor model\.") as e:
        from_pretrained(str(bad))
    assert "\n" not in str(e.value)


def test_garbage_file_raises_value_error(saved, tmp_path):
    _, path = saved
    bad = copy_ckpt(path, tmp_path / "garbage")
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        from_pretrained(str(bad))
    (bad / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        from_pretrained(str(bad))


def test_missing_tensor_and_wrong_shape(saved, tmp_path):
    _, path = saved
    tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
    bad = copy_ckpt(path, tmp_path / "missing")
    name = "model.layers.0.mlp.up_proj.weight"
    kept = {k: v for k, v in tensors.items() if k != name}
    safetensors.numpy.save_file(kept, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensors do not match Llama: 1 missing: {name}$"):
        from_pretrained(str(bad))
    tensors[name] = np.zeros((3, 3), np.float32)
    safetensors.numpy.save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"model\.safetensors: .*1 mis-shaped: {name} \[3, 3\] \(expected"):
        from_pretrained(str(bad))


def test_every_mismatch_is_listed_in_one_error(saved, tmp_path):
    """Missing, unexpected and mis-shaped tensors together: one line names them all."""
    _, path = saved
    tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
    gone = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.v_proj.weight"]
    for n in gone:
        del tensors[n]
    tensors["model.layers.0.mlp.down_proj.weight"] = np.zeros((2, 2), np.float32)
    tensors["model.layers.7.mlp.extra.weight"] = np.zeros((2,), np.float32)
    bad = copy_ckpt(path, tmp_path / "mismatch")
    safetensors.numpy.save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        from_pretrained(str(bad))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(bad / "model.safetensors"))
    assert f"2 missing: {gone[0]}, {gone[1]}" in msg
    assert "1 unexpected: model.layers.7.mlp.extra.weight" in msg
    assert "1 mis-shaped: model.layers.0.mlp.down_proj.weight [2, 2]" in msg


def refuse_tensor_reads(monkeypatch) -> None:
    """Make reading any tensor's bytes from a safetensors checkpoint fail (headers still read)."""
    from models.safetensors_io import SafetensorsCheckpoint

    def refused(*_args, **_kwargs):
        raise AssertionError("a tensor's bytes were read")

    for method in ("read", "read_into", "_pread", "_read_mapped", "_read_remote"):
        monkeypatch.setattr(SafetensorsCheckpoint, method, refused)


def test_check_pretrained_finds_what_a_load_would_from_the_headers_alone(saved, tmp_path, monkeypatch):
    """The command line's preflight (`forgeline release` runs it on base.url): the same one-line error as
    `from_pretrained` for a mismatched checkpoint, the abstract model for a good one, and no tensor read."""
    model, path = saved
    tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = np.zeros((3,), np.float32)
    tensors["model.layers.7.mlp.extra.weight"] = np.zeros((2,), np.float32)
    bad = copy_ckpt(path, tmp_path / "mismatch")
    safetensors.numpy.save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError) as loaded:
        from_pretrained(str(bad))
    refuse_tensor_reads(monkeypatch)
    with pytest.raises(ValueError) as checked:
        check_pretrained(str(bad))
    assert str(checked.value) == str(loaded.value)
    assert "1 missing" in str(checked.value) and "1 unexpected" in str(checked.value)
    abstract = check_pretrained(f"file://{path}")
    assert abstract.config == model.config
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(abstract)))


def test_no_weights_or_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config\.json: architectures \['GPT2LMHeadModel'\] is not supported "
                                         r"\(supported: LlamaForCausalLM, .*DeepseekV3ForCausalLM, GptOssForCausalLM"):
        from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig.tiny(64).to_hf()))
    with pytest.raises(ValueError, match="no model.safetensors"):
        from_pretrained(str(tmp_path))
