"""One run per folder at a time: while a run goes on its process holds the folder (`hold`: a lock on the folder
itself, which the system lets go when the process ends, killed or not), so that a second run there, --resume and
--replace included, is refused instead of writing over it. A barrier started by hand (`mosaicd barrier`) holds its
--out by a lock file in it (`hold_barrier`), which `claim_out` checks as well (`barrier_running`): the folder lock
stays with a cluster's launcher, whose barrier is another process.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

BARRIER_LOCK = ".barrier.lock"  # held by the barrier writing to OUT (`hold_barrier`); not a file of the run


def refused(text: str) -> ValueError:
    """A refusal worded for the flags the user typed: a usage error (exit 2)."""
    from mosaicd.settings import SettingsError  # only when refusing: the looking tools never import pydantic

    return SettingsError(text)


_HELD: dict[Path, int] = {}  # folder -> this process's locked descriptor of it


def hold(out: Path, what: str = "--out") -> None:
    """This process takes `out` (a folder) for its run: refused (one line naming `what`) while another process holds
    it. Forked children share the hold (a cluster's warm nodes), so it lasts while any of them runs."""
    key = out.resolve()
    if key in _HELD:
        return
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:  # no permission to read it, say: one line naming the flag, as `writable` says it
        raise ValueError(f"{what} {out}: cannot open it: {exc.strerror or exc}") from None
    _lock(key, fd, f"{what} {out}: another process is running a run there now: wait for it to end, or stop it "
          "(Ctrl-C), then try again")


def hold_barrier(out: Path) -> None:
    """A barrier takes `out` for its run (made if missing): refused (one line naming --out) while another barrier
    holds it. Kept until the process ends (`claim_out`, in `simulate` and `cluster`, refuses such a folder)."""
    key = (out / BARRIER_LOCK).resolve()
    if key in _HELD:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / BARRIER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write {exc.filename or out}: {exc.strerror or exc}") from None
    _lock(key, fd, f"--out {out}: another barrier is running a run there now: give another --out, or stop it "
          "(Ctrl-C) and start this one again")


def _lock(key: Path, fd: int, refusal: str) -> None:
    """Lock `fd` for this process (kept in `_HELD` under `key`), or close it and refuse with `refusal` while another
    process holds it. A file system without locks (some network mounts): the run goes on unguarded."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise refused(refusal) from None
    except OSError:
        os.close(fd)
        return
    _HELD[key] = fd


def barrier_running(out: Path) -> bool:
    """Whether a barrier in another process holds `out` (`hold_barrier`)."""
    if (out / BARRIER_LOCK).resolve() in _HELD:
        return False
    try:
        fd = os.open(out / BARRIER_LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def release(out: Path | str) -> None:
    """Let go of `out` (`hold`), once this process's run there has ended."""
    fd = _HELD.pop(Path(out).resolve(), None)
    if fd is not None:
        os.close(fd)
