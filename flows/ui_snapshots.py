"""Screenshots of a release in the Prefect UI, checked for what they must show (headless Chromium).

    python -m flows.ui_snapshots --out DIR [--chromium PATH]      # PREFECT_API_URL: the stack's server

Finds the newest completed `release` run on the server, its stage runs and its eval report artifact, then
loads three pages in headless Chromium: the runs list, the release run (its child runs, one per stage) and
the eval report artifact. For each it saves a screenshot (`DIR/<page>.png`) and the rendered page text
(`DIR/<page>.txt`, from `--dump-dom`), and checks that the text names what the page is for: the stage runs'
names on the runs list and the release page, the report's numbers on the artifact page. A page that does not
show them is an `error:` line and exit 1. The UI is a single-page app: without `--virtual-time-budget` it
screenshots an empty shell, so every load gets a budget of virtual time to render in.

Chromium is not a Python package: install it with the system's package manager (Debian: `apt-get install -y
chromium`). Not part of the test suite, which runs where no browser is installed; the same facts are checked
through the API by tests/integration/test_workers.py.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                  "--window-size=1600,1100", "--virtual-time-budget=20000"]


def _chromium(explicit: str | None) -> str:
    for name in ([explicit] if explicit else ["chromium", "chromium-browser", "google-chrome"]):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise SystemExit("error: Chromium not found (install it, e.g. `apt-get install -y chromium`, or pass --chromium)")


def _text(dom: str) -> str:
    """The visible text of a rendered page, whitespace collapsed."""
    dom = re.sub(r"(?is)<(script|style)\b.*?</\1>", " ", dom)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"(?s)<[^>]+>", " ", dom))).strip()


def _load(chromium: str, url: str, png: Path) -> str:
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--screenshot={png}", url], capture_output=True, timeout=120,
                   check=False)
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, check=False).stdout
    return _text(dom)


def _release(client) -> tuple[Any, list[Any], Any]:
    """The newest completed release run, its stage runs (child runs) and its eval report artifact."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["release"])),
                                 flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                                     type=FlowRunFilterStateType(any_=[StateType.COMPLETED]))),
                                 sort=FlowRunSort.START_TIME_DESC, limit=1)
    if not runs:
        raise SystemExit("error: no completed `release` run on the server")
    release = runs[0]
    stages = [r for r in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["stage"])),
                                               limit=200)
              if r.parent_task_run_id and client.read_task_run(r.parent_task_run_id).flow_run_id == release.id]
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[release.id])))
    reports = [a for a in artifacts if a.type == "markdown" and (a.key or "").endswith("-eval")]
    if not reports:
        raise SystemExit(f"error: release run {release.name} has no eval report artifact")
    return release, stages, reports[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the screenshots and page texts")
    p.add_argument("--chromium", help="the Chromium binary (default: chromium on PATH)")
    a = p.parse_args(argv)
    api = os.environ.get("PREFECT_API_URL")
    if not api:
        raise SystemExit("error: PREFECT_API_URL is not set (`eval \"$(forgeline stack env)\"`)")
    ui = os.environ.get("PREFECT_UI_URL") or api.removesuffix("/api")
    chromium = _chromium(a.chromium)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        release, stages, report = _release(client)
    names = sorted({r.name for r in stages})
    numbers = re.findall(r"\| (?:finetuned|base) \| ([0-9.]+) \|", report.data)  # the perplexity rows
    pages = {
        "runs": (f"{ui}/runs", [release.name, *names]),
        "release-run": (f"{ui}/runs/flow-run/{release.id}", [release.name, *names]),
        "eval-report": (f"{ui}/artifacts/artifact/{report.id}", ["Gates", *numbers]),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"release": release.name, "stages": names, "pages": {}}
    failures = []
    for page, (url, expected) in pages.items():
        text = _load(chromium, url, a.out / f"{page}.png")
        (a.out / f"{page}.txt").write_text(text)
        missing = [s for s in expected if s not in text]
        summary["pages"][page] = {"url": url, "expected": expected, "missing": missing,
                                  "png_bytes": (a.out / f"{page}.png").stat().st_size
                                  if (a.out / f"{page}.png").exists() else 0}
        if missing:
            failures.append(f"{page} ({url}) does not show {missing}")
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if failures:
        print("error: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
