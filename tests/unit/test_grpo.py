"""GRPO's objective (tasks/training/grpo.py) against the paper's formula written out per token in plain
Python, on known log-probabilities: group-relative advantages, the clipped ratio, the k3 KL estimate, the
per-completion and per-token aggregations; and the clip stops the gradient where the paper says it does."""

from __future__ import annotations

import json
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tasks.training import grpo

pytestmark = pytest.mark.unit

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]


def test_group_advantages():
    adv = np.asarray(grpo.group_advantages(jnp.asarray(REWARDS), eps=1e-4))
    for g, row in zip(REWARDS, adv, strict=True):
        mean = sum(g) / len(g)
        std = math.sqrt(sum((r - mean) ** 2 for r in g) / len(g))
        np.testing.assert_allclose(row, [(r - mean) / (std + 1e-4) for r in g], rtol=1e-5)
    assert (adv[1] == 0).all()  # all equal: nothing to learn from this group
    centred = np.asarray(grpo.group_advantages(jnp.asarray(REWARDS), scale=False))
    np.testing.assert_allclose(centred[2], [0.25, 0.25, 0.25, -0.75])


def _reference(new, old, ref, adv, mask, eps, beta, agg):
    per_seq, tok_sum, tok_n = [], 0.0, 0
    for i in range(len(new)):
        terms = []
        for t in range(len(new[i])):
            if not mask[i][t]:
                continue
            rho = math.exp(new[i][t] - old[i][t])
            surr = min(rho * adv[i], min(max(rho, 1 - eps), 1 + eps) * adv[i])
            kl = math.exp(ref[i][t] - new[i][t]) - (ref[i][t] - new[i][t]) - 1
            terms.append(surr - beta * kl)
        per_seq.append(sum(terms) / max(len(terms), 1))
        tok_sum += sum(terms)
        tok_n += len(terms)
    return -(sum(per_seq) / len(per_seq)) if agg == "sequence" else -(tok_sum / tok_n)


@pytest.mark.parametrize("agg", ["sequence", "token"])
def test_loss_is_the_papers_formula(agg):
    rng = np.random.default_rng(0)
    N, T = 6, 7
    old = rng.uniform(-3, -0.1, (N, T))
    new = old + rng.normal(0, 0.3, (N, T))  # ratios inside and outside [0.8, 1.2]
    ref = old + rng.normal(0, 0.2, (N, T))
    adv = rng.normal(0, 1, N)
    mask = (rng.random((N, T)) < 0.7).astype(np.int32)
    mask[:, 0] = 1
    loss, m = grpo.grpo_loss(*(jnp.asarray(x, jnp.float32) for x in (new, old, ref, adv)), jnp.asarray(mask),
                             clip_eps=0.2, beta=0.04, loss_agg=agg)
    want = _reference(new.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.04, agg)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert 0 < float(m["clip_fraction"]) < 1 and float(m["kl"]) > 0


def test_clipped_tokens_carry_no_gradient():
    """A positive advantage with ρ > 1 + ε (or a negative one with ρ < 1 - ε) is clipped: no gradient; inside the
    range the gradient is the policy gradient -A·ρ/|o| (β = 0)."""
    old = jnp.zeros((1, 3))
    adv = jnp.asarray([2.0])
    new = jnp.log(jnp.asarray([[1.5, 1.1, 0.5]]))  # ρ = 1.5 (clipped), 1.1, 0.5 (min picks the unclipped)
    g = jax.grad(lambda x: grpo.grpo_loss(x, old, None, adv, jnp.ones((1, 3)), beta=0.0)[0])(new)
    np.testing.assert_allclose(np.asarray(g), [[0.0, -2.0 * 1.1 / 3, -2.0 * 0.5 / 3]], rtol=1e-6)


def test_sampled_logps_use_the_sampling_temperature():
    logits = jnp.asarray([[[2.0, 0.0, -1.0]]])
    got = grpo.sampled_logps(logits, jnp.asarray([[0]]), temperature=0.5)
    want = 4.0 - math.log(math.exp(4.0) + 1.0 + math.exp(-2.0))
    assert float(got[0, 0]) == pytest.approx(want, rel=1e-6)


