"""The `forgeline` command line.

    forgeline release [--recipe NAME|FILE] [--store URL] [--set key=value ...] [--allow-weaker-gates]
    forgeline draft-refresh [--recipe NAME|FILE] [--store URL] [--set key=value ...] [--allow-weaker-gates]
    forgeline verify URL [--store URL] [--no-lineage]
    forgeline deploy [--prefect-file infra/prefect.yaml] [--recipe NAME|FILE] [--gpu-slots N]
    forgeline worker [--pool forgeline-gpu] [--limit 1]
    forgeline stack up|env|down [--dir .forgeline-stack]
    forgeline plan MODEL --mode lora|full --seq-len T --global-batch B --devices N --device-memory GIB [--json]
    forgeline quantize-checkpoint SRC --scheme S --out DST [--ignore MODULE ...]

Without PREFECT_API_URL, Prefect runs an ephemeral server for the command's lifetime; with it, runs
appear on that server's UI. Every failure is one `error:` line on stderr and a non-zero exit (2 for a
bad recipe or command line, 1 for bad input or a failed stage, 130/143 when interrupted); tracebacks go
to the run's logs in Prefect (and, for errors outside a run, to a file the line names), never to the
terminal. Ctrl-C or SIGTERM stops the run and everything it started (the ephemeral Prefect server
included); nothing half-written is ever visible, and the same command resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated

import typer

from flows.prefect_api import launch_prefect_server, prefect_api

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# Prefect's console handler would print a failed task's traceback on the terminal; the API handler still
# sends it to the run's logs in the UI. Set the variable to see Prefect's own lines again.
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_DEBUG_LEVEL", "CRITICAL")  # prefect._internal's own stderr handler
# absl (imported by orbax) calls logging.basicConfig() on its first message when the root logger has no
# handler, which would print every library's errors -- Prefect's task tracebacks included -- on stderr.
logging.getLogger().addHandler(logging.NullHandler())
# A log record that cannot be delivered (the Prefect API gone after Ctrl-C) is dropped, not printed.
logging.raiseExceptions = False

app = typer.Typer(add_completion=False, no_args_is_help=True, help="forgeline: open model releases.")

Recipe = Annotated[str, typer.Option("--recipe", "-r", help="recipe name (tasks/recipes/) or YAML file")]
Store = Annotated[str, typer.Option("--store", "-s", help="artifact store URL: file://DIR, s3://BUCKET/PREFIX")]
Sets = Annotated[list[str] | None, typer.Option("--set", help="override a recipe key: section.key=value")]
Weaker = Annotated[bool, typer.Option("--allow-weaker-gates",
                                      help="accept --set overrides that loosen the recipe's gates, recorded as waivers "
                                           "(the bundle is exported; the release pointer moves only if the declared "
                                           "gates pass)")]


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


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _preflight(recipe: str, overrides: list[str], store: str, allow_weaker_gates: bool):
    """Everything that can be checked before Prefect starts and any stage commits: the recipe and its
    gates, the store, the input URLs, the first records of each user corpus, the quantize group sizes, and
    a base.url checkpoint's files, tokenizer and tensor names and shapes (headers only)."""
    import storage
    from tasks.recipe import ConfigError, load_release

    try:
        cfg = load_release(recipe, overrides, allow_weaker_gates=allow_weaker_gates)
    except ConfigError as e:
        _fail(str(e), 2)
    try:
        storage.check_store(store)
    except storage.StorageKeyError as e:
        _fail(f"--store: {e}", 2)
    except storage.StoreUnavailable as e:
        _fail(e.strerror or _first_line(e))
    corpora = (("base.data.corpus", cfg.base.data), ("data.corpus", cfg.data),
               ("refresh.data.corpus", cfg.refresh.data))
    listed: dict[str, list[str]] = {}
    for field, url in (*((f, d.corpus) for f, d in corpora), ("base.url", cfg.base.url)):
        if url and not url.startswith("builtin://"):
            try:
                listed[field] = storage.list_files(url)
            except (FileNotFoundError, storage.StorageKeyError):
                _fail(f"{field}: no such file or folder: {url}")
            except Exception as e:  # an unreachable endpoint, refused credentials
                _fail(f"{field}: cannot read {url} ({_first_line(e)})")
    from tasks.data_prep import check_corpus

    template = None  # the base checkpoint's own chat template, which data_prep renders conversations with
    if cfg.base.url is not None:
        from tasks.base_model import check_base

        try:  # the listing's keys, the tokenizer, its chat template and the safetensors headers: no weight
            template = check_base(cfg.base.url, listed["base.url"])
        except ValueError as e:
            _fail(_first_line(e))
        except Exception as e:  # an endpoint that stopped answering, refused credentials
            _fail(f"base.url: cannot read {cfg.base.url} ({_first_line(e)})")
    for field, data in corpora:
        if cfg.base.url is not None and field == "base.data.corpus":
            continue  # no pretraining: the base corpus is not read
        try:
            check_corpus(data, needs_pairs=field == "data.corpus" and cfg.finetune.method == "dpo",
                         template=template if field != "base.data.corpus" else None)
        except ValueError as e:
            _fail(f"{field}: {_first_line(e).removeprefix('corpus: ')}")
    try:
        _check_quantize(cfg)
    except ValueError as e:
        _fail(f"quantize: {e}", 2)
    if cfg.execution.mode == "workers":
        from flows.execution import StageRunFailed, check_workers
        from tasks.registry import STAGES

        try:
            check_workers(cfg.execution, cfg.resources, list(STAGES))
        except StageRunFailed as e:
            _fail(str(e), 2)
        _check_fits(cfg)
    else:
        _check_meshes(cfg)  # with workers, each stage's mesh is checked on its worker, against its devices
    return cfg


