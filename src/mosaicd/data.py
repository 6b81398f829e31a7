"""Data sets in their standard on-disk formats, read from --data-dir; `fetch` downloads them.

Layout under data_dir (what the official archives unpack to):

- cifar10: cifar-10-batches-py/{data_batch_1..5,test_batch} (python pickles: b"data", b"labels")
- cifar100: cifar-100-python/{train,test} (python pickles: b"data", b"fine_labels")
- movielens: ml-latest-small/ratings.csv (userId,movieId,rating,timestamp)
- shakespeare: shakespeare/{train,test}/*.json (LEAF: users, num_samples, user_data{x, y})
- digits: bundled with scikit-learn, nothing on disk.

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
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .partition import DataStream, data_rng
from .tasks.base import DataMissing

__all__ = [
    "LEAF_LETTERS", "RowFile", "Split", "data_path", "fetch", "load_cifar", "load_digits", "load_movielens",
    "load_shakespeare", "missing",
]

# LEAF's 80-character vocabulary (models/utils/language_utils.py); other characters map to index 0.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"

CIFAR_URLS = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
}
MOVIELENS_URL = "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"
_DIRS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python", "movielens": "ml-latest-small",
         "shakespeare": "shakespeare"}
_CACHE_VERSION = 1


@dataclass(frozen=True, eq=False)
class Split:
    """A data set's training and test arrays (numpy; possibly read-only memory maps)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    clients: np.ndarray | None = None  # client id of every training sample (natural partition)
    info: dict[str, Any] = field(default_factory=dict)


def data_path(task: str, data_dir: Path | str) -> Path:
    """Where `task`'s files are expected under data_dir."""
    return Path(data_dir) / _DIRS[str(task)]


def missing(task: str, path: Path, what: str = "") -> DataMissing:
    detail = f" ({what})" if what else ""
    return DataMissing(f"task {task}: data set not found at {path}{detail}; run `mosaicd data fetch {task}` "
                       f"(with --data-dir {Path(path).parent} if not the default) or put the files there")


# ---------------------------------------------------------------------------------------------- digits


def load_digits(seed: int, test_fraction: float = 0.2) -> Split:
    """scikit-learn's bundled 8x8 digits: float32 (N, 1, 8, 8) standardised images, int64 labels.

    The train/test split is a seeded permutation (359 test images of 1797).
    """
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = np.asarray(bunch.data, dtype=np.float32).reshape(-1, 1, 8, 8) / 16.0
    y = np.asarray(bunch.target, dtype=np.int64)
    perm = data_rng(seed, DataStream.DIGITS_SPLIT).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    mean, std = float(x[train].mean()), float(x[train].std())
    x = ((x - mean) / std).astype(np.float32)
    return Split(x[train], y[train], x[test], y[test], info={"classes": 10})


# ----------------------------------------------------------------------------------------------- CIFAR


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
        tmp = cache / f"{part}_x.u8.tmp"
        with open(tmp, "wb") as out:
            for p in paths:
                data, y = _read_batch(p, key)
                out.write(memoryview(np.ascontiguousarray(data)).cast("B"))
                labels.append(y)
                del data
        os.replace(tmp, cache / f"{part}_x.u8")
        y_all = np.concatenate(labels)
        with open(cache / f"{part}_y.npy.tmp", "wb") as out:
            np.save(out, y_all)
        os.replace(cache / f"{part}_y.npy.tmp", cache / f"{part}_y.npy")
        counts[part] = len(y_all)
    tmp = cache / "manifest.json.tmp"
    tmp.write_text(json.dumps({"version": _CACHE_VERSION, "sources": stamp, "counts": counts}))
    os.replace(tmp, cache / "manifest.json")


# ------------------------------------------------------------------------------------------- MovieLens


def load_movielens(data_dir: Path | str, seed: int, test_fraction: float = 0.2) -> Split:
    """ml-latest-small ratings: x = (N, 2) int64 [user index, item index], y = float32 rating.

    Users and items are numbered densely over the whole file. Every user's ratings are split with the
    seed: floor(test_fraction * count) of them go to the test set (a user with one rating keeps it for
    training). clients = the user index of every training rating (the natural partition).
    """
    root = data_path("movielens", data_dir)
    path = root / "ratings.csv"
    if not path.is_file():
        raise missing("movielens", root, "no ratings.csv")
    with open(path, encoding="utf-8") as f:
        header = f.readline().strip().split(",")
        if header[:3] != ["userId", "movieId", "rating"]:
            raise ValueError(f"{path}: expected a userId,movieId,rating,... header, got {header}")
        table = np.loadtxt(f, delimiter=",", usecols=(0, 1, 2), dtype=np.float64, ndmin=2)
    if len(table) == 0:
        raise ValueError(f"{path}: no ratings")
    user_ids, users = np.unique(table[:, 0].astype(np.int64), return_inverse=True)
    item_ids, items = np.unique(table[:, 1].astype(np.int64), return_inverse=True)
    users, items = users.reshape(-1), items.reshape(-1)
    ratings = table[:, 2].astype(np.float32)
    keys = data_rng(seed, DataStream.MOVIELENS_SPLIT).random(len(ratings))
    order = np.lexsort((keys, users))  # by user, then by the random key
    counts = np.bincount(users, minlength=len(user_ids))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(len(ratings), dtype=np.int64)
    rank[order] = np.arange(len(ratings)) - starts[users[order]]
    test = rank < np.floor(counts * test_fraction).astype(np.int64)[users]
    x = np.stack([users, items], axis=1).astype(np.int64)
    return Split(x[~test], ratings[~test], x[test], ratings[test], clients=users[~test],
                 info={"users": len(user_ids), "items": len(item_ids), "mean": float(ratings[~test].mean())})


