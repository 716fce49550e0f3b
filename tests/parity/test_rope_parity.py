"""RoPE frequency tables against transformers' own `ROPE_INIT_FUNCTIONS` (modeling_rope_utils.py)
for the published rope configs of every family, and the derived YaRN constants (correction range and
attention factor; docs/models/deepseek-v3.md, docs/models/gpt-oss.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.layers import rope_frequencies

pytestmark = pytest.mark.parity

DEEPSEEK_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
               "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}
KIMI_K2 = {**DEEPSEEK_V3, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1, "beta_slow": 1}
KIMI_K2_0905 = {**KIMI_K2, "factor": 64.0}
GPT_OSS = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
           "original_max_position_embeddings": 4096, "truncate": False}
LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CASES = {  # name: (rope parameters, rotary dims, max_position_embeddings)
    "deepseek_v3": (DEEPSEEK_V3, 64, 163840),
    "kimi_k2": (KIMI_K2, 64, 131072),
    "kimi_k2_0905": (KIMI_K2_0905, 64, 262144),
    "gpt_oss": (GPT_OSS, 64, 131072),
    "llama3.1": (LLAMA31, 128, 131072),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 32, 4096),
    "glm4_5_partial": ({"rope_type": "default", "rope_theta": 1e6}, 64, 131072),  # 128 head dims × 0.5
    "yarn_no_factor": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
                        "original_max_position_embeddings": 4096}, 64, 32768),
}


def transformers_table(params: dict, dim: int, max_pos: int):
    config = transformers.PretrainedConfig()
    config.rope_parameters = dict(params)
    config.head_dim, config.hidden_size, config.num_attention_heads = dim, dim, 1
    config.max_position_embeddings = max_pos
    rope_type = params["rope_type"]
    if rope_type == "default":
        inv = 1.0 / (params["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
        return inv.astype(np.float32), 1.0
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv.numpy(), float(scale)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_and_attention_scaling_match_transformers(name):
    params, dim, max_pos = CASES[name]
    ours, scale = rope_frequencies(dim, params["rope_theta"], params, max_pos)
    ref, ref_scale = transformers_table(params, dim, max_pos)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_yarn_constants_of_the_reference_table():
    """DeepSeek folds the temperature into the softmax (cos/sin × 1), GPT-OSS
    scales cos/sin by 0.1 ln 32 + 1 = 1.3465736 and does not truncate its correction range."""
    _, s = rope_frequencies(64, 1e4, DEEPSEEK_V3, 163840)
    assert s == 1.0
    mscale = 0.1 * math.log(40) + 1
    assert 192**-0.5 * mscale**2 == pytest.approx(0.1352338, abs=1e-7)
    _, s = rope_frequencies(64, 1.5e5, GPT_OSS, 131072)
    assert s == pytest.approx(1.3465736, abs=1e-7)
    # the correction range: frequencies below `low` extrapolate (unchanged), above `high` interpolate (÷ factor)
    inv, _ = rope_frequencies(64, 1e4, DEEPSEEK_V3, 163840)
    base = 1.0 / (1e4 ** (np.arange(0, 64, 2, dtype=np.float32) / 64))
    np.testing.assert_allclose(inv[:11], base[:11], rtol=1e-6)  # ramp 0 up to low = 10
    np.testing.assert_allclose(inv[23:], base[23:] / 40, rtol=1e-6)  # ramp 1 from high = 23
    assert np.all(inv[11:23] < base[11:23]) and np.all(inv[11:23] > base[11:23] / 40)