def _check_meshes(cfg) -> None:
    """Every training stage's mesh against the devices this process sees (the inline execution runs every
    stage here): `data x tensor x expert (x fsdp)` must fill them."""
    import jax

    n = jax.device_count()
    for section, train in (("base.train", cfg.base.train), ("finetune.train", cfg.finetune.train),
                           ("draft.train", cfg.draft.train), ("refresh.draft.train", cfg.refresh.draft.train)):
        if section == "base.train" and cfg.base.url is not None:
            continue  # an imported base is not trained
        m = train.mesh
        fixed = m.data * m.tensor * m.expert
        if m.fsdp is None and n % fixed:
            _fail(f"{section}.mesh: data {m.data} x tensor {m.tensor} x expert {m.expert} needs a multiple of {fixed} "
                  f"devices; this machine has {n}", 2)
        if m.fsdp is not None and fixed * m.fsdp != n:
            _fail(f"{section}.mesh: data {m.data} x fsdp {m.fsdp} x tensor {m.tensor} x expert {m.expert} needs "
                  f"{fixed * m.fsdp} devices; this machine has {n}", 2)


def _base_config(cfg) -> dict:
    """The base's config.json: base.url's, or the scratch base's (the data's tokenizer vocabulary)."""
    import json

    import storage
    from tasks.base_model import shape_config

    if cfg.base.url is None:
        return shape_config(cfg.base.model, vocab_size=cfg.base.data.vocab_size).to_hf("float32")
    return json.loads(storage.read_bytes(storage.join(cfg.base.url, "config.json")))


def _check_fits(cfg) -> None:
    """The fine-tune against its workers' accelerators (`resources.finetune.accelerator_memory_gib`, when set):
    the capacity planner compiles the step the stage will run (its mode, mesh, batch, sequence length, remat and
    dtypes; fp32 parameters, as the stage loads them) on abstract arrays over as many fake devices, so a
    fine-tune that cannot fit fails here, in seconds, with the numbers (tasks/training/plan.py)."""
    import json
    import tempfile

    from tasks.training.plan import GIB, run_in_subprocess

    res, ft = cfg.resources.finetune, cfg.finetune
    if res.accelerator_memory_gib is None or res.accelerators == 0:
        return
    m, devices = ft.train.mesh, res.accelerators * res.hosts
    mesh = f"data={m.data},tensor={m.tensor},expert={m.expert}" + (f",fsdp={m.fsdp}" if m.fsdp else "")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(_base_config(cfg), f)
        argv = [path, "--json", "--mode", ft.mode, "--devices", str(devices), "--hosts", str(res.hosts),
                "--device-memory", str(res.accelerator_memory_gib), "--seq-len", str(cfg.data.seq_len),
                "--global-batch", str(ft.train.batch_size), "--grad-accum", str(ft.train.grad_accum),
                "--param-dtype", "float32", "--compute-dtype", ft.train.compute_dtype, "--remat", ft.train.remat,
                "--optimizer", ft.train.optimizer, "--lora-rank", str(ft.lora_rank), "--lora-targets",
                ",".join(ft.lora_targets), "--mesh", mesh, "--compile", "1"]
        proc = run_in_subprocess(argv, timeout=900, capture=True)
    if proc.returncode == 2 or not proc.stdout.strip():
        _fail(f"resources.finetune: the capacity planner failed: "
              f"{(proc.stderr.strip().splitlines() or ['no output'])[-1].removeprefix('error: ')}", 2)
    plan = json.loads(proc.stdout)
    if not plan["fits"]:
        b = plan["bytes_per_device"]
        parts = ", ".join(f"{k} {b[k] / GIB:.2f}" for k in ("params", "frozen", "grads", "optimizer", "temp"))
        _fail(f"finetune does not fit: {b['total'] / GIB:.2f} GiB per device > resources.finetune."
              f"accelerator_memory_gib {res.accelerator_memory_gib:g} ({parts} GiB; mesh {mesh}, {devices} "
              f"devices); lower finetune.train.batch_size, set finetune.train.remat, or add accelerators", 2)