# ----------------------------------------------------------------------------------------- Shakespeare

_CODE = np.zeros(128, dtype=np.uint8)
for _i, _c in enumerate(LEAF_LETTERS):
    _CODE[ord(_c)] = _i


def encode_chars(strings: list[str]) -> np.ndarray:
    """(N, L) uint8 LEAF vocabulary indices of N strings of equal length L (unknown characters: 0)."""
    if not strings:
        return np.zeros((0, 0), dtype=np.uint8)
    length = len(strings[0])
    if any(len(s) != length for s in strings):
        raise ValueError("LEAF samples must all have the same length")
    codes = np.array(strings, dtype=f"<U{max(length, 1)}").view(np.uint32).reshape(len(strings), -1)[:, :length]
    return np.where(codes < 128, _CODE[np.minimum(codes, 127)], 0).astype(np.uint8)


def _read_leaf(folder: Path) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    files = sorted(folder.glob("*.json"))
    if not files:
        raise missing("shakespeare", folder.parent, f"no *.json in {folder.name}/")
    users, xs, ys = [], [], []
    for path in files:
        with open(path, encoding="utf-8") as f:
            blob = json.load(f)
        for user in blob["users"]:
            record = blob["user_data"][user]
            if not record["y"]:
                continue
            users.append(user)
            xs.append(encode_chars(record["x"]))
            ys.append(encode_chars([c[:1] or " " for c in record["y"]])[:, 0])
    return users, xs, ys


def load_shakespeare(data_dir: Path | str) -> Split:
    """LEAF Shakespeare: x = (N, 80) uint8 character indices, y = int64 next character, clients = role."""
    root = data_path("shakespeare", data_dir)
    for sub in ("train", "test"):
        if not (root / sub).is_dir():
            raise missing("shakespeare", root, f"no {sub}/ folder")
    train_users, train_x, train_y = _read_leaf(root / "train")
    _, test_x, test_y = _read_leaf(root / "test")
    if not train_x or not test_x:
        raise ValueError(f"{root}: no samples in train/ or test/")
    lengths = {x.shape[1] for x in train_x + test_x}
    if len(lengths) != 1:
        raise ValueError(f"{root}: samples of different lengths {sorted(lengths)}")
    clients = np.repeat(np.arange(len(train_users), dtype=np.int64), [len(y) for y in train_y])
    return Split(np.concatenate(train_x), np.concatenate(train_y).astype(np.int64), np.concatenate(test_x),
                 np.concatenate(test_y).astype(np.int64), clients=clients,
                 info={"classes": len(LEAF_LETTERS), "users": train_users})


# --------------------------------------------------------------------------------------------- fetching

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


# ------------------------------------------------------------------------------------- synthetic files


def write_synthetic(task: str, data_dir: Path | str, *, train: int = 50, test: int = 20, seed: int = 0,
                    users: int = 6) -> Path:
    """Write a small random data set for `task` in its official on-disk format (for tests and benchmarks).

    cifar10: 5 training batches (train split evenly) + test_batch; cifar100: train + test; movielens:
    ratings.csv from `users` users (train + test ratings in all); shakespeare: LEAF json with `users` roles
    in train/ and test/ (train and test samples in all).
    """
    task = str(task)
    rng = np.random.default_rng(seed)
    root = data_path(task, data_dir)
    root.mkdir(parents=True, exist_ok=True)

    def cifar_batch(path: Path, count: int, classes: int, key: bytes) -> None:
        blob = {b"batch_label": b"synthetic", key: rng.integers(0, classes, count).tolist(),
                b"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
                b"filenames": [b"img_%d.png" % i for i in range(count)]}
        if key == b"fine_labels":
            blob[b"coarse_labels"] = [x // 5 for x in blob[key]]
        with open(path, "wb") as f:
            pickle.dump(blob, f, protocol=2)

    if task == "cifar10":
        for i, part in enumerate(np.array_split(np.arange(train), 5), start=1):
            cifar_batch(root / f"data_batch_{i}", len(part), 10, b"labels")
        cifar_batch(root / "test_batch", test, 10, b"labels")
    elif task == "cifar100":
        cifar_batch(root / "train", train, 100, b"fine_labels")
        cifar_batch(root / "test", test, 100, b"fine_labels")
    elif task == "movielens":
        total = train + test
        user = np.sort(np.arange(total) % users) + 1
        movie = rng.choice(np.arange(1, 4 * total + 1), total)
        rating = rng.integers(1, 11, total) / 2.0
        lines = ["userId,movieId,rating,timestamp"]
        rows = zip(user, movie, rating, strict=True)
        lines += [f"{u},{m},{r:.1f},{964982703 + i}" for i, (u, m, r) in enumerate(rows)]
        (root / "ratings.csv").write_text("\n".join(lines) + "\n")
    elif task == "shakespeare":
        letters = np.array(list(LEAF_LETTERS))
        for sub, count in (("train", train), ("test", test)):
            names = [f"ROLE_{u}" for u in range(users)]
            per_user = np.array_split(np.arange(count), users)
            blob = {"users": names, "num_samples": [len(p) for p in per_user], "user_data": {}}
            for name, part in zip(names, per_user, strict=True):
                text = "".join(rng.choice(letters, 80 + len(part)))
                blob["user_data"][name] = {"x": [text[i:i + 80] for i in range(len(part))],
                                           "y": [text[i + 80] for i in range(len(part))]}
            (root / sub).mkdir(exist_ok=True)
            (root / sub / f"all_data_niid_0_keep_0_{sub}_8.json").write_text(json.dumps(blob))
    else:
        raise ValueError(f"no synthetic data for task {task!r}")
    return root
