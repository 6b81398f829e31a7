"""A run's folder as its files describe it, read with the standard library only, so that the tools that look at
runs (`mosaicd runs`, `log`, `status FOLDER`) start at once and work on runs that ended, failed or crashed.

    OUT/summary.json       status, settings, progress, the newest evaluation ("final"); see `mosaicd.outputs`
    OUT/rounds.csv         one row per evaluated round (`read_rounds`)
    OUT/nodes.csv          one row per node and round (`last_node_rows`: each node's newest, from the file's end;
                           `node_losses_after`: a resumed run's losses of the rounds it has yet to evaluate)
    OUT/logs/barrier.log   a cluster's barrier, OUT/logs/node-<rank>.log its nodes (JSON lines)
    OUT/run.log            a sweep's run: one line per round

A run's folder belongs to one run: `claim_out` (used by `mosaicd cluster` and `simulate` before they write
anything) gives a fresh folder when no --out is given, and refuses a folder that holds another run unless the user
says what to do with it (--resume it, or --replace it). While a run goes on its process holds the folder (`hold`:
a lock on the folder itself, which the system lets go when the process ends, killed or not), so that a second run
there, --resume and --replace included, is refused instead of writing over it. A barrier started by hand
(`mosaicd barrier`) holds its --out by a lock file in it (`hold_barrier`), which `claim_out` checks as well: the
folder lock stays with a cluster's launcher, whose barrier is another process.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LIST_COLUMNS = ("nodes", "per_node")  # rounds.csv cells that hold a list: its items separated by spaces
RUN_MARKER = "summary.json"
JOURNAL = "barrier-state.json"                 # a cluster's barrier decisions (daemon/barrier/journal.py)
SIMULATE_CHECKPOINT = "simulate-checkpoint.npz"  # what `simulate --resume` continues from (experiments/resume.py)
# a run's own files: what --replace removes (and all a folder may hold besides for a new run to start there);
# logs/, state/ (node checkpoints) and nodes/ (a cluster's nodes' folders) are folders
RUN_FILES = (RUN_MARKER, "rounds.csv", "nodes.csv", JOURNAL, SIMULATE_CHECKPOINT, "logs", "state", "nodes")
DEFAULT_ROOT = Path("runs")
BARRIER_LOCK = ".barrier.lock"  # held by the barrier writing to OUT (`hold_barrier`); not a file of the run
EARLIER = "earlier"  # where a barrier keeps the run its --out held when it starts a new one (`keep_earlier_run`)


def read_summary(out: Path | str) -> dict[str, Any] | None:
    """OUT/summary.json, or None where there is none or it cannot be read."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def read_rounds(out: Path | str) -> list[dict[str, Any]]:
    """The evaluation rows of OUT/rounds.csv, parsed back (numbers, booleans, the lists of `LIST_COLUMNS`);
    an empty cell is None. None of them if the file is missing."""
    rounds: list[dict[str, Any]] = []
    try:
        with open(Path(out) / "rounds.csv", newline="") as f:
            for row in csv.DictReader(f):
                rounds.append(parse_row(row))
    except OSError:
        pass
    return rounds


def parse_row(row: dict[str | None, str | None]) -> dict[str, Any]:
    return {k: _parse_list(v) if k in LIST_COLUMNS else parse_cell(v) for k, v in row.items() if k is not None}


