"""EAGLE-3 draft exports checked against code nobody on this project wrote.

1. vLLM `speculators` 0.9.0 (the library that trains and converts `Eagle3Speculator` drafts) loads
   our `save_speculators` output with its own config classes and `from_pretrained`, and its draft
   forward (3 TTT steps, its dense-mask "eager" path) gives the same logits and fed-back hidden states
   as our `Eagle3Draft` in fp32; the per-step TTT losses of our `ttt_loss` equal the ones computed from
   its unrolled logits (diagonal-extended attention, shifted tokens, rope offsets, packed segments).
2. SGLang `LlamaForCausalLMEagle3` and vLLM `Eagle3LlamaForCausalLM` (GPU-only, not installable
   here): what their `__init__` / `load_weights` / config adapters read is encoded below as explicit
   tables (cited, not copied) and our `save_sglang` / `save_speculators` output is checked against
   them: tensor names, shapes, dtypes, config fields, aux-layer-id conventions, nothing an engine
   would silently drop.

Reference: docs/formats/eagle3.md (layouts and pitfalls: d2t inside the safetensors file, vocab_size =
the target's, dropped keys, aux layer ids).

The speculators library pins transformers<=5.19 and pulls torchvision / torchaudio; it imports and
runs with our transformers 5.24 and torch 2.13 CPU when installed without its dependency resolver
(its package __init__ imports its trainer, hence openai / datasets / hs-connectors):
    pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 distro==1.9.0 \
        jiter==0.19.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pandas==3.1.1
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from parity_helpers import TINY, VARIANTS, rel_err

from models.eagle3 import (
    Eagle3Config,
    Eagle3Draft,
    build_draft_vocab,
    load_eagle3,
    save_sglang,
    save_speculators,
    ttt_loss,
)
from models.llama import LlamaConfig

pytestmark = pytest.mark.parity

SPECULATORS_INSTALL = ("pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 distro==1.9.0 "
                       "jiter==0.19.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pandas==3.1.1")
TARGET_LAYERS = 8  # distinct default aux ids (1, 3, 4); speculators rejects repeated ids
DRAFT_VOCAB = 48
T = 12  # tokens per test sequence
TTT_STEPS = 3
TOL = 1e-4


# ------------------------------------------------------------------------------------------------
# What the serving engines read (encoded from their source; see the citations on each entry)
# ------------------------------------------------------------------------------------------------
#
# SGLang: python/sglang/srt/models/llama_eagle3.py (sgl-project/sglang, read at 03d5a777):
#   - `LlamaModel.__init__`: `fc = Linear(target_hidden_size * 3 if hasattr(config, "target_hidden_size")
#     else hidden_size * 3, hidden_size, bias=getattr(config, "bias", False))` -> a `target_hidden_size`
#     key must hold an int (null makes `None * 3`); `midlayer` is one decoder layer whose fused
#     `qkv_proj` reads 2 * hidden_size; more than one layer adds `additional_layers`.
#   - `LlamaForCausalLMEagle3.__init__`: `lm_head = embed_tokens` when `tie_word_embeddings`, else
#     `ParallelLMHead(config.draft_vocab_size, hidden_size)`; `embed_tokens` is
#     `VocabParallelEmbedding(config.vocab_size, ...)` shared with the target (so vocab_size = V).
#   - `load_weights`: "d2t" -> `hot_token_id = d2t + arange(len(d2t))`; "t2d" skipped; q/k/v_proj
#     stacked into `qkv_proj`, gate/up_proj into `gate_up_proj`; any other name is looked up as-is or
#     with a "model." prefix and SKIPPED WITHOUT AN ERROR when absent (a `layers.0.*` tensor is lost).
#   - python/sglang/srt/models/llama.py `set_eagle3_layers_to_capture(layer_ids)`:
#     `layers_to_capture = [i + 1 for i in layer_ids]`, captured as the residual stream ENTERING that
#     layer, i.e. `eagle_config.eagle_aux_hidden_state_layer_ids` are output-layer ids (ours). Since
#     sgl-project/sglang#25454 the +1 is applied only when the first id is 1 (other lists are read as
#     boundary ids), so the SGLang layout must start at 1 to mean the same thing in every version;
#     sglang#32334 reads GPT-OSS targets' ids as boundaries regardless.
# vLLM: vllm/model_executor/models/llama_eagle3.py (vllm-project/vllm, read at 00bd1493):
#   - `LlamaModel.load_weights` renames "midlayer." -> "layers.0." and then indexes `params_dict[name]`
#     (an unknown name raises KeyError); `Eagle3LlamaForCausalLM.load_weights` skips "t2d", stores
#     "d2t" in `draft_id_to_target_id` (an int64 [draft_vocab_size] parameter; `compute_logits`
#     scatters draft logits to `arange(draft_vocab_size) + d2t` of a `vocab_size` row filled with
#     -inf), prefixes everything but `lm_head` with "model.", and skips `embed_tokens` when absent.
#   - `fc` input: `target_hidden_size * 3` if the config has the attribute, else `hidden_size * 3`;
#     `eagle_config.use_aux_hidden_state` (default True); `norm_before_residual` attribute (default
#     False here); q/k/v bias from `attention_bias`, MLP bias from `mlp_bias`.
#   - vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py `get_eagle3_aux_layers_from_config` reads
#     the TOP-LEVEL `eagle_aux_hidden_state_layer_ids` of the draft config only (not `eagle_config`)
#     and passes them to the target's `set_aux_hidden_state_layers`; vllm/model_executor/models/
#     llama.py captures `hidden_states + residual` BEFORE running layer `idx`, so vLLM id i+1 = the
#     output of layer i. Without the field the target's default (2, N//2, N-3) is used.
#   - vllm/transformers_utils/configs/speculators/{base,algos}.py (speculators layout): requires
#     `speculators_config.proposal_methods[0].speculative_tokens`, `speculators_config.verifier.
#     name_or_path`, a dict `transformer_layer_config` (becomes the draft's hf_config; its
#     `model_type` picks Eagle3LlamaForCausalLM for "llama", a QK-norm Qwen3 layer for "qwen3");
#     `update_eagle3` copies `draft_vocab_size`, `target_hidden_size` (only when not null),
#     `norm_before_residual` (DEFAULT TRUE when the key is missing), `norm_before_fc`, `fc_norm`,
#     `norm_output` (default False) and `eagle_aux_hidden_state_layer_ids`.
# speculators 0.9.0 itself (src/speculators/models/utils.py `resolve_target_layer_ids`) defaults the
# aux ids to [2, N//2, N-3] (vLLM's capture ids) and accepts ids up to N.


def engine_tensors(cfg: Mapping[str, Any], layer_prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, safetensors dtype) that SGLang / vLLM build from a draft config.json
    (geometry read from the top level for the SGLang layout, from `transformer_layer_config` for
    speculators'). `layer_prefix`: "midlayer." (SGLang layout) or "layers.0." (speculators)."""
    layer = cfg.get("transformer_layer_config", cfg)
    D, F = layer["hidden_size"], layer["intermediate_size"]
    N, K, H = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    V, Vd = layer["vocab_size"], cfg["draft_vocab_size"]
    Dt = cfg.get("target_hidden_size") or D
    wdtype = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[cfg["torch_dtype"]]
    p = layer_prefix
    return {
        "fc.weight": ((D, 3 * Dt), wdtype),
        f"{p}input_layernorm.weight": ((D,), wdtype),
        f"{p}hidden_norm.weight": ((D,), wdtype),
        f"{p}self_attn.q_proj.weight": ((N * H, 2 * D), wdtype),
        f"{p}self_attn.k_proj.weight": ((K * H, 2 * D), wdtype),
        f"{p}self_attn.v_proj.weight": ((K * H, 2 * D), wdtype),
        f"{p}self_attn.o_proj.weight": ((D, N * H), wdtype),
        f"{p}post_attention_layernorm.weight": ((D,), wdtype),
        f"{p}mlp.gate_proj.weight": ((F, D), wdtype),
        f"{p}mlp.up_proj.weight": ((F, D), wdtype),
        f"{p}mlp.down_proj.weight": ((D, F), wdtype),
        "norm.weight": ((D,), wdtype),
        "lm_head.weight": ((Vd, D), wdtype),
        "d2t": ((Vd,), "I64"),  # inside the safetensors file, int64 offsets (docs/formats/eagle3.md)
        "t2d": ((V,), "BOOL"),
    }


STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def sglang_destination(name: str) -> str | None:
    """Where SGLang's `LlamaForCausalLMEagle3.load_weights` puts a tensor; None = silently dropped."""
    if "d2t" in name:
        return "hot_token_id"
    if "t2d" in name:
        return "<skipped t2d>"
    for old, new in STACKED:
        if old in name:
            name = name.replace(old, new)
            break
    params = {"lm_head.weight", "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight"} | {
        f"model.midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                               "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                               "mlp.down_proj")}
    for candidate in (name, f"model.{name}"):
        if candidate in params:
            return candidate
    return None


def vllm_destination(name: str) -> str:
    """Where vLLM's `Eagle3LlamaForCausalLM.load_weights` puts a tensor; raises like it does
    (KeyError) for a name its one-layer draft has no parameter for."""
    if "t2d" in name:
        return "<skipped t2d>"
    if "d2t" in name:
        return "draft_id_to_target_id"
    name = name.replace("midlayer.", "layers.0.")
    if "lm_head" not in name:
        name = "model." + name
    for old, new in STACKED:
        if old in name:
            name = name.replace(old, new)
            break
    params = {"lm_head.weight", "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight"} | {
        f"model.layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                               "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                               "mlp.down_proj")}
    if name not in params:
        raise KeyError(f"vLLM has no parameter {name!r}")
    return name


