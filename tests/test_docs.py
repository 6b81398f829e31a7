"""The documentation site (mkdocs.yml, docs/): it builds in strict mode (a broken link, anchor or page fails), its
reference lists every flag `mosaicd` and its subcommands take, every route of the OpenAPI documents, every metric the
daemons serve and every column a run writes; the home page reaches the own-model tutorial, the deploy guide and the
flag reference within two clicks; and the blocks a page marks `<!-- run: NAME -->` run as written, in page order, in
one fresh folder."""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from pageblocks import LAB_PAGES, ROOT, blocks

from mosaic_proto import NODE_COLUMNS
from mosaicd.cli import build_parser, subparsers
from mosaicd.outputs import ROUND_COLUMNS
from mosaicd.settings import Settings

DOCS = ROOT / "docs"
HREF = re.compile(r'href="([^"#]+)(?:#[^"]*)?"')


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def page(site: Path, name: str) -> str:
    return html.unescape((site / name).read_text())


def test_the_reference_lists_every_flag_mosaicd_and_its_subcommands_take(site: Path) -> None:
    text = page(site, "reference/cli.html")
    parser = build_parser()
    commands = {"mosaicd": parser, **{f"mosaicd {n}": p for n, p in subparsers(parser).items()}}
    missing = []
    for command, sub in commands.items():
        assert f">{command}<" in text or f">{command}</" in text, f"no section for {command}"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            names = action.option_strings or [action.metavar or action.dest]
            missing += [f"{command} {name}" for name in names if f"<code>{name}</code>" not in text]
    for name in Settings.model_fields:
        missing += [] if f"<code>MOSAIC_{name.upper()}</code>" in text else [f"MOSAIC_{name.upper()}"]
    assert not missing, f"in `mosaicd --help` but not in the reference: {missing}"


def test_the_reference_lists_every_route_of_the_openapi_documents(site: Path) -> None:
    text = page(site, "reference/rest.html")
    missing = []
    for package in ("mosaicd.daemon.node", "mosaicd.daemon.barrier"):
        document = json.loads(resources.files(package).joinpath("openapi.json").read_text())
        for path, methods in document["paths"].items():
            missing += [f"{m.upper()} {path}" for m in methods if not m.startswith("x-")  # x-mosaic-sync
                        and f"<code>{m.upper()} {path}</code>" not in text]
    assert not missing, missing


def test_the_reference_lists_every_metric_a_node_and_the_barrier_serve(site: Path) -> None:
    from mosaic_proto import NodeState
    from mosaicd.daemon.barrier.metrics import EVALUATION_GAUGES, BarrierMetrics
    from mosaicd.daemon.http.auth import Keyring
    from mosaicd.daemon.node.inbox import Inbox
    from mosaicd.daemon.node.routes import node_app
    from mosaicd.settings import DaemonOptions

    barrier = BarrierMetrics()
    barrier.evaluated({key: 0.5 for key in EVALUATION_GAUGES})
    inbox = Inbox(NodeState(), DaemonOptions(), Keyring(b"a-secret-of-the-docs-test"))
    node_app(inbox)  # what a node's app adds: its limits, its secret's check, its fragments streams
    served = {f.name for r in (inbox.metrics.registry, barrier.registry) for f in r.collect()}
    assert "mosaic_fragment_frames" in served
    text = page(site, "reference/metrics.html")
    assert served and not [n for n in served if f"<code>{n}</code>" not in text]


def test_the_output_files_page_describes_every_column_and_summary_key(site: Path, tmp_path: Path) -> None:
    run = ["simulate", "--nodes", "4", "--rounds", "2", "--fanout", "1", "--byzantine", "1", "--quiet"]
    subprocess.run([sys.executable, "-m", "mosaicd", *run, "--out", str(tmp_path / "run")], check=True, timeout=120,
                   capture_output=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    text = page(site, "reference/outputs.html")
    missing = [c for c in [*ROUND_COLUMNS, *NODE_COLUMNS, *summary] if f"<code>{c}</code>" not in text]
    assert not missing, f"written by a run but not described: {missing}"


def test_the_home_page_reaches_own_model_deploy_and_the_flags_in_two_clicks(site: Path) -> None:
    def links(name: str) -> set[str]:
        base = (site / name).parent
        return {os.path.normpath(base / href).removeprefix(str(site) + "/")
                for href in HREF.findall((site / name).read_text()) if not href.startswith(("http", "mailto"))}

    reached = links("index.html")
    reached |= {n for p in reached if p.endswith(".html") and (site / p).is_file() for n in links(p)}
    for wanted in ("own-model.html", "deploy.html", "reference/cli.html"):
        assert wanted in reached, wanted


def marked_blocks() -> list[tuple[str, str]]:
    """(page/name, text) of every marked block of the site's pages, the lab's pages apart, in nav order."""
    order = re.findall(r"(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = [DOCS / p for p in order] + sorted(set(DOCS.rglob("*.md")) - {DOCS / p for p in order})
    return [(f"{p.relative_to(DOCS)}/{name}", text) for p in pages if p not in LAB_PAGES
            for name, text in blocks(p).items()]


def test_the_pages_mark_blocks_to_run() -> None:
    names = [name for name, _ in marked_blocks()]
    assert "tutorials/quickstart.md/quickstart" in names and len(names) >= 5, names


@pytest.mark.slow
def test_the_marked_blocks_run_as_written(tmp_path: Path) -> None:
    """The blocks share one folder, as a reader who follows the pages: the quick start's run, then looking at it."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for name, text in marked_blocks():
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env={**os.environ, "MOSAIC_LOG_JSON": "false"})
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.browser
def test_a_reader_clicks_from_the_home_page_to_the_guides_and_the_flags_offline(site: Path, browser: Any) -> None:
    """The built site opened from disk (file://, no server) in headless Chromium: the home page's links reach the
    own-model tutorial, the deploy guide and the flag reference, and the offline search finds a flag.
    MOSAIC_SCREENSHOT=1 keeps pictures of the home page and the reference in runs/site-screenshots/."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def click(text: str, heading: str) -> None:
        browser.find_element(By.PARTIAL_LINK_TEXT, text).click()
        WebDriverWait(browser, 10).until(lambda b: heading in b.find_element(By.TAG_NAME, "h1").text)

    home = (site / "index.html").as_uri()
    for text, heading in (("Your own model", "Your own model"), ("Deploy on real hosts", "Deploying Mosaic"),
                          ("Command line", "Command line")):
        browser.get(home)
        click(text, heading)
    assert "--fragments" in browser.find_element(By.TAG_NAME, "article").text
    shots = ROOT / "runs" / "site-screenshots"
    if os.environ.get("SCREENSHOT_SITE") == "1":
        shots.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(shots / "reference-cli.png"))
    browser.get(home)
    query = browser.find_element(By.CSS_SELECTOR, "input[data-md-component='search-query']")
    query.click()
    query.send_keys("round-deadline")
    WebDriverWait(browser, 10).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
    if os.environ.get("SCREENSHOT_SITE") == "1":
        browser.get(home)
        browser.save_screenshot(str(shots / "home.png"))
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
