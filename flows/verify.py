"""`forgeline verify URL`: is this bundle (or any committed artifact) exactly what its manifest says?

    forgeline verify s3://bucket/releases/export/<fingerprint>
    forgeline verify file:///data/bundle --no-lineage        # a bundle copied out of its store

1. the manifest parses and every file key in it stays inside the artifact;
2. every file listed is there with its sha256 and size, and no file is there that is not listed
   (`Store.audit`): one line per missing, extra or altered file;
3. every `lineage.json` entry names a committed artifact of the same digest in the bundle's store (the
   folder two levels above the artifact, or `--store`), when that store is reachable;
4. every checkpoint folder (`model/`, `quantized/<scheme>/`) has a config.json that names a supported
   architecture and parses, and every safetensors file's header is valid and fits the file (read with a
   ranged read; the tensors themselves are covered by the sha256 check).

It then prints the waivers `lineage.json` records, one `waiver:` line each: every gate the release was held to
below forgeline's default (by its recipe, with the recipe's reason) or below its recipe (by `--set`).

No Prefect here: verification runs anywhere the store is readable.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import storage
from storage import ArtifactError, Store


def store_root_of(url: str) -> str:
    """`<root>/<kind>/<fingerprint>` -> `<root>`."""
    url = storage.normalize_url(url)
    scheme, path = url.split("://", 1)
    return f"{scheme}://{posixpath.dirname(posixpath.dirname(path.rstrip('/')))}"


def verify(url: str, *, store: str | None = None, lineage: bool = True) -> tuple[list[str], dict[str, Any]]:
    """(problems, summary): one line per problem found (empty when the artifact is intact)."""
    url = storage.normalize_url(url)
    st = Store(store or store_root_of(url))
    try:
        ref = st.load(url)
        bad = st.audit(ref)
        manifest = st.manifest(ref)
    except ArtifactError as e:
        return [f"manifest: {e}"], {}
    problems = [str(p) for p in bad]
    files = {**manifest.get("files", {}), **manifest.get("volatile", {})}
    intact = set(files) - {p.rel for p in bad}
    summary: dict[str, Any] = {"kind": ref.kind, "files": len(files), "digest": ref.digest, "lineage": 0,
                               "checkpoints": 0, "waivers": []}
    if "lineage.json" in intact:
        try:
            body = json.loads(storage.read_bytes(ref.file("lineage.json")))
            summary["waivers"] = [w for w in body.get("waivers", []) if isinstance(w, dict)]
        except (ValueError, AttributeError, TypeError):
            pass  # unreadable: _lineage says so when it checks the lineage
    if lineage and "lineage.json" in intact:
        lines, summary["lineage"] = _lineage(st, ref)
        problems += lines
    for folder in sorted({posixpath.dirname(rel) for rel in intact if rel.endswith("config.json")}):
        if folder == "model" or folder.startswith("quantized/"):
            problems += _checkpoint(ref, folder, sorted(r for r in intact if posixpath.dirname(r) == folder))
            summary["checkpoints"] += 1
    return problems, summary


def _lineage(st: Store, ref) -> tuple[list[str], int]:
    try:
        body = json.loads(storage.read_bytes(ref.file("lineage.json")))
        stages = body["stages"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"lineage: {ref.file('lineage.json')}: unreadable ({type(e).__name__})"], 0
    try:
        storage.list_files(st.root)
    except FileNotFoundError:
        return [], 0  # the bundle travels without its store (pass --store to check against one)
    except Exception as e:
        return [f"lineage: store {st.root} is unreachable ({storage.fs._first_line(e)})"], 0
    problems = []
    for name, entry in stages.items():
        key = entry.get("key", "")
        try:
            found = st.load(st.url(key), missing_ok=True)
        except (ArtifactError, storage.StorageKeyError) as e:
            problems.append(f"lineage: {name}: {e}")
            continue
        if found is None:
            problems.append(f"lineage: {name}: no committed artifact at {st.url(key)}")
        elif found.digest != entry.get("digest"):
            problems.append(f"lineage: {name}: {found.url} has digest {found.digest[:16]}, lineage.json says "
                            f"{str(entry.get('digest'))[:16]}")
    return problems, len(stages)


def _checkpoint(ref, folder: str, files: list[str]) -> list[str]:
    from models import families
    from models.hf import read_safetensors_header

    problems = []
    config_url = ref.file(f"{folder}/config.json")
    try:
        raw = json.loads(storage.read_bytes(config_url))
        config_cls, _ = families.resolve(raw, config_url)
        config_cls.from_hf(raw)
    except (ValueError, TypeError, KeyError, NotImplementedError) as e:
        problems.append(f"checkpoint: {config_url}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    for rel in files:
        if rel.endswith(".safetensors"):
            url = ref.file(rel)
            try:
                with storage.open_url(url, "rb") as f:
                    size = f.seek(0, 2)
                    f.seek(0)
                    read_safetensors_header(url, f, size)
            except ValueError as e:
                problems.append(f"checkpoint: {str(e).splitlines()[0]}")
    return problems


def waiver_line(w: dict[str, Any]) -> str:
    """`waiver: evaluate.gates.finetune_improves true -> false (tiny-dpo.yaml: DPO does not aim at ...)`; a
    lineage written before waivers named their source and reason says `declared` / `effective`."""
    def shown(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    was, now = w.get("from", w.get("declared")), w.get("to", w.get("effective"))
    source = w.get("source", "--set")
    why = " ".join(str(w["reason"]).split()) if w.get("reason") else "no reason: loosened on the command line"
    return f"waiver: {w.get('gate')} {shown(was)} -> {shown(now)} ({source}: {why})"


def report(url: str, **kwargs: Any) -> tuple[int, list[str]]:
    """(exit code, lines to print) for the command line: the problems and an `error:` line, or an `ok:` line;
    then (before the `error:` line) one `waiver:` line per waiver the bundle's lineage records."""
    problems, s = verify(url, **kwargs)
    waivers = [waiver_line(w) for w in s.get("waivers", [])]
    if problems:
        return 1, problems + waivers + [f"error: {storage.normalize_url(url)}: {len(problems)} problem(s) found"]
    return 0, [f"ok: {storage.normalize_url(url)}: {s['kind']} artifact, {s['files']} files match their sha256, "
               f"{s['lineage']} lineage entries resolve, {s['checkpoints']} checkpoint(s) load; digest {s['digest']}",
               *waivers]
