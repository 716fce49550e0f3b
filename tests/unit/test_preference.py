"""Preference optimisation (tasks/training/preference.py, `finetune.method: dpo`): DPO and SimPO equal their
papers' formulas on known log-probabilities; the objective's sequence log-probabilities equal transformers'
on the same pairs; data_prep writes chosen / rejected pair rows whose loss regions are exactly the answers
(strings, chat prompts with answers, whole conversations); gradient accumulation changes nothing; and a
short DPO / SimPO run raises the held-out reward margin and accuracy of pairs it never saw."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import models
from models.sharding import make_mesh
from tasks.configs import FinetuneConfig, PreferenceConfig
from tasks.data import corpora
from tasks.data.rows import read_pairs
from tasks.data_prep import DataPrepConfig, run_local
from tasks.finetune import finetune
from tasks.training import preference as pm
from tasks.training.config import TrainConfig
from tasks.training.trainer import Trainer

pytestmark = pytest.mark.unit


# -- the losses against the papers' formulas ---------------------------------------------------------------

# sequence log-probabilities of four pairs: policy chosen / rejected, reference chosen / rejected, lengths
PC = [-12.0, -30.5, -8.25, -40.0]
PR = [-15.0, -29.0, -9.0, -38.5]
RC = [-13.0, -31.0, -8.0, -41.0]
RR = [-14.0, -28.0, -9.5, -39.0]
LC = [6, 15, 4, 20]
LR = [7, 12, 4, 25]


def _log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z))


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_dpo_loss_is_the_papers_formula(eps):
    beta = 0.1
    loss, rewards = pm.dpo_loss(*(jnp.asarray(x) for x in (PC, PR, RC, RR)), beta, eps)
    for i in range(4):  # Rafailov et al. 2023, eq. 7; conservative DPO mixes in the flipped label with ε
        h = (PC[i] - RC[i]) - (PR[i] - RR[i])
        want = -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h)
        assert float(loss[i]) == pytest.approx(want, rel=1e-6)
        assert float(rewards["reward_chosen"][i]) == pytest.approx(beta * (PC[i] - RC[i]), rel=1e-6)
        assert float(rewards["reward_rejected"][i]) == pytest.approx(beta * (PR[i] - RR[i]), rel=1e-6)


def test_simpo_loss_is_the_papers_formula():
    beta, gamma = 2.0, 1.0
    loss, rewards = pm.simpo_loss(*(jnp.asarray(x, jnp.float32) for x in (PC, PR, LC, LR)), beta, gamma)
    for i in range(4):  # Meng et al. 2024, eq. 6
        h = beta / LC[i] * PC[i] - beta / LR[i] * PR[i] - gamma
        assert float(loss[i]) == pytest.approx(-_log_sigmoid(h), rel=1e-6)
        assert float(rewards["reward_chosen"][i]) == pytest.approx(beta * PC[i] / LC[i], rel=1e-6)


# -- the objective against transformers' log-probabilities -------------------------------------------------

V, T, B = 96, 24, 4


def _pair_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """B pairs of padded sequences: a shared prompt, different answers of different lengths, loss on the answers."""
    rng = np.random.default_rng(seed)
    batch: dict[str, np.ndarray] = {}
    prompt_len = rng.integers(3, 8, B)
    for side in ("chosen", "rejected"):
        n = rng.integers(10, T, B)  # real tokens per row (the rest is padding)
        ids = rng.integers(3, V, (B, T + 1)).astype(np.int32)
        real = np.arange(T)[None] < n[:, None]
        batch[f"{side}_input_ids"] = np.where(real, ids[:, :-1], 0)
        batch[f"{side}_target_ids"] = np.where(real, ids[:, 1:], 0)
        batch[f"{side}_positions"] = np.where(real, np.arange(T)[None], 0).astype(np.int32)
        batch[f"{side}_segment_ids"] = real.astype(np.int32)
        batch[f"{side}_loss_mask"] = (real & (np.arange(T)[None] >= prompt_len[:, None] - 1)).astype(np.int32)
        batch[f"{side}_{pm.REF}"] = (rng.normal(size=(B, T)) - 3).astype(np.float32)
    for c in ("input_ids", "target_ids", "positions"):  # the pair shares its prompt
        for i in range(B):
            batch[f"rejected_{c}"][i, : prompt_len[i]] = batch[f"chosen_{c}"][i, : prompt_len[i]]
    return batch


def _hf_sequence_logps(hf, batch: dict[str, np.ndarray], side: str) -> np.ndarray:
    ids = torch.tensor(batch[f"{side}_input_ids"], dtype=torch.long)
    attn = torch.tensor(batch[f"{side}_segment_ids"] > 0, dtype=torch.long)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=attn).logits.float()  # [B, T, V]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(batch[f"{side}_target_ids"],
                                                                 dtype=torch.long)[..., None])[..., 0]
    return (logp.numpy() * batch[f"{side}_loss_mask"]).sum(-1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random tiny Llama saved by transformers, loaded by us."""
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("pref_llama")
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.mark.parametrize("loss", ["dpo", "simpo"])
def test_objective_uses_transformers_sequence_logprobs(tiny_llama, loss):
    hf, path = tiny_llama
    ours = models.from_pretrained(path, dtype=jnp.float32)
    batch = _pair_batch()
    beta, gamma = (0.1, 0.0) if loss == "dpo" else (2.0, 0.5)
    objective = pm.preference_objective(loss, beta, 0.0, gamma)
    total, _, metrics = objective(ours, {k: jnp.asarray(v) for k, v in batch.items()})
    pc, pr = _hf_sequence_logps(hf, batch, "chosen"), _hf_sequence_logps(hf, batch, "rejected")
    if loss == "dpo":
        rc = (batch[f"chosen_{pm.REF}"] * batch["chosen_loss_mask"]).sum(-1)
        rr = (batch[f"rejected_{pm.REF}"] * batch["rejected_loss_mask"]).sum(-1)
        h = beta * ((pc - rc) - (pr - rr))
    else:
        h = beta * (pc / batch["chosen_loss_mask"].sum(-1) - pr / batch["rejected_loss_mask"].sum(-1)) - gamma
    want = sum(-_log_sigmoid(float(x)) for x in h)
    np.testing.assert_allclose(float(total), want, rtol=1e-5)
    margin = h + (gamma if loss == "simpo" else 0.0)
    np.testing.assert_allclose(float(metrics["reward_margin"]), margin.sum(), rtol=1e-4, atol=1e-5)
    assert float(metrics["reward_accuracy"]) == float((margin > 0).sum())


