"""Per-family numerical parity table against transformers (fp32, eager), the numbers the tests bound.

    python -m benchmarks.parity

For each registered architecture, a tiny random transformers model (tests/parity/parity_helpers.py
`tiny_configs`, every norm/bias/sink/correction bias perturbed) is saved with `save_pretrained`,
loaded with our `from_pretrained`, and compared on 40-token sequences (one batch row left-padded by 9):
- forward: max |ours − transformers| / max |transformers| over real tokens;
- decode: prefill 8 tokens, then one token at a time through our KV cache (MLA: the latent cache),
  against our own full forward;
- round trip: our `save_pretrained` → transformers `from_pretrained` → its logits vs the original.
The parity tests assert ≤ 1e-4 for each; this prints the measured values.
"""

from __future__ import annotations

import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "parity"))


def main() -> None:
    import transformers
    from parity_helpers import (
        build_from_config,
        decode_logits,
        hf_logits,
        hf_reload_logits,
        left_padded_rel_err,
        rel_err,
        tiny_configs,
    )

    from models import from_pretrained, save_pretrained

    jax.config.update("jax_default_matmul_precision", "highest")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (2, 40)).astype(np.int32)
    print("| architecture | forward rel err (padded batch) | decode vs forward rel err | our save → transformers |")
    print("|---|---|---|---|")
    for arch, config in tiny_configs().items():
        hf = build_from_config(config, seed=1)
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(os.path.join(tmp, "hf"))
            model = from_pretrained(os.path.join(tmp, "hf"))
            fwd = left_padded_rel_err(model, hf, ids, [0, 9])
            full = np.asarray(model(jnp.asarray(ids)))
            dec = rel_err(decode_logits(model, ids, 8), full)
            save_pretrained(model, os.path.join(tmp, "ours"))
            trip = rel_err(hf_reload_logits(os.path.join(tmp, "ours"), ids), hf_logits(hf, ids))
        print(f"| {arch} | {fwd:.1e} | {dec:.1e} | {trip:.1e} |", flush=True)


if __name__ == "__main__":
    main()