def test_the_completion_window_gives_the_full_heads_log_probabilities_and_gradient():
    """The objective runs the LM head on each row's completion window only: its log-probabilities, loss and
    gradient are those of the head over every position (the model's own logits) restricted to the loss mask,
    on rows of different prompt and completion lengths, a full-width completion and an empty one among them."""
    from flax import nnx

    import models

    model = models.Llama(models.LlamaConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    W, T = 4, 10
    prompts = [rng.integers(3, 64, n).astype(np.int32) for n in (3, 6, 2, 5)]
    completions = [rng.integers(3, 64, n).astype(np.int32) for n in (4, 2, 0, 1)]
    adv = np.asarray([1.0, -0.5, 0.3, -1.2], np.float32)
    batch = {k: jnp.asarray(v) for k, v in grpo.rollout_batch(prompts, completions, adv, seq_len=T, pad=0).items()}
    idx, mask = grpo.completion_window(batch, W)
    window = grpo.completion_logps(model, batch, idx, 0.7)  # [N, W]
    full = grpo.sampled_logps(model(batch["input_ids"], positions=batch["positions"],
                                    segment_ids=batch["segment_ids"]), batch["target_ids"], 0.7)  # [N, T]
    lm = np.asarray(batch["loss_mask"], bool)
    np.testing.assert_allclose(np.asarray(window)[np.asarray(mask, bool)], np.asarray(full)[lm], rtol=1e-5)
    assert int(mask.sum()) == int(lm.sum()) == 7

    def full_loss(m):
        new = grpo.sampled_logps(m(batch["input_ids"], positions=batch["positions"],
                                   segment_ids=batch["segment_ids"]), batch["target_ids"], 0.7)
        return grpo.grpo_sums(new, jax.lax.stop_gradient(new), None, batch["advantage"], batch["loss_mask"],
                              beta=0.0)[0]

    objective = grpo.grpo_objective(clip_eps=0.2, beta=0.0, loss_agg="sequence", temperature=0.7, width=W)
    want, g_want = nnx.value_and_grad(full_loss)(model)
    got, g_got = nnx.value_and_grad(lambda m: objective(m, batch)[0])(model)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(g_got)), jax.tree.leaves(nnx.state(g_want)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_filtered_groups_give_the_full_batchs_gradient_per_kept_completion():
    """`filter_groups`: dropping the groups whose rewards are all equal (zero advantages) and padding the batch
    with empty rows leaves the gradient of the full batch, rescaled from its completions to the kept ones (the
    per-completion mean of GRPO's `sequence` aggregation, over the kept rows): the dropped and padded rows add
    nothing. The row counts are eighths of the batch, rounded up to what the mesh divides."""
    from flax import nnx

    import models

    assert [grpo.filtered_rows(n, 64, 1) for n in (0, 1, 8, 9, 63, 64)] == [8, 8, 8, 16, 64, 64]
    assert [grpo.filtered_rows(n, 64, 6) for n in (0, 13, 64)] == [12, 24, 64]  # eighths of 12: 6 divides them
    model = models.Llama(models.LlamaConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    P, G, T, W = 4, 4, 12, 4
    prompts = [rng.integers(3, 64, int(rng.integers(2, 7))).astype(np.int32) for _ in range(P) for _ in range(G)]
    completions = [rng.integers(3, 64, int(rng.integers(1, W + 1))).astype(np.int32) for _ in range(P * G)]
    rewards = np.asarray([[1, 0, 0, 1], [1, 1, 1, 1], [0.5, 0, 0, 0], [0, 0, 0, 0]], np.float32)  # 2 informative
    adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards))).reshape(-1)
    objective = grpo.grpo_objective(clip_eps=0.2, beta=0.0, loss_agg="sequence", temperature=0.7, width=W)
    count = grpo.grpo_count("sequence")

    def loss_and_grad(batch):
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        value, grad = nnx.value_and_grad(lambda m: objective(m, batch)[0])(model)
        n = float(count(batch))
        return float(value) / n, [np.asarray(g) / n for g in jax.tree.leaves(nnx.state(grad))], n

    full = loss_and_grad(grpo.rollout_batch(prompts, completions, adv, seq_len=T, pad=0))
    rows = [g * G + j for g in (0, 2) for j in range(G)]
    kept = grpo.rollout_batch([prompts[i] for i in rows], [completions[i] for i in rows], adv[rows], seq_len=T,
                              pad=0)
    padded = grpo.pad_rows(kept, grpo.filtered_rows(len(rows), 48, 1), 0)  # as if the step's batch were 48 rows
    assert padded["input_ids"].shape == (12, T) and not padded["loss_mask"][8:].any()
    filtered = loss_and_grad(padded)
    assert (full[2], filtered[2]) == (16, 8)
    assert filtered[0] * 8 == pytest.approx(full[0] * 16, rel=1e-5, abs=1e-7)
    for a, b in zip(filtered[1], full[1], strict=True):
        np.testing.assert_allclose(a * 8, b * 16, rtol=1e-4, atol=1e-7)
    assert max(np.abs(g).max() for g in full[1]) > 1e-4  # a gradient to compare


