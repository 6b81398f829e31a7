"""The node daemon: register, build the task, then train off the event loop and gossip through `Peer`."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from mosaicd.daemon.entry import on_signals, told_to_stop
from mosaicd.daemon.errors import OutputError, PeerDropped, RunEnded
from mosaicd.daemon.hosting import BarrierHost
from mosaicd.daemon.http.server import keep_freed_memory
from mosaicd.daemon.loop import sleep_at_least
from mosaicd.daemon.node import checkpoint
from mosaicd.daemon.node.console import NodeConsole
from mosaicd.daemon.node.core_turn import on_core
from mosaicd.daemon.node.outbound import SAME_COMMANDS
from mosaicd.daemon.node.peer import Peer
from mosaicd.daemon.node.warmup import prefetch_in_background
from mosaicd.logs import get_logger, json_logs
from mosaicd.outputs import is_eval_round
from mosaicd.protocol import profile_spec
from mosaicd.settings import DaemonOptions, Settings

T = TypeVar("T")


async def run_node(settings: Settings, task: Any = None, host: BarrierHost | None = None) -> int:
    """Register (the barrier hands out the run), build the task, then train and gossip every round.

    `task`: one built before registration (`mosaicd cluster`'s warm start), used only if it is the registered
    run's. Without one, the task's imports run in a thread while the node registers. SIGTERM or SIGINT make the
    node leave the run (it tells the barrier, which stops waiting for it; before the roster is made, it withdraws
    its registration) and exit 0; an error after registration
    makes it leave too, saying why, before the error ends the process. `host`: builds the barrier this node hosts
    where it is rank 0 of a --peer-list (`mosaicd node` runs `mosaicd.daemon.embedded.run_node`, which gives it)."""
    keep_freed_memory()  # this process is a node: let it reuse what each round frees (daemon/server.py)
    prefetched = None if task is not None else prefetch_in_background(settings.task)
    run = settings.run_config() if settings.peer_list is not None else None
    options = settings.daemon_options()
    directory = checkpoint.state_dir(options)
    kept = checkpoint.kept(directory)  # read once: the checkpoint to go on from, and the rounds it could go on at
    saved = found_checkpoint(options, kept)
    resume_rank = saved.rank if saved is not None and options.resume_round is not None else None
    held = None  # a member started again says which rounds it can go on from, where the barrier resumes the run
    if options.resume_round is None and directory is not None:
        held = checkpoint.rounds_of(kept, run.run_id if run is not None else None)
    came_back = saved is not None or checkpoint.was_member(directory)  # a run's member before, started again
    del kept  # its models: the one to go on from is `saved`, which the rounds drop once begun
    peer = Peer(options, run=run, host=host, rejoining=came_back, resume_rank=resume_rank, checkpoints=held,
                runs_task=True)
    registering = asyncio.ensure_future(peer.__aenter__())
    told = on_signals(registering) if options.leave_on_signal else None
    try:
        await registering
    except asyncio.CancelledError:  # told to stop before the run began: it withdrew its registration (Peer)
        if not told:
            raise
        return 0
    if str(peer.run.sync) == "async":  # the barrier is only the membership and the collector: no rounds
        return await run_asynchronously(peer, settings)
    if directory is not None:
        try:
            checkpoint.note_member(directory, peer.run.run_id, peer.rank, peer.address)
        except OSError as exc:  # it only makes a restart without a checkpoint cost its peers their send budget
            peer.log.warning("member_note_unwritten", state_dir=str(directory), error=str(exc))
    try:
        rounds = asyncio.ensure_future(train_and_gossip(peer, settings, task, saved, prefetched))
        del saved
        stopped = on_signals(rounds, 0 if peer.barrier is None else 130) if options.leave_on_signal else None
        try:
            await rounds
        except asyncio.CancelledError:
            if stopped is None or not stopped:
                raise
            await leave_for(peer, f"it was told to stop ({stopped[0]})", within=LEAVE_WITHIN_S, stopped=True)
            code = 0 if peer.barrier is None else 130  # rank 0 of a peer list interrupted the run it hosts
        except Exception as exc:
            if not isinstance(exc, PeerDropped | RunEnded):  # the barrier knows of those already
                await leave_for(peer, f"error: {exc}", ends_run=isinstance(exc, OutputError | OSError))
            elif peer.barrier is not None:  # the run this process hosts failed: the others hear it from it
                await linger_for_the_others(peer, stopped)
            raise
        else:
            await linger(settings.linger, options)
            code = 0
    finally:
        await peer.close()
    if stopped:
        told_to_stop(code)  # a command's process ends here, its round's training not waited for
    return code


async def run_asynchronously(peer: Peer, settings: Settings) -> int:
    """Registered with a barrier that runs --sync async (compose): the peer's part ends with the roster (its port
    freed), and the node runs as a peer list's member does on the same port (`async_run.run_registered_node`)."""
    from mosaicd.daemon.node.async_run import run_registered_node

    run, addresses, rank, address = peer.run, list(peer.state.addresses), peer.rank, peer.address
    await peer.close()
    return await run_registered_node(settings, run, addresses, rank, int(address.rsplit(":", 1)[1]))


