"""Quantization benchmark: every scheme vs the float model it came from, on the same held-out rows, in one run.

    python -m benchmarks.quant --model DIR --data DIR [--schemes int8,fp8-block,w4a16-rtn,w4a16-gptq,w4a16-awq,...]
                               [--group 128] [--calib-samples 64] [--eval-batches 16] [--out FILE.json]
    python -m benchmarks.quant --store DIR ...    # the store's newest fine-tuned model and its data
    python -m benchmarks.quant --store DIR --plant-outliers 4 --schemes nvfp4,nvfp4+rot,mxfp4+brot,...
    python -m benchmarks.quant --store DIR --plant-outliers 4 --recover-steps 150 ...   # then trained with them

`--model` is an HF checkpoint folder `models.from_pretrained` loads (e.g. `<store>/finetune/<fp>/model`),
`--data` a data_prep artifact folder (train-*.parquet / valid-*.parquet). `--store` picks the newest
finetune artifact's `model/` and the data_prep artifact that fine-tuning was trained on (the finetune
manifest's `data_prep` input: the release's data, which also holds `prompts.parquet`, not the base's).

The float model is loaded once and its held-out perplexity measured on data_prep's valid split
(tasks/evaluate.py `_batches`: the same batches for every row). Each scheme then quantizes a fresh copy of
the float model exactly as the quantize stage does (tasks/quantize.py: `calibration_batches` from the train
split, `models.quant.quantize_model`, `disk_bytes`), and is measured against the float model: perplexity
and its increase, KL(float || quantized) per loss position (mean, p99, max) and the top-1 flip rate over
the same positions, bytes of the quantized weights (codes, scales, zero points as compressed-tensors writes
them) vs the same weights in bf16 and of the whole checkpoint (every tensor, embeddings and LM head
included, float tensors at bf16) vs the whole checkpoint in bf16, and the quantization time (calibration
forwards + quantization, compile included).

A scheme name with `+rot` / `+brot` is measured after `rotate: hadamard` / `hadamard-block`
(models/quant/rotation.py), beside the same scheme unrotated (added when missing). `--plant-outliers N`
first gives the model N outlier residual channels (`plant_outlier_channels`; the reference float model
too); `--recover-steps K` then trains the planted model K full-parameter steps on the data's train split
(`recover`: the rest of the network learns to live with the outliers, as a model that grew them in
training has, instead of measuring quantization on a model the planting broke), and that trained model is
the float reference every row is measured against.

Peer ratio: each GPTQ / AWQ row is divided by the round-to-nearest row with the same bits, group and
symmetry measured in the same run (`vs RTN` = its perplexity increase / RTN's); when that RTN scheme is not
in `--schemes` it is added. Aims (docs/quantization.md; forgeline issue 6, the
evaluate gates' defaults `tasks.evaluate.Gates`): int8 / w8a16 increase <= 0.5 %, fp8-block <= 0.3 %,
int4 GPTQ/AWQ <= 2 % and below RTN's increase, every int4 scheme's bytes <= 0.30x bf16; FP4 (nvfp4a16,
mxfp4a16; issue 18) <= 3 %; schemes with quantized activations their gates' limits; a rotated W4A4 row's
KL at most half its unrotated peer's (issue 18).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import models
from models import quant
from models.layers import Linear
from models.moe import Experts
from models.quant.rotation import attention_readers, mlp_parts
from tasks.evaluate import EvalConfig, Gates, _batches, agreement, perplexity
from tasks.quantize import CalibrationConfig, calibration_batches, disk_bytes
from tasks.training.config import TrainConfig
from tasks.training.loop import fit
from tasks.training.save import save_model_dir
from tasks.training.trainer import Trainer

DEFAULT_SCHEMES = "int8,fp8-block,w4a16-rtn,w4a16-gptq,w4a16-awq,nvfp4a16,nvfp4a16-gptq,mxfp4a16"
INT4_BYTES_AIM = 0.30  # issue 6: int4 weights on disk <= 0.30x their bf16 size


# -- inputs ----------------------------------------------------------------------------------------


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "manifest.json").read_text())


def _local(url: str) -> Path:
    if url.startswith("file://"):
        return Path(url[len("file://"):])
    if "://" in url:
        raise SystemExit(f"benchmarks.quant: --store reads a local store folder; the input {url} is not local "
                         "(pass --model and --data instead)")
    return Path(url)


def from_store(store: Path) -> tuple[Path, Path]:
    """(model folder, data folder): the newest finetune artifact's `model/` and the data_prep artifact it
    was trained on (its manifest's `data_prep` input)."""
    runs = [p for p in (store / "finetune").glob("*") if (p / "manifest.json").exists() and (p / "model").is_dir()]
    if not runs:
        raise SystemExit(f"benchmarks.quant: no finetune artifact with a model/ under {store}/finetune "
                         "(run a release first, or pass --model and --data)")
    newest = max(runs, key=lambda p: (_manifest(p).get("created_at", ""), p.stat().st_mtime))
    data = [_local(i["url"]) for i in _manifest(newest).get("inputs", []) if i.get("kind") == "data_prep"]
    if not data:  # an older manifest without inputs: the newest data_prep artifact that has prompts.parquet
        data = sorted((p for p in (store / "data_prep").glob("*") if (p / "prompts.parquet").exists()),
                      key=lambda p: (_manifest(p).get("created_at", ""), p.stat().st_mtime))[-1:]
    if not data or not data[0].is_dir():
        raise SystemExit(f"benchmarks.quant: no data_prep artifact for {newest} under {store} (pass --data)")
    return newest / "model", data[0]


ROT = {"+rot": "hadamard", "+brot": "hadamard-block"}  # benchmark row suffixes: the scheme after rotations


def split_rot(name: str) -> tuple[str, str | None]:
    """"nvfp4+rot" -> ("nvfp4", "hadamard"); "nvfp4+brot" -> ("nvfp4", "hadamard-block"); else (name, None)."""
    for suffix, how in ROT.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], how
    return name, None