# -- the loop ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def arithmetic_base(tmp_path_factory):
    """data_prep on builtin://arithmetic (its own small tokenizer) and a random tiny Llama on that vocabulary."""
    import json

    from flax import nnx

    import models
    from tasks.data_prep import DataPrepConfig, run_local
    from tasks.training.save import save_model_dir

    root = tmp_path_factory.mktemp("grpo")
    data = root / "data"
    run_local(DataPrepConfig(corpus="builtin://arithmetic", seq_len=32, vocab_size=300, max_documents=2000,
                             max_prompts=32), data)
    special = json.loads((data / "special_tokens.json").read_text())
    cfg = models.LlamaConfig.tiny(vocab_size=special["vocab_size"], bos_token_id=special["bos"],
                                  eos_token_id=special["eos"], pad_token_id=special["pad"])
    save_model_dir(models.Llama(cfg, rngs=nnx.Rngs(0)), root / "base", data)
    return root / "base", data


def _vowel_start(prompt: str, completion: str) -> float:
    """A test checker a random model can learn fast: does the completion start with a vowel?"""
    return float(completion.lstrip()[:1] in tuple("aeiouAEIOU"))


def _vowel_grpo(**train):
    """Full-parameter GRPO with the vowel_start checker, 32 completions per step in groups of 8."""
    from tasks.configs import FinetuneConfig, GRPOConfig
    from tasks.training.config import TrainConfig

    return FinetuneConfig(method="grpo", mode="full",
                          grpo=GRPOConfig(checker="vowel_start", group_size=8, max_new_tokens=4, eval_every=10,
                                          eval_prompts=32, eval_batch_size=32),
                          train=TrainConfig(batch_size=32, learning_rate=1e-2, warmup_steps=2, **train))


def test_grpo_raises_the_reward_and_reports_its_curves(arithmetic_base, tmp_path, monkeypatch):
    import json

    import matplotlib.image

    from tasks import checkers
    from tasks.checkers.registry import CHECKERS, Checker
    from tasks.finetune import finetune

    monkeypatch.setitem(CHECKERS, "vowel_start", Checker("vowel_start", _vowel_start, lambda p: True, "test"))
    base, data = arithmetic_base
    cfg = _vowel_grpo(steps=30, log_every=10)
    out = finetune(cfg, base, data, tmp_path / "out")
    reward = [r for _, r in out["curves"]["reward"]]
    print("reward curve", [round(r, 2) for r in reward], out["accuracy_before"], out["accuracy_after"])
    assert np.mean(reward[-5:]) > np.mean(reward[:5]) + 0.3, reward
    assert out["accuracy_after"]["accuracy_t1"] > out["accuracy_before"]["accuracy_t1"] + 0.2, out
    assert {"kl", "clip_fraction", "completion_tokens", "accuracy_t0", "accuracy_t1"} <= set(out["curves"])
    assert out["curves"]["kl"][-1][1] > 0  # the policy moved away from the reference
    assert checkers.get("arithmetic")  # the registry is intact
    # the artifact keeps the curves: training.json (what evaluate reads) and curves.png (a panel per metric)
    record = json.loads((tmp_path / "out" / "training.json").read_text())
    assert record["accuracy_before"] == out["accuracy_before"] and record["accuracy_after"] == out["accuracy_after"]
    assert record["checker"] == "vowel_start" and record["curves"]["reward"] == out["curves"]["reward"]
    assert "seconds" not in record and "rollout_tokens_per_s" not in record  # a run's wall clock stays out
    png = matplotlib.image.imread(tmp_path / "out" / "curves.png")
    assert png.shape[0] >= 400 and png.shape[1] >= 1000 and len(np.unique(png.reshape(-1, png.shape[-1]), axis=0)) > 50


