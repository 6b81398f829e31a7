"""`mosaicd.files`: a rewritten file is the one before or the one after, never part of one."""

from __future__ import annotations

from pathlib import Path

import pytest

from mosaicd.files import replacing, write_whole

pytestmark = pytest.mark.quick


def test_write_whole_replaces_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text("before")
    write_whole(path, "after")
    write_whole(tmp_path / "b.bin", b"\x00\x01", durable=True)
    assert path.read_text() == "after"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "summary.json"]


def test_a_failed_write_leaves_the_file_before_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "nodes.csv"
    path.write_text("round,node\n0,0\n")
    with pytest.raises(RuntimeError, match="disk"):
        with replacing(path) as f:
            f.write(b"round,node\n")
            raise RuntimeError("disk full, say")
    assert path.read_text() == "round,node\n0,0\n"
    assert [p.name for p in tmp_path.iterdir()] == ["nodes.csv"]


def test_a_write_into_a_missing_folder_fails_and_makes_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_whole(tmp_path / "absent" / "x.json", "{}")
    assert list(tmp_path.iterdir()) == []
