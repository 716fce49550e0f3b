"""Stage `base`: the checkpoint a release starts from.

Either an existing HF-layout checkpoint (`url`: file://, s3://, a local folder) that is validated and
copied into the store, or -- since no real weights can be downloaded on the development machines --
a short, documented pretraining run from a scratch initialisation on the base corpus (the default
recipe pretrains a small Llama on the Python standard library's source).

    python -m tasks.base_model --data DIR --out DIR [--set model.hidden_size=256 train.steps=300 ...]
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from tokenizers import Tokenizer

import models
import storage
from tasks.cli import stage_cli
from tasks.configs import BaseModelConfig, ModelShape
from tasks.data import chat
from tasks.stage import StageContext
from tasks.training.checkpoints import Checkpoints
from tasks.training.loop import Progress, fit
from tasks.training.save import save_model_dir
from tasks.training.trainer import Trainer

log = logging.getLogger("forgeline.base")


def llama_config(shape: ModelShape, data_dir: Path) -> models.LlamaConfig:
    special = json.loads((data_dir / "special_tokens.json").read_text())
    vocab_size = Tokenizer.from_file(str(data_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return shape_config(shape, vocab_size, special)


def shape_config(shape: ModelShape, vocab_size: int, special: dict[str, int] | None = None) -> models.LlamaConfig:
    """The scratch base's config for a vocabulary (the layer widths do not depend on it)."""
    special = special or {"bos": 0, "eos": 0, "pad": 0}
    fields = shape.model_dump()
    return models.LlamaConfig(
        vocab_size=vocab_size,
        head_dim=shape.head_dim or shape.hidden_size // shape.num_attention_heads,
        qk_norm=shape.architecture == "Qwen3ForCausalLM",
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"],
        **{k: v for k, v in fields.items() if k != "head_dim"},
    )