# ------------------------------------------------------------------------------------------------
# Fixtures: a tiny Llama target (transformers, saved), our draft for it, both exports
# ------------------------------------------------------------------------------------------------


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """name -> {"dtype", "shape", "data_offsets"} straight from the file header (what engines see)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def randomize(draft: Eagle3Draft, seed: int) -> None:
    """Every trainable weight random (norm gains around 1) so each of them changes the logits."""
    state = nnx.state(draft, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [1.0 + 0.2 * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 1
           else 0.08 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(draft, jax.tree.unflatten(treedef, new))


def build_draft(target_dir: Path, embedding: np.ndarray | None, seed: int = 0,
                **overrides: Any) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Our draft for the saved target: random weights, a draft vocabulary from random counts, the
    target's embedding table (when given: it is [V, D_t], usable only when D = D_t)."""
    target_config = json.loads((target_dir / "config.json").read_text())
    counts = np.random.default_rng(seed).integers(0, 1000, size=target_config["vocab_size"])
    d2t, t2d, _ = build_draft_vocab(counts, DRAFT_VOCAB)
    cfg = Eagle3Config.for_target(LlamaConfig.from_hf(target_config), draft_vocab_size=DRAFT_VOCAB, **overrides)
    draft = Eagle3Draft(cfg, rngs=nnx.Rngs(seed))
    randomize(draft, seed)
    draft.set_vocab(d2t, t2d)
    if embedding is not None:
        draft.load_embedding(embedding)
    return draft, target_config


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    """Target (8-layer tiny Llama, llama3 RoPE) saved with save_pretrained; our draft; its fp32
    speculators export and bf16 / fp32 SGLang exports."""
    root = tmp_path_factory.mktemp("eagle3")
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": TARGET_LAYERS}, **VARIANTS["llama3_rope"][1])
    torch.manual_seed(0)
    hf_target = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    target_dir = root / "target"
    hf_target.save_pretrained(target_dir)
    draft, target_config = build_draft(target_dir, hf_target.model.embed_tokens.weight.detach().numpy())
    dirs = {name: root / name for name in ("speculators", "sglang_fp32", "sglang_bf16")}
    save_speculators(draft, str(dirs["speculators"]), target_config=target_config,
                     verifier_name_or_path=str(target_dir), num_speculative_tokens=TTT_STEPS, dtype="float32")
    save_sglang(draft, str(dirs["sglang_fp32"]), target_config=target_config, dtype="float32")
    save_sglang(draft, str(dirs["sglang_bf16"]), target_config=target_config)
    return dict(draft=draft, target_config=target_config, target_dir=target_dir, hf_target=hf_target, **dirs)


