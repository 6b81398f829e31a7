"""An asynchronous node daemon (`mosaicd cluster --sync async`, `mosaicd node --peer-list --sync async`):
`AsyncNodeState` driven for real (`async_member.AsyncNode`, its HTTP face `async_routes.async_app`), and its runs.

The state is the one `simulate --sync async` runs (`mosaic_proto.async_node`); this module only feeds it. Three
things run at once on the event loop, none waiting for another node:

- the training loop: H local steps of `state.start` in a worker thread (as slow as --node-profile's slowdown
  says), then `state.trained(...)`, which queues the step's sends (--async-send) and aggregates the inbox; then
  the next at once;
- the sender: the node's link, as the simulator's: the oldest queued message goes (`state.next_send`), one at a
  time, paced by the profile's bandwidth and latency (`outbound.Link`), signed with the run's key, its step in the
  header's round; a message not taken (a peer down or finished) is dropped, never retried (a newer one follows);
- POST /v1/fragments: decoded (`wire.decode`) and fed to `state.receive` with the sender the signature proved;
  POST /v1/pair (--exchange pairwise, AD-PSGD): a peer's whole model, averaged at once (`state.paired`) and the
  average answered, which the asking node keeps too (`state.averaged`);
- GET /v1/status: the state's `AsyncNodeStatus` (steps, inbox and queue depths, staleness), what this module
  counted, and every member's address; GET / the dashboard, which reads every member's status.

Replays: the signature's nonce is taken once within its time window (`http.auth`), and beyond it a sender's message
whose step is not newer than the newest taken from it is refused (409 `replayed_step`): a sender's messages to one
receiver leave in step order, so an honest one never is.

The roster comes from the launcher (`experiments/cluster_async.py`) or the --peer-list file: every member's
address, in rank order (the start's barrier: each node waits, up to --register-deadline, for the others to answer
/healthz). Every --checkpoint-every iterations the node checkpoints (`daemon/node/checkpoint.py`, in a worker
thread); started again with the same state directory, it goes on from its newest checkpoint (`restore`; not
bit-exact). When its --rounds iterations are done, or its --time-budget is spent (seconds from the start's
barrier, on this node's clock: it starts no iteration from then on), and its queue is sent, the node writes its
report (`async_end.write_report`: `async.json`, `model.npy`, `grid.npz`). In `cluster` it then serves until it
is stopped (at most `LINGER_S`): the launcher ends the run once every node has reported. In a peer list, rank 0
fetches every member's report (`collect`), writes the summary and tells them the run ended (`end_run`); the others
serve until then (`await_end`). Rank 0 told to stop records the run interrupted and tells them so at once
(`tell_interrupted`); a member that hears it stops its run where it is (`RunStop`), as if it were told to stop
itself, and exits 130.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from mosaicd.daemon.async_end import collect_reports, node_folder, summarize, tell_end
from mosaicd.daemon.entry import on_signals, told_to_stop
from mosaicd.daemon.http.auth import Secret, check_listen, signer
from mosaicd.daemon.http.client import Client, HttpError
from mosaicd.daemon.http.server import serve
from mosaicd.daemon.http.tls import client_context
from mosaicd.daemon.node.async_member import AsyncNode
from mosaicd.daemon.node.async_routes import async_app
from mosaicd.outputs import MODE_ENV, RunRecorder, failure_text, remove_summary
from mosaicd.settings import RunConfig, Settings

ROSTER_ENV = "MOSAICD_ASYNC_ROSTER"  # the launcher's roster file: {"addresses": [...]} in rank order
LINGER_S = 600.0  # a finished node serves this long at most, waiting to be stopped


async def wait_for_peers(client: Client, addresses: list[str], rank: int, deadline_s: float) -> None:
    """The start: every other member (`addresses`: their base URLs) answers /healthz, within `deadline_s`
    (TimeoutError naming those that did not)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline_s
    waiting = [a for i, a in enumerate(addresses) if i != rank]
    while waiting:
        answers = await asyncio.gather(*(client.request("GET", f"{a}/healthz", retries=0, timeout=1.0)
                                         for a in waiting), return_exceptions=True)
        waiting = [a for a, r in zip(waiting, answers, strict=True) if isinstance(r, BaseException)]
        if waiting and loop.time() > until:
            raise TimeoutError(f"members {waiting} did not start within {deadline_s:g} s (--register-deadline)")
        if waiting:
            await asyncio.sleep(0.05)