def pretrain(cfg: BaseModelConfig, data_dir: Path, out_dir: Path, *, checkpoints: Checkpoints | None = None,
             progress: Progress | None = None) -> dict[str, Any]:
    config = llama_config(cfg.model, data_dir)
    model = models.Llama(config, rngs=nnx.Rngs(cfg.train.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    log.info("base: pretraining a %s with %.2fM parameters from scratch", config.architecture, n_params / 1e6)
    trainer = Trainer(model, cfg.train, trainable=nnx.Param)
    metrics = fit(trainer, data_dir, checkpoints=checkpoints, progress=progress, label="base",
                  logdir=out_dir / "tensorboard")
    save_model_dir(trainer.model(), out_dir / "model", data_dir)
    return {**metrics, "source": "pretrained", "params": int(n_params)}


def import_checkpoint(url: str, out_dir: Path) -> dict[str, Any]:
    """Copy an HF checkpoint folder into the artifact after checking everything the later stages read from
    it: the config (a supported architecture and settings), every tensor (names, shapes, bytes), and a
    tokenizer whose special tokens and vocabulary fit the model. Errors name the user's URL, never the local
    copy; a checkpoint that fails is never committed. Pickle files (`*.bin`, `*.pt`) are never read."""
    local = out_dir / "model"
    try:
        storage.download_dir(url, local)
        return _check_import(url, local)
    except (ValueError, NotImplementedError, KeyError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"base.url: {msg.replace(str(local), storage.normalize_url(url))}") from None


def check_base(url: str, files: list[str] | None = None) -> chat.ChatTemplate | None:
    """`import_checkpoint`'s checks made on `url` in place, reading only its listing (`files`, when the caller
    listed it already), config.json, the tokenizer files and the safetensors headers, never a weight: what
    `forgeline release` runs before Prefect starts, so a broken checkpoint is one error line within seconds
    rather than a failed stage. The stage still checks the copy it imports (and the contents of quantized
    modules, which only a load reads). Raises ValueError prefixed `base.url:`, naming the user's URL or file.
    Returns the checkpoint's own chat template (None: it has none, data_prep's default applies), named by
    base.url's files, for the corpus check to render the corpus's conversations with."""
    base = storage.normalize_url(url)
    nowhere = Path(tempfile.gettempdir()) / "forgeline-base-check" / "model"  # never created: keys are only checked
    local = storage.local_path(base)
    try:
        names = set()
        for file_url in storage.list_files(base) if files is None else files:
            rel = file_url[len(base):].lstrip("/")
            storage.local_file(nowhere, rel, source=base)  # the refusal download_dir would make of a crafted key
            names.add(rel)
        _check_files(base, names)
        try:
            model = models.check_pretrained(base)
        except ValueError as e:  # it names the local files of a file:// URL
            raise ValueError(str(e) if local is None else str(e).replace(str(local), base)) from None
        tokenizer = storage.join(base, "tokenizer.json")
        tok_cfg = storage.join(base, "tokenizer_config.json")
        return _check_tokenizer(storage.read_bytes(tokenizer).decode("utf-8", errors="replace"), tokenizer,
                         storage.read_bytes(tok_cfg) if "tokenizer_config.json" in names else None, tok_cfg,
                         model.config.vocab_size,
                         storage.read_bytes(storage.join(base, "chat_template.jinja"))
                         if "chat_template.jinja" in names else None, base)
    except (ValueError, NotImplementedError, KeyError) as e:  # StorageKeyError is a ValueError
        raise ValueError(f"base.url: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _check_files(url: str, names: set[str]) -> None:
    """The folder's top-level files (`names`): an HF checkpoint with safetensors weights and a tokenizer."""
    top = {n for n in names if "/" not in n}
    if "config.json" not in top:
        raise ValueError(f"{url} has no config.json (not an HF checkpoint folder)")
    if not any(n.endswith(".safetensors") for n in top) and any(n.endswith((".bin", ".pt")) for n in top):
        raise ValueError(f"{url} holds only pickle weights (*.bin/*.pt), which forgeline never loads: "
                         "convert them to safetensors")
    if "tokenizer.json" not in top:
        raise ValueError(f"{url} has no tokenizer.json")


def _check_tokenizer(text: str, where: str, config: bytes | None, config_where: str, rows: int,
                     template_file: bytes | None = None, folder: str = "") -> chat.ChatTemplate | None:
    """tokenizer.json (`text`, read from `where`) and tokenizer_config.json (`config`, None when absent): a
    tokenizer whose special tokens are found and whose vocabulary fits the model's `rows` embedding rows; and
    its chat template (chat_template.jinja in `folder`, `template_file`, else tokenizer_config.json's), when it
    has one, compiles and renders a one-exchange conversation, with and without the generation prompt (what
    data_prep renders chat documents with, and what the release ships: tasks/data/chat.py). Returns that
    template (errors name the files under `base.url: <folder>`), None without one."""
    from tasks.data.tokens import find_special_tokens

    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ValueError(f"{where}: not a tokenizer ({str(e).splitlines()[0][:200]})") from None
    try:
        given = json.loads(config) if config is not None else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_where}: not JSON ({e})") from None
    try:
        sp = find_special_tokens(tok, given)
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).removeprefix('tokenizer: ')}") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > rows:
        raise ValueError(f"{where}: {vocab} tokens, but the model's embedding has {rows} rows")
    if template_file is None and not (isinstance(given, dict) and given.get("chat_template") is not None):
        return None  # data_prep's default template, ours
    try:
        source = template_file.decode("utf-8") if template_file is not None else None
    except UnicodeDecodeError as e:
        raise ValueError(f"{folder.rstrip('/')}/chat_template.jinja: not UTF-8 ({e})") from None
    template = chat.load(given if isinstance(given, dict) else None, sp, template_file=source, folder=folder)
    exchange = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}]
    template.render(exchange)  # ValueError naming the file and key: not Jinja, or its rendering failed
    template.render(exchange[:1], add_generation_prompt=True)
    return chat.load(given if isinstance(given, dict) else None, sp, template_file=source,
                     folder=f"base.url: {folder}" if "://" in folder else folder)


def _check_import(url: str, local: Path) -> dict[str, Any]:
    _check_files(url, {p.name for p in local.iterdir()})
    model = models.from_pretrained(str(local))  # raises ValueError naming a corrupt file or tensor
    tok_cfg = local / "tokenizer_config.json"
    jinja = local / "chat_template.jinja"
    _check_tokenizer((local / "tokenizer.json").read_text(errors="replace"), str(local / "tokenizer.json"),
                     tok_cfg.read_bytes() if tok_cfg.exists() else None, str(tok_cfg), model.config.vocab_size,
                     jinja.read_bytes() if jinja.exists() else None, str(local))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"source": url, "params": int(n_params)}


def run(config: BaseModelConfig, inputs: Mapping[str, Path], output: Path, *, progress: Progress | None = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The stage: import `config.url`, or pretrain on input `data` (resuming from the store's checkpoints
    when run with a `context`)."""
    if config.url is not None:
        return import_checkpoint(config.url, output)
    if "data" not in inputs:
        raise ValueError("base: pretraining needs a `data` input (or set base.url to import a checkpoint)")
    ckpt = Checkpoints.for_stage(context, config.train.keep_checkpoints) if context is not None else None
    try:
        return pretrain(config, inputs["data"], output, checkpoints=ckpt, progress=progress)
    finally:
        if ckpt is not None:
            ckpt.close()


main = stage_cli(__name__)  # `python -m tasks.base_model`: the command line its declaration implies (tasks/cli.py)


if __name__ == "__main__":
    main()