def read_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


# ------------------------------------------------------------------------------------------------
# SGLang / vLLM loader expectations
# ------------------------------------------------------------------------------------------------


def check_tensors(folder: Path, cfg: Mapping[str, Any], layer_prefix: str, draft: Eagle3Draft,
                  destination: Callable[[str], str | None]) -> dict[str, dict[str, Any]]:
    header = safetensors_header(folder / "model.safetensors")
    expected = engine_tensors(cfg, layer_prefix)
    assert sorted(header) == sorted(expected), "tensor names differ from what the engine loads"
    for name, (shape, dtype) in expected.items():
        assert (tuple(header[name]["shape"]), header[name]["dtype"]) == (shape, dtype), name
    landed = {name: destination(name) for name in header}
    assert None not in landed.values(), f"tensors the engine would drop silently: {landed}"
    assert len(set(landed.values())) == len(landed) - 3, "q/k/v and gate/up must be the only stacked tensors"

    from safetensors.numpy import load_file
    tensors = load_file(folder / "model.safetensors")
    target_ids = np.arange(cfg["draft_vocab_size"]) + tensors["d2t"]  # what both engines compute
    np.testing.assert_array_equal(target_ids, np.asarray(draft.target_token_ids))
    np.testing.assert_array_equal(np.flatnonzero(tensors["t2d"]), target_ids)
    return header


def check_geometry(layer: Mapping[str, Any], draft: Eagle3Draft, target_config: Mapping[str, Any]) -> None:
    c = draft.config
    want = dict(model_type="llama", num_hidden_layers=1, hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act="silu",
                rms_norm_eps=c.rms_norm_eps, vocab_size=target_config["vocab_size"], tie_word_embeddings=False)
    assert {k: layer.get(k) for k in want} == want
    assert not layer.get("attention_bias") and not layer.get("mlp_bias") and not layer.get("bias")
    # RoPE in the legacy spelling (SGLang's LlamaAttention: getattr(config, "rope_theta", 10000) and
    # config.rope_scaling; transformers 4.x), equal to the draft's own
    assert layer["rope_theta"] == c.rope_theta
    assert layer.get("rope_scaling") == (None if c.rope_scaling is None else dict(c.rope_scaling))
    parsed = transformers.LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"})  # transformers 5
    assert parsed.rope_parameters["rope_theta"] == c.rope_theta
    assert parsed.rope_parameters["rope_type"] == (c.rope_scaling or {}).get("rope_type", "default")