def rot_suffix(how: str | None) -> str:
    return next((k for k, v in ROT.items() if v == how), "")


def scheme_names(spec: str, group: int) -> list[str]:
    """`--schemes` with `-g{group}` appended to every w4a16 scheme that does not name a group, and the RTN
    peer of every GPTQ/AWQ scheme and the unrotated peer of every `+rot` row added (before it) when
    missing. Unknown names: parse_scheme's error."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if group <= 0:
        raise SystemExit(f"benchmarks.quant: --group {group} must be positive")
    out: list[str] = []
    for name in names:
        base, rot = split_rot(name)
        try:
            s = quant.parse_scheme(base)
        except ValueError as e:
            raise SystemExit(f"benchmarks.quant: {e}") from None
        if s.kind == "int" and s.bits == 4 and s.act is None and quant.SCHEME_RE.fullmatch(base)["group"] is None:
            name = f"{base}-g{group}{rot_suffix(rot)}"
        if name not in out:
            out.append(name)
    for name in list(out):
        for peer in (rtn_peer(name), rot_peer(name)):
            if peer is not None and peer not in out:
                out.insert(out.index(name), peer)
    return out


def rtn_peer(name: str) -> str | None:
    """The round-to-nearest scheme with the same bits, group, symmetry, activations and rotation as a GPTQ/AWQ
    scheme; None otherwise."""
    base, rot = split_rot(name)
    s = quant.parse_scheme(base)
    if s.method == "rtn":  # FP8 formats have no other method
        return None
    suffix = rot_suffix(rot)
    if s.format.fixed_group or s.act is not None:  # nvfp4a16-gptq -> nvfp4a16, int8-w8a8-gptq -> int8-w8a8
        return base.replace("-gptq", "") + suffix
    g = f"-g{s.group_size}" if s.group_size else ""
    return f"w{s.bits}a16{'' if s.symmetric else '-asym'}-rtn{g}{suffix}"


def rot_peer(name: str) -> str | None:
    """The same scheme without rotation, for a `+rot` row."""
    base, rot = split_rot(name)
    return base if rot else None


# -- a model with outlier channels -----------------------------------------------------------------


def plant_outlier_channels(model: nnx.Module, n: int = 4, factor: float = 20.0, seed: int = 0) -> list[int]:
    """Give the residual stream `n` fixed outlier channels at every layer, as LLMs have them (outlier features
    in the same hidden dimensions across tokens and layers: Dettmers et al. 2022, arXiv:2208.07339; massive
    activations: Sun et al. 2024, arXiv:2402.17762): every write to the residual in those channels × factor
    (the embedding's columns, o_proj's and down_proj's / the experts' output columns) and every matrix
    reading a normed residual (q/k/v or MLA's first projections, the MLP's / experts' gate/up, routers,
    shared experts, the LM head) rows / factor, so the channels' own contribution keeps its size. Every GEMM
    input that reads the residual then has those channels ~factor× the others, in every layer. The RMS norms
    see a larger mean square (the other channels shrink), so the planted model is a different, worse model
    (`--recover-steps` trains it back). Returns the channels. A tied LM head (the embedding) is left as it is."""
    D = model.config.hidden_size
    channels = sorted(np.random.default_rng(seed).choice(D, size=min(n, D), replace=False).tolist())
    c = np.asarray(channels)

    def shrink(r: Any) -> None:
        if isinstance(r, Linear):
            r.kernel[...] = r.kernel[...].at[c, :].divide(factor)  # [in, out]
        elif isinstance(r, Experts):
            r.gate_up[...] = r.gate_up[...].at[:, c, :].divide(factor)  # [E, D, 2I]
        else:  # a router [E, D]
            r.weight[...] = r.weight[...].at[:, c].divide(factor)

    def grow(w: Any) -> None:
        if isinstance(w, Experts):
            w.down[...] = w.down[...].at[..., c].multiply(factor)  # [E, I, D]
            if w.down_bias is not None:
                w.down_bias[...] = w.down_bias[...].at[:, c].multiply(factor)  # [E, D]
        else:
            w.kernel[...] = w.kernel[...].at[:, c].multiply(factor)  # [in, D]
            if w.bias is not None:
                w.bias[...] = w.bias[...].at[c].multiply(factor)

    model.embed_tokens.weight[...] = model.embed_tokens.weight[...].at[:, c].multiply(factor)  # [V, D]
    for layer in model.layers:
        readers, writers = mlp_parts(layer.mlp)
        for r in attention_readers(layer.self_attn) + readers:
            shrink(r)
        for w in [layer.self_attn.o_proj] + writers:
            grow(w)
    if model.lm_head is not None:
        shrink(model.lm_head)
    return channels


def recover(model: nnx.Module, data: Path, out: Path, steps: int, learning_rate: float) -> dict[str, Any]:
    """Train `model` (with its planted outliers) `steps` full-parameter AdamW steps on `data`'s train split and
    write it to `out` (HF layout). No weight decay, so the planted channels are not decayed away: they stay
    outliers and the other weights adapt to them. Returns the training metrics (validation loss before and
    after)."""
    cfg = TrainConfig(steps=steps, learning_rate=learning_rate, warmup_steps=min(10, steps // 5),
                      weight_decay=0.0, batch_size=16, log_every=max(steps // 5, 1), eval_batches=4)
    trainer = Trainer(model, cfg, trainable=nnx.Param)
    metrics = fit(trainer, data, label="recover")
    save_model_dir(trainer.model(), out, data)
    return metrics


def outlier_ratio(model: nnx.Module, channels: list[int]) -> float:
    """Mean |x| of the outlier channels' embedding columns over the median column's: how far out they are
    (the planting's factor before recovery; what training left of it after)."""
    col = np.abs(np.asarray(model.embed_tokens.weight[...], np.float32)).mean(axis=0)  # [D]
    return float(col[channels].mean() / np.median(col))


def attention_input_outliers(model: nnx.Module, batch: dict[str, np.ndarray], channels: list[int]) -> list[float]:
    """Per layer, what its q/k/v projections read (the normed residual, `input_layernorm(h)`): mean |x| of the
    outlier channels over the median channel's, over one held-out batch's real tokens. Measures what the
    activation quantizers see, after any training of the norms and projections."""
    L = model.config.num_hidden_layers
    _, hidden = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                      return_hidden=tuple(range(L - 1)))
    inputs = [model.embed_tokens(batch["input_ids"])] + list(hidden)  # the residual entering layer i
    real = np.asarray(batch["segment_ids"]) > 0
    out = []
    for layer, h in zip(model.layers, inputs, strict=True):
        x = np.abs(np.asarray(layer.input_layernorm(h), np.float32))[real]  # [N, D]
        col = x.mean(0)
        out.append(float(col[channels].mean() / np.median(col)))
    return out


