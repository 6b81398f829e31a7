"""Mosaic Learning's gossip, sans-I/O: fragmentation, peer sampling, wire format, aggregation, round state."""

from .aggregation import aggregate
from .attacks import Attack, AttackKind, byzantine_ranks
from .barrier import BarrierError, BarrierPhase, BarrierState, Release, received_counts
from .fragmentation import Fragmentation, Layout, Strategy
from .membership import MembershipError, parse_address, rank_addresses
from .network import InMemoryNetwork, RoundRecord, consensus_distance, consensus_error
from .quadratic import Curvature, Quadratic, curvature_matrix
from .rng import Purpose, keyed_rng
from .robust import Aggregator, AggregatorKind
from .round import EarlyMessage, OutgoingMessage, Receipt, RoundOutcome, RoundReport, RoundState
from .sampling import PeerSampler, SamplerKind, SamplingError, regular_digraph
from .wire import CONTENT_TYPE, FragmentBatch, Reason, WireError, decode, encode

__version__ = "0.1.0"
__all__ = [
    "Aggregator", "AggregatorKind", "Attack", "AttackKind", "byzantine_ranks",
    "BarrierError", "BarrierPhase", "BarrierState", "CONTENT_TYPE", "Curvature", "EarlyMessage", "FragmentBatch",
    "Fragmentation", "InMemoryNetwork", "Layout", "MembershipError", "OutgoingMessage", "PeerSampler", "Purpose",
    "Quadratic", "Reason", "Receipt", "Release", "RoundOutcome", "RoundRecord", "RoundReport", "RoundState",
    "SamplerKind", "SamplingError", "Strategy", "WireError", "aggregate", "consensus_distance", "consensus_error",
    "curvature_matrix", "decode", "encode", "keyed_rng", "parse_address", "rank_addresses", "received_counts",
    "regular_digraph",
]
