"""Registration at the barrier: the roster is made once every expected node registered (a count given, or the
addresses a DNS name resolves to, once they hold still), or the run fails at --register-deadline."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from mosaic_proto import BarrierPhase
from mosaicd.daemon.http.membership import resolve_all

if TYPE_CHECKING:
    from mosaicd.daemon.barrier.barrier import Barrier


def maybe_close(barrier: Barrier) -> None:
    """Make the roster once every expected node registered (the count may be known only now: DNS)."""
    if not barrier.state.complete:
        return
    count = len(barrier.state.pending)
    try:  # the node count may be known only now (DNS): check the run as it will be
        barrier.run = barrier.run.with_nodes(count)
    except ValueError as exc:
        dns = barrier.options.expect_dns
        counted = f" ({dns} resolved to that many addresses)" if dns else ""
        return fail_registration(barrier, f"{count} nodes registered{counted}, but the run is invalid with them: "
                                 f"{exc}", 422)
    barrier.state.close(barrier.now())
    barrier.save_journal()
    barrier.arm_deadline()
    barrier.recorder.settings["nodes"] = count
    barrier.metrics.members.set(count)
    barrier.log.info("registration_closed", members=count)
    barrier.registered.set()


def fail_registration(barrier: Barrier, reason: str, status: int) -> None:
    """Registration cannot complete: every waiting node hears `reason` (`status`), and the run ends."""
    barrier.state.fail(reason)
    barrier.register_status = status
    barrier.log.error("registration_failed", detail=reason)
    barrier.recorder.fail(f"registration failed: {reason}")
    barrier.registered.set()
    barrier.done.set()


async def registration_deadline(barrier: Barrier) -> None:
    """Fail the registration if it is not complete by --register-deadline."""
    await asyncio.sleep(barrier.options.register_deadline)
    if barrier.state.phase is BarrierPhase.REGISTERING:
        fail_registration(barrier, f"registration deadline ({barrier.options.register_deadline:g}s) passed with "
                          f"{len(barrier.state.pending)} of {barrier.state.expected or '?'} nodes", 503)


async def watch_dns(barrier: Barrier) -> None:
    """Count nodes as the addresses the service name resolves to, once the count holds still."""
    stable_since, last = barrier.now(), -1
    while barrier.state.phase is BarrierPhase.REGISTERING:
        count = len(await asyncio.to_thread(resolve_all, barrier.options.expect_dns))
        if count != last:  # still moving (replicas starting): nothing is counted until it holds still
            last, stable_since = count, barrier.now()
            barrier.state.expected = 0
        if count and barrier.now() - stable_since >= barrier.options.dns_settle:
            barrier.state.expected = count
            maybe_close(barrier)
        barrier.metrics.expected.set(barrier.state.expected)
        await asyncio.sleep(0.5)