def test_with_beta_zero_the_kl_to_the_reference_is_watched_at_each_evaluation(arithmetic_base, tmp_path,
                                                                              monkeypatch):
    """β = 0 trains without the KL term, yet `monitor_kl` measures KL(π ‖ π_ref) on the rollout of every
    evaluated step: about 0 while the policy has not moved (a rate of 1e-9), clearly above it once it has;
    `monitor_kl: false` holds no reference and has no KL curve."""
    from tasks.checkers.registry import CHECKERS, Checker
    from tasks.configs import FinetuneConfig, GRPOConfig
    from tasks.finetune import finetune
    from tasks.training.config import TrainConfig

    monkeypatch.setitem(CHECKERS, "vowel_start", Checker("vowel_start", _vowel_start, lambda p: True, "test"))
    base, data = arithmetic_base
    curves = {}
    for name, lr, watch in (("still", 1e-9, True), ("moved", 1e-2, True), ("off", 1e-2, False)):
        cfg = FinetuneConfig(method="grpo", mode="full",
                             grpo=GRPOConfig(checker="vowel_start", group_size=8, max_new_tokens=4, eval_every=4,
                                             eval_prompts=8, eval_batch_size=8, beta=0.0, monitor_kl=watch),
                             train=TrainConfig(steps=8, batch_size=32, learning_rate=lr, warmup_steps=1))
        curves[name] = finetune(cfg, base, data, tmp_path / name)["curves"]
    print({k: c.get("kl") for k, c in curves.items()})
    assert [s for s, _ in curves["still"]["kl"]] == [4, 8] == [s for s, _ in curves["moved"]["kl"]]
    assert all(abs(v) < 1e-5 for _, v in curves["still"]["kl"])
    assert all(v > 1e-3 for _, v in curves["moved"]["kl"])
    assert "kl" not in curves["off"] and "accuracy_t0" in curves["off"]


def test_grpo_config_and_data_errors_name_the_field(arithmetic_base, tiny_base, tmp_path):
    from pydantic import ValidationError

    from tasks.configs import FinetuneConfig, GRPOConfig
    from tasks.finetune import finetune
    from tasks.training.config import TrainConfig

    with pytest.raises(ValidationError, match=r"unknown checker 'nope' \(known: .*arithmetic"):
        GRPOConfig(checker="nope")
    with pytest.raises(ValidationError, match="batch_size 12 .* not a multiple of grpo.group_size 8"):
        FinetuneConfig(method="grpo", train=TrainConfig(batch_size=12))
    base, data = tiny_base  # stdlib docstring -> body prompts: not arithmetic
    with pytest.raises(ValueError, match=r"finetune.grpo.checker: 'arithmetic' judges 0 of the \d+ held-out prompts"):
        finetune(FinetuneConfig(method="grpo", train=TrainConfig(steps=1, batch_size=8)), base, data, tmp_path / "o")
    assert not (tmp_path / "o" / "model").exists()


def test_informative_groups_come_first_in_sampled_order():
    rewards = np.asarray([[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.2, 0.2, 0.2]])
    assert grpo.informative_groups(rewards, 2).tolist() == [1, 3]
    assert grpo.informative_groups(rewards, 4).tolist() == [1, 3, 0, 2]  # too few differ: all-equal ones fill in