def _check_quantize(cfg) -> None:
    """The quantize schemes against the base's layer widths (from the recipe, or base.url's config.json),
    on an abstract model: a group size that does not fit fails now, not after fine-tuning. A base.url whose
    config.json is missing, unreadable or unsupported fails here too, naming the file."""
    import json

    from flax import nnx

    import storage
    from models import abstract, families
    from models.config_schema import check_sizes
    from tasks.base_model import shape_config
    from tasks.quantize import check_fits

    for scheme in cfg.quantize.schemes:  # every shipped scheme needs its gate limits (else evaluate fails at the end)
        for gate in cfg.evaluate.gates.QUANT_GATES:
            cfg.evaluate.gates.quant_limit(scheme, gate)
    if cfg.base.url is None:
        config, model_cls = shape_config(cfg.base.model, vocab_size=8), families.family(cfg.base.model.architecture)[1]
    else:
        source = storage.join(cfg.base.url, "config.json")
        try:
            raw = json.loads(storage.read_bytes(source))
        except FileNotFoundError:
            _fail(f"base.url: {storage.normalize_url(cfg.base.url)} has no config.json (not an HF checkpoint folder)")
        except ValueError as e:
            _fail(f"base.url: {source}: cannot read config ({_first_line(e)})")
        try:
            config_cls, model_cls = families.resolve(raw, source)
            check_sizes(raw, source)
            config = config_cls.from_hf(raw)
            check_sizes(config, source)
        except KeyError as e:
            _fail(f"base.url: {source}: missing key {e.args[0]!r}")
        except (ValueError, TypeError, NotImplementedError) as e:
            _fail(f"base.url: {source}: {_first_line(e).removeprefix(source + ': ').removeprefix('config.json: ')}")
    check_fits(cfg.quantize, abstract.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0))))


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


def _on_signal(signum, _frame) -> None:
    from tasks.stage import interrupt

    interrupt(signum)  # recorded: later stage boundaries raise again should this raise be swallowed


def _unraisable(hook):
    """`sys.unraisablehook` for a run: a signal's exception raised inside a `__del__` (an asyncio transport
    collected mid-run) cannot propagate; record the signal, so the next stage boundary stops the run, and
    print nothing (no traceback). Anything else goes to the previous hook."""

    def quiet(unraisable) -> None:
        from prefect.exceptions import TerminationSignal

        from tasks.stage import Interrupted, record

        e = unraisable.exc_value
        if isinstance(e, Interrupted | KeyboardInterrupt | TerminationSignal):
            if not isinstance(e, Interrupted):  # Interrupted was recorded when raised
                record(e.signal if isinstance(e, TerminationSignal) else signal.SIGINT)
            return
        hook(unraisable)

    return quiet


def _run(fn, **kwargs):
    """Run a flow; any failure becomes one `error:` line and an exit code. SIGTERM and Ctrl-C unwind the
    run like an exception (stages release their leases, checkpoints finish uploading, the run is recorded
    as crashed, the ephemeral Prefect server is stopped on exit) and exit 128 + the signal number."""
    from tasks.stage import Interrupted, received

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)
    try:
        with prefect_api():
            out = fn(**kwargs)
        if received() is not None:  # the run finished although a signal came: say so, as if it had stopped
            raise Interrupted(received())
        return out
    except BaseException as e:
        from prefect.exceptions import TerminationSignal

        # a received signal decides how the run ended, whatever exception the unwinding then raised
        if received() is not None or isinstance(e, Interrupted | KeyboardInterrupt | TerminationSignal):
            signum = received() or (signal.SIGTERM if isinstance(e, TerminationSignal) else signal.SIGINT)
            _fail(f"interrupted by {signal.Signals(signum).name}: nothing half-written is visible; run the same "
                  f"command again to resume after the last committed stage", 128 + signum)
        _failure(e)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = previous_hook


