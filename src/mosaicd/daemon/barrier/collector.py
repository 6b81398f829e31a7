"""The barrier of an asynchronous run (`mosaicd barrier --sync async`, compose with MOSAIC_SYNC=async): the
membership point and the collector, never on the data path.

Nodes register as in a barrier run (registration.py: the count, the settle, the roster) and hear the run's settings
and the roster; from then on they run as a peer list's members do (`daemon/node/async_run.py`), and the barrier
opens no round (no deadline runs: `DecisionRunner._arm_timers`). `collect_run` fetches each member's report once it
has done its iterations (POST /v1/async/result, signed as the barrier; `async_end.collect_reports`, as rank 0 of a
peer list does), writes them into OUT/nodes/<rank>, evaluates them into rounds.csv and summary.json
(`async_end.summarize`), then tells each member that the run ended (POST /v1/async/end) and ends itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mosaicd.daemon.async_end import collect_reports, summarize, tell_end
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.http.auth import signer
from mosaicd.daemon.http.client import Client
from mosaicd.daemon.http.tls import client_context, scheme
from mosaicd.outputs import failure_text
from mosaicd.settings import Settings

POLL_S = 1.0  # how often a member still training is asked for its report (it answers 409 running)


async def collect_run(barrier: Barrier, settings: Settings) -> None:
    """Once the roster is made: every member's report, the summary, the end told to the members, then the barrier's
    `done`. A registration that failed ends the run without it (the barrier said why)."""
    await barrier.await_roster()
    if barrier.done.is_set() or not barrier.state.phases.goes_on:
        return
    run, options, addresses = barrier.run, barrier.options, list(barrier.state.addresses)
    settings = settings.model_copy(update={"nodes": len(addresses)})
    keyring = barrier.keyring
    sign = signer(lambda: keyring.credentials(run.run_id), lambda: "barrier") if keyring else None
    base = scheme(options)

    def url(rank: int, path: str) -> str:
        return f"{base}://{addresses[rank]}{path}"
    async with Client(settings.request_timeout, 0, signer=sign, ssl_context=client_context(options)) as client:
        reports: dict[int, dict[str, Any]] = {}
        try:
            reports, lost = await collect_reports(client, url, list(range(len(addresses))), options.out, settings,
                                                  barrier.log, POLL_S)
            if not reports:
                raise RuntimeError(f"no member reported its iterations (given up: {lost})")
            summary = await asyncio.to_thread(summarize, options.out, settings, barrier.recorder, reports, lost,
                                              addresses=addresses)
        except Exception as exc:
            barrier.end_failed(failure_text(exc))
            summary = None
        barrier.log.info("async_run_ended", members=sorted(reports), status=(summary or {}).get("status"))
        await tell_end(client, url, list(range(len(addresses))))
    if summary is not None:
        barrier.reported(summary)