def _plus_parity(prompt: str, completion: str) -> float:
    """A test checker that tells completions apart only on `+` prompts (a third of builtin://arithmetic's), about
    half of them 1.0 there: every other prompt's group scores all 0, carrying no gradient."""
    return float(zlib.crc32(completion.encode()) % 2 == 0) if "+" in prompt else 0.0


def test_oversampling_trains_on_the_groups_whose_rewards_differ(arithmetic_base, tmp_path, monkeypatch):
    """`grpo.oversample: 3` (DAPO's dynamic sampling): thrice the prompts are rolled out and, of those, the groups
    whose rewards differ fill the step's batch first; without it, the all-equal groups of non-`+` prompts take
    most of the batch. `filter_groups`: the batch holds the informative groups only."""
    from tasks.checkers.registry import CHECKERS, Checker
    from tasks.configs import FinetuneConfig, GRPOConfig
    from tasks.finetune import finetune
    from tasks.training.config import TrainConfig

    monkeypatch.setitem(CHECKERS, "plus_parity", Checker("plus_parity", _plus_parity, lambda p: True, "test"))
    trained: list[int] = []  # per step: groups of the batch whose advantages are not all zero
    rows: list[int] = []  # per step: completions in the batch
    original = grpo.rollout_batch

    def spy(prompts, completions, advantages, **kw):
        trained.append(int((np.abs(np.asarray(advantages).reshape(-1, 8)).max(-1) > 0).sum()))
        rows.append(len(prompts))
        return original(prompts, completions, advantages, **kw)

    monkeypatch.setattr(grpo, "rollout_batch", spy)
    base, data = arithmetic_base
    runs = {}
    for over, filt in ((1.0, False), (3.0, False), (1.0, True)):
        cfg = FinetuneConfig(method="grpo", mode="full",
                             grpo=GRPOConfig(checker="plus_parity", group_size=8, max_new_tokens=4, eval_every=100,
                                             eval_prompts=8, eval_batch_size=8, oversample=over,
                                             filter_groups=filt),
                             train=TrainConfig(steps=6, batch_size=32, learning_rate=1e-2, warmup_steps=2))
        trained.clear(), rows.clear()
        out = finetune(cfg, base, data, tmp_path / f"out{over}{filt}")
        sampled = [round(f * 4 * over) for _, f in out["curves"]["informative_groups"]]  # of 4 x `over` groups
        runs[over, filt] = (list(trained), sampled, list(rows))
    print("trained / informative among sampled / rows:", runs)
    plain, over, filtered = runs[1.0, False], runs[3.0, False], runs[1.0, True]
    assert plain[0] == plain[1] and plain[2] == [32] * 6  # every informative group of the 4 sampled, no more
    assert over[0] == [min(4, n) for n in over[1]]  # of the 12 sampled, as many informative ones as fit
    assert sum(over[0]) > sum(plain[0])
    assert filtered[0] == filtered[1] and filtered[2] == [8 * n for n in filtered[1]]  # those, and only those
    assert 0 < sum(filtered[1]) < 24


