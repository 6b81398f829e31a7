"""`mosaicd data fetch` against a loopback HTTP server: checksums checked, nothing half-unpacked."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mosaicd.cli import main
from mosaicd.learning.data import FetchError, fetch, load_cifar, load_movielens, write_synthetic

fetch_module = importlib.import_module("mosaicd.learning.data.fetch")  # the package's `fetch` is the function


class Mirror:
    """Files served by path on 127.0.0.1; `short[path] = n`: announce the whole length, send n bytes, hang up."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.short: dict[str, int] = {}
        self.asked: list[str] = []
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                mirror.asked.append(self.path)
                body = mirror.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:mirror.short.get(self.path, len(body))])
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/data"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Mirror:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def mirror(monkeypatch: pytest.MonkeyPatch) -> Iterator[Mirror]:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # a proxy configured in the environment must not see loopback
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    with Mirror() as m:
        yield m


def cifar10_archive(tmp_path: Path) -> bytes:
    """A small CIFAR-10 archive in the official layout (cifar-10-batches-py/...)."""
    root = write_synthetic("cifar10", tmp_path / "made", train=20, test=5)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(root, arcname=root.name)
    return buf.getvalue()


def register(monkeypatch: pytest.MonkeyPatch, task: str, payload: bytes | None) -> str | None:
    """Make `payload`'s md5 the published checksum of `task`'s archive (None: read from the .md5 file)."""
    md5 = hashlib.md5(payload).hexdigest() if payload is not None else None
    monkeypatch.setitem(fetch_module.ARCHIVES, task, dataclasses.replace(fetch_module.ARCHIVES[task], md5=md5))
    return md5


def leftovers(data_dir: Path) -> list[str]:
    return sorted(p.name for p in data_dir.iterdir()) if data_dir.exists() else []


def test_the_published_checksums() -> None:
    assert fetch_module.ARCHIVES["cifar10"].md5 == "c58f30108f718f92721af3b95e74349a"
    assert fetch_module.ARCHIVES["cifar100"].md5 == "eb9058c3a382ffc7106e4002c42a8d85"
    assert fetch_module.ARCHIVES["cifar10"].url() == "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    movielens = fetch_module.ARCHIVES["movielens"]
    assert movielens.md5 is None  # read from ml-latest-small.zip.md5, published next to it
    assert movielens.url() == "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"