def _failure(e: BaseException) -> None:
    """One `error:` line and the exit code for an exception that ended a run."""
    from flows.execution import StageRunFailed
    from flows.gang import GangFailed
    from storage import ArtifactError, StorageKeyError, StoreUnavailable
    from tasks.export import GateError
    from tasks.recipe import ConfigError
    from tasks.training.config import TrainingDiverged

    if isinstance(e, ConfigError):
        _fail(str(e), 2)
    if isinstance(e, ValueError | NotImplementedError | FileNotFoundError | PermissionError | GateError
                  | ArtifactError | StoreUnavailable | StorageKeyError | TrainingDiverged | StageRunFailed
                  | GangFailed):
        _fail(_first_line(e))
    if isinstance(e, Exception):  # a bug, or an error deep inside a library: the line says where the traceback is
        _fail(f"{type(e).__name__}: {_first_line(e)} (traceback: {_save_traceback(e)})")
    raise e


def _save_traceback(e: BaseException) -> Path:
    import storage

    folder = storage.cache_root() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text("".join(traceback.format_exception(e)))
    return path


@app.command()
def release(recipe: Recipe = "tiny", store: Store = "file://./artifacts", set_: Sets = None,
            allow_weaker_gates: Weaker = False) -> None:
    """Run the release flow and print the bundle URL as the last line."""
    _preflight(recipe, set_ or [], store, allow_weaker_gates)
    launch_prefect_server()  # boots while the flow's modules import
    from flows.release import release as release_flow
    from tasks.cli import configure_jax

    configure_jax()

    _log_to_stderr()

    console, rows = _console_progress()
    t0 = time.perf_counter()
    url = _run(release_flow, recipe=recipe, overrides=set_ or [], store=store, allow_weaker_gates=allow_weaker_gates)
    _summary(console, rows, f"release finished in {time.perf_counter() - t0:.0f}s")
    import storage

    console.print(storage.read_bytes(storage.join(url, "eval/report.md")).decode())
    print(url)


@app.command("draft-refresh")
def draft_refresh(recipe: Recipe = "tiny", store: Store = "file://./artifacts", set_: Sets = None,
                  allow_weaker_gates: Weaker = False) -> None:
    """Retrain the draft on fresh prompts; promote it only if acceptance does not drop."""
    _preflight(recipe, set_ or [], store, allow_weaker_gates)
    from flows.draft_refresh import draft_refresh as refresh_flow
    from tasks.cli import configure_jax

    configure_jax()

    _log_to_stderr()

    console, rows = _console_progress()
    result = _run(refresh_flow, recipe=recipe, overrides=set_ or [], store=store,
                  allow_weaker_gates=allow_weaker_gates)
    _summary(console, rows, "draft refresh")
    verdict = "promoted" if result["promoted"] else "kept current"
    console.print(f"acceptance length: current {result['current']:.3f}, candidate {result['candidate']:.3f} "
                  f"-> {verdict}")
    print(result["draft"])


@app.command()
def verify(url: Annotated[str, typer.Argument(help="a bundle or any committed artifact: file://, s3://")],
           store: Annotated[str | None, typer.Option(help="the store its lineage resolves in (default: the "
                                                          "folder two levels above URL)")] = None,
           lineage: Annotated[bool, typer.Option(help="check lineage.json against the store")] = True) -> None:
    """Re-hash every file against manifest.json, resolve the lineage, check checkpoint configs and headers.
    Prints one line per missing, extra or altered file (exit 1), or one `ok:` line."""
    import storage
    from flows.verify import report

    try:
        code, lines = report(url, store=store, lineage=lineage)
    except storage.StorageKeyError as e:
        _fail(str(e), 2)
    except Exception as e:  # unreachable store, refused credentials
        _fail(f"{url}: {_first_line(e)}")
    for line in lines:
        typer.echo(line, err=code != 0)
    raise typer.Exit(code)