async def run_async_node(settings: Settings, addresses: list[str], rank: int, folder: Path,
                         peer_list: bool = False, barrier_url: str | None = None) -> int:
    """Serve, wait for the others, train --rounds iterations (or until --time-budget), send what is queued, report
    into `folder`. Then, in `cluster`, serve until the launcher stops the process; in a peer list, rank 0 collects
    the others' reports and writes the summary (`end_run`), and every other member serves until rank 0 says the run
    ended (`await_end`); registered with a barrier (`barrier_url`), every member serves until the barrier, which
    collects, says so."""
    from mosaicd.learning.tasks import build_task

    run = settings.run_config()
    options = settings.daemon_options()
    secret = Secret.of(options)
    check_listen(options, secret.keyring())
    task = await asyncio.to_thread(build_task, run, settings.data_dir)
    node = AsyncNode(settings, task, rank, addresses, secret, barrier_url)
    await asyncio.to_thread(node.restore)
    recorder = open_recorder(settings) if peer_list and rank == 0 and barrier_url is None else None
    runner, _ = await serve(async_app(node), options)  # the one way a member listens (its caps, a handed socket)
    code = 0
    # a command's member told to stop (SIGTERM, as `scancel` and `docker stop` send; Ctrl-C) leaves at once, its run
    # record saying so, and its process ends within `entry.EXIT_WITHIN_S` whatever it still waits for
    task = asyncio.current_task()
    stopped = on_signals(task, 130) if task is not None and (peer_list or barrier_url is not None) else None
    if stopped is not None:  # ... and so when its collector, told to stop, says so
        node.stop.cancels(task)
    sign = None if node.keyring is None else signer(lambda: node.keyring.credentials(run.run_id), lambda: str(rank))
    try:
        async with Client(settings.request_timeout, 0, signer=sign, ssl_context=client_context(node.options)) as client:
            await wait_for_peers(client, [node.url(r, "") for r in range(len(addresses))], rank,
                                 settings.register_deadline)
            sending = asyncio.ensure_future(node.send(client))
            training = asyncio.ensure_future(node.train())
            await asyncio.sleep(0)  # its start is set: the grid counts from it
            grid = asyncio.ensure_future(node.snapshots())
            await training
            grid.cancel()
            await sending
            node.save_report(folder)  # the launcher reads the model once the report is there
            if recorder is not None:
                await end_run(node, client, settings, recorder)
            elif peer_list or barrier_url is not None:
                code = await await_end(node, client, settings)
            else:
                await asyncio.sleep(LINGER_S)  # the others may still send; the launcher stops this process
    except BaseException as exc:
        interrupted = isinstance(exc, asyncio.CancelledError | KeyboardInterrupt)
        if recorder is not None:  # interrupted: the process was told to stop (a signal), a person stopped the run
            reason = (f"interrupted (rank 0 at {addresses[rank]}, which collects the run, was told to stop with "
                      f"{node.state.step} of {run.rounds} iterations done)")
            recorder.fail(reason if interrupted else failure_text(exc))
            if interrupted:  # every member stops too, at once; one that does not hear it keeps waiting for rank 0
                await tell_interrupted(node, sign, [r for r in range(len(addresses)) if r != rank], reason)
        if interrupted and node.stop.reason is not None and not stopped:
            print(f"mosaicd node: {node.stop.reason}; this member (rank {rank}) stopped with {node.state.step} of "
                  f"{run.rounds} iterations done; {how_to_resume(node)}", file=sys.stderr, flush=True)
        elif not (interrupted and stopped):
            raise
        code = 130
    finally:
        await runner.cleanup()
    return told_to_stop(code) if stopped is not None and (stopped or node.stop.reason is not None) else code


TELL_WITHIN_S = 0.5  # the collector told to stop tells its members in parallel, within this: it ends within 1.5 s


async def tell_interrupted(node: AsyncNode, sign: Any, ranks: list[int], reason: str) -> None:
    """The collector (rank 0 of a peer list) told to stop: POST /v1/async/end {"interrupted": reason} to every
    member of `ranks` at once, each given `TELL_WITHIN_S`; one that does not answer is not waited for."""
    async with Client(TELL_WITHIN_S, 0, signer=sign, ssl_context=client_context(node.options)) as client:
        await tell_end(client, node.url, ranks, reason, timeout=TELL_WITHIN_S, retries=0)


def how_to_resume(node: AsyncNode) -> str:
    """What a member interrupted with its collector says of going on: from its checkpoints, where it keeps them."""
    if node.state_dir is None or not node.options.checkpoint_every:
        return ("start the same commands again, on every member, to run it again (this member keeps no checkpoint: "
                "--checkpoint-every 0 or --port 0; it starts over)")
    return (f"start the same commands again, on every member, to resume it: each goes on from its newest checkpoint "
            f"(this member's in {node.state_dir}; not bit-exact)")