@pytest.mark.parametrize("variant", ["sglang_fp32", "sglang_bf16"])
def test_sglang_layout_matches_sglang_and_vllm_loaders(exported, variant):
    folder, draft = exported[variant], exported["draft"]
    cfg = read_config(folder)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # SGLang's EntryClass
    assert cfg["torch_dtype"] == ("float32" if variant.endswith("fp32") else "bfloat16")
    check_geometry(cfg, draft, exported["target_config"])
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    # D_t == D here: no target_hidden_size key, or an int (never null: hasattr(...) -> None * 3)
    assert cfg.get("target_hidden_size", draft.config.hidden_size) == draft.config.hidden_size
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(draft.target_layers),
                                   "use_aux_hidden_state": True}
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"][0] == 1  # SGLang's +1 rule (#25454)
    # vLLM reads only a top-level field, as capture ids (= ours + 1); absent -> the target's default
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    assert top is None or top == [i + 1 for i in draft.target_layers]
    assert [i + 1 for i in draft.target_layers] == [2, TARGET_LAYERS // 2, TARGET_LAYERS - 3]
    check_tensors(folder, cfg, "midlayer.", draft, sglang_destination)
    check_tensors(folder, cfg, "midlayer.", draft, vllm_destination)


def test_speculators_layout_matches_vllm_adapter(exported):
    folder, draft = exported["speculators"], exported["draft"]
    cfg = read_config(folder)
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["proposal_methods"][0]["speculative_tokens"] == TTT_STEPS
    assert spec["default_proposal_method"] == spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["verifier"] == {"name_or_path": str(exported["target_dir"]), "architectures": ["LlamaForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert isinstance(layer, dict)
    check_geometry(layer, draft, exported["target_config"])
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    # plain EAGLE-3: every variant flag written out (vLLM defaults norm_before_residual to TRUE)
    flags = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    assert {k: cfg.get(k) for k in flags} == dict.fromkeys(flags, False)
    assert cfg.get("target_hidden_size") in (None, draft.config.hidden_size)
    # vLLM / speculators capture ids: the residual stream entering layer i+1 = the output of layer i
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in draft.target_layers]
    check_tensors(folder, cfg, "layers.0.", draft, vllm_destination)


def test_wider_target_writes_target_hidden_size(exported, tmp_path):
    """D = 32 < D_t = 64: fc reads 3·D_t, and both layouts say so in `target_hidden_size`."""
    draft, target_config = build_draft(exported["target_dir"], None, seed=1, hidden_size=32, intermediate_size=64)
    assert (draft.config.hidden_size, draft.config.target_hidden_size) == (32, 64)
    save_sglang(draft, str(tmp_path / "sglang"), target_config=target_config, dtype="float32")
    save_speculators(draft, str(tmp_path / "spec"), target_config=target_config,
                     verifier_name_or_path=str(exported["target_dir"]), num_speculative_tokens=2, dtype="float32")
    for folder, prefix in ((tmp_path / "sglang", "midlayer."), (tmp_path / "spec", "layers.0.")):
        cfg = read_config(folder)
        assert cfg["target_hidden_size"] == 64
        header = check_tensors(folder, cfg, prefix, draft, vllm_destination)
        assert header["fc.weight"]["shape"] == [32, 3 * 64]


# ------------------------------------------------------------------------------------------------
# The speculators library itself
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spx():
    try:
        import speculators
        from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the speculators library is needed for this parity check ({e}); install it with\n"
                    f"    {SPECULATORS_INSTALL}")
    return speculators


def load_speculators_model(spx, folder: Path):
    """speculators' own config dispatch + pydantic validation + from_pretrained, on its dense-mask
    attention path (its flex-attention default needs sequence lengths in multiples of 128)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    config = spx.SpeculatorModelConfig.from_pretrained(str(folder))
    assert type(config) is Eagle3SpeculatorConfig
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(str(folder), config=config).eval()
    # speculators fills the verifier-owned embedding with NaN in __init__ and loads the verifier's
    # table only while it is still NaN; transformers 5.24's from_pretrained materialises that skipped
    # parameter with torch.empty (arbitrary memory), so re-arm the sentinel and run its loader again
    with torch.no_grad():
        model.embed_tokens.weight.fill_(float("nan"))
    model.load_verifier_weights()
    return model, config


def test_speculators_library_accepts_the_export(spx, exported):
    from speculators.models.utils import resolve_target_layer_ids
    folder, draft = exported["speculators"], exported["draft"]
    model, config = load_speculators_model(spx, folder)
    c = draft.config
    assert config.draft_vocab_size == DRAFT_VOCAB and config.target_vocab_size == c.vocab_size
    assert not (config.norm_before_residual or config.norm_before_fc or config.fc_norm or config.norm_output)
    assert config.speculators_config.verifier.name_or_path == str(exported["target_dir"])
    assert config.transformer_layer_config.head_dim == c.head_dim
    assert model.target_layer_ids == [i + 1 for i in draft.target_layers]
    with pytest.warns(UserWarning):  # its default for an N-layer verifier, with a "not set" warning
        assert resolve_target_layer_ids(None, str(exported["target_dir"])) == model.target_layer_ids

    # every tensor loaded (the model's own state minus what comes from the verifier), none left over
    from safetensors.torch import load_file
    tensors = load_file(folder / "model.safetensors")
    from_verifier = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    state = model.state_dict()
    assert sorted(tensors) == sorted(set(state) - from_verifier)
    for name, value in tensors.items():
        assert torch.equal(state[name], value), name
    assert torch.equal(model.embed_tokens.weight, exported["hf_target"].model.embed_tokens.weight)
    model.load_vocab_mappings(tensors["t2d"], tensors["d2t"])  # its own t2d / d2t consistency checks


def speculators_unroll(model, ids: np.ndarray, feats: np.ndarray, positions: np.ndarray, docs: np.ndarray,
                       steps: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The library's TTT forward; per-step logits [1, T, Vd] and fed-back hidden [1, T, D] (hooks)."""
    logits, hidden = [], []
    hooks = [model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().numpy())),
             model.layers[0].register_forward_hook(lambda m, i, o: hidden.append(o.detach().numpy()))]
    try:
        with torch.no_grad():
            model(hidden_states=torch.tensor(feats), input_ids=torch.tensor(ids, dtype=torch.long),
                  document_ids=torch.tensor(docs, dtype=torch.long),
                  position_ids=torch.tensor(positions, dtype=torch.long), ttt_steps=steps)
    finally:
        for h in hooks:
            h.remove()
    assert len(logits) == len(hidden) == steps
    return logits, hidden


