"""Release recipes: one typed schema per stage (next to the stage), composed into `ReleaseConfig`,
loaded from YAML (`tasks/recipes/<name>.yaml` or a file path) plus `key=value` overrides.

An unknown or ill-typed key is a `ConfigError` whose one-line message names the key; nothing runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tasks.configs import (
    BaseModelConfig,
    DataPrepConfig,
    DraftConfig,
    EvalConfig,
    FinetuneConfig,
    QuantizeConfig,
    TracesConfig,
)

RECIPES = Path(__file__).parent / "recipes"
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema."""


class RefreshConfig(BaseModel):
    """The scheduled draft refresh: fresh prompts -> traces -> retrained draft -> promote if no worse."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: DataPrepConfig = DataPrepConfig(corpus="builtin://python-stdlib-functions", seed=1)
    traces: TracesConfig = TracesConfig()
    draft: DraftConfig = DraftConfig()
    min_acceptance_ratio: float = 1.0  # promote only if new acceptance >= ratio * current


class ReleaseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "forgeline-tiny"
    base: BaseModelConfig = BaseModelConfig()
    data: DataPrepConfig = DataPrepConfig(corpus="builtin://python-stdlib-functions")
    finetune: FinetuneConfig = FinetuneConfig()
    traces: TracesConfig = TracesConfig()
    draft: DraftConfig = DraftConfig()
    quantize: QuantizeConfig = QuantizeConfig()
    evaluate: EvalConfig = EvalConfig()
    refresh: RefreshConfig = RefreshConfig()
    # The model the release serves and the draft is trained and measured against: the fine-tuned
    # weights or one of `quantize.schemes` (a quantized target shifts the distribution the draft must match).
    serve: str = "finetuned"
    # Gates the command line loosened (`load_release(..., allow_weaker_gates=True)`); set by forgeline, never
    # by a recipe: {gate, declared, effective} each.
    waivers: tuple[dict[str, Any], ...] = ()

    @model_validator(mode="after")
    def _serve_known(self) -> ReleaseConfig:
        if self.serve != "finetuned" and self.serve not in self.quantize.schemes:
            raise ValueError(f"serve {self.serve!r} is neither 'finetuned' nor one of quantize.schemes "
                             f"{list(self.quantize.schemes)}")
        if not self.evaluate.gates.enabled(self.quantize.schemes):
            raise ValueError("evaluate.gates: no gate is enabled, so nothing would stand between a release and its "
                             "users (enable finetune_improves, speculative_lossless, min_acceptance_length > 0 or "
                             "ship a quantize scheme)")
        return self

    def refresh_ratio_declared(self) -> float:
        """The draft refresh's promotion threshold as the recipe declares it (a waiver may lower the one in force)."""
        for w in self.waivers:
            if w["gate"] == "refresh.min_acceptance_ratio":
                return float(w["declared"])
        return self.refresh.min_acceptance_ratio

    def served_model(self, finetuned: T, quantized: T) -> T:
        """Whichever of the two the release serves (`serve`): the fine-tuned weights, or the quantize
        artifact that holds the scheme `serve` names."""
        return finetuned if self.serve == "finetuned" else quantized

    def served(self, section: str) -> BaseModel:
        """A stage's config with its served-model field set from `serve`."""
        field = {"traces": "target", "draft": "target", "evaluate": "spec_target"}[section]
        return getattr(self, section).model_copy(update={field: self.serve})


def _one_line(e: ValidationError, source: str) -> ConfigError:
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return ConfigError(f"{source}: unknown key '{key}'")
    got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":  # a validator's own message says what was wrong; the input is the section
        got = ""
    return ConfigError(f"{source}: {key + ': ' if key else ''}{msg}{got}{more}")


