"""The `forgeline` command line.

    forgeline release [--recipe NAME|FILE] [--store URL] [--set key=value ...]
    forgeline draft-refresh [--recipe NAME|FILE] [--store URL] [--set key=value ...]
    forgeline deploy [--prefect-file infra/prefect.yaml]

Without PREFECT_API_URL, Prefect runs an ephemeral server for the command's lifetime; with it, runs
appear on that server's UI. Errors print one line on stderr and exit non-zero (2 for a bad recipe).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="forgeline: open model releases.")

Recipe = Annotated[str, typer.Option("--recipe", "-r", help="recipe name (tasks/recipes/) or YAML file")]
Store = Annotated[str, typer.Option("--store", "-s", help="artifact store URL: file://DIR, s3://BUCKET/PREFIX")]
Sets = Annotated[list[str] | None, typer.Option("--set", help="override a recipe key: section.key=value")]


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (test runners swap it), not the one at setup."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _log_to_stderr() -> None:
    """Our stage logs (training progress, skips) on stderr; Prefect keeps its own logging config."""
    log = logging.getLogger("forgeline")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _preflight(recipe: str, overrides: list[str]):
    """Validate the recipe and the inputs we can check cheaply before Prefect starts."""
    import storage
    from tasks.recipe import ConfigError, load_recipe

    try:
        cfg = load_recipe(recipe, overrides)
    except ConfigError as e:
        _fail(str(e), 2)
    for field, url in (("data.corpus", cfg.data.corpus), ("base.data.corpus", cfg.base.data.corpus),
                       ("base.url", cfg.base.url)):
        if url and not url.startswith("builtin://"):
            try:
                storage.list_files(url)
            except (FileNotFoundError, storage.StorageKeyError):
                _fail(f"{field}: no such file or folder: {url}")
    try:
        _check_quantize(cfg)
    except ValueError as e:
        _fail(f"quantize: {e}", 2)
    return cfg


def _check_quantize(cfg) -> None:
    """The quantize schemes against the base's layer widths (from the recipe, or base.url's config.json),
    on an abstract model: a group size that does not fit fails now, not after fine-tuning."""
    import json

    from flax import nnx

    import storage
    from models import registry
    from tasks.base import shape_config
    from tasks.quantize import check_fits

    for scheme in cfg.quantize.schemes:  # every shipped scheme needs a gate limit (else evaluate fails at the end)
        cfg.evaluate.gates.quant_limit(scheme)
    if cfg.base.url is None:
        config, model_cls = shape_config(cfg.base.model, vocab_size=8), registry.family(cfg.base.model.architecture)[1]
    else:
        source = storage.join(cfg.base.url, "config.json")
        try:
            raw = json.loads(storage.read_bytes(source))
        except (FileNotFoundError, storage.StorageKeyError, ValueError):
            return  # the base stage reports a missing or broken config.json with its own error
        try:
            config_cls, model_cls = registry.resolve(raw, source)
            config = config_cls.from_hf(raw)
        except (ValueError, TypeError, KeyError):
            return  # likewise an unsupported or malformed config
    check_fits(cfg.quantize, nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0))))


SHOWN = ("tokens.train", "rows.train", "params", "valid_loss_before", "valid_loss_after", "tokens_per_s",
         "generated_tokens", "acceptance_length", "passed")


def _console_progress():
    """Print one line per finished stage; return the rows for the summary table."""
    from rich.console import Console
    from rich.markup import escape

    from flows.stages import LISTENERS, StageEvent

    console, rows = Console(stderr=True, width=160), []

    def on_stage(e: StageEvent) -> None:
        status = "ran" if e.ran else "skipped (committed)"
        m = {f"{k}.{k2}" if isinstance(v, dict) else k: v2 for k, v in e.ref.metadata.items()
             for k2, v2 in (v.items() if isinstance(v, dict) else [(None, v)])}
        shown = ", ".join(f"{k}={m[k]:.4g}" for k in SHOWN if isinstance(m.get(k), int | float))
        console.print(f"[bold]{escape(e.name):<18}[/] {status:<20} {e.seconds:7.1f}s  {shown}", highlight=False)
        rows.append((e.name, status, f"{e.seconds:.1f}", e.ref.fingerprint, e.ref.url))

    LISTENERS.append(on_stage)
    return console, rows


def _summary(console, rows, title: str) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for col in ("stage", "status", "seconds", "fingerprint", "artifact"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(escape(c) for c in r))
    console.print(table)


def _run(fn, **kwargs):
    from storage import ArtifactError
    from tasks.export import GateError
    from tasks.recipe import ConfigError

    try:
        return fn(**kwargs)
    except ConfigError as e:
        _fail(str(e), 2)
    except (ValueError, FileNotFoundError, GateError, ArtifactError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


@app.command()
def release(recipe: Recipe = "tiny", store: Store = "file://./artifacts", set_: Sets = None) -> None:
    """Run the release flow and print the bundle URL as the last line."""
    _preflight(recipe, set_ or [])
    from flows.release import release as release_flow

    _log_to_stderr()

    console, rows = _console_progress()
    t0 = time.perf_counter()
    url = _run(release_flow, recipe=recipe, overrides=set_ or [], store=store)
    _summary(console, rows, f"release finished in {time.perf_counter() - t0:.0f}s")
    import storage

    console.print(storage.read_bytes(storage.join(url, "eval/report.md")).decode())
    print(url)


@app.command("draft-refresh")
def draft_refresh(recipe: Recipe = "tiny", store: Store = "file://./artifacts", set_: Sets = None) -> None:
    """Retrain the draft on fresh prompts; promote it only if acceptance does not drop."""
    _preflight(recipe, set_ or [])
    from flows.draft_refresh import draft_refresh as refresh_flow

    _log_to_stderr()

    console, rows = _console_progress()
    result = _run(refresh_flow, recipe=recipe, overrides=set_ or [], store=store)
    _summary(console, rows, "draft refresh")
    verdict = "promoted" if result["promoted"] else "kept current"
    console.print(f"acceptance length: current {result['current']:.3f}, candidate {result['candidate']:.3f} "
                  f"-> {verdict}")
    print(result["draft"])


@app.command()
def deploy(prefect_file: Annotated[Path, typer.Option(help="deployment declarations")] = ROOT / "infra/prefect.yaml",
           ) -> None:
    """Register the release and draft-refresh deployments (with the refresh's cron) on the Prefect server."""
    from flows.deploy import deploy_all

    for name, dep_id in deploy_all(prefect_file):
        print(f"deployed {name} ({dep_id})")


if __name__ == "__main__":
    app()
