"""Bad input refused: the catalogue. Each case is `forgeline release` run as a real subprocess (exit code and
stderr exactly as a user sees them) on one bad input, and must end with

- exactly one `error:` line, naming the field or the user's own file or URL (never a local copy under
  the work folder), containing the case's expected words;
- the case's exit code (2: the recipe or command line; 1: the inputs, stores, stages);
- no traceback anywhere on the terminal;
- nothing committed to the store (no manifest.json under it).

Cases marked `stage` fail inside a stage (a corpus is read whole only there); they run against the session's
Prefect test server. The others, a base checkpoint's tensors and tokenizer included, fail before Prefect
starts. All cases run concurrently (three at a time) in one module fixture, so the catalogue costs about as
much as its slowest few cases. The README's "Bad input" table lists every case: `test_readme_lists_every_case`
keeps the two in step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.numpy

import storage
from tests.conftest import ROOT, SMOKE

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Case:
    id: str
    what: str  # the README's "input" column
    expect: str  # words the error line must contain ({dir} is the case's folder, {store} its store URL)
    setup: Callable[[Path, dict], list[str]] = field(repr=False)  # -> extra command-line arguments
    code: int = 1
    stage: bool = False  # fails inside a stage: needs the Prefect server
    env: Callable[[dict], dict[str, str]] | None = field(default=None, repr=False)


CASES: list[Case] = []


def case(what: str, expect: str, *, code: int = 1, stage: bool = False, env=None):
    def register(fn: Callable[[Path, dict], list[str]]):
        CASES.append(Case(fn.__name__.removeprefix("case_"), what, expect, fn, code, stage, env))
        return fn

    return register


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def recipe_file(d: Path, text: str, name: str = "recipe.yaml") -> list[str]:
    (d / name).write_text(text)
    return ["--recipe", str(d / name)]


def jsonl(d: Path, rows: list, name: str = "corpus.jsonl") -> str:
    path = d / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return f"file://{path}"


def base_copy(d: Path, ctx: dict) -> Path:
    dst = d / "base"
    shutil.copytree(ctx["base"], dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


GOOD_CHAT = {"messages": [{"role": "user", "content": "add two numbers"},
                          {"role": "assistant", "content": "def add(a, b):\n    return a + b"}]}


# -- the recipe and the command line -------------------------------------------------------------------------

@case("`--set finetune.lora_rnak=8` (a misspelt key)", "unknown key 'finetune.lora_rnak'", code=2)
def case_unknown_key(d, ctx):
    return sets("finetune.lora_rnak=8")


@case("`--set finetune.train.steps=many`", "finetune.train.steps: Input should be a valid integer", code=2)
def case_ill_typed_value(d, ctx):
    return sets("finetune.train.steps=many")


@case("`--set finetune.lora_rank=0`", "finetune.lora_rank: Input should be greater than or equal to 1", code=2)
def case_out_of_range(d, ctx):
    return sets("finetune.lora_rank=0")


@case("`--set finetune.mode` (no `=`)", "override 'finetune.mode': expected key=value", code=2)
def case_override_without_value(d, ctx):
    return sets("finetune.mode")


@case("`--recipe nope` (no such recipe)", "unknown recipe 'nope' (known:", code=2)
def case_unknown_recipe(d, ctx):
    return ["--recipe", "nope"]


@case("`--recipe missing.yaml` (no such file)", "recipe file not found: {dir}/missing.yaml", code=2)
def case_recipe_file_missing(d, ctx):
    return ["--recipe", str(d / "missing.yaml")]


@case("a recipe file that is not YAML", "{dir}/recipe.yaml: not valid YAML", code=2)
def case_recipe_not_yaml(d, ctx):
    return recipe_file(d, "extends: tiny\nfinetune: {mode: lora\n")


@case("a recipe file that is a list, not a mapping", "a recipe is a mapping of stage sections", code=2)
def case_recipe_not_a_mapping(d, ctx):
    return recipe_file(d, "- finetune\n- quantize\n")


@case("recipes that extend each other in a circle", "extends itself", code=2)
def case_recipe_extends_cycle(d, ctx):
    (d / "b.yaml").write_text("extends: recipe.yaml\n")
    return recipe_file(d, "extends: b.yaml\n")


@case("`--set serve=fp8-block` (not a shipped scheme)", "serve 'fp8-block' is neither 'finetuned' nor one of", code=2)
def case_serve_unknown_scheme(d, ctx):
    return sets("serve=fp8-block")


@case("a draft candidate with an unknown objective", "loss: unknown objective 'kl' (known: kl_div", code=2)
def case_unknown_draft_objective(d, ctx):
    return recipe_file(d, "extends: tiny\ndraft:\n  candidates:\n    - {kind: peagle, loss: kl}\n")


@case("two draft candidates with the same name", "draft: candidates: names must be unique", code=2)
def case_duplicate_draft_candidates(d, ctx):
    return recipe_file(d, "extends: tiny\ndraft:\n  candidates:\n    - {kind: eagle3}\n    - {kind: eagle3}\n")


@case("`--set evaluate.serve_temperature=0.7` (not a measured temperature)",
      "serve_temperature 0.7 must be one of spec_temperatures", code=2)
def case_serve_temperature_not_measured(d, ctx):
    return sets("evaluate.serve_temperature=0.7")


@case("`--set quantize.schemes=[int3]`", "unknown quantization scheme 'int3'", code=2)
def case_unknown_scheme(d, ctx):
    return sets("quantize.schemes=[int3]")


@case("`--set quantize.schemes=[int8,w4a16-gptq]` on a 64-wide base (groups of 128)",
      "scheme w4a16-gptq: group size 128 does not divide", code=2)
def case_group_size_does_not_divide(d, ctx):
    return sets("quantize.schemes=[int8,w4a16-gptq]")


@case("a shipped scheme without a perplexity gate limit", "no limit for scheme 'w4a16-gptq-g64'", code=2)
def case_scheme_without_gate_limit(d, ctx):
    tiny = (ROOT / "tasks" / "recipes" / "tiny.yaml").read_text()  # (extends would merge the maps of limits)
    assert "\n  gates:\n" in tiny and "max_quant_ppl_increase" not in tiny  # the recipe states its limits whole
    # int8's limit at its default (a weaker one would be refused first, for want of a reason)
    return recipe_file(d, tiny.replace("\n  gates:\n", "\n  gates:\n    max_quant_ppl_increase: {int8: 0.005}\n", 1))


@case("`--set evaluate.gates.min_acceptance_length=0` without `--allow-weaker-gates`",
      "--set evaluate.gates.min_acceptance_length: 0.0 is weaker than the recipe's 2.0", code=2)
def case_gate_loosened_without_flag(d, ctx):
    return sets("evaluate.gates.min_acceptance_length=0")


@case("a recipe that lowers a gate below its default without `evaluate.gates.reasons`",
      "recipe recipe.yaml: evaluate.gates.min_acceptance_length: 0.5 is weaker than the built-in default 1.2", code=2)
def case_gate_lowered_without_reason(d, ctx):
    return recipe_file(d, f"extends: {SMOKE}\nevaluate:\n  gates: {{min_acceptance_length: 0.5}}\n")


@case("a recipe that enables no gate", "evaluate.gates: no gate is enabled", code=2)
def case_no_gates(d, ctx):
    return recipe_file(d, f"extends: {SMOKE}\nquantize: {{schemes: []}}\nserve: finetuned\nevaluate:\n  gates: "
                          "{finetune_improves: false, speculative_lossless: false, min_acceptance_length: 0}\n")


@case("`--set waivers=[]` (waivers are recorded, not set)", "'waivers' is recorded by forgeline", code=2)
def case_waivers_set_by_hand(d, ctx):
    return sets("waivers=[]")


@case("`--set base.model.num_key_value_heads=3` (4 heads)",
      "num_attention_heads 4 is not a multiple of num_key_value_heads 3", code=2)
def case_heads_not_divisible(d, ctx):
    return sets("base.model.num_key_value_heads=3")


@case("`--set base.model.architecture=GPT2LMHeadModel`", "base.model.architecture: Input should be", code=2)
def case_scratch_architecture_unsupported(d, ctx):
    return sets("base.model.architecture=GPT2LMHeadModel")


@case("`--set finetune.train.mesh.tensor=3` on a 1-device machine",
      "finetune.train.mesh: data 1 x tensor 3 x expert 1 needs a multiple of 3 devices", code=2)
def case_mesh_needs_more_devices(d, ctx):
    return sets("finetune.train.mesh.tensor=3")


@case("`--set resources.finetune.hosts=0`", "resources.finetune.hosts: Input should be greater than or equal to 1",
      code=2)
def case_resources_out_of_range(d, ctx):
    return sets("resources.finetune.hosts=0")


@case("`--set execution=workers` with no Prefect server set", "execution: workers needs a Prefect server with "
      "workers: set PREFECT_API_URL", code=2, env=lambda ctx: {"PREFECT_API_URL": ""})
def case_workers_without_a_server(d, ctx):
    return sets("execution=workers")


@case("`--set execution=workers`, `PREFECT_API_URL` on a closed port", "execution: workers: the Prefect server at "
      "http://127.0.0.1:", code=2, env=lambda ctx: {"PREFECT_API_URL": f"http://127.0.0.1:{ctx['closed_port']}/api"})
def case_workers_server_unreachable(d, ctx):
    return sets("execution=workers")


# -- stores -----------------------------------------------------------------------------------------------------

@case("`--store gs://bucket/x` (unsupported scheme)", "--store: unsupported URL scheme 'gs'", code=2)
def case_store_unsupported_scheme(d, ctx):
    return ["--store", "gs://bucket/x"]


@case("`--store` naming a file, not a folder", "store file://{dir}/a-file is not a folder")
def case_store_is_a_file(d, ctx):
    (d / "a-file").write_text("not a folder")
    return ["--store", f"file://{d}/a-file"]


@case("`--store file:///proc/forgeline` (cannot be written, even by root)", "store file:///proc/forgeline is not "
      "writable")
def case_store_unwritable(d, ctx):
    return ["--store", "file:///proc/forgeline"]


@case("`--store s3://...` with the endpoint a closed port on 127.0.0.1", "store s3://forgeline/x is unreachable",
      env=lambda ctx: {**ctx["s3"], "AWS_ENDPOINT_URL": f"http://127.0.0.1:{ctx['closed_port']}"})
def case_store_unreachable(d, ctx):
    return ["--store", "s3://forgeline/x"]


@case("`--store s3://...` naming an object, not a folder", "store s3://forgeline/an-object.txt is not a folder",
      env=lambda ctx: ctx["s3"])
def case_store_s3_object(d, ctx):
    return ["--store", "s3://forgeline/an-object.txt"]


@case("`--store s3://...` with a wrong secret key", "store s3://forgeline/x refused the credentials",
      env=lambda ctx: {**ctx["s3"], "AWS_SECRET_ACCESS_KEY": "wrong-secret"})
def case_store_wrong_credentials(d, ctx):
    return ["--store", "s3://forgeline/x"]


# -- corpora and chat data ---------------------------------------------------------------------------------------

@case("`data.corpus` that does not exist", "data.corpus: no such file or folder: file://{dir}/nowhere/corpus.jsonl")
def case_corpus_missing(d, ctx):
    return sets(f"data.corpus=file://{d}/nowhere/corpus.jsonl")


@case("an empty JSONL corpus", "data.corpus: file://{dir}/corpus.jsonl is empty (no documents)")
def case_corpus_empty(d, ctx):
    return sets(f"data.corpus={jsonl(d, [])}")


@case("a JSONL line that is not JSON", "data.corpus: file://{dir}/corpus.jsonl: line 2: not valid JSON")
def case_corpus_line_not_json(d, ctx):
    corpus = jsonl(d, [GOOD_CHAT, '{"messages": [', GOOD_CHAT])
    return sets(f"data.corpus={corpus}")


@case("a JSONL record with neither `text` nor `messages`", "corpus.jsonl: line 1: record has neither a string 'text' "
      "field nor a 'messages' list")
def case_corpus_record_without_text(d, ctx):
    return sets(f"data.corpus={jsonl(d, [{'body': 'no text field'}])}")


@case("a chat turn with role `robot`", "messages[1] has role 'robot' (expected system, user or assistant)")
def case_chat_bad_role(d, ctx):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}]
    return sets(f"data.corpus={jsonl(d, rows)}")


@case("a conversation without an assistant turn", "conversation has no assistant turn to train on")
def case_chat_no_assistant(d, ctx):
    return sets(f"data.corpus={jsonl(d, [{'messages': [{'role': 'user', 'content': 'hi'}]}])}")


@case("`finetune.method=dpo` on a corpus without preference pairs",
      "data.corpus: finetune.method dpo needs preference pairs (chosen/rejected records), and the first 1 "
      "documents of file://{dir}/corpus.jsonl hold none")
def case_dpo_without_pairs(d, ctx):
    return sets(f"data.corpus={jsonl(d, [GOOD_CHAT])}", "finetune.method=dpo")


@case("a preference record without `rejected`",
      "corpus.jsonl: line 1: a preference record needs both chosen and rejected")
def case_preference_without_rejected(d, ctx):
    return sets(f"data.corpus={jsonl(d, [{'prompt': 'q', 'chosen': 'a'}])}", "finetune.method=dpo")


@case("a Parquet corpus without a `text` or `messages` column", "corpus.parquet")
def case_parquet_without_text_column(d, ctx):
    pq.write_table(pa.table({"body": ["a", "b"]}), d / "corpus.parquet")
    return sets(f"data.corpus=file://{d}/corpus.parquet")


@case("a text corpus that is not UTF-8", "corpus.txt: not UTF-8 text")
def case_text_not_utf8(d, ctx):
    (d / "corpus.txt").write_bytes(b"caf\xe9 au lait\n" * 10)
    return sets(f"data.corpus=file://{d}/corpus.txt")


@case("`data.corpus=builtin://nope`", "data.corpus: unknown builtin 'builtin://nope'")
def case_unknown_builtin(d, ctx):
    return sets("data.corpus=builtin://nope")


@case("a corpus folder holding only hidden and marker files", "data.corpus: file://{dir}/corpus is empty (no files)")
def case_corpus_folder_without_data(d, ctx):
    (d / "corpus").mkdir()
    (d / "corpus" / ".hidden.jsonl").write_text(json.dumps(GOOD_CHAT) + "\n")
    (d / "corpus" / "_SUCCESS").write_text("")
    return sets(f"data.corpus=file://{d}/corpus")


# -- base checkpoints (read by the base stage, the first to run) --------------------------------------------------

@case("`base.url` that does not exist", "base.url: no such file or folder: file://{dir}/no-base")
def case_base_missing(d, ctx):
    return sets(f"base.url=file://{d}/no-base")


@case("a base folder without config.json", "base.url: file://{dir}/base has no config.json")
def case_base_without_config(d, ctx):
    (base_copy(d, ctx) / "config.json").unlink()
    return sets(f"base.url=file://{d}/base")


@case("a base config.json that is not JSON", "base.url: file://{dir}/base/config.json: cannot read config")
def case_base_config_not_json(d, ctx):
    (base_copy(d, ctx) / "config.json").write_text("{not json")
    return sets(f"base.url=file://{d}/base")


@case("a base of an unsupported architecture", "architectures ['GPT2LMHeadModel'] is not supported")
def case_base_unknown_architecture(d, ctx):
    edit_config(base_copy(d, ctx), architectures=["GPT2LMHeadModel"], model_type="gpt2")
    return sets(f"base.url=file://{d}/base")


@case("a base config with an unsupported setting (`hidden_act: gelu`)", "hidden_act 'gelu' (only silu)")
def case_base_unsupported_setting(d, ctx):
    edit_config(base_copy(d, ctx), hidden_act="gelu")
    return sets(f"base.url=file://{d}/base")


@case("a base config missing `num_attention_heads`", "config.json: missing key 'num_attention_heads'")
def case_base_config_missing_key(d, ctx):
    path = base_copy(d, ctx)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_attention_heads"]
    (path / "config.json").write_text(json.dumps(cfg))
    return sets(f"base.url=file://{d}/base")


@case("a base config with an impossible size (`hidden_size: -64`)",
      "base.url: file://{dir}/base/config.json: hidden_size -64: must be a positive integer")
def case_base_impossible_size(d, ctx):
    edit_config(base_copy(d, ctx), hidden_size=-64)  # JAX's shape check once failed on it with a traceback
    return sets(f"base.url=file://{d}/base")


@case("a base config with a fractional layer count (`num_hidden_layers: 2.5`)",
      "base.url: file://{dir}/base/config.json: num_hidden_layers 2.5: must be a positive integer")
def case_base_fractional_size(d, ctx):
    edit_config(base_copy(d, ctx), num_hidden_layers=2.5)
    return sets(f"base.url=file://{d}/base")


@case("a truncated safetensors file (an interrupted download)", "base.url: file://{dir}/base/model.safetensors: "
      "truncated safetensors")
def case_base_truncated_weights(d, ctx):
    weights = base_copy(d, ctx) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return sets(f"base.url=file://{d}/base")


@case("a base checkpoint missing a tensor", "tensors do not match Llama: 1 missing: model.layers.0.mlp.up_proj.weight")
def case_base_missing_tensor(d, ctx):
    weights = base_copy(d, ctx) / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(weights))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, str(weights))
    return sets(f"base.url=file://{d}/base")


@case("a base tensor of the wrong shape", "1 mis-shaped: model.norm.weight [7]")
def case_base_misshaped_tensor(d, ctx):
    weights = base_copy(d, ctx) / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(weights))
    tensors["model.norm.weight"] = np.ones(7, tensors["model.norm.weight"].dtype)
    safetensors.numpy.save_file(tensors, str(weights))
    return sets(f"base.url=file://{d}/base")


@case("a base folder with only pickle weights (`pytorch_model.bin`)", "holds only pickle weights")
def case_base_pickle_only(d, ctx):
    path = base_copy(d, ctx)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04\x95 never unpickled")
    return sets(f"base.url=file://{d}/base")


@case("a base folder without tokenizer.json", "base.url: file://{dir}/base has no tokenizer.json")
def case_base_without_tokenizer(d, ctx):
    (base_copy(d, ctx) / "tokenizer.json").unlink()
    return sets(f"base.url=file://{d}/base")


@case("a base tokenizer.json that is not a tokenizer", "base.url: file://{dir}/base/tokenizer.json: not a tokenizer")
def case_base_tokenizer_corrupt(d, ctx):
    (base_copy(d, ctx) / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    return sets(f"base.url=file://{d}/base")


@case("a tokenizer with more tokens than the model's embedding rows", "512 tokens, but the model's embedding has "
      "300 rows")
def case_base_vocab_larger_than_model(d, ctx):
    from flax import nnx

    import models
    from tasks.training.save import save_model_dir

    cfg = json.loads((ctx["base"] / "config.json").read_text())
    small = models.LlamaConfig.tiny(vocab_size=300, bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
                                    pad_token_id=cfg["pad_token_id"])
    save_model_dir(models.Llama(small, rngs=nnx.Rngs(0)), d / "base", ctx["base"])
    return sets(f"base.url=file://{d}/base")


def set_chat_template(path: Path, template: str) -> None:
    """The checkpoint's chat template: tokenizer_config.json's `chat_template` (no chat_template.jinja beside)."""
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg_path.write_text(json.dumps({**cfg, "chat_template": template}))


@case("a base whose chat template is not Jinja", "base.url: file://{dir}/base/tokenizer_config.json: chat_template: "
      "not a valid Jinja template")
def case_base_chat_template_not_jinja(d, ctx):
    set_chat_template(base_copy(d, ctx), "{% for m in messages %}{{ m.content }}")  # no endfor
    return sets(f"base.url=file://{d}/base")


@case("a base chat template that refuses a conversation of the corpus",
      "error: data.corpus: base.url: file://{dir}/base/tokenizer_config.json: chat_template: rendering failed "
      "(TemplateError: no system messages) (document 'corpus.jsonl:21')")
def case_base_chat_template_refuses_a_document(d, ctx):
    set_chat_template(base_copy(d, ctx), "{% for m in messages %}{% if m.role == 'system' %}"
                      "{{ raise_exception('no system messages') }}{% endif %}{{ m.role }}: {{ m.content }}\n"
                      "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    system = {"messages": [{"role": "system", "content": "be brief"}, *GOOD_CHAT["messages"]]}
    return sets(f"base.url=file://{d}/base", f"data.corpus={jsonl(d, [GOOD_CHAT] * 20 + [system])}")


@case("`base.url` on a crafted S3 listing with a key `../../escaped.txt`",
      "base.url: s3://bucket/ckpt: refusing the listed key '../../escaped.txt'",
      env=lambda ctx: ctx["hostile"])
def case_hostile_listing(d, ctx):
    return sets("base.url=s3://bucket/ckpt")


@case("a JSONL record past the 10,000 that `forgeline release` reads first (found by data_prep, in a stage)",
      "error: file://{dir}/corpus.jsonl: line 10001: not valid JSON", stage=True)
def case_corpus_bad_record_past_preflight(d, ctx):
    from tasks.data_prep import PREFLIGHT_DOCUMENTS

    corpus = jsonl(d, [{"text": "def add(a, b):\n    return a + b\n"}] * PREFLIGHT_DOCUMENTS + ['{"text": '])
    return sets(f"base.data.corpus={corpus}", "base.data.max_documents=20000")  # the first stage's input


# -- running them ------------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is: nothing listens there


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, tiny_base, s3_env, prefect_harness):
    """{case id: (folder, store URL, CompletedProcess)} for every case, run three at a time."""
    from prefect.settings import PREFECT_API_URL

    from tests.hostile_s3 import hostile_s3

    base, _ = tiny_base
    saved = {k: os.environ.get(k) for k in s3_env}
    os.environ.update(s3_env)
    try:
        storage.write_bytes("s3://forgeline/an-object.txt", b"an object where a store folder should be")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    files = {f"ckpt/{p.name}": p.read_bytes() for p in base.iterdir()}
    files["ckpt/../../escaped.txt"] = b"written outside the download folder"
    root = tmp_path_factory.mktemp("bad-input")
    with hostile_s3(files) as hostile:
        ctx = {"base": base, "s3": s3_env, "closed_port": _closed_port(), "hostile": hostile}

        def run(c: Case):
            d = root / c.id
            d.mkdir()
            store = f"file://{d}/store"
            args = c.setup(d, ctx)
            if "--store" not in args:
                args += ["--store", store]
            if "--recipe" not in args:
                args = ["--recipe", SMOKE, *args]
            env = {**os.environ, "FORGELINE_WORKDIR": str(d / "work"), "PREFECT_API_URL": PREFECT_API_URL.value(),
                   **(c.env(ctx) if c.env else {})}
            done = subprocess.run([sys.executable, "-m", "flows.cli", "release", *args], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=600)
            return c.id, (d, store, done)

        with ThreadPoolExecutor(max_workers=3) as pool:
            results = dict(pool.map(run, sorted(CASES, key=lambda c: not c.stage)))  # slow ones first
    return results


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_commits_nothing(c: Case, outcomes):
    d, store, done = outcomes[c.id]
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, done.stderr[-3000:]
    line = lines[0]
    assert c.expect.format(dir=d, store=store) in line, line
    assert done.returncode == c.code, (done.returncode, line)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert str(d / "work") not in line and "forgeline-dl-" not in line  # the user's file, never our copy
    assert not list(d.rglob("manifest.json")), "something was committed"
    assert not list(d.parent.rglob("escaped.txt")) and not list(d.rglob("escaped.txt"))
    print(f"\nREADME-ROW | `{c.id}` | {c.what} | {line.replace(str(d), '…')} | {c.code} |")


def test_the_catalogue_is_large_and_covers_every_kind_of_input():
    kinds = {"recipe": 0, "store": 0, "corpus": 0, "base": 0}
    for c in CASES:
        for k in kinds:
            kinds[k] += k in c.id or (k == "recipe" and not any(x in c.id for x in ("store", "corpus", "base", "chat",
                                                                                    "parquet", "text", "builtin",
                                                                                    "hostile")))
    assert len(CASES) >= 30 and all(kinds.values()), kinds


def test_readme_lists_every_case():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Bad input"):]
    missing = [c.id for c in CASES if f"`{c.id}`" not in table]
    assert not missing, f"README's Bad input table lacks: {missing}"


def test_stage_command_line_errors_are_one_line_too(tmp_path, tiny_base):
    """`python -m tasks.<stage>` (what a GPU worker runs) shares the path: an impossible mesh is one line."""
    base, data = tiny_base
    done = subprocess.run([sys.executable, "-m", "tasks.finetune", "--base", str(base), "--data", str(data),
                           "--out", str(tmp_path / "out"), "--set", "train.mesh.tensor=3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert lines == ["error: mesh data 1 x tensor 3 x expert 1 needs a multiple of 3 devices, have 1"], lines
    assert not (tmp_path / "out" / "model").exists()


def test_an_error_inside_jax_is_one_line_with_its_traceback_kept(tmp_path, monkeypatch, capsys):
    """A failure the code does not anticipate (here JAX refusing impossible shapes) is still one line; the
    traceback goes to a file the line names."""
    import jax.numpy as jnp
    import typer

    from flows.cli import _run

    monkeypatch.setenv("FORGELINE_CACHE", str(tmp_path))

    def impossible():
        return jnp.zeros((2, 3)) @ jnp.zeros((4, 5))

    with pytest.raises(typer.Exit) as e:
        _run(impossible)
    err = capsys.readouterr().err
    assert e.value.exit_code == 1 and err.count("\n") == 1 and err.startswith("error: TypeError: dot_general")
    saved = Path(re.search(r"traceback: (\S+)\)", err).group(1))
    assert saved.parent == tmp_path / "logs" and "Traceback" in saved.read_text() and "Traceback" not in err