def validate(cls: type[M], data: dict[str, Any], source: str) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise _one_line(e, source) from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["finetune.train.steps=10", "finetune.mode=full"]` -> nested dict; values parsed as YAML."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        if not key:
            raise ConfigError(f"override {item!r}: empty key")
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{part}' is not a section")
        node[parts[-1]] = value
    return out


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_overrides(cfg: M, overrides: list[str]) -> M:
    data = deep_merge(cfg.model_dump(mode="json"), parse_overrides(overrides))
    return validate(type(cfg), data, "overrides")


def recipe_path(name_or_file: str) -> Path:
    p = Path(name_or_file)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"recipe file not found: {p}")
        return p
    p = RECIPES / f"{name_or_file}.yaml"
    if not p.exists():
        known = ", ".join(sorted(q.stem for q in RECIPES.glob("*.yaml")))
        raise ConfigError(f"unknown recipe '{name_or_file}' (known: {known})")
    return p


def _recipe_data(name_or_file: str, seen: tuple[Path, ...] = ()) -> tuple[Path, dict[str, Any]]:
    """A recipe's mapping with its `extends: <recipe>` chain merged in (the extending file wins)."""
    path = recipe_path(name_or_file)
    if path.resolve() in seen:
        raise ConfigError(f"{path}: extends itself (through {' -> '.join(p.name for p in seen)})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of stage sections")
    parent = data.pop("extends", None)
    if parent is None:
        return path, data
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: extends: expected a recipe name or file (got {parent!r})")
    if not Path(parent).is_absolute() and (path.parent / parent).exists():
        parent = str(path.parent / parent)
    return path, deep_merge(_recipe_data(parent, seen + (path.resolve(),))[1], data)


def load_recipe(name_or_file: str = "tiny", overrides: list[str] | None = None) -> ReleaseConfig:
    path, data = _recipe_data(name_or_file)
    data = deep_merge(data, parse_overrides(overrides or []))
    for key, section in (("waivers", data), ("evaluate.declared_gates", data.get("evaluate"))):
        if isinstance(section, dict) and key.rsplit(".", 1)[-1] in section:
            raise ConfigError(f"recipe {path.name}: '{key}' is recorded by forgeline, not set by a recipe or --set")
    return validate(ReleaseConfig, data, f"recipe {path.name}")


def gate_waivers(declared: ReleaseConfig, effective: ReleaseConfig) -> list[dict[str, Any]]:
    """Every gate `effective` (the recipe plus command-line overrides) holds less strictly than `declared`
    (the recipe alone): the release's eval gates and the draft refresh's promotion ratio."""
    out = effective.evaluate.gates.waivers(declared.evaluate.gates, effective.quantize.schemes)
    if effective.refresh.min_acceptance_ratio < declared.refresh.min_acceptance_ratio:
        out.append({"gate": "refresh.min_acceptance_ratio", "declared": declared.refresh.min_acceptance_ratio,
                    "effective": effective.refresh.min_acceptance_ratio})
    return out


def load_release(name_or_file: str = "tiny", overrides: list[str] | None = None, *,
                 allow_weaker_gates: bool = False) -> ReleaseConfig:
    """The recipe with its overrides, as a release runs it. An override may make a gate stricter; one that
    loosens or disables a gate is a ConfigError unless `allow_weaker_gates`, and is then recorded in
    `waivers` (and the recipe's own gates in `evaluate.declared_gates`, so the report judges both)."""
    effective = load_recipe(name_or_file, overrides)
    waivers = gate_waivers(load_recipe(name_or_file), effective) if overrides else []
    if not waivers:
        return effective
    if not allow_weaker_gates:
        w = waivers[0]
        more = f" (and {len(waivers) - 1} more)" if len(waivers) > 1 else ""
        raise ConfigError(f"--set {w['gate']}: {w['effective']} is weaker than the recipe's {w['declared']}{more}; "
                          f"pass --allow-weaker-gates to release anyway (recorded as a waiver, the release "
                          f"pointer then moves only if the declared gates pass)")
    declared = load_recipe(name_or_file).evaluate.gates
    evaluate = effective.evaluate.model_copy(update={"declared_gates": declared})
    return effective.model_copy(update={"evaluate": evaluate, "waivers": tuple(waivers)})