def found_checkpoint(options: DaemonOptions, kept: list[checkpoint.Checkpoint]) -> checkpoint.Checkpoint | None:
    """The checkpoint in the state directory (`kept`: its checkpoints; of --resume-round, which must be there), if
    any."""
    saved = checkpoint.newest(kept, options.resume_round)
    if options.resume_round is not None and saved is None:
        raise FileNotFoundError(f"--resume-round {options.resume_round}: no checkpoint of that round in "
                                f"{checkpoint.state_dir(options)} (--state-dir)")
    return saved


async def linger(seconds: float, options: DaemonOptions) -> None:
    """Serve `seconds` more after the run (--linger); told to stop meanwhile (compose down), stop now."""
    lingering = asyncio.ensure_future(asyncio.sleep(seconds))
    if options.leave_on_signal:
        on_signals(lingering)
    try:
        await lingering
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # this task was stopped, not only its linger
            raise


# a node told to stop: how long the barrier has to hear its leave (two tries), within the process's 2 s to exit
LEAVE_WITHIN_S = 1.0
HOST_LINGER_S = 5.0  # rank 0 of a peer list that stops: how long at most it still tells the others the run failed


async def train_and_gossip(peer: Peer, settings: Settings, task: Any, saved: checkpoint.Checkpoint | None,
                           prefetched: asyncio.Future | None) -> None:
    """Every round of the run as this node takes part in it, then the final arrival."""
    from mosaicd.learning.tasks import build_task

    options, run = settings.daemon_options(), peer.run
    if prefetched is not None:
        await prefetched
    if task is None or task.run != run:
        task = await asyncio.to_thread(build_task, run, settings.data_dir)
    peer.set_model(task.layout)
    resume_round = options.resume_round if options.resume_round is not None else peer.resumed_at
    if peer.resumed_at and options.resume_round is None:  # rank 0 resumed the peer list's run at this round
        saved = resumed_checkpoint(peer, options, peer.resumed_at)
    vector = await starting_model(peer, task, saved, options)
    if peer.round > 0 and saved is not None and saved.run_id == run.run_id and settings.peer_list is not None:
        print(f"mosaicd node: run {run.run_id} goes on with {peer.round} of {run.rounds} rounds done, the newest point "
              f"every member holds a checkpoint of: this node resumes from its checkpoint of round {saved.round}",
              file=sys.stderr, flush=True)
    if resume_round:
        await begin_resumed(peer, task, vector, options, resume_round)
    else:
        peer.begin(vector)
    data_rank = peer.rank % run.nodes  # a node that joined late trains on the data of this rank
    if saved is not None and (saved.run_id, saved.rank, saved.round) == (run.run_id, peer.rank, peer.round):
        peer.restore_compression(saved.carried)  # it goes on from this checkpoint's round: exactly, as if never stopped
    if saved is not None and vector is saved.vector and run.train:  # its model from the checkpoint, and its optimizer
        task.load_node_state(data_rank, saved.trained)
    saving = Checkpoints(options, peer, lambda: task.node_state(data_rank) if run.train else {})
    del vector, saved  # the peer holds the model from now on (`peer.vector`): no frame keeps the first one alive
    with NodeConsole(f"rank {peer.rank}", run.rounds, enabled=not json_logs(settings.log_json)) as console:
        await rounds_of(peer, task, options, saving, data_rank, console)
    await saving.drain()
    await peer.finish()
    if peer.barrier is not None:
        await peer.barrier.wait_done()


