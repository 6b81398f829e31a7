"""Registration at the barrier: the long polls of the nodes that register (until the roster is made), come back
(join), come back at new addresses (a resumed run: rebind), come back with their checkpoints to a run resumed where
they all start again (rank 0 of a peer list: comeback.py) or withdraw; and how the node count is learned where it is
not given (it reads the addresses a DNS name resolves to, or the nodes registered, and the state takes the count
once it holds still: `BarrierState.count`). The long polls ask the state (`Host.decide`: `register`, `close`, `join`,
`rebind`, `registration.came_back`, `withdraw`, `count`) and wait; they write nothing of it and decide nothing by
waiting: the run failing at --register-deadline is the state's (`BarrierState.registration_deadline`, which the
runner's timer feeds to `tick`), and the barrier runs what each decision calls for (`DecisionRunner.apply`:
journal, timers, records, notices) and tells them (`roster_made`, `all_back`, `failed`). A long poll's own limit
only ends that request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from mosaic_proto import BarrierError, BarrierReason, BarrierState, Joined, Registration, TaskClaim
from mosaicd.daemon.barrier.comeback import Comeback, NotExact
from mosaicd.daemon.barrier.metrics import BarrierMetrics
from mosaicd.daemon.barrier.runner import Asked
from mosaicd.daemon.deadlines import join_wait
from mosaicd.daemon.http.membership import listed_addresses, resolve_all
from mosaicd.settings import DaemonOptions, RunConfig


class Host(Protocol):
    """What registration needs of the barrier (`Barrier`): its state to read, and `decide`, the one way to feed it."""

    state: BarrierState
    run: RunConfig
    options: DaemonOptions
    metrics: BarrierMetrics
    log: Any

    def now(self) -> float: ...

    def decide(self, ask: Callable[[BarrierState, float], Asked]) -> Asked: ...

    def close_roster(self, run: RunConfig) -> None: ...

    def resume_at(self, round: int) -> None: ...

    def fail_registration(self, reason: str) -> None: ...

    async def wait_published(self, round: int, limit: float) -> dict[str, Any]: ...

    async def leave(self, rank: int, reason: str) -> dict[str, Any]: ...


class Registrar:
    """The registration's long polls, its node count and its deadline, for one barrier (`host`)."""

    def __init__(self, host: Host, comeback: Comeback | None = None) -> None:
        """`comeback`: the members of a run resumed where they all start again (comeback.py), if it is one."""
        self.host, self.comeback = host, comeback
        self.status = 503  # what a failed registration answers: 422 when the run as registered is invalid
        self.registered, self.rebound = asyncio.Event(), asyncio.Event()

    def tasks(self) -> list[Coroutine[Any, Any, None]]:
        """What runs while nodes register: the node count, where it is not given (the deadline is the state's)."""
        host = self.host
        return [count_nodes(host.options, lambda: host.state.phases.registering, lambda: len(host.state.pending),
                            self._counted)]

    def roster_made(self) -> None:
        """The roster is made (`Barrier.apply`; or by the barrier this one resumes the run of): every registration
        waiting hears its rank."""
        self.registered.set()

    def members_return(self, comeback: Comeback) -> None:
        """The members of the run resumed are all awaited back (`Barrier.members_restarted`): they come back so."""
        self.comeback = comeback

    def all_back(self) -> None:
        """Every member of a resumed run is back (`Barrier.apply`): each waiting hears the run goes on."""
        self.rebound.set()

    def failed(self) -> None:
        """The registration (or a resumed run's members coming back) failed (`Barrier.apply`): each waiting hears
        why (`BarrierState.failure`)."""
        self.registered.set()
        self.rebound.set()

    async def register(self, address: str, rank: int | None = None, held: list[int] | None = None,
                       runs: TaskClaim | None = None) -> dict[str, Any]:
        """Long poll until the roster is made: the `Registration` as JSON. A node that comes back (or, with
        --allow-join, a new one) waits for the open round's release and joins the next round; a member of a resumed
        run (`rank`; or, where every member starts again, its address and the rounds of its checkpoints, `held`)
        waits for every member to be back. `runs`: what the node runs; one the barrier's task does not fit is
        refused (task_differs), and, while nodes register, ends the run: the barrier was started for another.
        BarrierError if refused."""
        host, state = self.host, self.host.state
        if (differs := host.decide(lambda s, now: s.task.differs(address, runs))) is not None:
            if state.phases.registering:
                self._fail(differs, 422)
            raise BarrierError(BarrierReason.TASK_DIFFERS, differs)
        if self.comeback is not None and self.comeback.waits(state, address):
            return await self._come_back(self.comeback, address, held or [])
        if rank is not None:
            return await self._rebind(address, rank)
        given = host.decide(lambda s, now: s.register(address, now, allow_new=host.options.allow_join))
        if isinstance(given, Joined):
            return await self._join(given)
        if given is not None and state.phases.goes_on:  # told it sits out, it asks again once placed: the open round
            return self._reply(given, state.round, state.live)
        if given is None:
            host.metrics.registered.set(len(state.pending))
            host.log.info("registered", address=address, registered=len(state.pending), expected=state.expected,
                          **({"not_yet": missing} if (missing := state.registration.unregistered(state.pending))
                             else {}))
            self._close_if_complete()
            await waited(self.registered, host.options.register_deadline)  # the state's deadline ends it before
            if (given := host.decide(lambda s, now: s.register(address, now, waited=True))) is None:
                raise BarrierError(BarrierReason.REGISTRATION_FAILED, state.failure or "registration did not complete")
        return self._reply(given, 0, state.live)

    def member_again(self, address: str) -> dict[str, Any]:
        """--sync async, the roster made: a member started again (its container restarted) hears its rank and the
        roster at once; it goes on from its own checkpoint, and nobody waits for it (no round to join)."""
        state = self.host.state
        self.host.log.warning("member_again", address=address, rank=state.addresses.index(address))
        return self._reply(state.addresses.index(address), 0, list(range(len(state.addresses))))

    def _reply(self, rank: int, round: int, live: list[int], resumed: bool = False) -> dict[str, Any]:
        host = self.host
        return Registration(rank, host.state.addresses, host.run.model_dump(mode="json"), round, tuple(live),
                            resumed).to_json()

    async def _join(self, joined: Joined) -> dict[str, Any]:
        """A member that comes back (or a newcomer, with --allow-join): it joins from the next round. A member's new
        incarnation hears so at once (409 `joining`), so that it refuses the open round's fragments for good while
        it waits, then asks again for its place (docs/spec.md, step 7)."""
        host = self.host
        if joined.incarnation:
            raise BarrierError(BarrierReason.JOINING, f"{joined.address} is rank {joined.rank} started again: it sits "
                               f"out round {joined.round} and is a member from round {joined.from_round}; register "
                               "again for its place")
        told = await host.wait_published(joined.round, join_wait(host.run.round_deadline))
        return self._reply(joined.rank, joined.from_round, told["members"])

    async def _rebind(self, address: str, rank: int) -> dict[str, Any]:
        """A member of a resumed run (`--resume-round`) started again, at any address: it takes its rank back. Once
        every live member is back, they all hear the new addresses and the open round starts again, its deadline
        counted from then (`mosaicd cluster --resume`)."""
        host, state = self.host, self.host.state
        host.decide(lambda s, now: s.rebind(rank, address, now))
        await self._all_back(lambda: sorted(state.awaited))
        return self._reply(rank, state.round, state.live)

    async def _all_back(self, missing: Callable[[], list[int]]) -> None:
        """Until every member of a resumed run is back (or it failed: where every member starts again, the state
        ends the run at --register-deadline, `RegistrationWait.came_back`); this request alone is refused after
        --register-deadline, naming the `missing` ones."""
        host = self.host
        if not await waited(self.rebound, host.options.register_deadline):
            deadline = host.options.register_deadline
            raise BarrierError(BarrierReason.REGISTRATION_FAILED, host.state.failure if host.state.phases.failed else
                               f"members {missing()} did not come back within --register-deadline {deadline:g}s")

    async def _come_back(self, comeback: Comeback, address: str, held: list[int]) -> dict[str, Any]:
        """A member of a run resumed where every member starts again, with the rounds of its checkpoints (`held`).
        Once every live member is back, the run goes on at the round `comeback` chooses, every member from its
        checkpoint of it (the answer says `resumed`); where there is none, every member hears why (422) and the
        run ends, failed, its journal as it was."""
        host = self.host
        if host.state.phases.rebinding:
            rank = comeback.back(host.state, address, held)
            host.decide(lambda s, now: s.registration.came_back(rank, now, host.options.register_deadline))
            host.log.info("back", rank=rank, address=address, checkpoints=sorted(held, reverse=True),
                          waiting_for=comeback.missing(host.state))
            if not comeback.missing(host.state):
                self._resume_chosen(comeback)
        await self._all_back(lambda: comeback.missing(host.state))
        state = host.state
        if state.phases.failed:
            raise BarrierError(BarrierReason.REGISTRATION_FAILED, state.failure or "the run failed")
        rank = state.addresses.index(address)
        return self._reply(rank, state.round, state.live, resumed=True)

    def _resume_chosen(self, comeback: Comeback) -> None:
        """Every member is back: the run goes on at the round chosen, with each at the address it came back at."""
        host = self.host
        try:
            round = comeback.choose()
        except NotExact as exc:
            self._fail(str(exc), 422)  # every member waiting hears it (`failed`)
            return
        host.resume_at(round)
        try:  # the last one back is saved (`Barrier.apply`); the others wait for it, or hear that the run failed
            for rank in sorted(host.state.awaited):
                host.decide(lambda s, now, rank=rank: s.rebind(rank, comeback.addresses[rank], now))
        finally:
            self.rebound.set()

    async def withdraw(self, address: str, reason: str) -> dict[str, Any]:
        """`address` registered and was told to stop before the roster was made: the roster is made without it (a
        node that does not come cannot be waited for a round). Once the roster is made, it leaves as a member."""
        host, state, comeback = self.host, self.host.state, self.comeback
        if comeback is not None and state.phases.rebinding and comeback.forget(address):
            host.decide(lambda s, now: s.registration.came_back(state.addresses.index(address), now,
                                                                 host.options.register_deadline, withdrew=True))
            host.log.warning("withdrew", address=address, reason=reason, back=len(comeback.addresses))
            return {"withdrawn": address, "registered": len(comeback.addresses)}
        withdrawal = host.decide(lambda s, now: s.withdraw(address, reason))
        if withdrawal is not None:
            return withdrawal.to_json()
        if address in state.addresses:
            return await host.leave(state.addresses.index(address), reason)
        raise BarrierError(BarrierReason.UNKNOWN_RANK, f"{address} has not registered")

    def _counted(self, reading: int) -> None:
        """The node count read while nodes register: the state takes it once it holds still (`BarrierState.count`),
        and the roster is made once they are all here."""
        host = self.host
        if not host.state.phases.registering:
            return
        host.decide(lambda s, now: s.count(reading, now))
        if host.state.expected:
            self._close_if_complete()
        host.metrics.expected.set(host.state.expected)

    def _close_if_complete(self) -> None:
        """Make the roster once every expected node registered (the count may be known only now: DNS)."""
        host = self.host
        if not host.state.complete:
            return
        count = len(host.state.pending)
        try:  # the node count may be known only now (DNS): check the run as it will be
            run = host.run.with_nodes(count)
        except ValueError as exc:
            return self._fail(invalid_count(count, host.options, exc), 422)
        host.close_roster(run)

    def _fail(self, reason: str, status: int) -> None:
        """Registration cannot complete: the run ends, and every waiting node hears `reason` (`status`; `failed`)."""
        self.status = status
        self.host.fail_registration(reason)


