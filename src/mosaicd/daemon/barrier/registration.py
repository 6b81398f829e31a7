"""Registration at the barrier: the roster is made once every expected node registered (a count given, the
addresses a DNS name resolves to once they hold still, or the nodes registered once no new one came for a while),
or the run fails at --register-deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from mosaic_proto import BarrierError, BarrierPhase, BarrierReason, reopen
from mosaic_proto import rebind as rebind_member
from mosaic_proto import withdraw as withdraw_registration
from mosaicd.daemon.deadlines import join_wait
from mosaicd.daemon.http.membership import listed_addresses, resolve_all

if TYPE_CHECKING:
    from mosaicd.daemon.barrier.barrier import Barrier


async def register(barrier: Barrier, address: str) -> dict[str, Any]:
    """Long poll until the roster is made: {"rank", "members", "run", "round", "live"}. A node that comes
    back (or, with --allow-join, a new one) waits for the open round's release and joins the next round.
    BarrierError if refused."""
    state = barrier.state
    if state.phase is BarrierPhase.RUNNING and (state.round > 0 or address not in state.addresses
                                                or state.addresses.index(address) in state.dropped):
        return await join(barrier, address)
    rank = barrier.state.register(address, barrier.now())
    if rank is None:
        barrier.metrics.registered.set(len(barrier.state.pending))
        barrier.log.info("registered", address=address, registered=len(barrier.state.pending),
                         expected=barrier.state.expected, **({"not_yet": missing} if (missing := unregistered(barrier))
                                                             else {}))
        maybe_close(barrier)
        try:
            await asyncio.wait_for(barrier.registered.wait(), timeout=barrier.options.register_deadline)
        except TimeoutError:
            pass
        rank = barrier.state.register(address, barrier.now())
        if rank is None:
            raise BarrierError(BarrierReason.REGISTRATION_FAILED,
                               barrier.state.failure or "registration did not complete")
    return {"rank": rank, "members": list(barrier.state.addresses), "run": barrier.run.model_dump(mode="json"),
            "round": 0, "live": list(barrier.state.live)}

async def join(barrier: Barrier, address: str) -> dict[str, Any]:
    """A member that comes back (or a newcomer, with --allow-join): it joins from the next round."""
    rank, release = barrier.state.join(address, barrier.now(), allow_new=barrier.options.allow_join)
    at = barrier.state.round - (release is not None)
    barrier.save_journal()
    barrier.log.warning("joining", rank=rank, address=address, from_round=at + 1)
    if release is not None:
        await barrier.publish(release)
    told = await barrier.wait_published(at, join_wait(barrier.run.round_deadline))
    return {"rank": rank, "members": list(barrier.state.addresses), "run": barrier.run.model_dump(mode="json"),
            "round": at + 1, "live": told["members"]}


async def rebind(barrier: Barrier, address: str, rank: int) -> dict[str, Any]:
    """A member of a resumed run (`--resume-round`) started again, at any address: it takes its rank back. Once
    every live member is back, they all hear the new addresses and the open round starts again, its deadline
    counted from then (`mosaicd cluster --resume`)."""
    state = barrier.state
    if rank not in barrier.rebinding:
        raise BarrierError(BarrierReason.REGISTRATION_CLOSED, f"rank {rank} is not a member the resumed run waits "
                           f"for (it waits for {sorted(barrier.rebinding)})")
    rebind_member(state, rank, address, barrier.now())
    barrier.rebinding.discard(rank)
    barrier.log.info("rebound", rank=rank, address=address, waiting_for=sorted(barrier.rebinding))
    if not barrier.rebinding:
        reopen(state, barrier.now())
        barrier.save_journal()
        barrier.arm_deadline()
        barrier.log.warning("resumed_all", round=state.round, live=len(state.live))
        barrier.rebound.set()
    try:
        await asyncio.wait_for(barrier.rebound.wait(), timeout=barrier.options.register_deadline)
    except TimeoutError:
        raise BarrierError(BarrierReason.REGISTRATION_FAILED, f"members {sorted(barrier.rebinding)} did not come "
                           f"back within --register-deadline {barrier.options.register_deadline:g}s") from None
    return {"rank": rank, "members": list(state.addresses), "run": barrier.run.model_dump(mode="json"),
            "round": state.round, "live": list(state.live)}


def maybe_close(barrier: Barrier) -> None:
    """Make the roster once every expected node registered (the count may be known only now: DNS)."""
    if not barrier.state.complete:
        return
    count = len(barrier.state.pending)
    try:  # the node count may be known only now (DNS): check the run as it will be
        barrier.run = barrier.run.with_nodes(count)
    except ValueError as exc:
        dns, settle = barrier.options.expect_dns, barrier.options.expect_settle
        counted = (f" ({dns} resolved to that many addresses)" if dns else
                   f" (none new came for --expect-settle {settle:g}s)" if settle else "")
        return fail_registration(barrier, f"{count} nodes registered{counted}, but the run is invalid with them: "
                                 f"{exc}", 422)
    barrier.state.min_members = barrier.run.min_members
    barrier.state.close(barrier.now())
    barrier.save_journal()
    barrier.arm_deadline()
    barrier.recorder.settings["nodes"] = count
    barrier.metrics.members.set(count)
    barrier.log.info("registration_closed", members=count)
    barrier.registered.set()


async def withdraw(barrier: Barrier, address: str, reason: str) -> dict[str, Any]:
    """`address` registered and was told to stop before the roster was made: the roster is made without it (a
    node that does not come cannot be waited for a round). Once the roster is made, it leaves as a member."""
    state = barrier.state
    if withdraw_registration(state, address):
        barrier.metrics.registered.set(len(state.pending))
        barrier.log.warning("withdrew", address=address, reason=reason, registered=len(state.pending),
                            expected=state.expected)
        return {"withdrawn": address, "registered": len(state.pending)}
    if address in state.addresses:
        return await barrier.leave(state.addresses.index(address), reason)
    raise BarrierError(BarrierReason.UNKNOWN_RANK, f"{address} has not registered")


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
        missing = unregistered(barrier)
        fail_registration(barrier, f"registration deadline ({barrier.options.register_deadline:g}s) passed with "
                          f"{len(barrier.state.pending)} of {barrier.state.expected or '?'} nodes" + (
                              f"; not registered: {', '.join(missing)}" if missing else ""), 503)


def unregistered(barrier: Barrier) -> list[str]:
    """The members a peer list names that have not registered yet (without a list, the barrier knows no names)."""
    if getattr(barrier.options, "peer_list", None) is None:
        return []
    try:
        listed = listed_addresses(barrier.options)
    except (OSError, ValueError):  # the list changed under the run: say nothing rather than something wrong
        return []
    return [a for a in listed if a not in barrier.state.pending]


async def count_nodes(barrier: Barrier) -> None:
    """Where the barrier is not told the node count, learn it while nodes register: --expect-dns counts the addresses
    the name resolves to once they hold still for --dns-settle seconds; --expect-settle counts the nodes registered
    once none new has come for that many seconds, or for twice the longest pause between two registrations so far,
    whichever is longer (replicas that start on a loaded host come in bursts), three times as long while too few
    came for the run's fanout (more are likely on their way; if not, the run fails saying why)."""
    options = barrier.options
    if options.expect_dns:
        async def resolved() -> int:
            return len(await asyncio.to_thread(resolve_all, options.expect_dns))

        await settled_count(barrier, resolved, lambda count, longest: options.dns_settle, every=0.5)
    elif options.expect_settle:
        async def registered() -> int:
            return len(barrier.state.pending)

        def settle(count: int, longest: float) -> float:
            return max(options.expect_settle, 2 * longest) * (1 if count > barrier.run.fanout else 3)

        await settled_count(barrier, registered, settle, every=0.25)


async def settled_count(barrier: Barrier, read: Callable[[], Awaitable[int]], settle: Callable[[int, float], float],
                        every: float) -> None:
    """Count the nodes as `read()` once it has held still for `settle(count, longest pause between two changes so
    far)` seconds; nothing is counted while it moves."""
    changed, last, longest = barrier.now(), -1, 0.0
    while barrier.state.phase is BarrierPhase.REGISTERING:
        count = await read()
        if count != last:
            if last > 0:
                longest = max(longest, barrier.now() - changed)
            last, changed = count, barrier.now()
            barrier.state.expected = 0
        if count and barrier.now() - changed >= settle(count, longest):
            barrier.state.expected = count
            maybe_close(barrier)
        barrier.metrics.expected.set(barrier.state.expected)
        await asyncio.sleep(every)