async def begin_resumed(peer: Peer, task: Any, vector: np.ndarray, options: DaemonOptions, resume_round: int) -> None:
    """A resumed node starts from `vector`, its checkpoint's model; its models after the two rounds before are its
    snapshots where the barrier evaluates them (it may collect them again: its rows cut short), with its metrics."""
    run = peer.run
    before = model_before(peer, options, resume_round)
    peer.begin(vector, kept_as=peer.round - 1, before=before)
    kept = [(r, v) for r, v in ((peer.round - 1, vector), (peer.round - 2, before))
            if v is not None and r >= 0 and is_eval_round(r, run)]
    for r, _ in kept:
        peer.evaluating(r)
    for r, v in kept:
        peer.evaluated(r, await evaluate_own(task, v, peer, r))


async def rounds_of(peer: Peer, task: Any, options: DaemonOptions, saving: Checkpoints, data_rank: int,
                    console: NodeConsole) -> None:
    """This node's rounds, from the one it is in to the run's last, from the model it began with (`peer.vector`):
    train, gossip, evaluate, checkpoint; each round done is a line on its `console`."""
    run, vector = peer.run, peer.vector
    log = get_logger(role="node", run=run.run_id, node=peer.rank)
    spec = profile_spec(run)
    profile = spec.of(peer.rank, run.seed, run.nodes) if spec is not None else None
    while peer.round < run.rounds:
        t = peer.round
        started = time.perf_counter()
        if run.train:  # the last round's checkpoint is written first, in the same worker call: one hand-off
            local, loss = await asyncio.to_thread(saving.before(on_core), task.train, data_rank, t, vector)
        else:
            local, loss = vector, math.nan
        if profile is not None and spec is not None:  # --node-profile: train as slowly as such a node would
            took = time.perf_counter() - started
            await sleep_at_least(profile.train_s(max(spec.compute_s, took)) - took)
        evaluates = is_eval_round(t, run)
        if evaluates:  # the barrier's collection of round t waits for this node's metrics of it
            peer.evaluating(t)
        try:  # the checkpoint of round t is on disk before this node arrives at t (`Checkpoints.drain`)
            vector = await peer.gossip(local, loss=loss, train_s=time.perf_counter() - started,
                                       before_arrival=saving.drain)
        except PeerDropped as exc:
            peer.evaluated(t, None)
            if not options.rejoin_dropped:
                raise
            vector = await rejoin_after_drop(peer, t, exc, options)
            continue
        except BaseException:
            peer.evaluated(t, None)
            raise
        log.info("round", round=t, loss=loss)
        console.round_done(t, loss, len(peer.members), len(peer.state.addresses))
        if evaluates:  # its own model after round t, on its own task, before it trains round t + 1
            peer.evaluated(t, await evaluate_own(task, vector, peer, t))
        await saving.after(t, vector)


async def evaluate_own(task: Any, vector: np.ndarray, peer: Peer, t: int) -> dict[str, Any] | None:
    """This node's evaluation of its model after round `t` (`learning.evaluation.node_evaluation`), in a worker
    thread; None (logged) where it fails: the barrier's row then leaves this node out."""
    from mosaicd.learning.evaluation import node_evaluation

    try:
        return await asyncio.to_thread(on_core, node_evaluation, task, vector)
    except Exception as exc:
        peer.log.warning("evaluation_failed", round=t, error=f"{type(exc).__name__}: {exc}")
        return None