def test_sft_then_grpo_starts_from_the_sft_model(arithmetic_base, tmp_path, monkeypatch):
    """`sft_steps`: SFT on the packed rows first (its validation loss falls), then GRPO from that model, whose
    held-out accuracy before RL is the SFT model's; with `method: sft` the key is refused."""
    from pydantic import ValidationError

    from tasks.checkers.registry import CHECKERS, Checker
    from tasks.configs import FinetuneConfig, GRPOConfig
    from tasks.finetune import finetune
    from tasks.training.config import TrainConfig

    monkeypatch.setitem(CHECKERS, "vowel_start", Checker("vowel_start", _vowel_start, lambda p: True, "test"))
    base, data = arithmetic_base
    cfg = FinetuneConfig(method="grpo", mode="lora", sft_steps=20,
                         sft_train={"batch_size": 8, "learning_rate": 1e-2, "warmup_steps": 1, "log_every": 5},
                         grpo=GRPOConfig(checker="vowel_start", max_new_tokens=4, eval_prompts=16, eval_batch_size=16),
                         train=TrainConfig(steps=2, batch_size=16, learning_rate=1e-6, warmup_steps=1))
    out = finetune(cfg, base, data, tmp_path / "out")
    # the SFT phase ran with sft_train's settings (its learning rate: train's 1e-6 would not move the loss)
    assert out["sft"]["steps"] == 20 and out["sft"]["valid_loss_after"] < out["sft"]["valid_loss_before"] - 0.2
    assert [s for s, _ in out["sft"]["train_losses"]] == [5, 10, 15, 20]
    with pytest.raises(ValidationError, match="sft_train sets the SFT phase"):
        FinetuneConfig(method="grpo", sft_train={"learning_rate": 1e-3})
    # sft_train overrides train's keys it names and keeps the rest (a bf16 run stays bf16 in its SFT phase)
    both = FinetuneConfig(method="grpo", sft_steps=7, sft_train={"learning_rate": 1e-3},
                          train=TrainConfig(batch_size=16, compute_dtype="bfloat16", learning_rate=1e-5))
    assert (both.sft_config.learning_rate, both.sft_config.compute_dtype, both.sft_config.batch_size,
            both.sft_config.steps) == (1e-3, "bfloat16", 16, 7)
    for bad, where in (({"mesh": {"data": 2}}, "sft_train.mesh"), ({"steps": 3}, "sft_train.steps"),
                       ({"learning_rat": 1}, "sft_train.learning_rat"),
                       ({"learning_rate": "x"}, "sft_train.learning_rate")):
        with pytest.raises(ValidationError, match=re.escape(where)):
            FinetuneConfig(method="grpo", sft_steps=5, sft_train=bad)
    assert out["steps"] == 2 and len(out["curves"]["reward"]) == 2 and len(out["curves"]["accuracy_t0"]) == 2
    with pytest.raises(ValidationError, match="sft_steps precedes method dpo or grpo"):
        FinetuneConfig(sft_steps=5)


def _crc_parity(prompt: str, completion: str) -> float:
    """A test checker whose score depends on every character of the completion (about half score 1.0)."""
    return float(zlib.crc32(completion.encode()) % 2 == 0)


def test_evaluate_task_accuracy_matches_plain_greedy_decoding(arithmetic_base, monkeypatch):
    """evaluate's task accuracy: the checkers that judge the data's held-out documents are found, the data's own
    answers score 1.0 (the ceiling), and pass@1 at T=0 equals scoring what plain greedy `generate` writes for
    each prompt alone (no padding, no batching). The test checker's score hashes the whole completion, so
    equal accuracies mean equal completions, not two zeros."""
    import json

    import jax.numpy as jnp
    from tokenizers import Tokenizer

    import models
    from models.generate import generate
    from tasks import evaluate as ev
    from tasks.checkers.registry import CHECKERS, Checker
    from tasks.configs import EvalConfig

    monkeypatch.setitem(CHECKERS, "crc", Checker("crc", _crc_parity, lambda p: p.endswith("="), "test", 6))
    base, data = arithmetic_base
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    special = json.loads((data / "special_tokens.json").read_text())

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    cfg = EvalConfig(task_prompts=24, task_batch_size=16, serve_temperature=1.0, spec_temperatures=[0.0, 1.0])
    tasks = ev.task_sets(data, cfg, decode, special["bos"], special["eos"])
    assert set(tasks) == {"arithmetic", "crc"} and tasks["arithmetic"].split == "valid"
    task = tasks["crc"]
    assert len(task.prompts) == 24 and task.prompts.text == tasks["arithmetic"].prompts.text
    model = models.from_pretrained(str(base))
    acc = ev.task_accuracy(model, tasks, cfg, decode, special["eos"], special["pad"])
    assert set(acc["crc"]) == {"t0", "t1"}
    want = []
    for ids, text in zip(task.prompts.ids, task.prompts.text, strict=True):
        out = generate(model, jnp.asarray(ids)[None], max_new_tokens=6, eos_token_id=special["eos"],
                       pad_token_id=special["pad"])
        want.append(_crc_parity(text, decode(np.asarray(out.tokens[0, : int(out.lengths[0])]).tolist())))
    assert 0.1 < np.mean(want) < 0.9 and acc["crc"]["t0"] == pytest.approx(np.mean(want))
    report = ev.task_report(tasks, {"finetuned": acc}, cfg)
    assert report["arithmetic"]["reference"] == 1.0 and report["arithmetic"]["max_new_tokens"] == 8
    assert report["crc"]["prompts"] == 24 and report["crc"]["max_new_tokens"] == 6


