"""Mosaic Learning's gossip, sans-I/O: fragmentation, peer sampling, wire format, aggregation, round state, the
node's and the barrier's state machines."""

from .aggregation import aggregate
from .attacks import Attack, AttackKind, byzantine_ranks
from .barrier import (
    BARRIER_TRANSITIONS,
    STOP_HOLD_S,
    BarrierDecision,
    BarrierError,
    BarrierInput,
    BarrierOutcome,
    BarrierPhase,
    BarrierPhases,
    BarrierReason,
    BarrierState,
    BarrierStateError,
    CountRule,
    Failure,
    Held,
    Joined,
    Left,
    Rebound,
    Roster,
    RunTask,
    TaskClaim,
    Withdrawal,
    resume_point,
)
from .fragmentation import Fragmentation, Layout, Strategy
from .membership import MembershipError, parse_address, rank_addresses
from .messages import Registration, Release, ReleaseNotice
from .network import InMemoryNetwork, RoundRecord, consensus_distance, consensus_error
from .node import (
    NODE_TRANSITIONS,
    SNAPSHOTS_KEPT,
    Advance,
    NodeInput,
    NodeOutcome,
    NodePhase,
    NodeRefused,
    NodeState,
    NodeStateError,
    Sending,
)
from .quadratic import Curvature, Quadratic, curvature_matrix
from .report import NODE_COLUMNS, NodeReport, ReportError, received_counts
from .rng import Purpose, keyed_raws, keyed_rng
from .robust import Aggregator
from .round import EarlyMessage, OutgoingMessage, Receipt, RoundOutcome, RoundReport, RoundState
from .sampling import PeerSampler, SamplerKind, SamplingError, regular_digraph
from .wire import CONTENT_TYPE, FragmentBatch, Reason, WireError, decode, encode

__version__ = "0.1.0"
__all__ = [
    "NODE_COLUMNS", "NODE_TRANSITIONS", "SNAPSHOTS_KEPT", "Advance", "Aggregator", "Attack", "AttackKind",
    "BARRIER_TRANSITIONS", "BarrierDecision", "BarrierError", "BarrierInput", "BarrierOutcome", "BarrierPhase",
    "BarrierPhases", "BarrierReason", "BarrierStateError", "CountRule", "Held", "STOP_HOLD_S", "resume_point",
    "Failure", "Joined", "Left", "Rebound", "Registration", "ReleaseNotice", "Roster", "RunTask", "TaskClaim",
    "Withdrawal", "byzantine_ranks",
    "BarrierState", "CONTENT_TYPE", "Curvature", "EarlyMessage", "FragmentBatch", "Fragmentation", "InMemoryNetwork",
    "Layout", "MembershipError", "NodeInput", "NodeOutcome", "NodePhase", "NodeRefused", "NodeReport", "NodeState",
    "NodeStateError", "Sending",
    "OutgoingMessage", "PeerSampler", "Purpose", "Quadratic", "Reason", "Receipt", "Release", "ReportError",
    "RoundOutcome", "RoundRecord", "RoundReport", "RoundState", "SamplerKind", "SamplingError", "Strategy",
    "WireError", "aggregate", "consensus_distance", "consensus_error", "curvature_matrix", "decode", "encode",
    "keyed_raws", "keyed_rng", "parse_address", "rank_addresses", "received_counts", "regular_digraph",
]
