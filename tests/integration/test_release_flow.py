"""The release flow end to end under Prefect's test harness, against a real S3 server (SeaweedFS),
then the checks a consumer of the bundle would make: transformers loads `model/` with our logits,
peft loads `adapter/`, every file matches the manifest; a second run is all cache hits; the draft
refresh promotes only through its pointer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import storage
from storage import Store
from tasks.recipe import load_recipe
from tests.conftest import SMOKE, release_with_events

pytestmark = [pytest.mark.integration]

BUNDLE_FILES = [  # (eval/timing.json and the model card are volatile: hashed, outside the digest)
    "model/config.json", "model/tokenizer.json", "model/tokenizer_config.json", "model/generation_config.json",
    "adapter/adapter_config.json",
    "adapter/adapter_model.safetensors",
    "draft/speculators/config.json", "draft/speculators/model.safetensors", "draft/draft_config.json",
    "quantized/int8/config.json", "quantized/w4a16-gptq-g64/config.json",
    "quantized/w4a16-gptq-g64/model.safetensors", "quantized/w4a16-gptq-g64/quant_error.svg",
    "quantized/w4a16-gptq-g64/quantization_report.json", "quantized/w4a16-gptq-g64/tokenizer.json",
    "eval/report.json", "eval/timing.json", "eval/report.md", "README.md", "lineage.json",
    "training/curves.png", "training/training.json",
    "manifest.json",
]


def test_bundle_layout_and_manifest(released, tmp_path):
    store, url, events = released
    assert url.startswith(store + "/export/")
    assert {e.kind for e in events if e.ran} == {"data_prep", "base", "finetune", "traces", "draft", "quantize",
                                                  "evaluate", "export"}
    for rel in BUNDLE_FILES:
        assert storage.exists(storage.join(url, rel)), rel
    # the shipped draft is the candidate evaluate chose; an EAGLE-3 draft also ships SGLang's layout
    report = json.loads(storage.read_bytes(storage.join(url, "eval/report.json")))
    shipped = json.loads(storage.read_bytes(storage.join(url, "draft/draft_config.json")))
    spec = json.loads(storage.read_bytes(storage.join(url, "draft/speculators/config.json")))
    assert shipped["name"] == report["draft"]["name"] and spec["speculators_model_type"] == shipped["method"]
    assert storage.exists(storage.join(url, "draft/sglang/config.json")) == (shipped["method"] == "eagle3")
    st = Store(store, cache_dir=tmp_path / "cache")
    ref = st.load(url)
    st.verify(ref)  # every file's sha256 matches the manifest
    manifest = st.manifest(ref)
    assert any(f.startswith("model/") and f.endswith(".safetensors") for f in manifest["files"])
    lineage = json.loads(storage.read_bytes(storage.join(url, "lineage.json")))
    assert set(lineage["stages"]) == {"base", "data", "finetune", "traces", "draft", "quant", "evaluate"}
    assert lineage["recipe"]["name"] == "forgeline-tiny" and lineage["gates_passed"] is True
    for stage in ("traces", "draft"):  # both ran against the served int8 variant, from the quantize artifact
        m = json.loads(storage.read_bytes(storage.join(store, lineage["stages"][stage]["key"] + "/manifest.json")))
        assert m["config"]["target"] == "int8"
        assert lineage["stages"]["quant"]["digest"] in {i["digest"] for i in m["inputs"]}
    assert st.read_pointer("releases/forgeline-tiny") == ref


def test_report_schema_and_gates(released):
    _, url, _ = released
    report = json.loads(storage.read_bytes(storage.join(url, "eval/report.json")))
    ppl = report["perplexity"]
    assert set(ppl) == {"base", "finetuned", "int8", "w4a16-gptq-g64"}
    assert ppl["finetuned"] < ppl["base"]
    assert abs(ppl["int8"] / ppl["finetuned"] - 1) < 0.01
    for scheme, bytes_ratio in (("int8", 0.55), ("w4a16-gptq-g64", 0.30)):
        q = report["quantization"][scheme]
        assert q["perplexity"] == ppl[scheme] and q["perplexity_increase"] == ppl[scheme] / ppl["finetuned"] - 1
        assert q["kl"] >= 0 and 0.9 <= q["top1_agreement"] <= 1 and q["top1_flip_rate"] == 1 - q["top1_agreement"]
        assert q["positions"] > 0 and q["kl_max"] < 1
        assert q["weight_bytes_ratio_vs_bf16"] < bytes_ratio and "quantize_seconds" not in q
        # the whole checkpoint (embeddings, head and norms at bf16) shrinks less than the quantized Linears
        assert q["weight_bytes_ratio_vs_bf16"] < q["checkpoint_bytes_ratio_vs_bf16"] < 1
        assert q["calibration_tokens"] >= 2048  # calibration.min_tokens
    # the int4 variant is compressed-tensors W4A16 (groups of 64), as transformers and vLLM read it
    config = json.loads(storage.read_bytes(storage.join(url, "quantized/w4a16-gptq-g64/config.json")))
    qc = config["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert qc["format"] == "pack-quantized" and (w["num_bits"], w["group_size"], w["strategy"]) == (4, 64, "group")
    made = json.loads(storage.read_bytes(storage.join(url, "quantized/w4a16-gptq-g64/quantization_report.json")))
    assert {r["method"] for r in made["modules"]} == {"gptq"} and len(made["modules"]) == 2 * 7
    judged = {g["gate"] for g in report["gates"]}  # the flipped-answer gates judge every shipped scheme
    assert {f"{s} {what}" for s in ("int8", "w4a16-gptq-g64") for what in ("KL p99", "top-1 flip rate")} <= \
        {g.rsplit(" <= ", 1)[0] for g in judged}
    d = report["draft"]
    # the declared floor (2.0 at k=5) is met: the draft learned the target, it does not just decode losslessly
    floor = load_recipe(SMOKE).evaluate.gates.min_acceptance_length
    assert floor >= 2.0 and floor <= d["acceptance_length"] <= d["draft_tokens"] + 1, d
    assert d["lossless"] is True and "speedup" not in d  # wall-clock numbers live in timing.json
    timing = json.loads(storage.read_bytes(storage.join(url, "eval/timing.json")))
    assert timing["draft"]["speedup"] > 0 and set(timing["draft"]["runs"]) == set(d["runs"])
    assert all(timing["quantization"][s]["quantize_seconds"] > 0 for s in ("int8", "w4a16-gptq-g64"))
    assert d["target"] == "int8"  # the smoke recipe serves the int8 variant: the draft is measured against it
    # every candidate of the smoke recipe was measured; the shipped one has the highest memory-bound speedup
    # at T=0 of those that pass the draft gates (lossless, the acceptance floor): deterministic, in report.json
    drafts = report["drafts"]
    assert list(drafts) == ["eagle3", "dflash-lk_hybrid"] and d["name"] in drafts
    speed = {n: r["speedup_memory_bound"] for n, r in drafts.items()}
    assert speed[d["name"]] == max(s for n, s in speed.items()
                                   if drafts[n]["lossless"] and drafts[n]["acceptance_length"] >= floor)
    assert all(timing["drafts"][n]["serve_speedup"] > 0 for n in drafts)  # the wall clock, beside it
    for name, r in drafts.items():
        assert r["lossless"] is True, name
        assert set(r["runs"]) == ({"chain_t0", "chain_t1", "tree_t0"} if r["kind"] == "eagle3"
                                  else {"chain_t0", "chain_t1"}), name
        for run in r["runs"].values():
            assert 1 <= run["acceptance_length"] <= r["draft_tokens"] + 1
            assert len(run["per_position_acceptance"]) == r["draft_tokens"]
        assert r["selected_step"] == 60 and r["trainable_params"] > 0
    assert drafts["eagle3"]["runs"]["tree_t0"]["lossless"] is True
    card = storage.read_bytes(storage.join(url, "README.md")).decode()
    assert "acceptance length" in card and "int8" in card and "## Draft candidates" in card


def test_transformers_and_peft_load_the_bundle(released, tmp_path):
    import peft
    import torch
    import transformers

    import models

    store, url, _ = released
    st = Store(store, cache_dir=tmp_path / "cache")
    local = st.fetch(st.load(url))
    ids = np.array([[1, 5, 9, 200, 17, 3, 64, 11]], np.int32)
    ours = np.asarray(models.from_pretrained(str(local / "model"))(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(local / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)

    # adapter/ on top of the base it was trained from reproduces the merged model
    lineage = json.loads((local / "lineage.json").read_text())
    base_dir = st.fetch(st.load(st.url(lineage["stages"]["base"]["key"]))) / "model"
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, local / "adapter").eval()
    with torch.no_grad():
        adapted = with_adapter(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(adapted, theirs, rtol=1e-4, atol=1e-4)


def test_second_run_is_all_cache_hits(released):
    store, url, _ = released
    again, events = release_with_events(store)
    assert again == url
    assert len(events) == 9 and not any(e.ran for e in events)


# in `pytest -m slow` (keeps the default run under 15 min on 2 cores)
@pytest.mark.slow
def test_draft_refresh_promotes_only_through_its_pointer(released):
    """Both outcomes, on the same computed stages: a threshold the candidate cannot reach keeps the current
    draft (no pointer written); the recipe's own threshold (candidate >= current) promotes the candidate,
    which trained on fresh prompts from the current draft, by one pointer write."""
    from flows.draft_refresh import draft_refresh

    store, _, _ = released
    st = Store(store)
    assert st.read_pointer("drafts/forgeline-tiny") is None
    kept = draft_refresh(recipe=SMOKE, overrides=["refresh.min_acceptance_ratio=100"], store=store)
    assert kept["promoted"] is False and st.read_pointer("drafts/forgeline-tiny") is None
    assert kept["candidate"] < 100 * kept["current"] and kept["current"] > 1

    promoted = draft_refresh(recipe=SMOKE, store=store)  # every stage is a cache hit: the same two drafts
    assert (promoted["current"], promoted["candidate"]) == (kept["current"], kept["candidate"])
    assert promoted["promoted"] is True and promoted["candidate"] >= promoted["current"], promoted
    pointer = st.read_pointer("drafts/forgeline-tiny")
    assert pointer is not None and pointer.url == promoted["draft"] != kept["draft"]


def test_credentials_never_reach_an_output(released, s3_env, capfd):
    """The S3 credentials -- canary strings given only through the environment (tests/s3_server.py) -- appear
    in no object of the store (artifacts, manifests, lineage, model card, reports, logs, checkpoints,
    pointers), no Prefect flow-run parameter, log, artifact or persisted result, and not on the console."""
    from prefect import get_client
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    store, _, _ = released
    canaries = [s3_env["AWS_SECRET_ACCESS_KEY"], s3_env["AWS_ACCESS_KEY_ID"]]
    assert all(c.startswith("canary-") for c in canaries)
    objects = storage.list_files(store, hidden=True)
    assert len(objects) > 50
    for url in objects:
        body = storage.read_bytes(url)
        assert not any(c.encode() in body for c in canaries), url
    with get_client(sync_client=True) as client:
        seen = [json.dumps(r.parameters) for r in client.read_flow_runs()]
        seen += [log.message for log in client.read_logs()]
        seen += [json.dumps(a.data, default=str) for a in client.read_artifacts()]
    assert len(seen) > 10
    assert not any(c in text for c in canaries for text in seen)
    results = Path(PREFECT_LOCAL_STORAGE_PATH.value())
    for path in (p for p in results.rglob("*") if p.is_file()) if results.exists() else []:
        assert not any(c.encode() in path.read_bytes() for c in canaries), path
    out, err = capfd.readouterr()
    assert not any(c in out + err for c in canaries)


@pytest.mark.slow
def test_benchmarks_run_on_the_release(released, tmp_path, capsys):
    """The speculative and quantization benchmarks, end to end on the smoke release at their smallest."""
    from benchmarks import quant as bench_quant
    from benchmarks import speculative as bench_spec

    store, url, _ = released
    bench_spec.main(["--store", store, "--release", "forgeline-tiny", "--k", "3", "--prompts", "1",
                     "--max-new-tokens", "8", "--mlp-width", "128", "--extra-layers", "0",
                     "--json", str(tmp_path / "spec.json")])
    rows = json.loads((tmp_path / "spec.json").read_text())
    assert {r["target"] for r in rows} == {"release", "memory-bound"}
    assert {r["draft"] for r in rows} == {"eagle3", "dflash-lk_hybrid"}  # every candidate
    greedy = [r for r in rows if "lossless" in r]  # greedy rows compare against plain decoding token for token
    # per target: each candidate's chain / parallel row, and the EAGLE-3 tree
    assert len(greedy) == 2 * 3 and all(r["lossless"] for r in greedy), greedy
    # each row's bound: the measured verify/step cost ratio and τ over it
    assert all(r["verify_cost_ratio"] > 0 and r["speedup_bound"] == r["acceptance_length"] / r["verify_cost_ratio"]
               for r in rows), rows
    st = Store(store, cache_dir=tmp_path / "cache")
    lineage = json.loads(storage.read_bytes(storage.join(url, "lineage.json")))
    model = st.fetch(st.load(st.url(lineage["stages"]["finetune"]["key"]))) / "model"
    data = st.fetch(st.load(st.url(lineage["stages"]["data"]["key"])))
    bench_quant.main(["--model", str(model), "--data", str(data), "--schemes", "int8", "--eval-batches", "1",
                      "--out", str(tmp_path / "quant.json")])
    quant_rows = json.loads((tmp_path / "quant.json").read_text())["rows"]
    assert any(r["scheme"] == "int8" and r["meets_aim"] for r in quant_rows), quant_rows
    assert "| int8 |" in capsys.readouterr().out


def test_verify_catches_a_tampered_byte_a_planted_file_and_a_missing_one(released, tmp_path):
    """`forgeline verify` on the real bundle: ok; then one flipped byte, one planted file and one deleted file
    are each named on their own line (exit 1); restored, ok again."""
    store, url, _ = released

    def verify() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", "verify", url], capture_output=True, text=True,
                              timeout=300)

    ok = verify()
    assert ok.returncode == 0 and ok.stdout.startswith(f"ok: {url}: export artifact"), ok.stderr
    assert "7 lineage entries resolve, 3 checkpoint(s) load" in ok.stdout  # model/ and two quantized/
    weights, card = storage.join(url, "quantized/int8/model.safetensors"), storage.join(url, "README.md")
    original, card_bytes = storage.read_bytes(weights), storage.read_bytes(card)
    flipped = bytearray(original)
    flipped[len(flipped) - 100] ^= 0x01  # deep in the tensor data: the header still parses
    try:
        storage.write_bytes(weights, bytes(flipped))
        storage.write_bytes(storage.join(url, "model/extra.bin"), b"planted")
        storage.rm(card)
        bad = verify()
    finally:
        storage.write_bytes(weights, original)
        storage.rm(storage.join(url, "model/extra.bin"))
        storage.write_bytes(card, card_bytes)
    lines = bad.stderr.splitlines()
    assert bad.returncode == 1, bad.stderr
    assert f"altered: {weights}" in "\n".join(lines) and f"missing: {card}" in lines
    assert any(ln.startswith("extra: ") and ln.endswith("model/extra.bin (not in the manifest)") for ln in lines)
    assert lines[-1] == f"error: {url}: 3 problem(s) found" and "Traceback" not in bad.stderr
    assert verify().returncode == 0
