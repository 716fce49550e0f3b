"""Stage `quantize`: post-training weight quantization of the fine-tuned model, calibrated on the
release's own data, written in the formats serving engines load.

    python -m tasks.quantize --model DIR --data DIR --out DIR [--set schemes=[int8,w4a16-gptq]]

Each scheme (models/quant/: int8, w4a16/w8a16 by RTN / GPTQ / AWQ, symmetric or asymmetric, any group
size; fp8-block) quantizes a fresh copy of the model, calibrated on `calibration.samples` packed rows of
the data artifact's train split — the fine-tuning data, rendered with the chat template by data_prep
(docs/quantization.md: SFT models are calibrated on their own template). Every
scheme is written as an HF checkpoint under `<scheme>/`: compressed-tensors `pack-quantized` (int) or
`float-quantized` (FP8 blocks) with the `quantization_config` transformers and vLLM read; fp8-block also
in DeepSeek's own layout (`weight_scale_inv`) under `<scheme>/deepseek/`. Next to the weights:
`quantization_report.json` (per module: method, calibration tokens, relative weight and output error;
AWQ folds; bytes; seconds) and `quant_error.svg` (the per-layer error plot that ships in the bundle).
With `kv_cache: fp8` every scheme's checkpoint also gets an FP8 KV cache: static k/v scales per attention layer
(or per KV head) calibrated on the quantized model (models/quant/kv_cache.py), written as compressed-tensors'
`kv_cache_scheme` (the fp8-block DeepSeek-layout copy, whose format has none, keeps the serving dtype).
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import models
from models import quant
from models.layers import Buffer
from tasks.cli import stage_cli
from tasks.configs import CalibrationConfig, QuantizeConfig
from tasks.layout import model_dir
from tasks.stage import StageContext, write_report
from tasks.training.config import Progress
from tasks.training.data import PackedBatches

log = logging.getLogger("forgeline.quantize")


def check_fits(cfg: QuantizeConfig, model: Any) -> None:
    """Every scheme against the model's layers (an `nnx.eval_shape` model will do): group sizes that do not
    divide a width, a partial ignore of an expert stack, unsupported experts. The release checks this
    before any stage runs; `quantize_model` checks it again."""
    for name in cfg.schemes:
        scheme = quant.parse_scheme(name)
        units = quant.quant_units(model, cfg.ignore, scheme)
        quant.check_supported(units, scheme)
        if cfg.kv_cache:  # an FP8 KV cache: GQA families, a layout with a kv_cache_scheme
            quant.check_kv_cache(model, cfg.kv_cache_strategy, units)


def calibration_batches(data_dir: Path, cfg: CalibrationConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, segment_ids) batches of the train split's packed rows; clear errors when there is too little."""
    try:
        rows = PackedBatches(data_dir, "train", cfg.batch_size, seed=cfg.seed, shuffle=True)
    except ValueError as e:
        raise ValueError(f"quantize.calibration: {e}") from None
    n = min(cfg.samples, rows.total)  # never repeat rows to reach `samples`
    out = []
    for step in range(math.ceil(n / cfg.batch_size)):
        b = rows.batch(step, 0, min(cfg.batch_size, n - step * cfg.batch_size))
        out.append((b["input_ids"], b["segment_ids"]))
    tokens = quant.calibration_tokens(out)
    if tokens < cfg.min_tokens:
        raise ValueError(f"quantize.calibration: {data_dir} has {tokens} calibration tokens in {n} train rows, "
                         f"fewer than calibration.min_tokens = {cfg.min_tokens}; add data or lower min_tokens")
    return out


def disk_bytes(model: Any, scheme: quant.Scheme) -> dict[str, int]:
    """Bytes the quantized modules take on disk (codes, scales, zero points, global scales) vs the same weights
    in bf16; and the whole checkpoint's - every tensor, embeddings, LM head, norms, routers, biases and
    ignored modules included, those float tensors counted at bf16 (2 bytes) as a server holds them - vs the
    whole checkpoint in bf16."""
    _, tensors = quant.to_compressed_tensors(model, scheme)
    quantized = sum(t.nbytes for n, t in tensors.items() if not n.endswith(".bias"))
    bf16 = sum(2 * int(np.prod(qm.q.shape)) for _, qm, _ in quant.iter_qmatrices(model))
    rest = 2 * sum(int(x.size) for x in jax.tree.leaves(
        nnx.state(model, nnx.Any(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)), Buffer))))  # every float tensor left
    return {"quantized_weight_bytes": quantized, "bf16_weight_bytes": bf16,
            "checkpoint_bytes": quantized + rest, "bf16_checkpoint_bytes": bf16 + rest}


