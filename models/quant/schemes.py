"""Quantization schemes: the scheme-name grammar, `Scheme` (what the weights become) and `Options`
(the algorithms' knobs).

    scheme = parse_scheme("w4a16-gptq")     # int4, group 128, symmetric, GPTQ

Schemes (names are also the artifact folders and the eval report keys):
  int8                              W8A16: int8, per output channel, symmetric, round-to-nearest
  w{4,8}a16[-asym]-{rtn,gptq,awq}[-actorder][-g<N>]
                                    int weights, group N along the input (w4a16: 128 by default; w8a16: per
                                    channel unless -gN), symmetric unless -asym; -actorder (GPTQ only) visits
                                    columns by descending Hessian diagonal with static groups (compressed-tensors
                                    `actorder: weight`, which needs no g_idx on disk)
  fp8-block                         FP8 e4m3 weights, one scale per 128x128 tile (DeepSeek-V3's format)
  nvfp4a16[-gptq]                   FP4 (E2M1) weights, an FP8-E4M3 scale per 16 values and a float32 global
                                    scale per tensor (shared by fused q/k/v and gate/up); RTN, or GPTQ
  mxfp4a16[-gptq]                   FP4 (E2M1) weights, a power-of-two (E8M0) scale per 32 values (OCP MX)

Schemes that also quantize each quantized Linear's (and expert's) input activations, as the engine will
(models/numerics.py `quantize_activation`; our forward simulates it, so eval sees what users get):
  fp8-dynamic                       W8A8 FP8: FP8 weights per output channel, FP8 activations per token (dynamic)
  int8-w8a8[-gptq][-nosmooth]       W8A8 int8: int8 weights per channel, int8 activations per token (dynamic),
                                    after SmoothQuant (arXiv:2211.10438) unless -nosmooth
  w4afp8[-gptq][-g<N>]              int4 weights (group N, 128 by default), FP8 activations per token
  nvfp4[-gptq]                      W4A4 NVFP4: NVFP4 weights and activations (an FP8 scale per 16 values,
                                    the activations' global scale calibrated: it needs calibration data)
  mxfp4[-gptq]                      W4A4 MXFP4: MXFP4 weights and activations (dynamic E8M0 scales per 32)

The int schemes are compressed-tensors' weight-only presets W8A16, W4A16 and W4A16_ASYM with a free group
size, fp8-block its FP8_BLOCK preset, nvfp4a16 / mxfp4a16 its NVFP4A16 / MXFP4A16 presets, and fp8-dynamic,
int8-w8a8, w4afp8, nvfp4, mxfp4 its FP8_DYNAMIC, W8A8, W4AFP8, NVFP4 and MXFP4 presets (compressed-tensors
`quantization/quant_scheme.py`); the methods
are RTN, GPTQ (arXiv:2210.17323) and AWQ (arXiv:2306.00978). See docs/quantization.md (schemes, GPTQ,
AWQ, RTN) and docs/formats/compressed-tensors.md (how each scheme is written).
"""

from __future__ import annotations

import dataclasses
import re

from models.quant.formats.registry import WEIGHT_FORMATS, ActFormat, WeightFormat, act_format, weight_format

FP8_BLOCK = 128  # fp8-block: one scale per FP8_BLOCK x FP8_BLOCK tile
FP4_GROUP = {"nvfp4": 16, "mxfp4": 32}  # values per scale of the FP4 formats

FP4_RE = re.compile(r"(?P<fmt>nvfp4|mxfp4)(?P<a16>a16)?(?P<gptq>-gptq)?")
W8A8_RE = re.compile(r"(?P<w>int8-w8a8|w4afp8)(?P<gptq>-gptq)?(?P<nosmooth>-nosmooth)?(?:-g(?P<group>\d+))?")
SCHEME_RE = re.compile(r"(?P<w>w4a16|w8a16)(?P<asym>-asym)?-(?P<method>rtn|gptq|awq)(?P<act>-actorder)?"
                       r"(?:-g(?P<group>\d+))?")


