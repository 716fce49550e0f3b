"""Release recipes: YAML (`tasks/recipes/<name>.yaml` or a file path, `extends:` another recipe) plus
`--set key=value` overrides, written over the defaults of `tasks/configs.py` section by section and
validated once into `ReleaseConfig`. A gate the recipe (or one it extends) sets weaker than its built-in
default needs the recipe's reason (`evaluate.gates.reasons`, `refresh.reasons`), and a gate an override
loosens needs `--allow-weaker-gates`; both become recorded waivers. The one `--set` parser
(`parse_overrides`, `apply_overrides`) serves `forgeline` and every `python -m tasks.<stage>`.

An unknown or ill-typed key is a `ConfigError` whose one-line message names the key; nothing runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from tasks.configs import ConfigError, ReleaseConfig, validate  # the one-line errors live with the schemas

RECIPES = Path(__file__).parent / "recipes"
M = TypeVar("M", bound=BaseModel)


# Sections a recipe may state as one string, short for one of their keys: `execution: workers`.
SHORTHANDS = {"execution": "mode"}


def _expand_shorthands(data: dict[str, Any]) -> dict[str, Any]:
    """`{"execution": "workers"}` -> `{"execution": {"mode": "workers"}}`, so that merging it with another
    source's `execution.<key>` keeps both."""
    return {k: {SHORTHANDS[k]: v} if k in SHORTHANDS and isinstance(v, str) else v for k, v in data.items()}


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["finetune.train.steps=10", "finetune.mode=full"]` -> nested dict; values parsed as YAML."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        if not key:
            raise ConfigError(f"override {item!r}: empty key")
        if key.strip() in SHORTHANDS:
            key = f"{key.strip()}.{SHORTHANDS[key.strip()]}"
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


def _recipe_chain(name_or_file: str, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """A recipe and every recipe it `extends:`, most derived first, each with the mapping its own file states."""
    path = recipe_path(name_or_file)
    if path.resolve() in seen:
        raise ConfigError(f"{path}: extends itself (through {' -> '.join(p.name for p in seen)})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of stage sections")
    data = _expand_shorthands(data)
    parent = data.pop("extends", None)
    if parent is None:
        return [(path, data)]
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: extends: expected a recipe name or file (got {parent!r})")
    if not Path(parent).is_absolute() and (path.parent / parent).exists():
        parent = str(path.parent / parent)
    return [(path, data), *_recipe_chain(parent, seen + (path.resolve(),))]


def _merged(chain: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """The chain's mappings merged, each file over the one it extends."""
    out: dict[str, Any] = {}
    for _, data in reversed(chain):
        out = deep_merge(out, data)
    return out


def over_defaults(default: BaseModel, data: dict[str, Any]) -> dict[str, Any]:
    """A recipe's `data` written over `default`, section by section: a section stated in part keeps the rest
    of *its own* defaults (`draft.train: {batch_size: 8}` keeps the draft's 300 steps, not TrainConfig's
    200). A value that is not a section -- a number, a list, a mapping such as the gate limits per scheme --
    is replaced: a recipe that states a mapping states all of it."""
    out = default.model_dump(mode="json")
    for key, value in data.items():
        current = getattr(default, key, None) if key in type(default).model_fields else None
        out[key] = over_defaults(current, value) if isinstance(current, BaseModel) and isinstance(value, dict) \
            else value
    return out


def _stating_file(chain: list[tuple[Path, dict[str, Any]]], gate: str) -> Path:
    """The file of the chain (most derived first) that states `gate` (`evaluate.gates.max_quant_kl_p99[int8]`
    is stated by the file that states `evaluate.gates.max_quant_kl_p99`)."""
    for path, data in chain:
        node: Any = data
        for part in gate.split("[")[0].split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return path
    return chain[0][0]


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _recipe_waivers(chain: list[tuple[Path, dict[str, Any]]], recipe: ReleaseConfig,
                    effective: ReleaseConfig) -> list[dict[str, Any]]:
    """Every gate the recipe (with what it extends) holds weaker than the built-in default, with the reason the
    recipe states for it (`evaluate.gates.reasons.<gate>`, `refresh.reasons.min_acceptance_ratio`): a gate
    lowered without one is a ConfigError naming the file that lowers it. Recorded: those still weaker than the
    default once `--set` applies, for the schemes `effective` ships; `to` is the recipe's value."""
    default = ReleaseConfig()
    schemes = tuple(dict.fromkeys((*recipe.quantize.schemes, *effective.quantize.schemes)))
    in_force = {w["gate"] for w in gate_waivers(default, effective)}
    out = []
    for w in gate_waivers(default, recipe, schemes):
        section, name = w["gate"].split("[")[0].rsplit(".", 1)
        reasons = recipe.evaluate.gates.reasons if section == "evaluate.gates" else recipe.refresh.reasons
        stated_by = _stating_file(chain, w["gate"])
        if name not in reasons:
            raise ConfigError(f"recipe {stated_by.name}: {w['gate']}: {_show(w['to'])} is weaker than the built-in "
                              f"default {_show(w['from'])}; state why as {section}.reasons.{name} (the release "
                              f"records it as a waiver)")
        if w["gate"] in in_force:
            out.append({**w, "source": stated_by.name, "reason": reasons[name]})
    return out


def _load(name_or_file: str, overrides: list[str] | None) -> tuple[ReleaseConfig, ReleaseConfig, list[dict[str, Any]]]:
    """(the recipe alone, the recipe with the overrides, the recipe's waivers in force)."""
    chain = _recipe_chain(name_or_file)
    path, data = chain[0][0], _merged(chain)
    sets = parse_overrides(overrides or [])
    stated = deep_merge(data, sets)
    for key, section in (("waivers", stated), ("evaluate.declared_gates", stated.get("evaluate")),
                         ("evaluate.waivers", stated.get("evaluate"))):
        if isinstance(section, dict) and key.rsplit(".", 1)[-1] in section:
            raise ConfigError(f"recipe {path.name}: '{key}' is recorded by forgeline, not set by a recipe or --set")
    # `--set a.b.key=value` changes one key of whatever is in force, a mapping's too
    effective = validate(ReleaseConfig, deep_merge(over_defaults(ReleaseConfig(), data), sets), f"recipe {path.name}")
    recipe = validate(ReleaseConfig, over_defaults(ReleaseConfig(), data), f"recipe {path.name}") if sets \
        else effective
    return recipe, effective, _recipe_waivers(chain, recipe, effective)


def load_recipe(name_or_file: str = "tiny", overrides: list[str] | None = None) -> ReleaseConfig:
    """The recipe with its overrides, validated; a gate the recipe lowers below its default without a stated
    reason is a ConfigError. The waivers are recorded by `load_release`."""
    return _load(name_or_file, overrides)[1]


def gate_waivers(stricter: ReleaseConfig, weaker: ReleaseConfig,
                 schemes: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Every gate `weaker` holds less strictly than `stricter` ({gate, from, to}): the release's eval gates for
    `schemes` (default: those `weaker` ships) and the draft refresh's promotion ratio."""
    out = weaker.evaluate.gates.waivers(stricter.evaluate.gates,
                                        weaker.quantize.schemes if schemes is None else schemes)
    if weaker.refresh.min_acceptance_ratio < stricter.refresh.min_acceptance_ratio:
        out.append({"gate": "refresh.min_acceptance_ratio", "from": stricter.refresh.min_acceptance_ratio,
                    "to": weaker.refresh.min_acceptance_ratio})
    return out


def load_release(name_or_file: str = "tiny", overrides: list[str] | None = None, *,
                 allow_weaker_gates: bool = False) -> ReleaseConfig:
    """The recipe with its overrides, as a release runs it, with every waiver recorded in `waivers` and
    `evaluate.waivers` ({gate, from, to, source, reason}): each gate the recipe holds below its built-in
    default (source: the file that lowers it, reason: the recipe's), and each an override loosens below the
    recipe (source: "--set"). An override may make a gate stricter; one that loosens or disables a gate is a
    ConfigError unless `allow_weaker_gates` (and then the recipe's own gates go to `evaluate.declared_gates`,
    so the report judges both)."""
    recipe, effective, waivers = _load(name_or_file, overrides)
    loosened = [{**w, "source": "--set", "reason": None} for w in gate_waivers(recipe, effective)] if overrides \
        else []
    if loosened and not allow_weaker_gates:
        w = loosened[0]
        more = f" (and {len(loosened) - 1} more)" if len(loosened) > 1 else ""
        raise ConfigError(f"--set {w['gate']}: {w['to']} is weaker than the recipe's {w['from']}{more}; "
                          f"pass --allow-weaker-gates to release anyway (recorded as a waiver, the release "
                          f"pointer then moves only if the declared gates pass)")
    waivers += loosened
    if not waivers:
        return effective
    evaluate = effective.evaluate.model_copy(update={"waivers": tuple(waivers),
                                                     **({"declared_gates": recipe.evaluate.gates} if loosened else {})})
    return effective.model_copy(update={"evaluate": evaluate, "waivers": tuple(waivers)})
