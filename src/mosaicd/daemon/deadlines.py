"""How long the node and the barrier hold a long poll beyond the round's deadline: one home for the paddings both
sides must agree on (a node that gave up earlier than the barrier answers would retry a round already decided)."""

from __future__ import annotations

RELEASE_PADDING_S = 60.0  # a release may come this long after the deadline: the journal, a collection, a busy host
FINAL_PADDING_S = 600.0  # the final release also waits for the final models to be collected
REQUESTS_PER_ARRIVAL = 2  # an arrival may follow a send that took a whole request timeout, and may retry once


def release_wait(round_deadline: float, request_timeout: float) -> float:
    """Barrier: how long an arrival waits for its round's release before it is answered 503 barrier_timeout."""
    return round_deadline + RELEASE_PADDING_S + REQUESTS_PER_ARRIVAL * request_timeout


def join_wait(round_deadline: float) -> float:
    """Barrier: how long a node that (re)joins waits for the open round's release."""
    return round_deadline + RELEASE_PADDING_S


def arrival_timeout(round_deadline: float, request_timeout: float, final: bool) -> float:
    """Node: the client's deadline for one arrival's long poll (the final one waits for the models' collection)."""
    return round_deadline + REQUESTS_PER_ARRIVAL * request_timeout + (FINAL_PADDING_S if final else RELEASE_PADDING_S)
