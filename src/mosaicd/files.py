"""Files replaced whole: written beside (NAME.tmp) and renamed over NAME, so that a reader, a crash or a full disk
finds the file before or the file after, never part of one. The one way the daemon and the experiment tools
rewrite a file (checkpoint slots, rewritten in place on purpose, are the exception: see daemon/node/checkpoint.py);
tests/test_layout.py checks it, with the writes that are not rewrites (logs, appends, a new secret) listed there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def replacing(path: Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` when the block ends; if the block fails, NAME.tmp is removed and `path`
    is left as it was. `durable`: the file and its folder are fsync'd before the block returns (what a crash right
    after must not lose: the barrier's journal, a simulation's checkpoint)."""
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_whole(path: Path, data: str | bytes | memoryview, *, durable: bool = False) -> None:
    """`data` (text as UTF-8) as the whole of `path`, through `replacing`."""
    with replacing(path, durable=durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)