def test_draft_logits_match_speculators_over_ttt_steps(spx, exported):
    """Step 0 from target features; steps 1-2 feed back the hidden state, attending to the step-0
    keys of positions <= p plus p's own later keys. Ours: a cache rolled back per row to p + 1."""
    model, _ = load_speculators_model(spx, exported["speculators"])
    draft = exported["draft"]
    rng = np.random.default_rng(1)
    V, D3 = draft.config.vocab_size, draft.fc.in_features
    ids = rng.integers(0, V, size=(1, T))  # [1, T]: the token each position consumes at step 0
    feats = rng.normal(size=(1, T, D3)).astype(np.float32)  # [1, T, 3·D_t]
    positions = np.arange(T)[None]
    ref_logits, ref_hidden = speculators_unroll(model, ids, feats, positions, np.zeros((1, T)), TTT_STEPS)

    logits, hidden, _ = draft(jnp.asarray(ids), features=jnp.asarray(feats), positions=jnp.asarray(positions))
    assert rel_err(logits, ref_logits[0]) <= TOL
    assert rel_err(hidden, ref_hidden[0]) <= TOL

    rows = jnp.arange(T)  # row p continues position p
    cache = draft.init_cache(T, T + TTT_STEPS)
    _, _, cache = draft(jnp.repeat(jnp.asarray(ids), T, 0), features=jnp.repeat(jnp.asarray(feats), T, 0),
                        positions=jnp.repeat(jnp.asarray(positions), T, 0), cache=cache)
    cache = cache.rollback(rows + 1)
    h = hidden[0][:, None, :]  # [T, 1, D]
    for k in range(1, TTT_STEPS):
        tok = np.concatenate([ids[0, k:], np.zeros(k, ids.dtype)])[:, None]  # [T, 1]: t_{p+k}, 0 past the end
        step_logits, h, cache = draft(jnp.asarray(tok), hidden=h, positions=(rows + k)[:, None], cache=cache)
        assert rel_err(step_logits[:, 0], ref_logits[k][0]) <= TOL, f"TTT step {k}"
        assert rel_err(h[:, 0], ref_hidden[k][0]) <= TOL, f"TTT step {k}"