@app.command()
def deploy(prefect_file: Annotated[Path, typer.Option(help="deployment declarations")] = ROOT / "infra/prefect.yaml",
           recipe: Annotated[str | None, typer.Option("--recipe", "-r", help="register the stage deployments on "
                                                      "this recipe's pools (resources.<stage>.pool)")] = None,
           gpu_slots: Annotated[int | None, typer.Option(help="GPUs the GPU pool's workers have in all: the size "
                                                          "of its GPU concurrency limit")] = None) -> None:
    """Register the release, draft-refresh and stage/<kind> deployments (with the refresh's cron) on the Prefect
    server, creating the work pools they name."""
    from flows.deploy import deploy_all
    from tasks.recipe import ConfigError, load_release
    from tasks.registry import STAGES

    pools, slots = None, None
    try:
        cfg = load_release(recipe) if recipe else load_release()
    except ConfigError as e:
        _fail(str(e), 2)
    if recipe:
        pools = {kind: cfg.execution.pool(cfg.resources.of(kind)) for kind in STAGES}
    if gpu_slots is not None:
        slots = {cfg.execution.gpu_pool: gpu_slots}
    try:
        for name, dep_id in deploy_all(prefect_file, stage_pools=pools, gpu_slots=slots):
            print(f"deployed {name} ({dep_id})")
    except Exception as e:
        _fail(f"deploy: {type(e).__name__}: {_first_line(e)}")


@app.command()
def jobset(stage: Annotated[str, typer.Option(help="the stage (resources.<stage>.hosts > 1)")] = "finetune",
           recipe: Recipe = "tiny", store: Store = "s3://forgeline-artifacts/releases", set_: Sets = None) -> None:
    """Print, as YAML, the JobSet a multi-host STAGE of the recipe runs as on a Kubernetes pool (to review, or
    to check with `kubectl apply --dry-run=server -f -`)."""
    import yaml

    from flows.jobset import preview
    from tasks.recipe import ConfigError, load_release
    from tasks.registry import STAGES

    if stage not in STAGES:
        _fail(f"--stage {stage!r}: not a stage (one of {', '.join(STAGES)})", 2)
    try:
        body = preview(load_release(recipe, set_ or []), stage, store)
    except (ConfigError, ValueError) as e:
        _fail(_first_line(e), 2)
    print(yaml.safe_dump(body, sort_keys=False, width=120), end="")


@app.command("quantize-checkpoint")
def quantize_checkpoint(
    src: Annotated[str, typer.Argument(help="a safetensors checkpoint: folder or URL (s3://...)")],
    scheme: Annotated[str, typer.Option(help="int8, w4a16-rtn[-g<N>], w8a16-rtn, fp8-block, nvfp4a16, mxfp4a16")],
    out: Annotated[str, typer.Option(help="where the quantized checkpoint goes (folder or URL; must not exist)")],
    ignore: Annotated[list[str] | None, typer.Option("--ignore", help="modules left in float: HF names or "
                                                     "re:<regex> (repeatable)")] = None,
) -> None:
    """Quantize a checkpoint tensor by tensor, without building the model (round-to-nearest; memory: about one
    tensor), into compressed-tensors' layout. Published FP8 (DeepSeek) and MXFP4 (GPT-OSS) sources are read
    dequantized. Nothing is left at --out unless the whole checkpoint is written."""
    import storage
    from models.quant import parse_scheme
    from models.quant.streaming import quantize_checkpoint as run
    from tasks.stage import Interrupted, raise_if_interrupted, received

    _log_to_stderr()
    try:
        parsed = parse_scheme(scheme)
    except ValueError as e:
        _fail(f"--scheme: {e}", 2)
    for flag, url in (("SRC", src), ("--out", out)):
        try:
            storage.normalize_url(url)
        except storage.StorageKeyError as e:
            _fail(f"{flag}: {e}", 2)
    def progress(line: str) -> None:
        raise_if_interrupted()  # a signal swallowed mid-shard stops the run at the next shard
        logging.getLogger("forgeline").info(line)

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        report = run(src, out, parsed, ignore=tuple(ignore or ()), progress=progress)
    except BaseException as e:
        if received() is not None or isinstance(e, Interrupted | KeyboardInterrupt):
            signum = received() or signal.SIGINT
            _fail(f"interrupted by {signal.Signals(signum).name}: nothing was left at {out}", 128 + signum)
        _failure(e)  # one `error:` line, as for a release
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(f"{out}: {parsed.name}, {report['quantized']} weights quantized, {report['copied']} tensors copied, "
          f"{report['bytes_written'] / 2**20:.1f} MiB of safetensors in {report['seconds']:.1f}s")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "help_option_names": []}, add_help_option=False)