# -- measurement -----------------------------------------------------------------------------------


def _params(model: nnx.Module) -> int:
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def aim(row: dict[str, Any], rows: dict[str, dict[str, Any]], gates: Gates) -> tuple[str, bool]:
    """The issue's aim for this row as text, and whether the row meets it (computed from the row and its RTN peer)."""
    base, _ = split_rot(row["scheme"])
    s = quant.parse_scheme(base)
    parts: list[tuple[str, bool]] = []
    if not (s.kind == "int" and s.bits == 4 and s.method == "rtn" and s.act is None):  # int4 RTN: the baseline
        limit = gates.quant_limit(base)
        parts.append((f"Δppl ≤ {100 * limit:g}%", row["perplexity_increase"] <= limit))
    peer = rows.get(row["rtn_peer"]) if row.get("rtn_peer") else None
    if peer is not None:
        parts.append(("< RTN", row["perplexity_increase"] < peer["perplexity_increase"]))
    unrotated = rows.get(row["rot_peer"]) if row.get("rot_peer") else None
    if unrotated is not None and s.act in ("nvfp4", "mxfp4"):  # issue 18: rotations cut W4A4's KL >= 2x
        parts.append(("KL ≤ ½ unrotated", 2 * row["kl"] <= unrotated["kl"]))
    if s.kind == "int" and s.bits == 4:
        parts.append((f"bytes ≤ {INT4_BYTES_AIM:.2f}x", row["bytes_ratio_vs_bf16"] <= INT4_BYTES_AIM))
    return ", ".join(p for p, _ in parts), all(ok for _, ok in parts)


