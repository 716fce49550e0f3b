"""The registry of quantization formats: a weight format is one registered class, an activation format one
registered record, and everything that quantizes, writes or reads a checkpoint looks them up here by name.

    @register_weight_format
    class MyFormat(WeightFormat):
        name = "my-format"
        ...                                    # quantize / dequantize / weight_args / specs / pack / unpack

    weight_format("nvfp4").specs("model.layers.0.mlp.down_proj", 64, 128, scheme, np.float32)

A `WeightFormat` owns what one weight becomes: the rounding to its grid (`quantize`, the RTN / GPTQ
algorithms of models/quant/quantizers.py called with its grid), `dequantize`, its compressed-tensors
`QuantizationArgs` and format name (`weight_args`, `compressed_tensors_format`), the tensors it writes
(`specs`: names, shapes, dtypes from the shape alone; `pack`: the arrays) and reads back (`unpack`), the
zero state a loader fills (`zeros`), and how its config is recognised on disk (`read`). A `Scheme`
(models/quant/schemes.py) names its weight format and its activation format; the scheme grammar stays in
schemes.py, and a registered format may add scheme names of its own (`parse`). The built-in formats:
models/quant/formats/int_formats.py (packed int, int8 per channel), fp8_formats.py (FP8 blocks, FP8 per
channel), fp4_formats.py (NVFP4, MXFP4); they are imported on the first lookup, so that parsing a scheme
name does not import JAX. The layouts mirror compressed-tensors (`quantization/quant_args.py`,
`compressors/`; https://github.com/vllm-project/compressed-tensors). See docs/adding-a-quantization-format.md.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import numpy as np

# The types the methods take, from modules that import this one (models/quant/schemes.py `Scheme`, `Options`;
# models/quant/state.py `QMatrix`): named here without importing them, so the imports point one way.
Scheme = Options = QMatrix = Any

TensorSpec = tuple[str, tuple, Any]  # (tensor name, shape, numpy dtype)
Getter = Callable[[str, tuple], Any]  # hf_to_state's get(name, shape): the array, or None when missing

# The built-in formats' modules in this package, imported on the first lookup. They import this module, so
# it names them relative to its package: the modules that run a format's code (the driver, the compressed-tensors
# reader and writer) import them by name, which is how a stage's code version covers them (tasks/code.py).
BUILTIN_MODULES = ("int_formats", "fp8_formats", "fp4_formats")


class WeightFormat:
    """One weight format. Subclasses set the class attributes and override the methods; `register_weight_format`
    makes the one instance every lookup returns. Arrays are HF-oriented [out, in]; `QMatrix`
    (models/quant/state.py) is the in-memory form: codes of dtype `codes`, scales [out, G] (or tiles)."""

    name: ClassVar[str]  # the registry key a Scheme names (`Scheme.weight`)
    kind: ClassVar[str]  # the family: "int" | "fp8-block" | "fp8" | "fp4" (`Scheme.kind`)
    codes: ClassVar[str] = "int8"  # in-memory codes dtype: "int8" or "float8_e4m3fn"
    block: ClassVar[int | None] = None  # edge of square scale tiles (Linear.qblock), None for row groups
    methods: ClassVar[tuple[str, ...]] = ("rtn",)  # the algorithms a scheme may name: rtn, gptq, awq
    fixed_group: ClassVar[bool] = True  # the group size is the format's (False: the scheme's -g<N>)
    shared_global: ClassVar[bool] = False  # a per-tensor global scale that fused projections share (NVFP4)
    layouts: ClassVar[Mapping[str, str]] = {}  # extra on-disk copies: sub-folder -> save_pretrained layout
    read_note: ClassVar[str | None] = None  # what `read` recognises, for the error naming what is read

    # -- the numbers -------------------------------------------------------------------------------

    def groups(self, scheme: Scheme, in_features: int) -> int:
        """Scale columns per output row for an input width."""
        return scheme.args.groups(in_features)

    def quantize(self, w: np.ndarray, scheme: Scheme, H: np.ndarray | None, opts: Options,
                 global_scale: np.ndarray | None = None) -> tuple[QMatrix, str]:
        """w [out, in] float32 -> (QMatrix, the algorithm used). H [in, in]: GPTQ's Hessian (None: RTN)."""
        raise NotImplementedError

    def dequantize(self, qm: QMatrix, scheme: Scheme) -> np.ndarray:
        """QMatrix -> float32 [out, in]."""
        raise NotImplementedError

    def global_scale(self, amax: float) -> np.ndarray:
        """The shared global scale [1] of a fused group whose largest |w| is `amax` (`shared_global` only)."""
        raise NotImplementedError

    # -- compressed-tensors ------------------------------------------------------------------------

    def compressed_tensors_format(self, scheme: Scheme) -> str:
        raise NotImplementedError

    def weight_args(self, scheme: Scheme) -> dict[str, Any]:
        """The weights' compressed-tensors QuantizationArgs."""
        raise NotImplementedError

    def specs(self, name: str, out: int, n_in: int, scheme: Scheme, scale_dtype: Any) -> list[TensorSpec]:
        """What `pack` writes for one [out, in] weight, in its order, from the shape alone."""
        raise NotImplementedError

    def pack(self, name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
        """The tensors of one weight as written (names as `specs`)."""
        raise NotImplementedError

    def unpack(self, get: Getter, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
        """Read one weight through `get`; None when a tensor is missing."""
        raise NotImplementedError

    def zeros(self, out: int, n_in: int, scheme: Scheme) -> QMatrix:
        """Zero state of the right shapes, for a loader to fill."""
        raise NotImplementedError

    def read(self, fmt: str | None, weights: Mapping[str, Any]) -> Scheme | None:
        """The weight-only Scheme of a config group in compressed-tensors format `fmt` with these weight args,
        when it is this format's; None otherwise."""
        return None

    def parse(self, name: str) -> Scheme | None:
        """A scheme name this format adds to the grammar (models/quant/schemes.py), or None."""
        return None


@dataclasses.dataclass(frozen=True)
class ActFormat:
    """An input-activation format: `static` when part of it is calibrated (NVFP4's global input scale,
    written per module as `input_global_scale`), `group` the values per scale (None: one per token), `args`
    its compressed-tensors QuantizationArgs. Its numerics: models/numerics.py `quantize_activation`."""

    name: str
    static: bool
    group: int | None
    args: Mapping[str, Any]


WEIGHT_FORMATS: dict[str, WeightFormat] = {}
ACT_FORMATS: dict[str, ActFormat] = {}
_builtins_loaded = False


def register_weight_format(cls: type[WeightFormat]) -> type[WeightFormat]:
    """Class decorator: register one instance of `cls` under `cls.name` (a name taken twice is an error)."""
    if cls.name in WEIGHT_FORMATS:
        raise ValueError(f"weight format {cls.name!r} is already registered")
    WEIGHT_FORMATS[cls.name] = cls()
    return cls


def unregister_weight_format(name: str) -> None:
    """Remove a registered weight format (for formats registered for a while, as tests do)."""
    WEIGHT_FORMATS.pop(name)


def register_act_format(fmt: ActFormat) -> ActFormat:
    if fmt.name in ACT_FORMATS:
        raise ValueError(f"activation format {fmt.name!r} is already registered")
    ACT_FORMATS[fmt.name] = fmt
    return fmt


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(f"{__package__}.{module}")


def weight_format(name: str) -> WeightFormat:
    """The registered weight format `name`; ValueError naming the known ones otherwise."""
    if name not in WEIGHT_FORMATS:
        _load_builtins()
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {name!r} (known: {', '.join(WEIGHT_FORMATS)})")
    return WEIGHT_FORMATS[name]


def weight_formats() -> list[WeightFormat]:
    """Every registered weight format, built-ins first, in registration order."""
    _load_builtins()
    return list(WEIGHT_FORMATS.values())


def act_format(name: str) -> ActFormat:
    if name not in ACT_FORMATS:
        raise ValueError(f"unknown activation format {name!r} (known: {', '.join(ACT_FORMATS)})")
    return ACT_FORMATS[name]


# ------------------------------------------------------------------------------------------------
# The activation formats: compressed-tensors' FP8_DYNAMIC / W8A8 / W4AFP8 (per token), NVFP4, MXFP4 presets
# ------------------------------------------------------------------------------------------------

_COMMON = {"symmetric": True, "block_structure": None, "actorder": None, "observer_kwargs": {}}
for _name in ("fp8", "int8"):
    register_act_format(ActFormat(_name, False, None, {
        "num_bits": 8, "type": "float" if _name == "fp8" else "int", "strategy": "token", "group_size": None,
        "dynamic": True, "observer": None, **_COMMON}))
for _name, _group in (("nvfp4", 16), ("mxfp4", 32)):
    _nv = _name == "nvfp4"
    register_act_format(ActFormat(_name, _nv, _group, {
        "num_bits": 4, "type": "float", "strategy": "tensor_group" if _nv else "group", "group_size": _group,
        "dynamic": "local" if _nv else True, "scale_dtype": "torch.float8_e4m3fn" if _nv else "torch.uint8",
        "zp_dtype": "torch.float8_e4m3fn" if _nv else "torch.uint8", "observer": "static_minmax" if _nv else None,
        **_COMMON}))
