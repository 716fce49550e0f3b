"""The special tokens of a tokenizer: which ids are pad, bos and eos.

A tokenizer data_prep trains reserves them itself (tasks/data/corpora.py: SPECIAL_TOKENS); a supplied one
(an HF checkpoint's tokenizer.json) names them in its tokenizer_config.json, or spells them one of the ways
the common families do (Llama, Qwen, DeepSeek, GPT-2/NeoX, BERT).
"""

from __future__ import annotations

from tasks.data import corpora

# Candidate spellings for a supplied tokenizer, most specific first (tokenizer_config.json wins).
EOS_CANDIDATES = ["<|eos|>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>", "<eos>",
                  "<|end|>", "<|im_end|>", "<|eot_id|>", "[SEP]"]
BOS_CANDIDATES = ["<|bos|>", "<|begin_of_text|>", "<s>", "<｜begin▁of▁sentence｜>", "<bos>",
                  "<|startoftext|>", "[CLS]"]
PAD_CANDIDATES = ["<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>", "<|padding|>"]


def _token_name(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def find_special_tokens(tok, tokenizer_config: dict | None = None) -> dict:
    """pad/bos/eos ids of a tokenizer: tokenizer_config.json's names first, then known spellings."""
    cfg = tokenizer_config or {}

    def pick(key: str, candidates: list[str]) -> tuple[str, int] | None:
        for name in [_token_name(cfg.get(f"{key}_token")), *candidates]:
            if name is not None and (i := tok.token_to_id(name)) is not None:
                return name, i
        return None

    eos = pick("eos", EOS_CANDIDATES)
    if eos is None:
        raise ValueError(
            "tokenizer: no end-of-sequence token found (looked for tokenizer_config.json's eos_token and "
            + ", ".join(EOS_CANDIDATES) + ")"
        )
    bos = pick("bos", BOS_CANDIDATES) or eos  # GPT-2/Qwen style: the eos token also opens documents
    pad = pick("pad", PAD_CANDIDATES) or eos  # padding is masked out everywhere; its id only fills space
    out = {"pad": pad[1], "bos": bos[1], "eos": eos[1],
           "pad_token": pad[0], "bos_token": bos[0], "eos_token": eos[0]}
    for key, name in (("user", corpora.USER), ("assistant", corpora.ASSISTANT)):
        if (i := tok.token_to_id(name)) is not None:
            out[key] = i
    return out
