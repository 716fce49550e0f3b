"""Stage `quantize`: post-training weight quantization of the fine-tuned model, in formats serving
engines load.

    python -m tasks.quantize --model DIR --out DIR [--set schemes=[int8]]

`int8`: weight-only, symmetric, per output channel (scale = amax / 127) on every decoder linear
layer; embeddings, norms and the LM head stay in float (compressed-tensors `W8A16`, `ignore:
[lm_head]`). The quantized forward dequantizes on the fly in JAX (models/quant.py). Each scheme is
written as an HF checkpoint in the compressed-tensors `pack-quantized` layout under `<scheme>/`,
which vLLM and transformers (with compressed-tensors installed) load.
Issue #6 adds GPTQ/AWQ int4 and FP8 block formats behind the same stage.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

import models
from models import quant
from tasks.cli import PATH, stage_main
from tasks.finetune import model_dir
from tasks.stage import StageContext

log = logging.getLogger("forgeline.quantize")

SCHEMES = {"int8": quant.quantize_int8}


class QuantizeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schemes: tuple[Literal["int8"], ...] = ("int8",)


def quantize(cfg: QuantizeConfig, model_path: Path, out_dir: Path) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for scheme in cfg.schemes:
        model = models.from_pretrained(str(model_path))
        float_bytes = quant.weight_bytes(model)
        qmodel = SCHEMES[scheme](model)
        dest = out_dir / scheme
        models.save_pretrained(qmodel, str(dest))
        for name in ("tokenizer.json", "special_tokens.json", "tokenizer_config.json"):
            if (model_path / name).exists():
                shutil.copyfile(model_path / name, dest / name)
        stats[scheme] = {"weight_bytes": quant.weight_bytes(qmodel), "float_weight_bytes": float_bytes}
        log.info("quantize: %s weights %.2f MB -> %.2f MB", scheme, float_bytes / 1e6,
                 stats[scheme]["weight_bytes"] / 1e6)
    return stats


def compute(cfg: QuantizeConfig):
    def _compute(ctx: StageContext) -> dict[str, Any]:
        return quantize(cfg, model_dir(ctx.inputs["model"]), ctx.out_dir)

    return _compute


def main(argv: list[str] | None = None) -> None:
    stage_main(__doc__, QuantizeConfig, {"--model": PATH},
               lambda cfg, a: quantize(cfg, model_dir(a.model), a.out), argv)

if __name__ == "__main__":
    main()