def test_task_and_rl_gates_judge_the_report():
    from tasks.configs import Gates
    from tasks.evaluate import gates, markdown

    def report(ft, q, before=0.2, after=0.4):
        return {"perplexity": {"finetuned": 10.0, "int8": 10.0},
                "quantization": {"int8": {"perplexity": 10.0, "perplexity_increase": 0.0, "kl": 0.0, "kl_p99": 0.0,
                                          "kl_max": 0.0, "top1_flip_rate": 0.0}},
                "tasks": {"letters": {"checker": "letters", "description": "d", "split": "valid", "prompts": 64,
                                      "max_new_tokens": 16, "reference": 1.0,
                                      "accuracy": {"finetuned": {"t0": ft}, "int8": {"t0": q}}}},
                "rl": {"checker": "letters", "steps": 10, "sft_steps": 5, "accuracy_before": {"accuracy_t0": before},
                       "accuracy_after": {"accuracy_t0": after}}}

    g = Gates(finetune_improves=False, max_quant_ppl_increase=1, max_quant_kl_p99=1, max_quant_flip_rate=1,
              min_task_accuracy=0.5, max_task_accuracy_drop=0.05, min_rl_accuracy_gain=0.15)
    judged = {x["gate"]: x["passed"] for x in gates(report(0.6, 0.58), g) if "task" in x["gate"] or "RL" in x["gate"]}
    assert judged == {"task letters: fine-tuned pass@1 (T=0)": True,
                      "task letters: int8 pass@1 drop vs fine-tuned (T=0)": True,
                      "RL (letters): held-out pass@1 gain over its start (T=0)": True}
    failed = {x["gate"] for x in gates(report(0.45, 0.30, after=0.3), g) if not x["passed"]}
    assert failed == set(judged)
    md = markdown({**report(0.6, 0.58), "gates": gates(report(0.6, 0.58), g)})
    assert "| finetuned | 60.0% |" in md and "| int8 | 58.0% |" in md and "| after RL | 40.0% |" in md
    assert set(g.enabled(["int8"])) >= {"min_task_accuracy", "max_task_accuracy_drop[int8]", "min_rl_accuracy_gain"}
    assert {w["gate"] for w in Gates(max_task_accuracy_drop=0.5, min_task_accuracy=0).waivers(g, ["int8"])} >= {
        "evaluate.gates.max_task_accuracy_drop", "evaluate.gates.min_task_accuracy",
        "evaluate.gates.min_rl_accuracy_gain"}


def test_a_resumed_grpo_run_reports_the_same_start_and_end(arithmetic_base, tmp_path, monkeypatch):
    """Resume: the held-out accuracy before RL travels in the checkpoint (a rerun does not re-measure it on
    the trained model), and a rerun that finds the last step already saved still measures the end."""
    from tasks.checkers.registry import CHECKERS, Checker
    from tasks.finetune import finetune
    from tasks.training.checkpoints import Checkpoints

    monkeypatch.setitem(CHECKERS, "vowel_start", Checker("vowel_start", _vowel_start, lambda p: True, "test"))
    base, data = arithmetic_base
    cfg = _vowel_grpo(steps=12, checkpoint_every=6)

    def run(out):
        ckpt = Checkpoints(tmp_path / "ckpt", None, "grpo", keep=2)
        try:
            return finetune(cfg, base, data, tmp_path / out, checkpoints=ckpt)
        finally:
            ckpt.close()

    first = run("a")
    assert first["resumed_from_step"] is None
    assert first["accuracy_after"] != first["accuracy_before"], first  # the run moved the policy
    again = run("b")  # every step is saved: nothing to train, the start read back, the end measured
    assert again["resumed_from_step"] == 12
    assert again["accuracy_before"] == first["accuracy_before"]
    assert again["accuracy_after"] == first["accuracy_after"]
    rl = json.loads((tmp_path / "b" / "rl.json").read_text())
    assert rl["accuracy_before"] == first["accuracy_before"] and rl["accuracy_after"] == first["accuracy_after"]