def test_grad_accumulation_equals_the_full_batch_for_dpo(tiny_llama):
    _, path = tiny_llama
    objective = pm.preference_objective("dpo", 0.1)
    stats = []
    for accum in (1, 2):
        cfg = TrainConfig(steps=2, batch_size=B, grad_accum=accum, learning_rate=1e-3, warmup_steps=0)
        trainer = Trainer(models.from_pretrained(path, dtype=jnp.float32), cfg,
                          mesh=make_mesh(devices=jax.devices()[:1]), loss_fn=objective,
                          eval_fn=pm.preference_eval(objective), count_fn=pm.pair_count)
        stats.append([trainer.step(_pair_batch(i)) for i in range(2)])
    for a, b in zip(*stats, strict=True):
        assert set(a) >= {"loss", "grad_norm", "reward_margin", "reward_accuracy"}
        for k in ("loss", "grad_norm", "reward_margin", "reward_chosen", "reward_accuracy"):
            np.testing.assert_allclose(float(b[k]), float(a[k]), rtol=1e-5, atol=1e-7, err_msg=k)


# -- pair rows ----------------------------------------------------------------------------------------------


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _records() -> list[dict]:
    recs = []
    for i in range(24):
        w = [WORDS[(i + k) % 12] for k in range(3)]
        kind = i % 3
        if kind == 0:  # strings
            recs.append({"id": f"s{i}", "prompt": f"Q{i}: repeat {' '.join(w)}\n", "chosen": " ".join(w),
                         "rejected": " ".join(w[::-1])})
        elif kind == 1:  # a chat prompt with answer strings
            recs.append({"id": f"c{i}", "prompt": [{"role": "user", "content": f"repeat {' '.join(w)}"}],
                         "chosen": " ".join(w), "rejected": " ".join(w[::-1])})
        else:  # whole conversations (implicit prompt), an earlier exchange as context
            head = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": f"repeat {' '.join(w)}"}]
            recs.append({"id": f"m{i}", "chosen": head + [{"role": "assistant", "content": " ".join(w)}],
                         "rejected": head + [{"role": "assistant", "content": " ".join(w[::-1])}]})
    return recs


