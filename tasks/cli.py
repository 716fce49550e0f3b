"""The command line every stage module shares: `python -m tasks.<stage> --in DIR ... --out DIR --set k=v`.

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

PATH = {"type": Path, "required": True}


def cache_root() -> Path:
    """forgeline's per-user cache folder: `$FORGELINE_CACHE`, default ~/.cache/forgeline."""
    return Path(os.environ.get("FORGELINE_CACHE", Path.home() / ".cache" / "forgeline"))


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

OPTIONAL_PATH = {"type": Path}


def stage_main(doc: str, config_cls: type[BaseModel], args: dict[str, dict[str, Any]],
               run: Callable[[Any, argparse.Namespace], dict[str, Any]], argv: list[str] | None = None) -> None:
    from tasks.recipe import ConfigError, apply_overrides

    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    for flag, kwargs in {**args, "--out": PATH}.items():
        p.add_argument(flag, **kwargs)
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable; values are YAML, as in `forgeline release --set`)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    for noisy in ("jax", "absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = apply_overrides(config_cls(), a.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from tasks.training.config import TrainingDiverged
    from tasks.training.distributed import initialize_from_env

    configure_jax()
    try:
        initialize_from_env()  # a no-op unless JAX_COORDINATOR_ADDRESS etc. describe a multi-host job
        stats = run(cfg, a)
    except (ValueError, FileNotFoundError, PermissionError, NotImplementedError, TrainingDiverged) as e:
        print(f"error: {_first_line(e)}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # a library error (e.g. inside JAX): one line too, the traceback in the log
        logging.getLogger("forgeline").debug("stage failed", exc_info=True)
        print(f"error: {type(e).__name__}: {_first_line(e)}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(stats, indent=1, default=str))
