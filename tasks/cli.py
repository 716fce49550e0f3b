"""The command line every stage module shares, derived from the stage's declaration (tasks/configs.py
`STAGES`): `python -m tasks.<stage> --<input> DIR ... --out DIR --set k=v`.

A stage runs as a plain process on a GPU node (no Prefect, no store): inputs and output are local
folders, the config is the stage's schema plus `--set` overrides, the stats are printed as JSON.
A bad config is one line on stderr and exit 2; a bad input, an unsupported configuration or any other
failure one line and exit 1 (the traceback goes to the log at DEBUG level, not to the terminal).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from storage import cache_root

_jax_configured = False


def configure_jax(compilation_cache: bool = True) -> None:
    """Process-wide JAX settings for forgeline's entry points, applied once per process (later calls are
    no-ops): a persistent compilation cache under the user's cache folder (`$FORGELINE_CACHE/jax`, default
    ~/.cache/forgeline/jax), so a rerun after a crash, a retry and every later stage process reuse compiled
    programs instead of compiling again. JAX keys the entries on the program, the backend and the compiler
    options, so a cached program is the program that would have been compiled. `JAX_COMPILATION_CACHE_DIR`
    overrides the folder; an empty value, or `compilation_cache=False`, disables it in this process. Programs
    that compile in under 0.2 s are not written, unless `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` says
    otherwise."""
    global _jax_configured
    if _jax_configured:
        return
    _jax_configured = True
    import jax

    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if folder is None:
        folder = str(cache_root() / "jax")
    if not (compilation_cache and folder):
        jax.config.update("jax_compilation_cache_dir", None)  # JAX itself reads JAX_COMPILATION_CACHE_DIR
        return
    if jax.config.jax_compilation_cache_dir is None or jax.config.jax_compilation_cache_dir == folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        min_seconds = os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")  # JAX's own variable, if set
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2 if min_seconds is None else
                          float(min_seconds))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

def stage_main(kind: str, argv: list[str] | None = None) -> None:
    """`python -m tasks.<module>` for the stage `kind`, read off its one declaration (tasks/configs.py
    `STAGES`): a path flag per input (`--<name> DIR`, required or optional as the stage takes it), `--out`,
    `--<key> VALUE` for each config key the record lists in `flags`, `--set key=value` for the rest, and for a
    training stage `--checkpoints DIR [--store URL]` (resumable checkpoints, uploaded to and resumed from the
    store). The stage runs through its `run(config, inputs, output, *, progress, context)`, as in a release."""
    from tasks.recipe import ConfigError, apply_overrides, validate
    from tasks.registry import stage

    spec = stage(kind)
    p = argparse.ArgumentParser(prog=f"python -m tasks.{spec.module}", description=f"Stage {kind}: {spec.summary}")
    for name in spec.inputs:
        p.add_argument(f"--{name}", type=Path, required=True, help=f"input `{name}`: a folder")
    for name in spec.optional:
        p.add_argument(f"--{name}", type=Path, help=f"optional input `{name}`: a folder")
    p.add_argument("--out", type=Path, required=True, help="the output folder")
    for key in spec.flags:
        p.add_argument(f"--{key}", help=f"config key `{key}`, taken as written (short for --set {key}=VALUE)")
    if spec.trains:
        p.add_argument("--checkpoints", type=Path, help="local checkpoint folder (enables resume)")
        p.add_argument("--store", help="also upload checkpoints to this store URL and resume from there")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable; values are YAML, as in `forgeline release --set`)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    for noisy in ("jax", "absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = apply_overrides(validate(spec.config, {}, kind), a.set)
        for key in spec.flags:
            if (value := getattr(a, key)) is not None:
                cfg = validate(spec.config, {**cfg.model_dump(mode="json"), key: value}, f"--{key}")
        if spec.trains and a.store and not a.checkpoints:
            raise ConfigError("--store: needs --checkpoints (the local folder its checkpoints are resumed into)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    inputs = {name: getattr(a, name) for name in spec.inputs + spec.optional if getattr(a, name) is not None}
    _run(spec, cfg, inputs, a)


def _run(spec: Any, cfg: BaseModel, inputs: dict[str, Path], a: argparse.Namespace) -> None:
    from storage import Store
    from tasks.stage import StageContext
    from tasks.training.config import TrainingDiverged
    from tasks.training.distributed import initialize_from_env

    configure_jax()
    try:
        initialize_from_env()  # a no-op unless JAX_COORDINATOR_ADDRESS etc. describe a multi-host job
        context = None
        if spec.trains and a.checkpoints:
            context = StageContext(spec.name, "cli", a.out, inputs, {}, Store(a.store) if a.store else None,
                                   local_checkpoints=a.checkpoints)
        stats = spec.load().run(cfg, inputs, a.out, progress=None, context=context)
    except (ValueError, FileNotFoundError, PermissionError, NotImplementedError, TrainingDiverged) as e:
        print(f"error: {_first_line(e)}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # a library error (e.g. inside JAX): one line too, the traceback in the log
        logging.getLogger("forgeline").debug("stage failed", exc_info=True)
        print(f"error: {type(e).__name__}: {_first_line(e)}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(stats, indent=1, default=str))


def stage_cli(module: str) -> Callable[[list[str] | None], None]:
    """The `main(argv)` of the stage whose module is `module` (a stage file's `__name__`; `__main__` under
    `python -m` resolves to the module it runs)."""
    if module == "__main__":  # run as `python -m tasks.<module>`: the stage's `run` is this very module's
        module = sys.modules["__main__"].__spec__.name
        sys.modules.setdefault(module, sys.modules["__main__"])  # not a second copy of it under its own name
    from tasks.configs import STAGES

    kind = next(s.name for s in STAGES.values() if f"tasks.{s.module}" == module)

    def main(argv: list[str] | None = None) -> None:
        stage_main(kind, argv)

    main.__doc__ = f"`python -m {module}`: the command line of stage {kind} (tasks/cli.py stage_main)."
    return main
