"""LEAF Shakespeare json, one speaking role per client."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .common import Split, data_path, missing

# LEAF's 80-character vocabulary (models/utils/language_utils.py); other characters map to index 0.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"

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