def parse_cell(text: str | None) -> Any:
    """A CSV cell as it was written: int, float, bool, or the text; '' is None."""
    if text is None or text == "":
        return None
    if text in ("true", "false", "True", "False"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_list(text: str | None) -> list[Any] | None:
    return None if text is None or text == "" else [parse_cell(item) for item in text.split()]


def tail_lines(path: Path, count: int, chunk: int = 1 << 16) -> list[str]:
    """The last `count` lines of a text file, read from its end (a long run's CSV is never read whole)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = position = f.tell()
        data = b""
        while position > 0 and data.count(b"\n") <= count:
            position = max(0, position - chunk)
            f.seek(position)
            data = f.read(end - position)
    lines = data.decode(errors="replace").splitlines()
    return lines[-count:]  # the first line read may be cut: there are more than `count` unless at the start


def last_node_rows(out: Path | str, nodes: int) -> dict[int, dict[str, Any]]:
    """node -> its newest row of OUT/nodes.csv (from the last rows of the file; a node that stopped long before
    the end is not among them)."""
    path = Path(out) / "nodes.csv"
    try:
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
        lines = tail_lines(path, 4 * max(1, nodes) + 1)
    except OSError:
        return {}
    if not header:
        return {}
    rows: dict[int, dict[str, Any]] = {}
    for values in csv.reader(io.StringIO("\n".join(lines))):
        if values == header or len(values) != len(header):
            continue
        row = parse_row(dict(zip(header, values, strict=True)))
        if isinstance(row.get("node"), int):
            rows[row["node"]] = row
    return rows


def node_losses_after(out: Path | str, round: int) -> dict[int, dict[int, float]]:
    """round -> node -> loss, from OUT/nodes.csv's rows of the rounds after `round` (read from the file's end, back
    to a row of `round` or before): the training losses of the rounds a resumed run has yet to evaluate."""
    path = Path(out) / "nodes.csv"
    try:
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
        if not header or header[:3] != ["round", "node", "loss"]:
            return {}
        count = 256
        while True:  # rows are appended in round order: read back until one of `round` or before
            lines = tail_lines(path, count)
            rows = [v for v in csv.reader(io.StringIO("\n".join(lines))) if len(v) == len(header)
                    and v[0].isdigit() and v[1].isdigit()]
            if len(lines) < count or any(int(v[0]) <= round for v in rows):
                break
            count *= 4
    except OSError:
        return {}
    losses: dict[int, dict[int, float]] = {}
    for t, node, loss, *_ in rows:
        if int(t) > round:
            try:
                losses.setdefault(int(t), {})[int(node)] = float(loss or "nan")
            except ValueError:
                continue
    return losses


def find_runs(root: Path | str) -> Iterator[Path]:
    """Every run folder under `root` (itself included): a folder with a summary.json, looked into further only for
    the runs a barrier kept aside in it (`keep_earlier_run`)."""
    root = Path(root)
    for folder, dirs, files in os.walk(root):
        if RUN_MARKER in files:
            dirs[:] = [EARLIER] if EARLIER in dirs else []
            yield Path(folder)
        else:
            dirs.sort()


def rounds_done(summary: dict[str, Any]) -> int | None:
    """Rounds the run got through: its progress, else (summaries of an earlier version) what its rows say."""
    progress = summary.get("progress") or {}
    if isinstance(progress.get("rounds_done"), int):
        return progress["rounds_done"]
    if summary.get("status") == "finished":
        return (summary.get("settings") or {}).get("rounds")
    final = summary.get("final") or {}
    return final["round"] + 1 if isinstance(final.get("round"), int) else None


def started_at(summary: dict[str, Any], folder: Path) -> str | None:
    """When the run started (ISO 8601): its summary's, else summary.json's time less the run's wall time."""
    if isinstance(summary.get("started"), str):
        return summary["started"]
    try:
        when = (folder / RUN_MARKER).stat().st_mtime - float(summary.get("wall_s") or 0.0)
    except (OSError, TypeError, ValueError):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(when))


