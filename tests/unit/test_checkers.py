"""Reward checkers (tasks/checkers/): the registry finds checkers by name and by the prompts they can judge;
the arithmetic task's answers are exact (against Python's own arithmetic on the parsed prompt), its checker
scores only exact answers, and the `builtin://arithmetic` corpus, packed by data_prep, holds held-out prompts
whose reference continuations the checker scores 1.0 and whose perturbed continuations it scores 0.0; likewise
the `letters` task (reverse or sort spelled-out letters)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from tasks import checkers
from tasks.checkers import arithmetic, letters
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


def test_letters_problems_are_exact_and_seeded():
    probs = list(letters.problems(seed=3, n=2000))
    assert probs == list(letters.problems(seed=3, n=2000)) and probs != list(letters.problems(seed=4, n=2000))
    ops = set()
    for prompt, completion in probs:
        op, rest = prompt.split(": ")
        xs = rest.removesuffix(" =").split(" ")
        assert 3 <= len(xs) <= 5 and all(len(x) == 1 and x.islower() for x in xs)
        want = xs[::-1] if op == "reverse" else sorted(xs)
        assert completion == " " + " ".join(want) and letters.expected(prompt) == want
        ops.add(op)
    assert ops == {"reverse", "sort"}


@pytest.mark.parametrize("completion, reward", [
    (" t a c", 1.0), ("t a c", 1.0), (" t a c \nmore", 1.0), (" c a t", 1 / 3), (" t a", 2 / 3), (" tac", 0.0),
    (" t  a c", 0.0), (" t a c d", 0.75), ("", 0.0), (" T A C", 0.0), (" x y z", 0.0),
])
def test_letters_checker_scores_exact_answers_only(completion, reward):
    assert letters.score("reverse: c a t =", completion) == reward
    assert letters.score("sort: c a t =", " a c t") == 1.0
    assert letters.score("reverse: cat =", " t a c") == 0.0  # not a prompt of this task
    assert checkers.applicable(["reverse: c a t =", "sort: b a ="]) == ["letters"]


def test_judged_and_score_all():
    prompts = ["3 + 4 =", "reverse: c a t =", "hello", "12 * 7 ="]
    assert checkers.judged(prompts) == {"arithmetic": [0, 3], "letters": [1]}
    got = checkers.score_all(arithmetic.score, ["3 + 4 =", "12 * 7 =", "1 - 2 ="], [" 7", " 83", " -1"])
    assert got == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 prompts, 1 completions"):
        checkers.score_all(arithmetic.score, ["3 + 4 =", "1 + 1 ="], [" 7"])


def test_builtin_letters_prompts_score_their_references(tmp_path):
    run_local(DataPrepConfig(corpus="builtin://letters", seq_len=64, vocab_size=300, max_documents=2000,
                             max_prompts=64), tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rows = pq.read_table(tmp_path / "prompts.parquet").to_pylist()
    assert len(rows) == 64 and checkers.applicable(r["prompt_text"] for r in rows) == ["letters"]
    for r in rows:
        reference = tok.decode(r["reference_ids"], skip_special_tokens=True)
        assert letters.score(r["prompt_text"], reference) == 1.0, (r["prompt_text"], reference)
        assert letters.score(r["prompt_text"], " " + " ".join(letters.expected(r["prompt_text"])[1:])) < 1.0