async def linger_for_the_others(peer: Peer, stopped: list[str] | None = None) -> None:
    """Rank 0 ended the run it hosts (failed): serve until every other live member has been told so (their long
    polls answered, not reset; or their next arrival or leave), for HOST_LINGER_S at most, and no longer once
    this process is told to stop itself. Under scancel every member leaves at once and hears it at once: the
    job's ports are free within moments of its end."""
    assert peer.barrier is not None
    loop = asyncio.get_running_loop()
    started = loop.time()
    while peer.barrier.unheard(peer.rank) and not stopped and loop.time() < started + HOST_LINGER_S:
        await asyncio.sleep(0.05)
    peer.log.info("failure_told", unheard=peer.barrier.unheard(peer.rank), waited_s=round(loop.time() - started, 2))
    await asyncio.sleep(0.1)  # the last answers leave the socket


async def leave_for(peer: Peer, reason: str, ends_run: bool = False, within: float | None = None,
                    stopped: bool = False) -> None:
    """Tell the barrier this node leaves, and why (`ends_run`: the run cannot go on exactly without it: a write it
    could not make; `within`: how long the barrier has to answer). Rank 0 of a peer list ends the run it hosts
    (failed; interrupted where it was told to stop: a person stopped it, `scancel`), and serves until the others
    have heard it (`linger_for_the_others`)."""
    if peer.barrier is None:
        await peer.leave(reason, ends_run, within, stopped)
        return
    done = f"{peer.round} of {peer.run.rounds} rounds done"  # rounds are counted done, in every line of a stop
    why = f"rank {peer.rank}, which hosts the barrier, stopped with {done}: {reason}"
    # every member says how to go on; told to stop, it is the run's interruption (`ended_status`)
    peer.barrier.fail(f"interrupted ({why}; {SAME_COMMANDS})" if stopped else why)
    if stopped:  # a person stopped it: how to go on (checkpoints: exactly)
        print(f"mosaicd node: rank 0 stopped the run with {done} (it hosts the barrier); start the same commands "
              "again, on every member, to resume it", file=sys.stderr, flush=True)
    await linger_for_the_others(peer)


async def starting_model(peer: Peer, task: Any, saved: checkpoint.Checkpoint | None,
                         options: DaemonOptions) -> np.ndarray:
    """Round 0: the task's initial model (a checkpoint found then is an earlier run's, and said so). A node that
    (re)joins later: its checkpoint if it is of this run and rank (and recent enough: `rejoin_model`), else the
    model of a live peer."""
    if peer.round == 0:
        if saved is not None:  # of an earlier run: one of this run is of round 1 or later
            peer.log.warning("checkpoint_not_used", checkpoint_round=saved.round, state_dir=str(
                checkpoint.state_dir(options)), detail="the run starts at round 0, so the checkpoint in the state "
                "directory is an earlier run's: this node starts from the initial model, and this run's checkpoints "
                "replace it")
        return task.initial(peer.rank)
    ours = saved is not None and (saved.run_id, saved.rank) == (peer.run.run_id, peer.rank) \
        and saved.vector.size == task.layout.dim
    return await rejoin_model(peer, saved.vector if ours and saved else None, saved.round if saved else None,
                              "checkpoint", options, checkpoint_round=saved.round if saved else None)


def resumed_checkpoint(peer: Peer, options: DaemonOptions, round: int) -> checkpoint.Checkpoint:
    """This member's checkpoint of `round`, where rank 0 resumed the peer list's run at it (this member said it
    holds it): FileNotFoundError, plainly, where it is not there (or not this run's and rank's) any more."""
    saved = checkpoint.load(checkpoint.state_dir(options), round)
    if saved is None or (saved.run_id, saved.rank) != (peer.run.run_id, peer.rank):
        raise FileNotFoundError(f"the run {peer.run.run_id} was resumed with {round} rounds done, but "
                                f"{checkpoint.state_dir(options)} (--state-dir) holds no checkpoint of this member "
                                f"(rank {peer.rank}) of round {round} now: it cannot go on exactly")
    return saved