def run_entry(folder: Path, root: Path | None = None) -> dict[str, Any] | None:
    """One run as `mosaicd runs` lists it (None: no readable summary.json)."""
    summary = read_summary(folder)
    if summary is None:
        return None
    settings = summary.get("settings") or {}
    final = summary.get("final") or {}
    name = str(folder.relative_to(root)) if root is not None and folder != root else folder.name
    return {
        "id": summary.get("run_id") or (name if name not in ("", ".") else folder.resolve().name),
        "status": summary.get("status"), "error": summary.get("error"), "mode": summary.get("mode"),
        "task": settings.get("task"), "nodes": settings.get("nodes"), "fragments": settings.get("fragments"),
        "fanout": settings.get("fanout"), "rounds_done": rounds_done(summary), "rounds": settings.get("rounds"),
        "metric": final.get("metric"), "node_average": final.get("node_average"),
        "average_model": final.get("average_model"), "evaluated_round": final.get("round"),
        "started": started_at(summary, folder), "wall_s": summary.get("wall_s"), "folder": str(folder),
    }


def list_runs(root: Path | str) -> list[dict[str, Any]]:
    """The runs under `root`, oldest first."""
    root = Path(root)
    entries = [e for e in (run_entry(f, root) for f in find_runs(root)) if e is not None]
    return sorted(entries, key=lambda e: (e["started"] or "", e["folder"]))


def log_files(out: Path | str) -> dict[str, Path]:
    """A run's logs by name: "barrier" and "node-<rank>" (cluster), "run" (a sweep's run)."""
    out = Path(out)
    logs = {p.stem: p for p in sorted((out / "logs").glob("*.log"), key=_log_order)} if (out / "logs").is_dir() \
        else {}
    if (out / "run.log").is_file():
        logs["run"] = out / "run.log"
    return logs


def _log_order(path: Path) -> tuple[int, int, str]:
    stem = path.stem
    if stem == "barrier":
        return 0, 0, stem
    rank = stem.removeprefix("node-")
    return (1, int(rank), stem) if rank.isdigit() else (2, 0, stem)


# ---------------------------------------------------------------------------------------------- claiming a folder