def test_pair_rows_hold_the_answers_as_their_loss_regions(tmp_path):
    from tokenizers import Tokenizer

    corpus = tmp_path / "prefs.jsonl"
    recs = _records() + [{"id": "long", "prompt": "x " * 400, "chosen": "a", "rejected": "b"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in recs))
    stats = run_local(DataPrepConfig(corpus=str(corpus), seq_len=64, vocab_size=320, valid_fraction=0.25),
                      tmp_path / "dp")
    tok = Tokenizer.from_file(str(tmp_path / "dp" / "tokenizer.json"))
    assert stats["pairs"]["train"] + stats["pairs"]["valid"] == 24
    assert stats["pairs_dropped_context_too_long"] == 1  # "long": its prompt alone fills the row
    assert stats["documents"]["train"] + stats["documents"]["valid"] == 25  # the chosen sides, packed as SFT rows
    answers = {}
    for r in recs[:24]:
        answers[" ".join(corpora.preference_document(r, r["id"], "t").completion.split())] = r
    seen = 0
    for f in sorted((tmp_path / "dp").glob("pairs-*.parquet")):
        rows = read_pairs(f)
        for i in range(len(rows["chosen_input_ids"])):
            text = {}
            for side in ("chosen", "rejected"):
                m = rows[f"{side}_loss_mask"][i] > 0
                assert m.any()
                tgt = rows[f"{side}_target_ids"][i]
                assert tgt[m][-1] == 2  # the answer ends with eos, trained
                # the trained region is one contiguous run: the final answer only, never an earlier turn
                idx = np.flatnonzero(m)
                assert (np.diff(idx) == 1).all()
                text[side] = tok.decode(tgt[m].tolist(), skip_special_tokens=True).strip()
                # inputs and targets are the same sequence shifted by one, padding after it
                n = int((rows[f"{side}_segment_ids"][i] > 0).sum())
                np.testing.assert_array_equal(rows[f"{side}_input_ids"][i][1:n], tgt[: n - 1])
            assert text["rejected"].split() == text["chosen"].split()[::-1]
            assert text["chosen"] in answers
            # both sides share the context before their answers
            start = int(np.flatnonzero(rows["chosen_loss_mask"][i])[0])
            np.testing.assert_array_equal(rows["chosen_input_ids"][i][: start + 1],
                                          rows["rejected_input_ids"][i][: start + 1])
            seen += 1
    assert seen == 24


