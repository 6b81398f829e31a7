"""`mosaicd data fetch`: download the official archives, check their published checksums, unpack them safely.

Every archive is downloaded with pooch into a temporary folder inside data_dir, its checksum is compared with
the published one (CIFAR: the md5 that the CIFAR page and torchvision give; MovieLens: the md5 that GroupLens
publishes next to the zip, `ml-latest-small.zip.md5`, downloaded from the same place), and only then is it
unpacked, still inside that temporary folder. The data set's folder is moved into place with one rename at
the end: a corrupted, truncated or hostile archive leaves nothing behind.

Where the archives come from: the official sites, or `base_url` (or the MOSAIC_DATA_URL environment variable)
for a mirror: a folder URL (http://, https:// or file://) holding the archives under their official names.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import data_path

__all__ = ["ARCHIVES", "Archive", "FetchError", "fetch", "safe_extract_tar", "safe_extract_zip"]

URL_ENV = "MOSAIC_DATA_URL"


@dataclass(frozen=True)
class Archive:
    """One data set's official archive: its name, the folder it is published in and its md5 checksum."""

    filename: str
    base_url: str
    md5: str | None  # None: the one published next to the archive, in `<filename>.md5`

    def url(self, base_url: str | None = None) -> str:
        return f"{(base_url or self.base_url).rstrip('/')}/{self.filename}"


# The CIFAR checksums are the ones on https://www.cs.toronto.edu/~kriz/cifar.html (and in torchvision).
# ml-latest-small is updated in place now and then, so its md5 is read from the file GroupLens puts beside it.
ARCHIVES: dict[str, Archive] = {
    "cifar10": Archive("cifar-10-python.tar.gz", "https://www.cs.toronto.edu/~kriz",
                       "c58f30108f718f92721af3b95e74349a"),
    "cifar100": Archive("cifar-100-python.tar.gz", "https://www.cs.toronto.edu/~kriz",
                        "eb9058c3a382ffc7106e4002c42a8d85"),
    "movielens": Archive("ml-latest-small.zip", "https://files.grouplens.org/datasets/movielens", None),
}

SHAKESPEARE_HOWTO = """\
Shakespeare (LEAF) has no single archive: build it with LEAF's scripts, then copy the result.
  git clone https://github.com/TalwalkarLab/leaf
  cd leaf/data/shakespeare
  ./preprocess.sh -s niid --sf 1.0 -k 0 -t sample -tf 0.8
  mkdir -p {root}
  cp -r data/train data/test {root}/
(If Project Gutenberg moved the text, fix the URL in leaf/data/shakespeare/get_data.sh first.)
Each node then gets whole speaking roles with --partition natural."""


class FetchError(ValueError):
    """A download failed or did not match its checksum; nothing was unpacked."""


