"""A run's folder belongs to one run: `claim_out` (used by `mosaicd cluster` and `simulate` before they write
anything) gives a fresh folder when no --out is given, and refuses a folder that holds another run unless the user
says what to do with it (--resume it, or --replace it: `remove_run`), holding it for this process (`rundir.lock`).
A barrier that starts a new run in a used --out keeps the run there aside instead (`keep_earlier_run`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from mosaicd.rundir.classify import occupant, run_files
from mosaicd.rundir.lock import barrier_running, hold, refused, release
from mosaicd.rundir.read import EARLIER, read_summary, started_at

DEFAULT_ROOT = Path("runs")


def remove_run(out: Path | str) -> list[str]:
    """Remove the run in OUT: its files (`run_files`), nothing else in the folder. Returns what it removed."""
    out = Path(out)
    removed = run_files(out)
    for name in removed:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return removed


def keep_earlier_run(out: Path | str) -> Path | None:
    """Move the run that OUT holds (a summary.json: finished, failed or killed) with its files into
    OUT/earlier/<run id>-<its start>, and return that folder; None if OUT holds no such run.

    For a barrier that starts a new run in its --out (compose's results folder started again, a job script run
    twice): it cannot ask, and a run's results are never replaced unasked. `cluster` and `simulate` refuse instead
    (`claim_out`): someone is there to say --replace."""
    out = Path(out)
    summary = read_summary(out)
    if summary is None:
        return None
    run_id = (summary.get("settings") or {}).get("run_id") or "run"
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{run_id}-{started_at(summary, out) or 'unknown'}")
    kept = new_folder(out / EARLIER / name)
    for file in run_files(out):
        os.replace(out / file, kept / file)
    return kept


def fresh_folder(run_id: str, root: Path | str = DEFAULT_ROOT) -> Path:
    """A new folder ROOT/<run id>-<UTC time, YYYYmmdd-HHMMSS> (with -2, -3, ... where taken), made now, so that
    two runs started in the same second never share one."""
    return new_folder(Path(root) / f"{run_id}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")


def new_folder(base: Path) -> Path:
    """`base`, or `base`-2, -3, ... where taken, made now (its parents too), so that two callers never share one."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise OSError(f"no free folder beside {base}")  # pragma: no cover


def claim_out(out: Path | str | None, mode: str, resume: bool = False, replace: bool = False,
              run_id: str = "mosaic") -> Path:
    """The folder a `mode` run ("simulate", "cluster") writes to, checked before anything is written.

    `out` None (no --out): a fresh folder (`fresh_folder`). A folder that holds another run is never taken over
    silently: an unfinished run is refused naming --resume and --replace, a finished one unless `replace`; files
    a run left are refused unless `replace`. `resume`: the folder must hold an unfinished run this mode can
    continue (its files are kept: the run goes on from them). `replace`: the run's files are removed (`remove_run`),
    nothing else. A refusal changes no file: it is a SettingsError (a ValueError) of one line."""
    if resume and replace:
        raise refused("--resume and --replace: give one (continue the run in --out, or start it afresh)")
    if out is None:
        if resume:
            raise refused("--resume needs --out: the folder of the run to continue")
        folder = fresh_folder(run_id)
        hold(folder)
        return folder
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise refused(f"--out {out} is a file, not a folder")
    if out.is_dir():
        hold(out)
    try:
        hold(_claimed(out, mode, resume, replace))  # a folder made just now is taken too
        return out
    except BaseException:
        release(out)
        raise


def _claimed(out: Path, mode: str, resume: bool, replace: bool) -> Path:
    """`claim_out` of a given --out, which this process holds if it exists."""
    if barrier_running(out):
        raise refused(f"--out {out}: a barrier (`mosaicd barrier`) is running a run there now: give another --out, "
                       "or stop it (Ctrl-C), then try again")
    held = occupant(out)
    other = f"`mosaicd {held.mode}` " if held.mode not in (None, mode) else ""
    how = ("the same `mosaicd barrier` command" if held.mode == "barrier" else f"`mosaicd {held.mode} --resume`") \
        if other else "--resume"
    if resume:
        if held.kind == "none":
            raise refused(f"--resume: {out} holds no run to continue" if out.exists()
                           else f"--resume: {out} does not exist")
        if held.kind == "finished":
            raise refused(f"--resume: {out} holds a finished run ({held.text}): nothing to continue (--replace "
                           "starts it afresh)")
        if not held.resumable:
            raise refused(f"--resume: {out} holds nothing to resume from ({held.text}): start afresh with --replace")
        if other:
            raise refused(f"--resume: {out} holds an unfinished {other}run ({held.text}): continue it with {how}")
        return out
    if held.kind == "none":
        return writable(out)
    if not replace:
        if held.kind == "unfinished" and held.resumable:
            raise refused(f"--out {out} holds an unfinished {other}run ({held.text}): continue it with {how}, or "
                           "start afresh with --replace")
        if held.kind == "unfinished":
            raise refused(f"--out {out} holds an unfinished run ({held.text}) that left nothing to resume from: "
                           "start afresh with --replace")
        if held.kind == "finished":
            raise refused(f"--out {out} holds a finished {other}run ({held.text}): give another --out, or --replace "
                           "to remove its files and start afresh")
        raise refused(f"--out {out} holds files of another run ({held.text}): give another --out, or --replace to "
                       "remove them")
    remove_run(out)
    return writable(out)


def writable(out: Path) -> Path:
    """`out`, made (with its parents) and written to once, so that a folder the run cannot write (its parent a
    file, a read-only file system, no permission) is one line naming --out before anything starts (exit 1), not a
    traceback from the first file written."""
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out, prefix=".mosaic-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write {exc.filename or out}: {exc.strerror or exc}") from None
    return out
