"""`NodeReport`: one node's account of one round, the one definition that the node sends with its arrival and
that the barrier (nodes.csv rows, history), `mosaicd status` and the dashboard read.

A node knows its traffic, refusals and phase times when it is done sending; it learns its barrier wait and the
round's stragglers at the release (`wait_s`, `stragglers`). `delivered` says which peers took which fragments,
so the barrier counts each node's incoming traffic from its senders' reports, without asking the receivers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .round import TRAFFIC, RoundReport, Traffic

__all__ = ["NODE_COLUMNS", "NodeReport", "ReportError", "received_counts"]

_RANK = re.compile(r"[0-9]{1,9}")


class ReportError(ValueError):
    """A report that cannot be a node's account of its round (the barrier refuses it, recording nothing)."""


@dataclass(frozen=True)
class NodeReport:
    round: int
    loss: float = math.nan
    traffic: Traffic = field(default_factory=Traffic)  # read as the report's own too: `report.bytes_out`
    refused: dict[str, int] = field(default_factory=dict)
    train_s: float = 0.0
    send_s: float = 0.0
    wait_s: float | None = None
    aggregate_s: float = 0.0
    delivered: dict[int, tuple[int, int]] = field(default_factory=dict)  # peer -> (fragments, bytes) it took
    stragglers: tuple[int, ...] = ()

    @classmethod
    def of_traffic(cls, traffic: RoundReport, **fields_: Any) -> NodeReport:
        """A report from a round state's traffic counts and refusals, and the node's own `fields_` (loss, phase
        seconds...; `refused` replaces the round state's)."""
        refused = dict(traffic.refused + traffic.cut) if traffic.refused or traffic.cut else {}
        return cls(**{"round": traffic.round, "traffic": traffic.counts(), "refused": refused, **fields_})

    def with_release(self, wait_s: float, stragglers: tuple[int, ...], **traffic_in: int) -> NodeReport:
        """The same round once it is released: the wait, the stragglers and the incoming traffic counted then."""
        return replace(self, wait_s=wait_s, stragglers=tuple(stragglers), traffic=replace(self.traffic, **traffic_in))

    def __getattr__(self, name: str) -> Any:
        """The traffic counts, read as the report's own (`report.bytes_out`)."""
        if name in TRAFFIC:
            return getattr(self.traffic, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for f in _FIELDS:  # the traffic counts in the traffic field's place, as fields of the report's own
            data.update(self.traffic.traffic_json() if f.name == "traffic" else {f.name: getattr(self, f.name)})
        data["refused"] = dict(self.refused)
        data["delivered"] = {str(p): [f, b] for p, (f, b) in sorted(self.delivered.items())}
        data["stragglers"] = list(self.stragglers)
        return data

    def row(self, node: int) -> dict[str, Any]:
        """This report as a nodes.csv row (refusals summed): `to_json`'s values, read directly (a simulation writes
        a row per node and round)."""
        t, refused = self.traffic, self.refused
        return {"round": self.round, "node": node, "loss": self.loss, "bytes_out": t.bytes_out, "bytes_in": t.bytes_in,
                "fragments_out": t.fragments_out, "fragments_in": t.fragments_in, "messages_out": t.messages_out,
                "messages_in": t.messages_in, "fragments_unsent": t.fragments_unsent, "raw_bytes_out": t.raw_bytes_out,
                "refused": sum(refused.values()) if refused else 0, "train_s": self.train_s, "send_s": self.send_s,
                "wait_s": self.wait_s, "aggregate_s": self.aggregate_s,
                "refused_by_reason": " ".join(f"{k}={v}" for k, v in sorted(refused.items()) if v) if refused else ""}

    @classmethod
    def from_json(cls, data: Any, round: int) -> NodeReport:
        """A report of round `round` as JSON gave it; ReportError naming the field if it is malformed (an int past
        64 bits is refused too: it would overflow float() when the round is recorded)."""
        if not isinstance(data, dict):
            raise ReportError("report must be an object or null")
        if type(data.get("round")) is not int or data["round"] != round:
            raise ReportError(f"report.round must be the arrival's round {round}")
        values: dict[str, Any] = {"round": round}
        counts: dict[str, int] = {}
        for name, kind in _NUMBERS:
            value = data.get(name)
            if value is None:
                continue
            if not _number(value):
                raise ReportError(f"report.{name} must be a number")
            if kind is float:
                values[name] = float(value)
            else:
                counts[name] = int(value)
        values["traffic"] = Traffic(**counts)
        refused = data.get("refused")
        if refused is not None:
            if not (isinstance(refused, dict) and all(_count(v) for v in refused.values())):
                raise ReportError("report.refused must map reasons to counts")
            values["refused"] = {str(k): v for k, v in refused.items()}
        delivered = data.get("delivered")
        if delivered is not None:
            if not (isinstance(delivered, dict) and all(
                    isinstance(k, str) and _RANK.fullmatch(k) and isinstance(v, list) and len(v) == 2
                    and all(_count(x) for x in v) for k, v in delivered.items())):
                raise ReportError("report.delivered must map peer ranks to [fragments, bytes]")
            values["delivered"] = {int(k): (v[0], v[1]) for k, v in delivered.items()}
        stragglers = data.get("stragglers")
        if stragglers is not None:
            if not (isinstance(stragglers, list) and all(_count(r) for r in stragglers)):
                raise ReportError("report.stragglers must be a list of ranks")
            values["stragglers"] = tuple(stragglers)
        return cls(**values)


_FIELDS = fields(NodeReport)  # dataclasses.fields() builds its tuple anew each call: once here
# the numbers of a report's JSON, in its order: float (loss, phase seconds) or int (the traffic counts)
_NUMBERS = tuple(n for f in _FIELDS for n in ([(name, int) for name in TRAFFIC] if f.name == "traffic" else
                                              [(f.name, float)] if f.type in ("float", "float | None") else []))

NODE_COLUMNS = ("round", "node", "loss", "bytes_out", "bytes_in", "fragments_out", "fragments_in", "messages_out",
                "messages_in", "fragments_unsent", "raw_bytes_out", "refused", "train_s", "send_s", "wait_s",
                "aggregate_s", "refused_by_reason")
# refused: messages refused and fragments the aggregator cut; by reason after. raw_bytes_out: before --compress


def received_counts(reports: dict[int, NodeReport | None]) -> dict[int, tuple[int, int, int]]:
    """receiver -> (messages, fragments, bytes) delivered to it, summed from the senders' `delivered` maps.

    A sender knows which of its messages a peer accepted as soon as it is done sending, so a round's
    incoming traffic is complete when the round is released, without asking the receivers again.
    """
    counts: dict[int, list[int]] = {}
    for report in reports.values():
        for peer, (fragments, nbytes) in (report.delivered if report else {}).items():
            c = counts.setdefault(int(peer), [0, 0, 0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + fragments, c[2] + nbytes
    return {peer: (c[0], c[1], c[2]) for peer, c in sorted(counts.items())}


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def _number(value: Any) -> bool:
    return type(value) is float or (type(value) is int and -(2**63) <= value < 2**63)
