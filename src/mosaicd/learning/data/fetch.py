"""`mosaicd data fetch`: download and unpack the official archives (for users who are online)."""

from __future__ import annotations

import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import data_path

CIFAR_URLS = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
}
MOVIELENS_URL = "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"

SHAKESPEARE_HOWTO = """\
Shakespeare (LEAF) has no single archive: build it with LEAF's scripts, then copy the result.
  git clone https://github.com/TalwalkarLab/leaf
  cd leaf/data/shakespeare
  ./preprocess.sh -s niid --sf 1.0 -k 0 -t sample -tf 0.8
  mkdir -p {root}
  cp -r data/train data/test {root}/
(If Project Gutenberg moved the text, fix the URL in leaf/data/shakespeare/get_data.sh first.)
Each node then gets whole speaking roles with --partition natural."""


def fetch(task: str, data_dir: Path | str, *, echo: Callable[[str], None] = print,
          opener: Callable[..., Any] = urllib.request.urlopen) -> Path | None:
    """Download and unpack `task`'s official archive into data_dir; returns where the data now is.

    Needs network access (never called by the tests). Shakespeare prints LEAF's instructions instead
    and returns None; digits and quadratic need nothing.
    """
    task = str(task)
    data_dir = Path(data_dir)
    if task in ("digits", "quadratic"):
        echo(f"task {task}: nothing to fetch (bundled)")
        return None
    if task == "shakespeare":
        echo(SHAKESPEARE_HOWTO.format(root=data_path(task, data_dir)))
        return None
    if task not in ("cifar10", "cifar100", "movielens"):
        raise ValueError(f"unknown task {task!r}")
    url = MOVIELENS_URL if task == "movielens" else CIFAR_URLS[task]
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".fetch-") as tmp:
        archive = Path(tmp) / url.rsplit("/", 1)[-1]
        echo(f"downloading {url}")
        with opener(url, timeout=60) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out, length=1 << 20)
        echo(f"unpacking {archive.name} into {data_dir}")
        if archive.suffix == ".zip":
            safe_extract_zip(archive, data_dir)
        else:
            safe_extract_tar(archive, data_dir)
    where = data_path(task, data_dir)
    echo(f"task {task}: data in {where}")
    return where


def _inside(root: Path, name: str) -> Path:
    target = (root / name).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"archive member {name!r} would land outside {root}")
    return target


def safe_extract_tar(archive: Path | str, dest: Path | str) -> None:
    """Extract regular files and folders only, refusing members that leave `dest` (links, devices, ..)."""
    root = Path(dest).resolve()
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        for m in members:
            _inside(root, m.name)
            if not (m.isfile() or m.isdir()):
                raise ValueError(f"archive member {m.name!r} is not a regular file or folder")
        for m in members:
            target = _inside(root, m.name)
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            with src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)


def safe_extract_zip(archive: Path | str, dest: Path | str) -> None:
    root = Path(dest).resolve()
    with zipfile.ZipFile(archive) as z:
        infos = z.infolist()
        for info in infos:
            _inside(root, info.filename)
        for info in infos:
            target = _inside(root, info.filename)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