def _journal_round(out: Path) -> tuple[str, int | None, int | None] | None:
    """(phase, round, rounds) of OUT's barrier journal, or None where there is none that can be read."""
    try:
        state = json.loads((out / JOURNAL).read_text())["state"]
        return str(state["phase"]), state.get("round"), state.get("rounds")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def journal_rounds(out: Path | str) -> list[int]:
    """The open rounds `cluster --resume` can go on from, newest first, as OUT's barrier journal keeps them: both
    kept states of a run still running; the last open round of a run whose barrier had finished it but was stopped
    before its summary said so (while it collected or evaluated the final models: the nodes' checkpoints hold them).
    """
    out = Path(out)
    try:
        data = json.loads((out / JOURNAL).read_text())
        newest, earlier = data["state"], data.get("earlier") or {}
        if newest["phase"] == "running":
            return [s["round"] for s in (newest, earlier) if s]
        if newest["phase"] == "finished" and earlier.get("phase") == "running" \
                and (read_summary(out) or {}).get("status") != "finished":
            return [earlier["round"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return []


def _has_node_checkpoints(out: Path) -> bool:
    return any(out.glob("state/*/checkpoint.npz")) or any(out.glob("nodes/*/state/*/checkpoint.npz"))


def run_files(out: Path | str) -> list[str]:
    """The names in OUT that belong to a run (`RUN_FILES` and their half-written `.tmp` siblings)."""
    out = Path(out)
    return [n for name in RUN_FILES for n in (name, f"{name}.tmp") if (out / n).exists() or (out / n).is_symlink()]


@dataclass(frozen=True)
class Occupant:
    """The run a folder holds, as far as starting another one there goes."""

    kind: str               # "none", "finished", "unfinished", or "leftovers" (a run's files, no summary of it)
    mode: str | None        # "simulate" or "cluster", where known
    text: str               # how it ended, for a person: "failed at round 17 of 60: interrupted"
    resumable: bool         # its mode's --resume can continue it (simulate: its summary; cluster: its journal)
    files: tuple[str, ...]  # its files (`run_files`)


def occupant(out: Path | str) -> Occupant:
    """What OUT holds: nothing of a run, a finished run, an unfinished one (its summary says running or failed, or
    a barrier journal of a run still going, or checkpoints without a summary), or files a run left."""
    out = Path(out)
    files = tuple(run_files(out)) if out.is_dir() else ()
    if not files:
        return Occupant("none", None, "", False, ())
    summary = read_summary(out)
    journal = _journal_round(out)
    journal_running = journal is not None and journal[0] == "running"
    resumable_journal = bool(journal_rounds(out))
    mode = (summary or {}).get("mode") or ("cluster" if journal else "simulate" if SIMULATE_CHECKPOINT in files
                                            else None)
    status = (summary or {}).get("status")
    if status == "finished" and not journal_running:
        done, started = rounds_done(summary or {}), (summary or {}).get("started")
        text = ", ".join(t for t in (f"{done} rounds" if done is not None else "", f"started {started}"
                                     if started else "") if t) or "no details"
        return Occupant("finished", mode, text, False, files)
    if summary is not None and status in ("running", "failed"):
        rounds = (summary.get("settings") or {}).get("rounds")
        at = f" at round {rounds_done(summary)} of {rounds}" if rounds_done(summary) is not None else ""
        text = (f"failed{at}: {summary.get('error') or 'no reason given'}" if status == "failed"
                else f"running{at}: still going, or killed")
        resumable = (resumable_journal if mode == "cluster" else mode == "simulate")
        return Occupant("unfinished", mode, text, resumable, files)
    if journal_running:
        assert journal is not None
        return Occupant("unfinished", "cluster", f"its barrier's journal is at round {journal[1]} of {journal[2]}",
                        True, files)
    if SIMULATE_CHECKPOINT in files or _has_node_checkpoints(out):
        return Occupant("unfinished", mode, "checkpoints, no summary.json", SIMULATE_CHECKPOINT in files, files)
    return Occupant("leftovers", mode, ", ".join(files), False, files)


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


def _refused(text: str) -> ValueError:
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
        raise _refused(refusal) from None
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
        raise _refused("--resume and --replace: give one (continue the run in --out, or start it afresh)")
    if out is None:
        if resume:
            raise _refused("--resume needs --out: the folder of the run to continue")
        folder = fresh_folder(run_id)
        hold(folder)
        return folder
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise _refused(f"--out {out} is a file, not a folder")
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
        raise _refused(f"--out {out}: a barrier (`mosaicd barrier`) is running a run there now: give another --out, "
                       "or stop it (Ctrl-C), then try again")
    held = occupant(out)
    other = f"`mosaicd {held.mode}` " if held.mode not in (None, mode) else ""
    how = f"`mosaicd {held.mode} --resume`" if other else "--resume"
    if resume:
        if held.kind == "none":
            raise _refused(f"--resume: {out} holds no run to continue" if out.exists()
                           else f"--resume: {out} does not exist")
        if held.kind == "finished":
            raise _refused(f"--resume: {out} holds a finished run ({held.text}): nothing to continue (--replace "
                           "starts it afresh)")
        if not held.resumable:
            raise _refused(f"--resume: {out} holds nothing to resume from ({held.text}): start afresh with --replace")
        if other:
            raise _refused(f"--resume: {out} holds an unfinished {other}run ({held.text}): continue it with {how}")
        return out
    if held.kind == "none":
        return writable(out)
    if not replace:
        if held.kind == "unfinished" and held.resumable:
            raise _refused(f"--out {out} holds an unfinished {other}run ({held.text}): continue it with {how}, or "
                           "start afresh with --replace")
        if held.kind == "unfinished":
            raise _refused(f"--out {out} holds an unfinished run ({held.text}) that left nothing to resume from: "
                           "start afresh with --replace")
        if held.kind == "finished":
            raise _refused(f"--out {out} holds a finished {other}run ({held.text}): give another --out, or --replace "
                           "to remove its files and start afresh")
        raise _refused(f"--out {out} holds files of another run ({held.text}): give another --out, or --replace to "
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