def model_before(peer: Peer, options: DaemonOptions, round: int) -> np.ndarray | None:
    """A resumed node's model after the round before `round`, the one its checkpoint goes on from (its earlier
    checkpoint, read before this node writes any): the interruption may have cut that round's evaluation short, and
    the barrier collects it again from the restarted nodes. None where that checkpoint is not kept."""
    earlier = checkpoint.load(checkpoint.state_dir(options), round - 1)
    if earlier is None or (earlier.run_id, earlier.rank) != (peer.run.run_id, peer.rank):
        return None
    return earlier.vector


async def rejoin_after_drop(peer: Peer, t: int, dropped: PeerDropped, options: DaemonOptions) -> np.ndarray:
    """--rejoin-dropped: register again, then go on with this node's own newest model or a live peer's."""
    peer.log.warning("dropped", round=t, detail=str(dropped), next="registering again (--rejoin-dropped)")
    own = peer.vector
    await peer.rejoin()
    return await rejoin_model(peer, own, t, "own", options)


async def rejoin_model(peer: Peer, kept: np.ndarray | None, kept_round: int | None, source: str,
                       options: DaemonOptions, **fields: Any) -> np.ndarray:
    """`kept` (the model to go on with at `kept_round`) if it is at most --rejoin-max-age rounds behind the round
    the peer rejoins at, else the newest model of a live peer."""
    behind = None if kept_round is None else peer.round - kept_round
    if kept is not None and behind is not None and behind <= options.rejoin_max_age:
        peer.log.info("rejoined", round=peer.round, model=source, behind=behind, **fields)
        return kept
    vector = await peer.download_model()
    peer.log.info("rejoined", round=peer.round, model="peer", behind=behind, **fields)
    return vector


class Checkpoints:
    """Writes the model every --checkpoint-every rounds, off the event loop: in the worker call that trains the next
    round, before it trains (`before`), or, where no training comes before the node arrives, in a thread of its own
    (`drain`). One hand-off to a worker thread a round, not two (bench/README.md, issue 59 item 3)."""

    def __init__(self, options: DaemonOptions, peer: Peer, trained: Callable[[], dict[str, np.ndarray]]) -> None:
        self.every, self.peer, self.trained = options.checkpoint_every, peer, trained
        self.directory = checkpoint.state_dir(options)
        self.slots = checkpoint.Slots(self.directory) if self.directory is not None else None
        self._pending: checkpoint.Checkpoint | None = None  # taken after a round, not written yet
        self._failed: OSError | None = None  # a write that failed in a worker call, raised by `drain`

    async def after(self, t: int, vector: np.ndarray) -> None:
        if not self.every or self.slots is None or (t + 1) % self.every:
            return
        await self.drain()
        self._pending = checkpoint.Checkpoint(self.peer.run.run_id, self.peer.rank, self.peer.address, t + 1, vector,
                                              self.peer.compression_state(), self.trained())  # before t + 1 trains

    def before(self, work: Callable[..., T]) -> Callable[..., T]:
        """`work` (a worker thread's call) after the pending checkpoint is written; a write that fails is kept for
        `drain` to raise, and `work` runs all the same."""
        saved, self._pending = self._pending, None
        if saved is None:
            return work

        def written_then(*args: Any) -> T:
            self._write(saved)
            return work(*args)
        return written_then

    async def drain(self) -> None:
        """Write the pending checkpoint, if no worker call did. One that cannot be written ends the run
        (OutputError), at its last saved decision: a run whose checkpoints cannot be trusted could not be resumed
        exactly."""
        saved, self._pending = self._pending, None
        if saved is not None:
            await asyncio.to_thread(self._write, saved)
        if self._failed is not None:
            exc, self._failed = self._failed, None
            path = exc.filename or self.directory
            raise OutputError(f"cannot write the checkpoint {path}: {exc.strerror or exc}") from None

    def _write(self, saved: checkpoint.Checkpoint) -> None:
        assert self.slots is not None
        try:
            self.slots.save(saved)
        except OSError as exc:
            self._failed = exc