def plan(ctx: typer.Context) -> None:
    """Capacity planner: per-device memory of a LoRA or full fine-tune of MODEL (a preset such as deepseek-v3, or
    a config.json) on N devices, the best meshes, FLOPs and step time. Compiles the real train step on abstract
    arrays over N fake CPU devices; nothing is allocated. Exit 0: fits, 1: does not fit, 2: bad input.
    `forgeline plan --help` lists the options."""
    from tasks.training.plan import run_in_subprocess

    raise typer.Exit(run_in_subprocess(ctx.args).returncode)


@app.command()
def worker(pool: Annotated[str, typer.Option(help="the work pool to serve")] = "forgeline-gpu",
           name: Annotated[str | None, typer.Option(help="the worker's name (default: Prefect's)")] = None,
           limit: Annotated[int | None, typer.Option(help="flow runs at once (1: a one-GPU machine)")] = None,
           ) -> None:
    """Start a process worker for POOL in the foreground (Prefect's own, with forgeline's log routing)."""
    from flows.stack import beside_python

    prefect = beside_python("prefect")
    if prefect is None:
        _fail("the `prefect` command is not installed")
    if not os.environ.get("PREFECT_API_URL"):
        _fail("PREFECT_API_URL is not set: a worker serves a Prefect server (`forgeline stack up` starts one)", 2)
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "forgeline")
    cmd = [prefect, "worker", "start", "--pool", pool, "--type", "process"]
    cmd += ["--name", name] if name else []
    cmd += ["--limit", str(limit)] if limit else []
    os.execv(prefect, cmd)


stack_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="A local Prefect server (on PostgreSQL), S3 server and workers, without Docker.")
app.add_typer(stack_app, name="stack")
StackDir = Annotated[Path, typer.Option("--dir", help="where the stack keeps its data, logs and state")]


@stack_app.command("up")
def stack_up(dir: StackDir = Path(".forgeline-stack"),
             gpu_workers: Annotated[int, typer.Option(help="workers on the GPU pool (one GPU slot each)")] = 2,
             cpu_workers: Annotated[int, typer.Option(help="workers on the CPU pool")] = 1,
             port: Annotated[int, typer.Option(help="the Prefect server's port (another when taken)")] = 4200,
             pg_port: Annotated[int, typer.Option(help="PostgreSQL's port (another when taken)")] = 5433,
             zombie_after: Annotated[int, typer.Option(help="seconds without a heartbeat before a run is "
                                                            "marked Crashed")] = 600) -> None:
    """Start PostgreSQL, a Prefect server on it, SeaweedFS S3 and the workers; return once all are healthy."""
    from flows.stack import StackError, exports, up

    logging.getLogger("httpx").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    try:
        state = up(dir, gpu_workers=gpu_workers, cpu_workers=cpu_workers, prefect_port=port, pg_port=pg_port,
                   zombie_after_s=zombie_after)
    except StackError as e:
        _fail(f"stack: {_first_line(e)}")
    print(f"# forgeline stack up in {time.perf_counter() - t0:.0f}s: PostgreSQL :{state['postgres']['port']}, "
          f"Prefect UI {state['prefect']['ui_url']}, S3 {state['s3']['endpoint']} (bucket {state['s3']['bucket']}), "
          f"{len(state['workers'])} workers")
    print("\n".join(exports(state)))
    print(f"# then: forgeline release --set execution=workers --store s3://{state['s3']['bucket']}/releases")


@stack_app.command("env")
def stack_env(dir: StackDir = Path(".forgeline-stack")) -> None:
    """Print the `export` lines of the running stack (`eval "$(forgeline stack env)"`)."""
    from flows.stack import StackError, exports, load_state

    try:
        print("\n".join(exports(load_state(dir))))
    except StackError as e:
        _fail(f"stack: {_first_line(e)}")


@stack_app.command("down")
def stack_down(dir: StackDir = Path(".forgeline-stack"),
               purge: Annotated[bool, typer.Option(help="also delete the databases and stored objects")] = False,
               ) -> None:
    """Stop everything `stack up` started from DIR (the data stays for the next `up`, unless --purge)."""
    from flows.stack import StackError, down

    try:
        stopped = down(dir, purge=purge)
    except StackError as e:
        _fail(f"stack: {_first_line(e)}")
    print("stopped: " + ", ".join(stopped))


def main() -> None:
    """The `forgeline` console script: the process re-executes itself once with glibc's huge-page tunable
    (tasks/host_memory.py: XLA:CPU's per-step temporaries stop costing a page fault per 4 KiB), then runs."""
    from tasks.host_memory import reexec_tuned

    reexec_tuned()
    app()


if __name__ == "__main__":
    main()