@pytest.mark.parametrize("rec, field", [
    ({"prompt": "p", "chosen": "a"}, "chosen and rejected"),
    ({"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}, "strings"),
    ({"chosen": "a", "rejected": "b"}, "string prompt"),
    ({"prompt": 3, "chosen": [], "rejected": []}, "prompt"),
])
def test_malformed_preference_records_name_the_line(tmp_path, rec, field):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl: line 2.*{field}"):
        list(corpora.resolve(str(corpus))())


def test_builtin_preferences_pair_each_body_with_a_corrupted_copy():
    source = "".join(f'def f{i}(a):\n    """Doc {i}."""\n    b = a + {i}\n    c = b * 2\n    d = c - 1\n'
                     f"    return d\n\n" for i in range(12))
    docs = list(corpora.preference_pairs(list(corpora.function_pairs(source, "m.py"))))
    assert len(docs) == 12
    kinds = set()
    for d in docs:
        good, bad = d.completion.splitlines(), d.rejected.completion.splitlines()
        assert d.rejected.prompt == d.prompt and d.rejected.group == d.group and bad != good
        if sorted(bad) == sorted(good):
            kinds.add("shuffled")
        else:
            assert bad == good[: len(bad)] and len(bad) == 2  # the first half: an answer that stops early
            kinds.add("cut")
    assert kinds == {"shuffled", "cut"}
    again = list(corpora.preference_pairs(list(corpora.function_pairs(source, "m.py"))))
    assert [d.rejected.completion for d in again] == [d.rejected.completion for d in docs]  # deterministic


# -- training raises held-out margins ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def copy_pairs(tiny_base, tmp_path_factory):
    """Preference pairs with a rule to learn: the chosen answer repeats the prompt's words, the rejected one
    reverses them (held-out pairs are other records, split by a hash of their id)."""
    base, _ = tiny_base
    root = tmp_path_factory.mktemp("copy_pairs")
    words = "red green blue cat dog fish one two three sun moon star".split()
    recs = []
    for i in range(240):
        w = [words[(i * 7 + k * (1 + i % 5)) % 12] for k in range(3)]
        recs.append({"id": f"p{i}", "prompt": f"say {' '.join(w)}:", "chosen": " " + " ".join(w),
                     "rejected": " " + " ".join(w[::-1])})
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run_local(DataPrepConfig(corpus=str(root / "prefs.jsonl"), seq_len=32, valid_fraction=0.2), root / "data",
              tokenizer_json=base / "tokenizer.json")
    return base, root / "data"


@pytest.mark.parametrize("loss", ["dpo", "simpo"])
def test_training_raises_held_out_margins(copy_pairs, tmp_path, loss):
    base, data = copy_pairs
    cfg = FinetuneConfig(method="dpo", mode="full", preference=PreferenceConfig(loss=loss),
                         train=TrainConfig(steps=40, batch_size=16, learning_rate=3e-3, warmup_steps=4, log_every=10))
    out = finetune(cfg, base, data, tmp_path / "out")
    before, after = out["preference_before"], out["preference_after"]
    assert before["pairs"] == after["pairs"] >= 30
    assert after["reward_margin"] > before["reward_margin"] + 0.1, (before, after)
    assert after["reward_accuracy"] >= 0.8, after
    assert after["preference_accuracy"] > before["preference_accuracy"], (before, after)
    assert {"reward_margin", "reward_accuracy"} <= set(out["train_metrics"])
    refs = sorted(p.name for p in (tmp_path / "out" / "reference").glob("*.safetensors")) if loss == "dpo" else []
    assert refs == (["reference-pairs-train-00000.safetensors", "reference-pairs-valid-00000.safetensors"]
                    if loss == "dpo" else [])
    assert models.from_pretrained(str(tmp_path / "out" / "model")) is not None


def test_dpo_on_data_without_pairs_names_the_folder(tiny_base, tmp_path):
    base, data = tiny_base
    with pytest.raises(ValueError, match=rf"method: dpo needs preference pairs, and {data} has no train pairs"):
        finetune(FinetuneConfig(method="dpo", train=TrainConfig(steps=1)), base, data, tmp_path / "out")


def test_reference_is_the_starting_model(copy_pairs, tmp_path):
    """The stored reference equals the starting model's log-probabilities (LoRA: adapters at zero = off)."""
    base, data = copy_pairs
    out = finetune(FinetuneConfig(method="dpo", train=TrainConfig(steps=2, batch_size=8)), base, data, tmp_path / "o")
    assert out["reference"]["pairs"] == sum(pm.count_pairs(data, s) for s in ("train", "valid"))
    model = models.from_pretrained(str(base), dtype=jnp.float32)
    loader = pm.PairBatches(data, "valid", 8, shuffle=False, reference_dir=tmp_path / "o" / "reference")
    batch = loader.batch(0)
    c, r = nnx.jit(pm.pair_token_logps)(model, {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(batch[f"chosen_{pm.REF}"], np.asarray(c), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch[f"rejected_{pm.REF}"], np.asarray(r), rtol=1e-5, atol=1e-5)
    assert Path(tmp_path / "o" / "adapter").exists()


SHARDED_CHILD = """
import json
import jax, numpy as np
from flax import nnx
from models import llama, qwen3_moe
from models.sharding import make_mesh
from tasks.training import preference as pm
from tasks.training.config import MeshConfig, TrainConfig
from tasks.training.trainer import Trainer
from tests.unit.test_preference import _pair_batch

assert jax.device_count() == 8
objective = pm.preference_objective("dpo", 0.5)
builds = {"llama": lambda: llama.Llama(llama.LlamaConfig.tiny(vocab_size=96), rngs=nnx.Rngs(0)),
          "qwen3_moe": lambda: qwen3_moe.Qwen3Moe(qwen3_moe.Qwen3MoeConfig.tiny(vocab_size=96), rngs=nnx.Rngs(0))}
out = {}
for name, build in builds.items():
    for layout, mesh in {"single": None, "fsdp": dict(fsdp=8), "dp_ep": dict(data=2, fsdp=1, expert=4)}.items():
        if name == "llama" and layout == "dp_ep":
            mesh = dict(data=2, fsdp=4)
        cfg = TrainConfig(steps=3, batch_size=8, learning_rate=1e-2, warmup_steps=0, aux_loss_coef=0.01,
                          mesh=MeshConfig(**(mesh or {})))
        devices = [jax.devices()[0]] if mesh is None else None
        trainer = Trainer(build(), cfg, mesh=make_mesh(devices=devices, **(mesh or dict(fsdp=1))), loss_fn=objective,
                          eval_fn=pm.preference_eval(objective), count_fn=pm.pair_count)
        batches = [{k: np.concatenate([v, v]) for k, v in _pair_batch(i).items()} for i in (0, 1, 0)]
        stats = [trainer.step(b) for b in batches]
        out[f"{name}/{layout}"] = {k: [float(s[k]) for s in stats] for k in ("loss", "reward_margin", "aux_loss")}
print("REPORT" + json.dumps(out))
"""


def test_sharded_dpo_equals_single_device():
    """DPO on 8 fake CPU devices (FSDP; data x expert parallel for the MoE) gives the single-device loss,
    reward margins and MoE load-balancing loss, step by step."""
    from tests.devices import run_on_8_devices

    report = run_on_8_devices(SHARDED_CHILD)
    for name in ("llama", "qwen3_moe"):
        ref = report[f"{name}/single"]
        assert ref["reward_margin"][2] > ref["reward_margin"][0], ref  # the first batch again: it trains
        for layout in ("fsdp", "dp_ep"):
            got = report[f"{name}/{layout}"]
            for k in ("loss", "reward_margin", "aux_loss"):
                np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=f"{name}/{layout}/{k}")
    assert all(x > 0 for x in report["qwen3_moe/single"]["aux_loss"])  # the MoE's balance loss is seen


def test_evaluate_reports_and_gates_held_out_preferences(copy_pairs, tmp_path):
    """evaluate's preference section: the base against itself has no margin; a DPO-trained model against its
    base moves toward the chosen answers; the gate reads the reward accuracy and refuses data without pairs."""
    from tasks.configs import EvalConfig, Gates
    from tasks.evaluate import gates, markdown, preference_report

    base, data = copy_pairs
    cfg = EvalConfig(batch_size=8)
    b = models.from_pretrained(str(base))
    same = preference_report(b, b, data, cfg)
    assert same["reward_margin"] == 0 and same["reward_accuracy"] == 0 and same["base"] == same["finetuned"]
    finetune(FinetuneConfig(method="dpo", mode="full", train=TrainConfig(steps=30, batch_size=16, learning_rate=3e-3,
                                                                         warmup_steps=3)), base, data, tmp_path / "o")
    p = preference_report(b, models.from_pretrained(str(tmp_path / "o" / "model")), data, cfg)
    assert p["pairs"] >= 30 and p["reward_accuracy"] >= 0.8 and p["reward_margin"] > 1, p
    assert p["finetuned"]["preference_accuracy_normalized"] > p["base"]["preference_accuracy_normalized"], p
    report = {"perplexity": {"finetuned": 1.0}, "quantization": {}, "preference": p}
    judged = gates(report, Gates(finetune_improves=False, min_preference_accuracy=0.8))
    assert [(g["gate"], g["passed"]) for g in judged] == [("held-out preference accuracy (fine-tuned vs base)", True)]
    worse = {**report, "preference": {**p, "reward_accuracy": 0.5}}
    assert not gates(worse, Gates(finetune_improves=False, min_preference_accuracy=0.8))[0]["passed"]
    assert "## Preference pairs (held-out)" in markdown({**report, "gates": judged})


def test_sft_then_dpo_takes_the_sft_model_as_reference(copy_pairs, tmp_path):
    """`sft_steps` before DPO: the stored reference is the SFT model's log-probabilities, not the base's."""
    base, data = copy_pairs
    cfg = FinetuneConfig(method="dpo", mode="full", sft_steps=10,
                         train=TrainConfig(steps=2, batch_size=8, learning_rate=3e-3, warmup_steps=1))
    out = finetune(cfg, base, data, tmp_path / "o")
    assert out["sft"]["valid_loss_after"] < out["sft"]["valid_loss_before"]
    loader = pm.PairBatches(data, "valid", 8, shuffle=False, reference_dir=tmp_path / "o" / "reference")
    batch = loader.batch(0)
    c, _ = nnx.jit(pm.pair_token_logps)(models.from_pretrained(str(base), dtype=jnp.float32),
                                        {k: jnp.asarray(v) for k, v in batch.items()})
    stored, from_base = batch[f"chosen_{pm.REF}"].sum(-1), np.asarray(c).sum(-1)
    assert np.abs(stored - from_base).max() > 1.0, (stored, from_base)  # SFT moved the answers' log-probabilities
