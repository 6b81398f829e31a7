"""What a run's settings build of the protocol: each node's aggregation rule, compressor and attack, the attacking
ranks, the nodes' profiles. `RunConfig` only configures; the node (`daemon/node`) and `simulate` build these here,
from the same run the same way, so that a rank is the same node in both."""

from __future__ import annotations

from mosaic_proto import Aggregator, Attack
from mosaic_proto import byzantine_ranks as _drawn_ranks
from mosaic_proto.compression import Compression, Compressor
from mosaic_proto.profiles import NodeProfile, NodeProfiles
from mosaicd.settings import RunConfig


def aggregator_rule(run: RunConfig) -> Aggregator:
    """The aggregation every node of the run applies (`mosaic_proto.robust`)."""
    return Aggregator(run.aggregator, run.trim, run.clip_radius)


def compressor_of(run: RunConfig, node: int) -> Compressor:
    """`node`'s side of the run's --compress (its error feedback starts empty)."""
    return Compressor(Compression.parse(run.compress), seed=run.seed, node=node, error_feedback=run.error_feedback)


def byzantine_ranks(run: RunConfig) -> tuple[int, ...]:
    """The ranks that attack, drawn from the seed: the same on every node and in simulate."""
    return _drawn_ranks(run.seed, run.nodes, run.byzantine)


def attack_of(run: RunConfig, node: int) -> Attack | None:
    """How `node` lies, or None for an honest node."""
    if node not in byzantine_ranks(run):
        return None
    return Attack.of(run.attack, run.seed, node, run.nodes, run.byzantine, run.attack_scale)


def profile_spec(run: RunConfig) -> NodeProfiles | None:
    """--node-profile as written (its compute_s, draws and named nodes), or None."""
    return None if run.node_profile is None else NodeProfiles.from_json(run.node_profile)


def node_profiles(run: RunConfig) -> tuple[NodeProfile, ...] | None:
    """Each rank's profile (draws from --seed), the same on every node and in simulate; None without one."""
    spec = profile_spec(run)
    return None if spec is None else spec.resolve(run.seed, run.nodes)