def fetch(task: str, data_dir: Path | str, *, echo: Callable[[str], None] = print, base_url: str | None = None,
          progress: bool = True, timeout: float = 60.0) -> Path | None:
    """Download, check and unpack `task`'s official archive into data_dir; returns where the data now is.

    `base_url` (default: $MOSAIC_DATA_URL, else the official site): the folder URL the archive is read from.
    `progress`: a progress bar on stderr while downloading. Raises FetchError when the download fails or its
    md5 differs from the published one; data_dir then holds nothing new. Shakespeare prints LEAF's
    instructions instead and returns None; digits and quadratic need nothing.
    """
    task = str(task)
    data_dir = Path(data_dir)
    if task in ("digits", "quadratic"):
        echo(f"task {task}: nothing to fetch (bundled)")
        return None
    if task == "shakespeare":
        echo(SHAKESPEARE_HOWTO.format(root=data_path(task, data_dir)))
        return None
    if task not in ARCHIVES:
        raise ValueError(f"unknown task {task!r}")
    archive = ARCHIVES[task]
    base_url = base_url or os.environ.get(URL_ENV) or None
    url = archive.url(base_url)
    where = data_path(task, data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".fetch-") as tmp:
        expected = archive.md5
        if expected is None:
            md5_file = Path(tmp) / f"{archive.filename}.md5"
            _download(f"{url}.md5", md5_file, progress=False, timeout=timeout)
            expected = published_md5(md5_file)
        local = Path(tmp) / archive.filename
        echo(f"downloading {url}")
        _download(url, local, progress=progress, timeout=timeout)
        check_md5(local, expected)
        echo(f"{archive.filename}: md5 {expected} as published; unpacking into {data_dir}")
        unpacked = Path(tmp) / "unpacked"
        unpacked.mkdir()
        if archive.filename.endswith(".zip"):
            safe_extract_zip(local, unpacked)
        else:
            safe_extract_tar(local, unpacked)
        new = unpacked / where.name
        if not new.is_dir():
            raise FetchError(f"{archive.filename} holds no {where.name}/ folder; nothing was unpacked into "
                             f"{data_dir}")
        if where.exists():  # the old copy goes with the temporary folder
            os.replace(where, Path(tmp) / "previous")
        os.replace(new, where)
    echo(f"task {task}: data in {where}")
    return where


def published_md5(path: Path) -> str:
    """The md5 in a checksum file: `MD5 (name) = <hex>` (GroupLens, BSD md5) or `<hex>  name` (md5sum)."""
    found = re.findall(r"\b[0-9a-fA-F]{32}\b", path.read_text(errors="replace"))
    if len(found) != 1:
        raise FetchError(f"{path.name}: expected one md5 checksum in it, found {len(found)}")
    return found[0].lower()


def check_md5(path: Path, expected: str) -> None:
    import pooch

    actual = pooch.file_hash(str(path), alg="md5")
    if actual != expected.lower():
        raise FetchError(f"{path.name}: md5 checksum mismatch: expected {expected.lower()}, got {actual} "
                         f"({path.stat().st_size} bytes; a corrupted or incomplete download); nothing was unpacked")


def _download(url: str, dest: Path, *, progress: bool, timeout: float) -> None:
    """`url` into `dest` with pooch's HTTP downloader (file:// URLs are copied); FetchError when it fails."""
    name = url.rsplit("/", 1)[-1]
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme == "file":
        source = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
        try:
            shutil.copyfile(source, dest)
        except OSError as exc:
            raise FetchError(f"{name}: cannot read {source}: {exc}; nothing was unpacked") from None
        return
    if scheme not in ("http", "https"):
        raise FetchError(f"{url}: only http://, https:// and file:// URLs can be fetched")
    try:
        import pooch
        import requests
    except ModuleNotFoundError as exc:
        raise FetchError(f"mosaicd data fetch needs {exc.name}, which is not installed: "
                         "pip install 'mosaic-learning[learning]'") from None
    with _progress_bar(name, progress) as bar:
        downloader = pooch.HTTPDownloader(progressbar=bar if bar is not None else False, timeout=timeout)
        try:
            downloader(url, str(dest), None)
        except requests.RequestException as exc:
            raise FetchError(f"{name}: download from {url} failed ({exc}); nothing was unpacked") from None


class _Bar:
    """The progress bar pooch's downloader drives (total, update, reset, close), drawn by rich."""

    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task = progress, task

    @property
    def total(self) -> float | None:
        return self._progress.tasks[0].total

    @total.setter
    def total(self, value: float | None) -> None:
        self._progress.update(self._task, total=value or None)  # 0: the server did not say (no length)

    def update(self, n: float) -> None:
        self._progress.advance(self._task, n)

    def reset(self) -> None:
        self._progress.reset(self._task, total=self.total)

    def close(self) -> None:
        pass


@contextmanager
def _progress_bar(name: str, enabled: bool) -> Iterator[_Bar | None]:
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=False) as progress:
        yield _Bar(progress, progress.add_task(name, total=None))


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