def error_plot_svg(rows: list[dict[str, Any]], title: str) -> str:
    """A bar chart of every module's relative output error (weight error where uncalibrated), log scale,
    in model order: what `quant_error.svg` shows. Plain SVG: no plotting dependency."""
    vals = [(r["module"].replace("model.layers.", "L"), r.get("output_error", r["weight_error"])) for r in rows]
    W, H, left, top, bottom, right = max(640, 14 * len(vals) + 140), 360, 60, 30, 120, 70
    logs = [math.log10(max(v, 1e-8)) for _, v in vals]
    lo = math.floor(min(logs))
    hi = max(math.ceil(max(logs)), lo + 1)
    plot_h = H - top - bottom
    bw = (W - left - right) / max(len(vals), 1)
    y = lambda lv: top + plot_h * (hi - lv) / (hi - lo)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
             'font-size="10">',
             f'<text x="{left}" y="18" font-size="13">{title}</text>']
    for d in range(lo, hi + 1):
        parts.append(f'<line x1="{left}" x2="{W - right}" y1="{y(d):.1f}" y2="{y(d):.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y(d) + 3:.1f}" text-anchor="end">1e{d}</text>')
    for k, ((name, _), lv) in enumerate(zip(vals, logs, strict=True)):
        x = left + k * bw
        colour = "#c44" if "fallback" in rows[k] else "#47a"
        parts.append(f'<rect x="{x + 1:.1f}" y="{y(lv):.1f}" width="{max(bw - 2, 1):.1f}" '
                     f'height="{max(top + plot_h - y(lv), 0):.1f}" fill="{colour}"><title>{name}: {10 ** lv:.3g} '
                     f'({rows[k]["method"]})</title></rect>')
        parts.append(f'<text transform="translate({x + bw / 2 + 3:.1f},{top + plot_h + 6}) rotate(60)">{name}</text>')
    parts.append(f'<text x="12" y="{top + plot_h / 2}" transform="rotate(-90 12 {top + plot_h / 2})" '
                 'text-anchor="middle">relative output error</text></svg>')
    return "\n".join(parts) + "\n"


def quantize(cfg: QuantizeConfig, model_path: Path, data_dir: Path, out_dir: Path) -> dict[str, Any]:
    batches = calibration_batches(data_dir, cfg.calibration)
    opts = quant.Options(dampening_frac=cfg.dampening_frac, expert_min_tokens=cfg.expert_min_tokens,
                         awq_grid=cfg.awq_grid, expert_chunk=cfg.calibration.expert_chunk,
                         smoothquant_alpha=cfg.smoothquant_alpha, rotate=cfg.rotate)
    stats: dict[str, Any] = {}
    for name in cfg.schemes:
        scheme = quant.parse_scheme(name)
        model = models.from_pretrained(str(model_path))
        float_bytes = quant.weight_bytes(model)
        report = quant.quantize_model(model, scheme, batches, ignore=cfg.ignore, opts=opts)
        if cfg.kv_cache:  # on the quantized model: the scales see the K / V it produces
            report["kv_cache_calibration"] = kv = quant.calibrate_kv_cache(model, batches, cfg.kv_cache_strategy)
            report["seconds"] += kv["seconds"]
        dest = out_dir / name
        models.save_pretrained(model, str(dest))
        copies = scheme.format.layouts  # the format's other layouts (fp8-block: DeepSeek's, under deepseek/)
        for sub, layout in copies.items():  # those layouts have no kv_cache_scheme: copies keep the serving dtype
            with quant.without_kv_scales(model):
                models.save_pretrained(model, str(dest / sub), layout=layout)
        for fn in ("tokenizer.json", "special_tokens.json", "tokenizer_config.json"):
            if (model_path / fn).exists():
                shutil.copyfile(model_path / fn, dest / fn)
                for sub in copies:
                    shutil.copyfile(model_path / fn, dest / sub / fn)
        sizes = disk_bytes(model, scheme)
        errors = [r.get("output_error", r["weight_error"]) for r in report["modules"]]
        summary = {
            "seconds": round(report["seconds"], 3),
            "calibration_tokens": report["calibration_tokens"],
            **sizes,
            "weight_bytes_ratio_vs_bf16": sizes["quantized_weight_bytes"] / sizes["bf16_weight_bytes"],
            "checkpoint_bytes_ratio_vs_bf16": sizes["checkpoint_bytes"] / sizes["bf16_checkpoint_bytes"],
            "float_model_bytes": float_bytes,
            "mean_output_error": float(np.mean(errors)),
            "max_output_error": float(np.max(errors)),
            "fallbacks": sum("fallback" in r for r in report["modules"]),
            "kv_cache": None if not cfg.kv_cache else f"{cfg.kv_cache}-{cfg.kv_cache_strategy}",
            **quant.kv_cache_bytes(model, cfg.kv_cache),
        }
        write_report(dest / "quantization_report.json", {**summary, **report})  # seconds: timing.json
        plot = error_plot_svg(report["modules"], f"{name}: per-module quantization error")
        (dest / "quant_error.svg").write_text(plot)
        stats[name] = summary
        log.info("quantize: %s in %.1fs, %d modules, mean output error %.2e, %.3fx bf16 bytes", name,
                 report["seconds"], len(report["modules"]), summary["mean_output_error"],
                 summary["weight_bytes_ratio_vs_bf16"])
    return stats


def run(config: QuantizeConfig, inputs: Mapping[str, Path], output: Path, *, progress: Progress | None = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The stage: inputs `model` (a finetune artifact or HF folder) and `data` (calibration rows)."""
    return quantize(config, model_dir(inputs["model"]), inputs["data"], output)


main = stage_cli(__name__)  # `python -m tasks.quantize`: the command line its declaration implies (tasks/cli.py)


if __name__ == "__main__":
    main()
