"""A run's folder, with the standard library only, one concern per module:

    read.py      its files read back: `read_summary`, `read_rounds`, each node's newest `nodes.csv` row and a resumed
                 run's losses of the rounds it has yet to evaluate, the runs under a folder, a run's logs
    journal.py   the barrier's journal as a file (its one name, `JOURNAL`, and its reading); written and loaded by
                 `mosaicd.daemon.barrier.journal`
    classify.py  what a folder holds as far as starting a run there goes (`occupant`, `run_files`)
    lock.py      one run per folder at a time (`hold`, `hold_barrier`, `release`): a lock the system lets go when the
                 process ends
    claim.py     the folder a `cluster` or `simulate` run may write to (`claim_out`: a fresh one, or refusals naming
                 `--resume` / `--replace`); `keep_earlier_run`: a barrier starting a new run in a used `--out` keeps
                 the run there in `OUT/earlier/`

The names below are the package's: import them from `mosaicd.rundir`.
"""

from mosaicd.rundir.claim import (
    DEFAULT_ROOT,
    claim_out,
    fresh_folder,
    keep_earlier_run,
    new_folder,
    remove_run,
    writable,
)
from mosaicd.rundir.classify import MODEL_HASHES, RUN_FILES, SIMULATE_CHECKPOINT, Occupant, occupant, run_files
from mosaicd.rundir.journal import JOURNAL
from mosaicd.rundir.lock import BARRIER_LOCK, barrier_running, hold, hold_barrier, release
from mosaicd.rundir.read import (
    EARLIER,
    LIST_COLUMNS,
    RUN_MARKER,
    find_runs,
    last_node_rows,
    list_runs,
    log_files,
    node_losses_after,
    parse_cell,
    parse_row,
    read_rounds,
    read_summary,
    rounds_done,
    run_entry,
    started_at,
    tail_lines,
)

__all__ = [
    "BARRIER_LOCK", "DEFAULT_ROOT", "EARLIER", "JOURNAL", "LIST_COLUMNS", "MODEL_HASHES", "RUN_FILES", "RUN_MARKER",
    "SIMULATE_CHECKPOINT", "Occupant", "barrier_running", "claim_out", "find_runs", "fresh_folder", "hold",
    "hold_barrier", "keep_earlier_run", "last_node_rows", "list_runs", "log_files", "new_folder",
    "node_losses_after", "occupant", "parse_cell", "parse_row", "read_rounds", "read_summary", "release",
    "remove_run", "rounds_done", "run_entry", "run_files", "started_at", "tail_lines", "writable",
]