@dataclasses.dataclass(frozen=True)
class IntArgs:
    """Integer weight quantization settings (compressed-tensors `QuantizationArgs`, type int)."""

    bits: int  # 4 or 8
    group_size: int | None  # None = one scale per output channel ("channel" strategy)
    symmetric: bool = True

    def qrange(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1

    def groups(self, in_features: int) -> int:
        if self.group_size is None:
            return 1
        if self.group_size <= 0 or in_features % self.group_size != 0:
            raise ValueError(f"group_size {self.group_size} does not divide in_features {in_features}")
        return in_features // self.group_size

    def width(self, in_features: int) -> int:
        """Columns per parameter set: group_size, or in_features for the channel strategy."""
        return in_features // self.groups(in_features)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A parsed scheme: its weight format (`weight`, a name registered in models/quant/formats/registry.py)
    with the scheme's knobs, the algorithm, and its activation format (`act`, registered too; None:
    weight-only)."""

    name: str
    weight: str  # "packed-int" | "int8-channel" | "fp8-block" | "fp8-channel" | "nvfp4" | "mxfp4" | registered
    bits: int = 8
    group_size: int | None = None  # None: one scale per output channel
    symmetric: bool = True
    method: str = "rtn"  # rtn | gptq | awq (the weight format's `methods`)
    actorder: bool = False
    act: str | None = None  # input activations: None (weight-only) | "fp8" | "int8" | "nvfp4" | "mxfp4"
    smooth: bool = False  # SmoothQuant before quantizing (int8-w8a8)

    @property
    def format(self) -> WeightFormat:
        """The registered weight format (models/quant/formats/registry.py)."""
        return weight_format(self.weight)

    @property
    def act_format(self) -> ActFormat | None:
        return None if self.act is None else act_format(self.act)

    @property
    def kind(self) -> str:
        """The weight format's family: "int" | "fp8-block" | "fp8" (per output channel) | "fp4"."""
        return self.format.kind

    @property
    def fp4(self) -> str | None:
        """Kind "fp4": the format's name, "nvfp4" | "mxfp4"."""
        return self.weight if self.kind == "fp4" else None

    @property
    def static_act(self) -> bool:
        """The activations have a calibrated (static) part: NVFP4's global input scale."""
        return self.act is not None and act_format(self.act).static

    @property
    def args(self) -> IntArgs:
        return IntArgs(self.bits, self.group_size, self.symmetric)

    def groups(self, in_features: int) -> int:
        return self.format.groups(self, in_features)


def parse_scheme(name: str) -> Scheme:
    """A scheme name (see the module docstring, or one a registered weight format adds) -> Scheme; ValueError
    naming the accepted forms otherwise."""
    if name == "int8":
        return Scheme("int8", "packed-int", 8, None, True, "rtn")
    if name == "fp8-block":
        return Scheme("fp8-block", "fp8-block", 8)
    if name == "fp8-dynamic":
        return Scheme("fp8-dynamic", "fp8-channel", 8, None, True, "rtn", act="fp8")
    if m := FP4_RE.fullmatch(name):
        return Scheme(name, m["fmt"], 4, FP4_GROUP[m["fmt"]], True, "gptq" if m["gptq"] else "rtn",
                      act=None if m["a16"] else m["fmt"])
    if m := W8A8_RE.fullmatch(name):
        int8 = m["w"] == "int8-w8a8"
        if (m["nosmooth"] and not int8) or (m["group"] and int8):
            raise ValueError(f"scheme {name!r}: -nosmooth applies to int8-w8a8 only, -g<N> to w4afp8 only")
        group = None if int8 else int(m["group"] or 128)
        if group is not None and group <= 0:
            raise ValueError(f"scheme {name!r}: group size must be positive")
        return Scheme(name, "int8-channel" if int8 else "packed-int", 8 if int8 else 4, group, True,
                      "gptq" if m["gptq"] else "rtn", act="int8" if int8 else "fp8", smooth=int8 and not m["nosmooth"])
    m = SCHEME_RE.fullmatch(name)
    if m is None:
        for fmt in WEIGHT_FORMATS.values():  # scheme names registered formats add (built-ins add none)
            if (scheme := fmt.parse(name)) is not None:
                return scheme
        raise ValueError(f"unknown quantization scheme {name!r} (known: int8, fp8-block, fp8-dynamic, "
                         "nvfp4|mxfp4[a16][-gptq], int8-w8a8[-gptq][-nosmooth], w4afp8[-gptq][-g<N>], "
                         "w4a16|w8a16[-asym]-rtn|gptq|awq[-actorder][-g<N>], e.g. w4a16-gptq, w4a16-asym-awq-g64)")
    bits = 4 if m["w"] == "w4a16" else 8
    group = int(m["group"]) if m["group"] else (128 if bits == 4 else None)
    if group is not None and group <= 0:
        raise ValueError(f"scheme {name!r}: group size must be positive")
    if m["act"] and m["method"] != "gptq":
        raise ValueError(f"scheme {name!r}: -actorder applies to GPTQ only")
    return Scheme(name, "packed-int", bits, group, not m["asym"], m["method"], bool(m["act"]))


@dataclasses.dataclass
class Options:
    """The algorithms' knobs: GPTQ damping, the per-expert token floor, the AWQ grid size, and how many
    experts' Hessians calibration builds and holds at once (models/quant/calibration.py `ExpertStats`)."""

    dampening_frac: float = 0.01
    expert_min_tokens: int = 16  # fewer routed tokens: GPTQ on the layer's pooled expert statistics
    awq_grid: int = 20
    smoothquant_alpha: float = 0.5  # SmoothQuant migration strength α (llm-compressor's smoothing_strength)
    rotate: str | None = None  # "hadamard" | "hadamard-block": fold rotations first (models/quant/rotation.py)
    rotate_seed: int = 0
    expert_chunk: int = 8  # experts per Hessian chunk: peak expert-Hessian memory is expert_chunk x in² floats

    def __post_init__(self) -> None:
        if self.expert_chunk < 1:
            raise ValueError(f"expert_chunk must be >= 1, got {self.expert_chunk}")
        if self.rotate not in (None, "hadamard", "hadamard-block"):
            raise ValueError(f"rotate must be null, 'hadamard' or 'hadamard-block', got {self.rotate!r}")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ValueError(f"smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")
