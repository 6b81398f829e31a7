import io
import json
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from mosaicd.learning.data import (
    LEAF_LETTERS,
    RowFile,
    data_path,
    encode_chars,
    load_cifar,
    load_digits,
    load_movielens,
    load_shakespeare,
    safe_extract_tar,
    safe_extract_zip,
    write_synthetic,
)
from mosaicd.learning.tasks import DataMissing


def _official_cifar10(root: Path, per_batch: int = 4) -> np.ndarray:
    """The layout of the official archive, written by hand (pickle protocol 2, bytes keys)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(5)
    images = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        images.append(data)
        blob = {b"batch_label": b"training batch", b"labels": list(range(per_batch)), b"data": data,
                b"filenames": [b"x.png"] * per_batch}
        (root / name).write_bytes(pickle.dumps(blob, protocol=2))
    return np.concatenate(images)


def test_cifar_reads_the_official_layout_and_caches_it(tmp_path):
    images = _official_cifar10(tmp_path / "cifar-10-batches-py")
    split = load_cifar(tmp_path, 10)
    assert split.x_train.shape == (20, 3, 32, 32) and split.x_train.dtype == np.uint8
    assert split.x_test.shape == (4, 3, 32, 32)
    assert np.array_equal(np.asarray(split.x_train).reshape(20, -1), images[:20])
    assert np.array_equal(np.asarray(split.x_test).reshape(4, -1), images[20:])
    # channel-major rows: the first 1024 bytes of a row are the red plane
    assert np.array_equal(split.x_train[0][0].reshape(-1), images[0, :1024])
    assert split.y_train.tolist() == [0, 1, 2, 3] * 5
    assert isinstance(split.x_train, RowFile)
    assert (tmp_path / "cifar-10-batches-py" / "mosaic-cache" / "manifest.json").is_file()
    again = load_cifar(tmp_path, 10)
    assert np.array_equal(again.x_train, split.x_train)


def test_row_file_reads_rows_by_int_slice_and_array(tmp_path):
    data = np.arange(5 * 6, dtype=np.int16).reshape(5, 2, 3)
    (tmp_path / "rows").write_bytes(data.tobytes())
    rows = RowFile(tmp_path / "rows", (5, 2, 3), np.int16)
    assert len(rows) == 5 and rows.ndim == 3
    assert np.array_equal(rows[3], data[3]) and np.array_equal(rows[-1], data[-1])
    assert np.array_equal(rows[1:4], data[1:4]) and np.array_equal(rows[::2], data[::2])
    assert rows[4:2].shape == (0, 2, 3)
    pick = np.array([4, 0, 4, 2])
    assert np.array_equal(rows[pick], data[pick]) and np.array_equal(np.asarray(rows), data)
    with pytest.raises(IndexError):
        rows[np.array([5])]
    with pytest.raises(IndexError):
        rows[np.array([0.5])]


def test_cifar_cache_follows_changed_sources(tmp_path):
    write_synthetic("cifar10", tmp_path, train=10, test=5, seed=1)
    first = np.array(load_cifar(tmp_path).x_test)
    write_synthetic("cifar10", tmp_path, train=10, test=7, seed=2)
    second = load_cifar(tmp_path).x_test
    assert second.shape[0] == 7 and not np.array_equal(first, np.array(second)[:5])


def test_cifar_without_writable_cache_loads_into_memory(tmp_path, monkeypatch):
    write_synthetic("cifar100", tmp_path, train=12, test=6)

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr("mosaicd.learning.data.cifar._write_cache", refuse)
    split = load_cifar(tmp_path, 100)
    assert split.x_train.shape == (12, 3, 32, 32) and isinstance(split.x_train, np.ndarray)
    assert split.y_train.max() < 100


def test_cifar_cache_falls_back_to_another_folder(tmp_path, monkeypatch):
    write_synthetic("cifar10", tmp_path / "data", train=10, test=5)
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setattr("mosaicd.learning.data.cifar.cache_dirs",
                        lambda root: [tmp_path / "a-file" / "cache", tmp_path / "alt"])
    split = load_cifar(tmp_path / "data")
    assert isinstance(split.x_train, RowFile) and split.x_train.path.parent == tmp_path / "alt"
    assert len(split.y_train) == 10


def test_cifar_pickle_with_code_is_refused(tmp_path):
    root = tmp_path / "cifar-100-python"
    root.mkdir()
    (root / "train").write_bytes(pickle.dumps({b"data": io.StringIO("x")}, protocol=2))
    (root / "test").write_bytes(pickle.dumps({b"data": 1}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="unexpected object"):
        load_cifar(tmp_path, 100)


@pytest.mark.parametrize("task", ["cifar10", "cifar100", "movielens", "shakespeare"])
def test_missing_data_names_task_path_and_command(tmp_path, task):
    loaders = {"cifar10": lambda: load_cifar(tmp_path, 10), "cifar100": lambda: load_cifar(tmp_path, 100),
               "movielens": lambda: load_movielens(tmp_path, 0), "shakespeare": lambda: load_shakespeare(tmp_path)}
    with pytest.raises(DataMissing) as err:
        loaders[task]()
    text = str(err.value)
    assert f"task {task}" in text and str(data_path(task, tmp_path)) in text
    assert f"mosaicd data fetch {task}" in text
    assert isinstance(err.value, FileNotFoundError)


def test_movielens_split_is_per_user_and_seeded(tmp_path):
    root = tmp_path / "ml-latest-small"
    root.mkdir()
    rows = ["userId,movieId,rating,timestamp"]
    rows += [f"{u},{m},{(u + m) % 10 / 2 + 0.5},1" for u in (3, 7, 11) for m in range(10, 20)]
    rows += ["42,10,4.0,1"]  # a user with one rating keeps it for training
    (root / "ratings.csv").write_text("\n".join(rows) + "\n")
    split = load_movielens(tmp_path, seed=1)
    assert split.info["users"] == 4 and split.info["items"] == 10
    assert len(split.y_train) == 3 * 8 + 1 and len(split.y_test) == 3 * 2
    assert np.bincount(split.x_test[:, 0]).tolist() == [2, 2, 2]
    assert np.array_equal(split.clients, split.x_train[:, 0])
    assert split.y_train.dtype == np.float32
    assert split.info["mean"] == pytest.approx(float(split.y_train.mean()))
    same = load_movielens(tmp_path, seed=1)
    assert np.array_equal(same.x_test, split.x_test)
    other = [load_movielens(tmp_path, seed=s).x_test for s in range(2, 6)]
    assert any(not np.array_equal(o, split.x_test) for o in other)


def test_movielens_rejects_a_foreign_csv(tmp_path):
    (tmp_path / "ml-latest-small").mkdir()
    (tmp_path / "ml-latest-small" / "ratings.csv").write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="header"):
        load_movielens(tmp_path, 0)


def test_shakespeare_reads_leaf_json(tmp_path):
    for sub, users in (("train", {"ROMEO": "abcdefgh", "JULIET": "Hello, W"}), ("test", {"ROMEO": "xyz!?xyz"})):
        blob = {"users": list(users), "num_samples": [2] * len(users), "user_data": {}}
        for user, text in users.items():
            blob["user_data"][user] = {"x": [text[:4], text[2:6]], "y": [text[4], text[6]]}
        (tmp_path / "shakespeare" / sub).mkdir(parents=True)
        (tmp_path / "shakespeare" / sub / "data.json").write_text(json.dumps(blob))
    split = load_shakespeare(tmp_path)
    assert split.x_train.shape == (4, 4) and split.x_train.dtype == np.uint8
    assert "".join(LEAF_LETTERS[i] for i in split.x_train[0]) == "abcd"
    assert "".join(LEAF_LETTERS[i] for i in split.y_train) == "ego "
    assert split.clients.tolist() == [0, 0, 1, 1]
    assert split.info["users"] == ["ROMEO", "JULIET"]
    assert len(split.y_test) == 2


def test_leaf_vocabulary():
    assert len(LEAF_LETTERS) == 80
    codes = encode_chars(["a\n}", "~é "])
    assert codes.tolist() == [[LEAF_LETTERS.index("a"), 0, 79], [0, 0, 1]]  # unknown characters -> 0


def test_digits_split_is_seeded_and_standardised():
    a, b, c = load_digits(0), load_digits(0), load_digits(1)
    assert a.x_train.shape == (1438, 1, 8, 8) and a.x_test.shape == (359, 1, 8, 8)
    assert np.array_equal(a.y_test, b.y_test) and not np.array_equal(a.y_test, c.y_test)
    assert abs(float(a.x_train.mean())) < 1e-4 and float(a.x_train.std()) == pytest.approx(1.0, abs=1e-3)


def test_safe_extract_refuses_escapes(tmp_path):
    good = tmp_path / "good.tar.gz"
    with tarfile.open(good, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-py/readme.html")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi!"))
    safe_extract_tar(good, tmp_path / "out")
    assert (tmp_path / "out" / "cifar-10-batches-py" / "readme.html").read_bytes() == b"hi!"

    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="outside"):
        safe_extract_tar(evil, tmp_path / "out")
    link = tmp_path / "link.tar"
    with tarfile.open(link, "w") as tar:
        info = tarfile.TarInfo("a-link")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(ValueError, match="not a regular file"):
        safe_extract_tar(link, tmp_path / "out")
    assert not (tmp_path / "escaped").exists()

    zevil = tmp_path / "evil.zip"
    with zipfile.ZipFile(zevil, "w") as z:
        z.writestr("ml-latest-small/ratings.csv", "userId,movieId,rating,timestamp\n")
        z.writestr("../../zipped", "x")
    with pytest.raises(ValueError, match="outside"):
        safe_extract_zip(zevil, tmp_path / "zout")
    assert not (tmp_path / "zout" / "ml-latest-small").exists()