def test_ttt_loss_matches_speculators_unroll(spx, exported):
    """Two packed segments. Per-step forward KL of our `ttt_loss` vs the same KL (labels and
    mask as in docs/speculative-decoding.md) computed from the library's unrolled logits."""
    model, _ = load_speculators_model(spx, exported["speculators"])
    draft = exported["draft"]
    rng = np.random.default_rng(2)
    V, D3 = draft.config.vocab_size, draft.fc.in_features
    seg = np.array([[1] * 7 + [2] * (T - 7)])  # [1, T]
    positions = np.concatenate([np.arange(7), np.arange(T - 7)])[None]
    ids = rng.integers(0, V, size=(1, T))  # target_ids[p] = t_{p+1}: what position p consumes at step 0
    feats = rng.normal(size=(1, T, D3)).astype(np.float32)
    target_logits = (3.0 * rng.normal(size=(1, T, V))).astype(np.float32)
    used = np.asarray(draft.target_token_ids)
    target_logits[0, ::2, used[::3]] += 8.0  # most argmaxes inside the draft vocabulary
    loss_mask = (rng.random((1, T)) < 0.8).astype(np.int32)
    batch = dict(input_ids=jnp.zeros((1, T), jnp.int32), target_ids=jnp.asarray(ids, jnp.int32),
                 positions=jnp.asarray(positions, jnp.int32), segment_ids=jnp.asarray(seg, jnp.int32),
                 loss_mask=jnp.asarray(loss_mask))
    total, stats = ttt_loss(draft, batch, jnp.asarray(feats), jnp.asarray(target_logits), steps=TTT_STEPS, decay=0.8)

    ref_logits, _ = speculators_unroll(model, ids, feats, positions, seg - 1, TTT_STEPS)
    restricted = torch.tensor(target_logits[0][:, used]).softmax(-1).numpy()  # [T, Vd]
    in_draft = np.isin(target_logits[0].argmax(-1), used)
    want_total = 0.0
    for k in range(TTT_STEPS):
        logq = torch.tensor(ref_logits[k][0]).log_softmax(-1).numpy()  # [T, Vd]
        loss = num = den = 0.0
        for p in range(T - 1 - k):
            q = p + 1 + k  # the label position
            if loss_mask[0, q] and in_draft[q] and seg[0, q] == seg[0, p]:
                P = restricted[q]
                loss += (P * (np.log(P) - logq[p])).sum()  # forward KL(P || Q): speculators' kl_div
                num += float(logq[p].argmax() == restricted[q].argmax())
                den += 1
        assert den > 0
        np.testing.assert_allclose(float(stats["loss"][k]), loss, rtol=TOL)
        assert (float(stats["acc_num"][k]), float(stats["acc_den"][k])) == (num, den), f"step {k}"
        want_total += 0.8**k * loss
    np.testing.assert_allclose(float(total), want_total, rtol=TOL)


def test_sglang_export_through_the_speculators_converter(spx, exported, tmp_path):
    """speculators' own reader of the SGLang / EAGLE-official layout (`Eagle3Converter`: geometry,
    legacy `rope_theta` / `rope_scaling`, vocab from `t2d`, `midlayer.` -> `layers.0.`) rebuilds a
    draft whose step-0 logits equal ours."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    draft = exported["draft"]
    ids_vllm = [i + 1 for i in draft.target_layers]
    Eagle3Converter().convert(str(exported["sglang_fp32"]), str(tmp_path / "converted"), str(exported["target_dir"]),
                              validate=False, eagle_aux_hidden_state_layer_ids=ids_vllm)
    model, config = load_speculators_model(spx, tmp_path / "converted")
    assert config.draft_vocab_size == DRAFT_VOCAB and config.target_vocab_size == draft.config.vocab_size
    rng = np.random.default_rng(3)
    ids = rng.integers(0, draft.config.vocab_size, size=(1, T))
    feats = rng.normal(size=(1, T, draft.fc.in_features)).astype(np.float32)
    ref_logits, _ = speculators_unroll(model, ids, feats, np.arange(T)[None], np.zeros((1, T)), 1)
    logits, _, _ = draft(jnp.asarray(ids), features=jnp.asarray(feats), positions=jnp.arange(T)[None])
    assert rel_err(logits, ref_logits[0]) <= TOL


def test_load_eagle3_reads_a_speculators_checkpoint(spx, exported, tmp_path):
    """The other direction: a checkpoint written by speculators' own `save_pretrained` (its config
    spelling: `rope_parameters` only, vLLM aux ids, an `embed_tokens.weight` copy) loads with our
    `load_eagle3` into the same draft (aux ids back in our convention, same logits)."""
    model, _ = load_speculators_model(spx, exported["speculators"])
    model.save_pretrained(str(tmp_path / "saved"))
    draft = exported["draft"]
    loaded = load_eagle3(str(tmp_path / "saved"), exported["hf_target"].model.embed_tokens.weight.detach().numpy())
    assert loaded.config == draft.config
    np.testing.assert_array_equal(np.asarray(loaded.target_token_ids), np.asarray(draft.target_token_ids))
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(0, draft.config.vocab_size, size=(1, T)))
    feats = jnp.asarray(rng.normal(size=(1, T, draft.fc.in_features)).astype(np.float32))
    want, _, _ = draft(ids, features=feats)
    got, _, _ = loaded(ids, features=feats)
    assert rel_err(got, want) <= TOL