async def waited(event: asyncio.Event, limit: float) -> bool:
    """Whether `event` was set within `limit` seconds: a long poll's own limit, which ends that request only."""
    try:
        await asyncio.wait_for(event.wait(), timeout=limit)
    except TimeoutError:
        return False
    return True


def peer_list_names(options: DaemonOptions) -> tuple[str, ...]:
    """The members a peer list names, in rank order, read as the registration opens (`RegistrationWait.begin`: its
    failure line names those that did not register); none without a list, or where it cannot be read (say nothing
    rather than something wrong)."""
    if getattr(options, "peer_list", None) is None:
        return ()
    try:
        return tuple(listed_addresses(options))
    except (OSError, ValueError):
        return ()


def invalid_count(count: int, options: DaemonOptions, exc: ValueError) -> str:
    """Why the run cannot go on with the `count` nodes that registered (422: retrying cannot help)."""
    dns, settle = options.expect_dns, options.expect_settle
    per = options.nodes_per_address
    counted = (f" ({dns} resolved to {count // per} addresses of {per} nodes each)" if dns and per > 1 else
               f" ({dns} resolved to that many addresses)" if dns else
               f" (none new came for --expect-settle {settle:g}s)" if settle else "")
    return f"{count} nodes registered{counted}, but the run is invalid with them: {exc}"


async def count_nodes(options: DaemonOptions, registering: Callable[[], bool], registered: Callable[[], int],
                      counted: Callable[[int], None]) -> None:
    """Where the barrier is not told the node count, read it while nodes register (`counted(reading)`; the state
    takes it once it holds still: `BarrierState.count`, its `CountRule`): --expect-dns reads the addresses the name
    resolves to every half second (times --nodes-per-address: a container of several nodes is one address),
    --expect-settle the nodes registered every quarter second."""
    if options.expect_dns:
        async def read() -> int:
            return len(await asyncio.to_thread(resolve_all, options.expect_dns)) * options.nodes_per_address
        every = 0.5
    elif options.expect_settle:
        async def read() -> int:
            return registered()
        every = 0.25
    else:
        return
    while registering():
        counted(await read())
        await asyncio.sleep(every)