def test_several_updates_per_rollout_make_the_clip_act_and_resume_at_a_rollout(arithmetic_base, tmp_path,
                                                                               monkeypatch):
    """`num_iterations: 2`: a rollout every 2 updates, the later ones against the rollout's log-probabilities, so
    ratios leave 1 and some are clipped (with one update per rollout the clip fraction is 0); the reward still
    rises; train.steps and checkpoint_every must be multiples of it; a run killed after a checkpoint resumes at a
    rollout and ends where an uninterrupted run ends."""
    from pydantic import ValidationError

    from tasks.checkers.registry import CHECKERS, Checker
    from tasks.configs import FinetuneConfig, GRPOConfig
    from tasks.finetune import finetune
    from tasks.training import checkpoints as ck
    from tasks.training.config import TrainConfig

    monkeypatch.setitem(CHECKERS, "vowel_start", Checker("vowel_start", _vowel_start, lambda p: True, "test"))
    base, data = arithmetic_base
    grpo_cfg = GRPOConfig(checker="vowel_start", group_size=8, max_new_tokens=4, eval_every=9, eval_prompts=32,
                          eval_batch_size=32, num_iterations=2, clip_eps=0.1)
    with pytest.raises(ValidationError, match="train.steps 9 is not a multiple of grpo.num_iterations 2"):
        FinetuneConfig(method="grpo", mode="full", grpo=grpo_cfg, train=TrainConfig(steps=9, checkpoint_every=4))
    with pytest.raises(ValidationError, match="train.checkpoint_every 5 is not a multiple"):
        FinetuneConfig(method="grpo", mode="full", grpo=grpo_cfg, train=TrainConfig(steps=10, checkpoint_every=5))
    cfg = FinetuneConfig(method="grpo", mode="full", grpo=grpo_cfg,
                         train=TrainConfig(steps=40, batch_size=32, learning_rate=1e-2, warmup_steps=2, log_every=10,
                                           checkpoint_every=20))
    whole = finetune(cfg, base, data, tmp_path / "whole")
    clip = [v for _, v in whole["curves"]["clip_fraction"]]
    reward = [r for _, r in whole["curves"]["reward"]]
    print("clip", [round(c, 3) for c in clip], "reward", [round(r, 2) for r in reward])
    assert max(clip) > 0
    assert np.mean(reward[-10:]) > np.mean(reward[:10]) + 0.2, reward

    saves = []
    real_save = ck.Checkpoints.save

    def save_then_die(self, step, state):
        real_save(self, step, state)
        saves.append(step)
        if step == 20:
            self.wait()
            raise RuntimeError("killed after step 20")

    monkeypatch.setattr(ck.Checkpoints, "save", save_then_die)
    ckpt = ck.Checkpoints(tmp_path / "ckpt", None, "grpo", keep=2)
    with pytest.raises(RuntimeError, match="killed after step 20"):
        finetune(cfg, base, data, tmp_path / "a", checkpoints=ckpt)
    ckpt.close()
    monkeypatch.setattr(ck.Checkpoints, "save", real_save)
    ckpt = ck.Checkpoints(tmp_path / "ckpt", None, "grpo", keep=2)
    try:
        resumed = finetune(cfg, base, data, tmp_path / "b", checkpoints=ckpt)
    finally:
        ckpt.close()
    assert resumed["resumed_from_step"] == 20
    assert resumed["accuracy_after"] == whole["accuracy_after"]
    np.testing.assert_allclose([v for _, v in resumed["curves"]["reward"]], reward[20:], rtol=1e-6)