def test_a_good_archive_is_checked_unpacked_and_loads(tmp_path: Path, mirror: Mirror,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    payload = cifar10_archive(tmp_path)
    md5 = register(monkeypatch, "cifar10", payload)
    mirror.files["/data/cifar-10-python.tar.gz"] = payload
    data_dir = tmp_path / "data"
    lines: list[str] = []
    where = fetch("cifar10", data_dir, echo=lines.append, base_url=mirror.url, progress=False)
    assert where == data_dir / "cifar-10-batches-py"
    assert leftovers(data_dir) == ["cifar-10-batches-py"]  # the download and the unpacking folder are gone
    assert any(md5 in line for line in lines)
    split = load_cifar(data_dir, 10)
    assert split.x_train.shape == (20, 3, 32, 32) and split.x_test.shape == (5, 3, 32, 32)

    # fetched again: the new copy replaces the old one whole
    (where / "stale").write_text("x")
    assert fetch("cifar10", data_dir, echo=lines.append, base_url=mirror.url, progress=True) == where
    assert not (where / "stale").exists() and leftovers(data_dir) == ["cifar-10-batches-py"]


def test_a_corrupted_archive_is_refused_and_nothing_unpacked(tmp_path: Path, mirror: Mirror,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    payload = cifar10_archive(tmp_path)
    md5 = register(monkeypatch, "cifar10", payload)
    corrupted = bytearray(payload)
    for i in range(100, 110):
        corrupted[i] ^= 0xFF
    mirror.files["/data/cifar-10-python.tar.gz"] = bytes(corrupted)
    data_dir = tmp_path / "data"
    with pytest.raises(FetchError) as refused:
        fetch("cifar10", data_dir, echo=lambda _: None, base_url=mirror.url, progress=False)
    text = str(refused.value)
    assert "cifar-10-python.tar.gz" in text and f"expected {md5}" in text
    assert f"got {hashlib.md5(corrupted).hexdigest()}" in text and "nothing was unpacked" in text
    assert leftovers(data_dir) == []


def test_a_truncated_archive_is_refused(tmp_path: Path, mirror: Mirror, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = cifar10_archive(tmp_path)
    md5 = register(monkeypatch, "cifar10", payload)
    half = payload[: len(payload) // 2]
    data_dir = tmp_path / "data"

    # a partial file on the mirror (served whole): its checksum gives it away
    mirror.files["/data/cifar-10-python.tar.gz"] = half
    with pytest.raises(FetchError, match=f"expected {md5}, got {hashlib.md5(half).hexdigest()}"):
        fetch("cifar10", data_dir, echo=lambda _: None, base_url=mirror.url, progress=False)
    assert leftovers(data_dir) == []

    # the connection closes before the announced length: the download itself fails
    mirror.files["/data/cifar-10-python.tar.gz"] = payload
    mirror.short["/data/cifar-10-python.tar.gz"] = len(payload) // 2
    with pytest.raises(FetchError, match="cifar-10-python.tar.gz") as refused:
        fetch("cifar10", data_dir, echo=lambda _: None, base_url=mirror.url, progress=False)
    assert "nothing was unpacked" in str(refused.value)
    assert leftovers(data_dir) == []


def test_an_archive_without_the_data_set_folder_is_refused(tmp_path: Path, mirror: Mirror,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("something-else/readme.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    register(monkeypatch, "cifar100", buf.getvalue())
    mirror.files["/data/cifar-100-python.tar.gz"] = buf.getvalue()
    with pytest.raises(FetchError, match="no cifar-100-python/ folder"):
        fetch("cifar100", tmp_path / "data", echo=lambda _: None, base_url=mirror.url, progress=False)
    assert leftovers(tmp_path / "data") == []


def movielens_zip(tmp_path: Path) -> bytes:
    root = write_synthetic("movielens", tmp_path / "made", train=40, test=10, users=4)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.write(root / "ratings.csv", f"{root.name}/ratings.csv")
    return buf.getvalue()


def test_movielens_is_checked_against_the_md5_published_next_to_it(tmp_path: Path, mirror: Mirror,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    payload = movielens_zip(tmp_path)
    md5 = hashlib.md5(payload).hexdigest()
    mirror.files["/data/ml-latest-small.zip"] = payload
    mirror.files["/data/ml-latest-small.zip.md5"] = f"MD5 (ml-latest-small.zip) = {md5}\n".encode()
    monkeypatch.setenv("MOSAIC_DATA_URL", mirror.url)  # the mirror, from the environment
    data_dir = tmp_path / "data"
    where = fetch("movielens", data_dir, echo=lambda _: None, progress=False)
    assert where == data_dir / "ml-latest-small" and leftovers(data_dir) == ["ml-latest-small"]
    assert mirror.asked == ["/data/ml-latest-small.zip.md5", "/data/ml-latest-small.zip"]
    assert load_movielens(data_dir, 0).info["users"] == 4

    other = tmp_path / "other"
    mirror.files["/data/ml-latest-small.zip.md5"] = f"MD5 (ml-latest-small.zip) = {'0' * 32}\n".encode()
    with pytest.raises(FetchError, match=f"ml-latest-small.zip: md5 checksum mismatch: expected {'0' * 32}, "
                                         f"got {md5}"):
        fetch("movielens", other, echo=lambda _: None, progress=False)
    assert leftovers(other) == []

    del mirror.files["/data/ml-latest-small.zip.md5"]  # no published checksum: no download is trusted
    with pytest.raises(FetchError, match="ml-latest-small.zip.md5.*404"):
        fetch("movielens", other, echo=lambda _: None, progress=False)
    assert leftovers(other) == []


def test_a_file_url_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = cifar10_archive(tmp_path)
    register(monkeypatch, "cifar10", payload)
    folder = tmp_path / "mirror"
    folder.mkdir()
    (folder / "cifar-10-python.tar.gz").write_bytes(payload)
    where = fetch("cifar10", tmp_path / "data", echo=lambda _: None, base_url=folder.as_uri(), progress=False)
    assert load_cifar(where.parent, 10).x_test.shape == (5, 3, 32, 32)


def test_fetch_shakespeare_prints_leaf_instructions(tmp_path: Path) -> None:
    lines: list[str] = []
    assert fetch("shakespeare", tmp_path, echo=lines.append) is None
    assert "preprocess.sh" in lines[0] and str(tmp_path / "shakespeare") in lines[0]
    assert fetch("digits", tmp_path, echo=lines.append) is None


def test_the_command_names_the_mismatch_in_one_line(tmp_path: Path, mirror: Mirror, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    payload = cifar10_archive(tmp_path)
    register(monkeypatch, "cifar10", b"something else")
    mirror.files["/data/cifar-10-python.tar.gz"] = payload
    with pytest.raises(SystemExit) as done:
        main(["data", "fetch", "cifar10", "--data-dir", str(tmp_path / "data"), "--url", mirror.url])
    assert done.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mosaicd data: error: cifar-10-python.tar.gz: md5 checksum mismatch")
    assert leftovers(tmp_path / "data") == []
