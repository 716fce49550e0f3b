"""Reward checkers (tasks/checkers/): the registry finds checkers by name and by the prompts they can judge;
the arithmetic task's answers are exact (against Python's own arithmetic on the parsed prompt), its checker
scores only exact answers, and the `builtin://arithmetic` corpus, packed by data_prep, holds held-out prompts
whose reference continuations the checker scores 1.0 and whose perturbed continuations it scores 0.0."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from tasks import checkers
from tasks.checkers import arithmetic
from tasks.data_prep import DataPrepConfig, run_local

pytestmark = pytest.mark.unit


def test_registry_finds_checkers_by_name_and_prompt():
    assert checkers.get("arithmetic").score is arithmetic.score
    with pytest.raises(ValueError, match=r"unknown checker 'nope' \(known: .*arithmetic"):
        checkers.get("nope")
    assert checkers.applicable(["3 + 4 =", "12 * 7 ="]) == ["arithmetic"]
    assert checkers.applicable(["3 + 4 =", "def f(x):"]) == [] and checkers.applicable([]) == []
    with pytest.raises(ValueError, match="registered twice"):
        checkers.register("arithmetic", applies=lambda p: True)(lambda p, c: 0.0)


def test_arithmetic_problems_are_exact_and_seeded():
    probs = list(arithmetic.problems(seed=3, n=2000))
    assert probs == list(arithmetic.problems(seed=3, n=2000)) and probs != list(arithmetic.problems(seed=4, n=2000))
    ops = set()
    for prompt, completion in probs:
        a, op, b, eq = prompt.split(" ")
        assert eq == "=" and 0 <= int(a) <= 99 and 0 <= int(b) <= (9 if op == "*" else 99)
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert completion == f" {want}" and arithmetic.expected(prompt) == want
        ops.add(op)
    assert ops == {"+", "-", "*"}


@pytest.mark.parametrize("completion, reward", [
    (" 46", 1.0), ("46", 1.0), (" 46 \nmore text", 1.0), (" 47", 0.0), (" 46 + 0", 0.0), (" 46abc", 0.0),
    ("", 0.0), (" forty-six", 0.0), (" -46", 0.0),
])
def test_arithmetic_checker_scores_exact_answers_only(completion, reward):
    assert arithmetic.score("12 + 34 =", completion) == reward
    assert arithmetic.score("12 - 34 =", " -22") == 1.0
    assert arithmetic.score("what is 12 + 34?", " 46") == 0.0  # not a prompt of this task


def test_builtin_arithmetic_prompts_score_their_references(tmp_path):
    stats = run_local(DataPrepConfig(corpus="builtin://arithmetic", seq_len=64, vocab_size=300, max_documents=3000,
                                     max_prompts=64), tmp_path)
    assert stats["documents"]["valid"] > 50 and stats["prompts"] == 64
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rows = pq.read_table(tmp_path / "prompts.parquet").to_pylist()
    assert checkers.applicable(r["prompt_text"] for r in rows) == ["arithmetic"]
    for r in rows:
        reference = tok.decode(r["reference_ids"], skip_special_tokens=True)
        assert arithmetic.score(r["prompt_text"], reference) == 1.0, (r["prompt_text"], reference)
        wrong = f" {arithmetic.expected(r['prompt_text']) + 1}"
        assert arithmetic.score(r["prompt_text"], wrong) == 0.0
