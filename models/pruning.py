"""Depth pruning: a model made of a subset of another's decoder layers, read straight from the larger
checkpoint, the usual initialisation of a distilled student (layer dropping as in Sajjad et al. 2023, "On the
effect of dropping layers of pre-trained transformer models", and NVIDIA's Minitron depth pruning, Muralidharan
et al. 2024, "Compact language models via pruning and knowledge distillation").

    select_layers(config_dict, layers) -> the student's config.json (num_hidden_layers, per-layer lists)
    LayerSelection(tensors, layers)     -> the teacher's tensors under the student's names

`models.from_pretrained(path, layers=[0, 2, 3])` uses both: nothing is copied, and on a mesh each process reads
only its slices of the kept layers, as for any checkpoint. Layer `layers[j]` of the teacher becomes layer `j`;
embeddings, the final norm and the LM head are kept; multi-token-prediction layers (DeepSeek-V3 / GLM-4.5
`num_nextn_predict_layers`, stored after the main stack) are dropped, since they read the last main layer's
output, which the student changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


def check_layers(layers: Sequence[int], num_layers: int, where: str = "layers") -> tuple[int, ...]:
    """`layers` as a tuple: strictly increasing ids of the teacher's main decoder layers."""
    ids = tuple(int(i) for i in layers)
    if not ids:
        raise ValueError(f"{where}: no layer selected")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{where}: {bad} not a layer of the teacher (ids 0..{num_layers - 1})")
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise ValueError(f"{where}: {list(ids)} must be strictly increasing (the student keeps the teacher's order)")
    return ids


def evenly_spaced(num_layers: int, keep: int) -> tuple[int, ...]:
    """`keep` layers spread over `num_layers`, the first and the last always in (they matter most: Men et al.
    2024, "ShortGPT", measure the middle layers as the most redundant)."""
    if not 1 <= keep <= num_layers:
        raise ValueError(f"keep {keep} layers of {num_layers}")
    if keep == 1:
        return (num_layers - 1,)
    return tuple(sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)}))


def select_layers(config: Mapping[str, Any], layers: Sequence[int]) -> dict[str, Any]:
    """The student's HF config: the teacher's with `num_hidden_layers` = len(layers) and every per-layer field
    cut to the kept layers (`layer_types`: GPT-OSS / Qwen3 sliding vs full attention; `mlp_only_layers`:
    Qwen3-MoE's dense layers; `first_k_dense_replace`: the dense prefix of DeepSeek-V3 / Kimi K2 / GLM-4.5, which
    a sorted selection keeps a prefix). A layer pattern the renumbering would change (Qwen3-MoE
    `decoder_sparse_step` > 1) is an error."""
    L = int(config["num_hidden_layers"])
    ids = check_layers(layers, L)
    out = dict(config)
    out["num_hidden_layers"] = len(ids)
    if isinstance(config.get("layer_types"), list):
        out["layer_types"] = [config["layer_types"][i] for i in ids]
    if config.get("mlp_only_layers"):
        dense = set(config["mlp_only_layers"])
        out["mlp_only_layers"] = [j for j, i in enumerate(ids) if i in dense]
    if int(config.get("decoder_sparse_step") or 1) > 1:
        raise ValueError(f"decoder_sparse_step {config['decoder_sparse_step']}: which layers are sparse depends on "
                         "their index, which the selection renumbers")
    if "first_k_dense_replace" in config:
        out["first_k_dense_replace"] = sum(1 for i in ids if i < int(config["first_k_dense_replace"] or 0))
    for key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if key in config:
            out[key] = 0
    return out


class LayerSelection(Mapping):
    """{student name: array} over a teacher checkpoint's tensors: `model.layers.{j}.*` is the teacher's
    `model.layers.{layers[j]}.*`; tensors of other layers (and MTP layers) are absent; the rest passes through.
    Lazy like the checkpoint it wraps: `view`, `shape` and `path_of` go to the teacher's tensor."""

    def __init__(self, base: Mapping[str, np.ndarray], layers: Sequence[int]):
        self.base = base
        self.to_teacher: dict[str, str] = {}
        index = {teacher: student for student, teacher in enumerate(layers)}
        for name in base:
            m = _LAYER.match(name)
            if m is None:
                self.to_teacher[name] = name
            elif int(m.group(2)) in index:
                self.to_teacher[f"{m.group(1)}{index[int(m.group(2))]}{m.group(3)}"] = name

    def __getitem__(self, name: str) -> np.ndarray:
        return self.base[self.to_teacher[name]]

    def __contains__(self, name: object) -> bool:
        return name in self.to_teacher

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_teacher)

    def __len__(self) -> int:
        return len(self.to_teacher)

    def view(self, name: str) -> Any:
        base_view = getattr(self.base, "view", None)
        if base_view is None:
            from models import views

            return views.Array(self.base[self.to_teacher[name]])
        return base_view(self.to_teacher[name])

    def shape(self, name: str) -> tuple[int, ...]:
        shape = getattr(self.base, "shape", None)
        return tuple(shape(self.to_teacher[name])) if shape else tuple(np.shape(self.base[self.to_teacher[name]]))

    def path_of(self, name: str) -> str:
        path_of = getattr(self.base, "path_of", None)
        return path_of(self.to_teacher.get(name, name)) if path_of else "<tensors>"

    def clear_cache(self) -> None:
        getattr(self.base, "clear_cache", lambda: None)()
