"""The runnable shell blocks of a page: a ```sh block right after a line `<!-- run: NAME -->` is run as written,
by the hosts lab (docs/deploy.md, deploy/slurm/README.md) or by tests/test_docs.py (every other page of the site);
other blocks explain (ssh, the internet, sizes the lab has not). `block(page, name, **names)` gives one block's
text, with the page's placeholders (host names, paths) replaced by the lab's: only those, so the page cannot drift
from what works."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOY_PAGE = ROOT / "docs" / "deploy.md"
SLURM_PAGE = ROOT / "deploy" / "slurm" / "README.md"
LAB_PAGES = (DEPLOY_PAGE, SLURM_PAGE)
MARKED = re.compile(r"^<!-- run: ([\w-]+) -->\n```sh\n(.*?)^```$", re.M | re.S)


def blocks(page: Path) -> dict[str, str]:
    """name -> the block's text, for every marked block of `page` (names are unique)."""
    found: dict[str, str] = {}
    for name, text in MARKED.findall(page.read_text()):
        assert name not in found, f"{page}: two blocks marked {name}"
        found[name] = text
    return found


def block(page: Path, name: str, **names: str) -> str:
    """The block `name` of `page`, each placeholder KEY replaced by names[KEY] (every one must occur)."""
    text = blocks(page)[name]
    for placeholder, value in names.items():
        assert placeholder in text, f"{page}, block {name}: no {placeholder} to substitute"
        text = text.replace(placeholder, value)
    return text
