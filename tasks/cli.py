"""The command line every stage module shares: `python -m tasks.<stage> --in DIR ... --out DIR --set k=v`.

A stage runs as a plain process on a GPU node (no Prefect, no store): inputs and output are local
folders, the config is the stage's schema plus `--set` overrides, the stats are printed as JSON.
A bad config is one line on stderr and exit 2; a bad input one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

PATH = {"type": Path, "required": True}
OPTIONAL_PATH = {"type": Path}


def stage_main(doc: str, config_cls: type[BaseModel], args: dict[str, dict[str, Any]],
               run: Callable[[Any, argparse.Namespace], dict[str, Any]], argv: list[str] | None = None) -> None:
    from tasks.recipe import ConfigError, apply_overrides

    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    for flag, kwargs in {**args, "--out": PATH}.items():
        p.add_argument(flag, **kwargs)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override a config key")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    for noisy in ("jax", "absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = apply_overrides(config_cls(), a.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from tasks.distributed import initialize_from_env
    from tasks.train import TrainingDiverged

    try:
        initialize_from_env()  # a no-op unless JAX_COORDINATOR_ADDRESS etc. describe a multi-host job
        stats = run(cfg, a)
    except (ValueError, FileNotFoundError, TrainingDiverged) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(stats, indent=1, default=str))