def open_recorder(settings: Settings) -> RunRecorder:
    """Rank 0 of a peer list's run record in its --out (summary.json says "running" from the first row on)."""
    out = Path(settings.out)
    remove_summary(out)
    return RunRecorder(out, settings, mode=os.environ.get(MODE_ENV, "node"))


async def end_run(node: AsyncNode, client: Client, settings: Settings, recorder: RunRecorder) -> None:
    """Rank 0 of a peer list: every member's report fetched into OUT/nodes/<rank> (`collect`), the summary written
    (`async_end.summarize`), then each member told that the run ended."""
    out = Path(settings.out)
    reports, lost = await collect(node, client, out, settings)
    summary = await asyncio.to_thread(summarize, out, settings, recorder, reports, lost,
                                      addresses=node.addresses)
    node.log.info("async_run_ended", members=sorted(reports), dropped=lost, status=summary.get("status"))
    await tell_end(client, node.url, [r for r in sorted(reports) if r != node.rank])


async def collect(node: AsyncNode, client: Client, out: Path, settings: Settings,
                  poll_s: float = 0.2) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Rank 0 of a peer list: its own report and every other member's (`async_end.collect_reports`)."""
    others = [r for r in range(len(node.addresses)) if r != node.rank]
    reports, lost = await collect_reports(client, node.url, others, out, settings, node.log, poll_s)
    return {node.rank: node.report(), **reports}, lost


async def await_end(node: AsyncNode, client: Client, settings: Settings, poll_s: float = 1.0) -> int:
    """A member, reported, that does not collect: serve until the collector (rank 0 of a peer list, or the
    barrier) says the run ended (0), or until it has not answered for --register-deadline seconds in a row (1: the
    summary will not come from it)."""
    loop = asyncio.get_running_loop()
    heard = loop.time()
    while not node.ended.is_set():
        try:
            await client.request("GET", f"{node.collector_url}/healthz", retries=0, timeout=2.0)
            heard = loop.time()
        except HttpError:
            if loop.time() - heard > settings.register_deadline:
                print(f"mosaicd node: error: {node.collector_name} ({node.collector_url}) did not answer for "
                      f"{settings.register_deadline:g} s (--register-deadline): no summary will come from it; this "
                      f"node's report is in {node_folder(Path(settings.out), node.rank)}", file=sys.stderr, flush=True)
                return 1
        try:
            await asyncio.wait_for(node.ended.wait(), poll_s)
        except TimeoutError:
            pass
    return 0


async def run_registered_node(settings: Settings, run: RunConfig, addresses: list[str], rank: int, port: int
                              ) -> int:
    """`mosaicd node --barrier-url URL` whose barrier runs --sync async (compose): registered as rank `rank` of
    `addresses` (the barrier's roster) with the barrier's run, this node runs what a peer list's member runs, on
    the same port; its report goes into OUT/nodes/<rank>, and the barrier collects it and ends the run."""
    settings = settings.model_copy(update={**{k: getattr(run, k) for k in RunConfig.model_fields}, "port": port})
    return await run_async_node(settings, addresses, rank, node_folder(Path(settings.out), rank),
                                barrier_url=settings.barrier_url)


async def run_peer_list_node(settings: Settings) -> int:
    """`mosaicd node --peer-list FILE --sync async`: this node is the member the file lists at its address (rank:
    the file's order, as in --sync barrier); its report goes into OUT/nodes/<rank>, and rank 0 writes the run's
    summary into its OUT."""
    from mosaicd.daemon.http.membership import listed_addresses, own_address

    options = settings.daemon_options()
    addresses = listed_addresses(options)
    rank = addresses.index(own_address(options, options.port))
    settings = settings.model_copy(update={"nodes": len(addresses)})
    return await run_async_node(settings, addresses, rank, node_folder(Path(settings.out), rank), peer_list=True)


def main() -> None:
    from mosaicd.logs import configure_logging

    settings = Settings.load()
    configure_logging(settings.log_level, settings.log_json)
    try:
        roster = json.loads(Path(os.environ[ROSTER_ENV]).read_text())["addresses"]
        rank = roster.index(settings.advertise or f"{settings.host}:{settings.port}")
        code = asyncio.run(run_async_node(settings, roster, rank, Path(settings.out)))
    except TimeoutError as exc:
        print(f"mosaicd node: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    main()
