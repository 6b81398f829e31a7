"""CIFAR-10/100 from the python-pickle archives.

CIFAR images are converted once into raw uint8 files in a `mosaic-cache` folder next to the pickles and
read from there row by row (`RowFile`, plain pread): the pixels stay in the kernel's page cache, shared
by every process on the host, instead of in each process (a memory map would not do: with large page-cache
folios one touched row maps megabytes into the process). Where that folder cannot be written, the
arrays are kept in memory (about 180 MB for CIFAR).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from mosaicd.files import replacing, write_whole

from .common import Split, data_path, missing

_CACHE_VERSION = 1


class RowFile:
    """A read-only array of fixed-size rows in a raw file, read on demand with pread.

    Indexing with an int, a slice or an integer array returns a fresh numpy array; nothing of the file
    is kept in the process. `np.asarray(rows)` reads everything.
    """

    def __init__(self, path: Path | str, shape: tuple[int, ...], dtype: Any = np.uint8) -> None:
        self.path = Path(path)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"RowFile({str(self.path)!r}, shape={self.shape}, dtype={self.dtype})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, key: Any) -> np.ndarray:
        n = self.shape[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._read_run(start, max(stop - start, 0))
            key = np.arange(start, stop, step)
        scalar = np.ndim(key) == 0
        idx = np.atleast_1d(np.asarray(key))
        if idx.dtype.kind not in "iu":
            raise IndexError(f"RowFile rows are selected by int, slice or integer array, got {idx.dtype}")
        idx = np.where(idx < 0, idx + n, idx).astype(np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"row index out of range for {n} rows")
        out = np.empty((len(idx),) + self.shape[1:], dtype=self.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        rb = self.row_bytes
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for k, i in enumerate(idx.tolist()):
                self._pread(fd, view[k * rb:(k + 1) * rb], i * rb)
        finally:
            os.close(fd)
        return out[0] if scalar else out

    def _read_run(self, start: int, count: int) -> np.ndarray:
        out = np.empty((count,) + self.shape[1:], dtype=self.dtype)
        if count:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                self._pread(fd, memoryview(out.reshape(-1).view(np.uint8)), start * self.row_bytes)
            finally:
                os.close(fd)
        return out

    def _pread(self, fd: int, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            got = os.preadv(fd, [buf[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.path}: short read at byte {offset + done}")
            done += got


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles CIFAR batches: plain containers and numpy arrays only, nothing executable."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR pickle")
        if module == "numpy.core.multiarray":
            module = "numpy._core.multiarray" if hasattr(np, "_core") else module
        return super().find_class(module, name)


def _read_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        batch = _ArrayUnpickler(f, encoding="bytes").load()
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ValueError(f"{path}: not a CIFAR batch (data {data.shape}, {len(labels)} labels)")
    return data, labels


def _cifar_sources(task: str, root: Path) -> tuple[list[Path], list[Path], bytes]:
    if task == "cifar10":
        train = [root / f"data_batch_{i}" for i in range(1, 6)]
        test = [root / "test_batch"]
        return train, test, b"labels"
    return [root / "train"], [root / "test"], b"fine_labels"


def load_cifar(data_dir: Path | str, classes: int = 10) -> Split:
    """CIFAR-10 (classes=10) or CIFAR-100 (fine labels): uint8 (N, 3, 32, 32) images, int64 labels."""
    task = "cifar10" if classes == 10 else "cifar100"
    root = data_path(task, data_dir)
    train_files, test_files, key = _cifar_sources(task, root)
    absent = [p.name for p in train_files + test_files if not p.is_file()]
    if absent:
        raise missing(task, root, "missing " + ", ".join(absent))
    stamp = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in train_files + test_files}
    for cache in cache_dirs(root):
        try:
            arrays = _open_cache(cache, stamp)
            if arrays is None:
                _write_cache(cache, stamp, {"train": train_files, "test": test_files}, key)
                arrays = _open_cache(cache, stamp)
        except OSError:
            continue
        if arrays is not None:
            break
    else:
        arrays = {}
        for part, files in (("train", train_files), ("test", test_files)):
            arrays[f"{part}_x"], arrays[f"{part}_y"] = _read_batches(files, key)
    return Split(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"],
                 info={"classes": classes})


def cache_dirs(root: Path) -> list[Path]:
    """Where CIFAR's converted cache may live: next to the pickles, else in the temp folder."""
    tag = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return [root / "mosaic-cache", Path(tempfile.gettempdir()) / f"mosaicd-cache-{os.getuid()}" / tag]


def _read_batches(files: list[Path], key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """All batches in one array without holding two copies (pages of np.empty fill as they are written)."""
    batches = [_read_batch(p, key) for p in files]
    labels = np.concatenate([b[1] for b in batches])
    images = np.empty((len(labels), 3, 32, 32), dtype=np.uint8)
    pos = 0
    for k in range(len(batches)):
        data = batches[k][0]
        images[pos:pos + len(data)] = data.reshape(-1, 3, 32, 32)
        pos += len(data)
        batches[k] = (np.zeros((0, 3072), np.uint8), batches[k][1])
        del data
    return images, labels


def _open_cache(cache: Path, stamp: dict) -> dict[str, np.ndarray] | None:
    manifest = cache / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        meta = json.loads(manifest.read_text())
    except ValueError:
        return None
    if meta.get("version") != _CACHE_VERSION or meta.get("sources") != stamp:
        return None
    out: dict[str, np.ndarray] = {}
    for part in ("train", "test"):
        count = int(meta["counts"][part])
        raw = cache / f"{part}_x.u8"
        if raw.stat().st_size != count * 3072:
            return None
        out[f"{part}_x"] = RowFile(raw, (count, 3, 32, 32), np.uint8)
        out[f"{part}_y"] = np.load(cache / f"{part}_y.npy")
    return out


def _write_cache(cache: Path, stamp: dict, files: dict[str, list[Path]], key: bytes) -> None:
    """Streams the pickles' pixels into raw files, one batch in memory at a time."""
    cache.mkdir(parents=True, exist_ok=True)
    counts = {}
    for part, paths in files.items():
        labels = []
        with replacing(cache / f"{part}_x.u8") as out:
            for p in paths:
                data, y = _read_batch(p, key)
                out.write(memoryview(np.ascontiguousarray(data)).cast("B"))
                labels.append(y)
                del data
        y_all = np.concatenate(labels)
        with replacing(cache / f"{part}_y.npy") as out:
            np.save(out, y_all)
        counts[part] = len(y_all)
    write_whole(cache / "manifest.json", json.dumps({"version": _CACHE_VERSION, "sources": stamp, "counts": counts}))