def _fmt_pct(x: float) -> str:
    return f"{100 * x:+.3f}%"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="HF checkpoint folder (e.g. <store>/finetune/<fp>/model)")
    ap.add_argument("--data", type=Path, help="data_prep artifact folder (train-*.parquet, valid-*.parquet)")
    ap.add_argument("--store", type=Path, help="a local store: its newest fine-tuned model and that model's data")
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"comma-separated (default {DEFAULT_SCHEMES})")
    ap.add_argument("--group", type=int, default=128, help="group size for w4a16 schemes without -g<N>")
    ap.add_argument("--calib-samples", type=int, default=64, help="packed train rows to calibrate on")
    ap.add_argument("--eval-batches", type=int, default=16, help="held-out batches (of 16 rows) to evaluate on")
    ap.add_argument("--plant-outliers", type=int, default=0, metavar="N",
                    help="give the model N outlier residual channels first (plant_outlier_channels)")
    ap.add_argument("--outlier-factor", type=float, default=20.0, help="their size relative to the others")
    ap.add_argument("--recover-steps", type=int, default=0, metavar="K",
                    help="after planting, train the model K full-parameter steps on the train split (see above)")
    ap.add_argument("--recover-lr", type=float, default=1e-3, help="the recovery's peak learning rate")
    ap.add_argument("--out", type=Path, help="also write the rows here as JSON")
    a = ap.parse_args(argv)

    if a.store is not None:
        store_model, store_data = from_store(a.store)
        a.model, a.data = a.model or store_model, a.data or store_data
    if a.model is None or a.data is None:
        ap.error("pass --model and --data, or --store")
    names = scheme_names(a.schemes, a.group)
    ecfg = EvalConfig(eval_batches=a.eval_batches)
    ccfg = CalibrationConfig(samples=a.calib_samples)

    planted: list[int] = []
    recovered: dict[str, Any] = {}
    scratch = tempfile.TemporaryDirectory(prefix="benchmarks-quant-")
    source = a.model
    if a.plant_outliers and a.recover_steps:
        m = models.from_pretrained(str(a.model))
        planted[:] = plant_outlier_channels(m, a.plant_outliers, a.outlier_factor)
        print(f"recovering the planted model: {a.recover_steps} steps at lr {a.recover_lr:g}", flush=True)
        t = time.perf_counter()
        recovered = recover(m, a.data, Path(scratch.name) / "model", a.recover_steps, a.recover_lr)
        recovered = {k: recovered[k] for k in ("steps", "valid_loss_before", "valid_loss_after")} | {
            "seconds": round(time.perf_counter() - t, 1)}
        print(f"  valid loss {recovered['valid_loss_before']:.4f} -> {recovered['valid_loss_after']:.4f} "
              f"({recovered['seconds']}s)", flush=True)
        source = Path(scratch.name) / "model"

    def load() -> nnx.Module:  # the float model, with the same planted outlier channels every time
        m = models.from_pretrained(str(source))
        if a.plant_outliers and not recovered:
            planted[:] = plant_outlier_channels(m, a.plant_outliers, a.outlier_factor)
        return m

    float_model = load()
    units = quant.quant_units(float_model)
    for name in names:  # fail before any measurement: the quantizer's own error for a group that does not divide
        try:
            quant.check_divisible(units, quant.parse_scheme(split_rot(name)[0]))
        except ValueError as e:
            raise SystemExit(f"benchmarks.quant: {e}") from None
    batches = _batches(a.data, ecfg)
    try:
        calib = calibration_batches(a.data, ccfg)
    except ValueError as e:
        raise SystemExit(f"benchmarks.quant: {e}") from None
    eval_tokens = int(sum(b["loss_mask"].sum() for b in batches))
    cfg_json = json.loads((a.model / "config.json").read_text())
    c = float_model.config
    dev = jax.devices()[0]
    setup = {
        "model": str(a.model), "architecture": (cfg_json.get("architectures") or ["?"])[0],
        "params": _params(float_model), "hidden_size": c.hidden_size, "layers": c.num_hidden_layers,
        "quantized_modules": len(units), "data": str(a.data), "eval_batches": len(batches),
        "eval_rows": int(sum(b["input_ids"].shape[0] for b in batches)), "eval_tokens": eval_tokens,
        "calibration_rows": int(sum(ids.shape[0] for ids, _ in calib)),
        "calibration_tokens": quant.calibration_tokens(calib), "jax": jax.__version__,
        "backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
        "outlier_channels": planted, "outlier_factor": a.outlier_factor if a.plant_outliers else None,
        "recovery": recovered or None,
    }
    print(f"model: {setup['model']}\n  {setup['architecture']}, {setup['params'] / 1e6:.2f}M params, hidden size "
          f"{setup['hidden_size']}, {setup['layers']} layers, {setup['quantized_modules']} quantized modules "
          f"(lm_head, embeddings, norms stay float)")
    print(f"data: {setup['data']}\n  eval: {setup['eval_rows']} held-out rows in {setup['eval_batches']} batches, "
          f"{eval_tokens} loss tokens; calibration: {setup['calibration_rows']} train rows, "
          f"{setup['calibration_tokens']} tokens")
    print(f"jax {setup['jax']} ({setup['backend']}: {setup['device']}); schemes: {', '.join(names)}", flush=True)
    if a.plant_outliers:
        setup["outlier_embedding_ratio"] = outlier_ratio(float_model, planted)
        setup["outlier_attention_input_ratio"] = attention_input_outliers(float_model, batches[0], planted)
        print(f"planted outlier channels {setup['outlier_channels']} (x{a.outlier_factor:g} in the residual stream; "
              f"now their embedding columns' mean |x| is {setup['outlier_embedding_ratio']:.1f}x the median column's, "
              "and what each layer's q/k/v read: "
              + ", ".join(f"{r:.1f}x" for r in setup["outlier_attention_input_ratio"]) + ")")

    t0 = time.perf_counter()
    ppl_float = perplexity(float_model, batches)
    print(f"float perplexity: {ppl_float:.4f} ({time.perf_counter() - t0:.1f}s)\n", flush=True)

    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        base, rot = split_rot(name)
        scheme = quant.parse_scheme(base)
        model = load()  # a fresh float copy: quantize_model works in place
        t = time.perf_counter()
        try:
            report = quant.quantize_model(model, scheme, calib, opts=quant.Options(rotate=rot))
        except ValueError as e:
            raise SystemExit(f"benchmarks.quant: {e}") from None
        wall = time.perf_counter() - t
        agree = agreement(float_model, model, batches)  # the quantized model's perplexity, and its KL
        ppl = agree.pop("perplexity")
        agree.pop("reference_perplexity")  # the float model's, measured once above
        sizes = disk_bytes(model, scheme)
        rows[name] = {
            "scheme": name, "perplexity": ppl, "perplexity_increase": ppl / ppl_float - 1,
            **agree, **sizes,
            "bytes_ratio_vs_bf16": sizes["quantized_weight_bytes"] / sizes["bf16_weight_bytes"],
            "checkpoint_bytes_ratio_vs_bf16": sizes["checkpoint_bytes"] / sizes["bf16_checkpoint_bytes"],
            "quant_seconds": wall, "quantize_model_seconds": report["seconds"],
            "calibration_tokens": report["calibration_tokens"], "rtn_peer": rtn_peer(name),
            "rot_peer": rot_peer(name),
        }
        print(f"  {name}: ppl {ppl:.4f} ({_fmt_pct(rows[name]['perplexity_increase'])}), quantized in {wall:.1f}s",
              file=sys.stderr, flush=True)

    gates = Gates()
    header = ("| scheme | perplexity | Δppl vs float | KL mean | KL p99 | KL max | top-1 flips | bytes vs bf16 "
              "| checkpoint vs bf16 | quant time (s) | vs RTN | aim | meets aim |")
    lines = [header, "|---" * 13 + "|",
             f"| float | {ppl_float:.4f} | — | — | — | — | — | 1.000x | 1.000x | — | — | — | — |"]
    for name, r in rows.items():
        peer = rows.get(r["rtn_peer"]) if r["rtn_peer"] else None
        if peer is None:
            vs = "—"
        elif peer["perplexity_increase"] <= 0:
            vs = f"n/a (RTN Δ {_fmt_pct(peer['perplexity_increase'])})"
        else:
            r["vs_rtn"] = r["perplexity_increase"] / peer["perplexity_increase"]
            vs = f"{r['vs_rtn']:.2f}"
        r["aim"], r["meets_aim"] = aim(r, rows, gates)
        lines.append(f"| {name} | {r['perplexity']:.4f} | {_fmt_pct(r['perplexity_increase'])} | {r['kl']:.2e} "
                     f"| {r['kl_p99']:.2e} | {r['kl_max']:.2e} | {100 * r['top1_flip_rate']:.2f}% "
                     f"| {r['bytes_ratio_vs_bf16']:.3f}x | {r['checkpoint_bytes_ratio_vs_bf16']:.3f}x "
                     f"| {r['quant_seconds']:.1f} | {vs} | {r['aim']} | {'yes' if r['meets_aim'] else '**NO**'} |")
    print("\n".join(lines))
    if a.out:
        a.out.write_text(json.dumps({"setup": setup, "float_perplexity": ppl_float, "rows": list(rows.values())},
                                    indent=1))


if __name__ == "__main__":
    main()
