"""What a run's settings build of the protocol: each node's aggregation rule, compressor and attack, the attacking
ranks, the nodes' profiles. `RunConfig` only configures; the node (`daemon/node`) and `simulate` build these here,
from the same run the same way, so that a rank is the same node in both."""

from __future__ import annotations

import math
from typing import Any

from mosaic_proto import Aggregator, Attack, Fragmentation, PeerSampler
from mosaic_proto import byzantine_ranks as _drawn_ranks
from mosaic_proto.async_node import AsyncNodeState, Exchange
from mosaic_proto.compression import Compression, Compressor
from mosaic_proto.profiles import DEFAULT_COMPUTE_S, NodeProfile, NodeProfiles
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


def nominal_iterations(run: RunConfig) -> int:
    """The iterations an unslowed node of an asynchronous run does: --rounds, or fewer where its --time-budget ends
    them first (an iteration takes --node-profile's compute_s, 1 s without one; the one that ends at or past the
    budget is its last)."""
    if run.time_budget is None:
        return run.rounds
    spec = profile_spec(run)
    compute_s = spec.compute_s if spec is not None else DEFAULT_COMPUTE_S
    return min(run.rounds, max(1, math.ceil(run.time_budget / compute_s - 1e-9)))


def async_node_state(run: RunConfig, task: Any, rank: int, planned_only: bool = True,
                     max_norm: float | None = None) -> AsyncNodeState:
    """Node `rank`'s state at the start of an asynchronous run, the same in `simulate --sync async` and in the
    daemons (pairwise: one fragment, a sampler of fanout 1). `planned_only`: refuse what the sender's plan does not
    send here (the daemons; the simulator's messages are all honest); `max_norm`: --max-norm (a node's option, not
    the run's)."""
    pairwise = run.exchange is Exchange.PAIRWISE
    fragmentation = Fragmentation.build(task.layout, 1 if pairwise else run.fragments, run.seed, run.strategy)
    sampler = PeerSampler("local", 1, run.seed) if pairwise else PeerSampler(run.sampler, run.fanout, run.seed)
    return AsyncNodeState(rank, tuple(range(run.nodes)), fragmentation, sampler, run.rounds, task.initial(rank),
                          run_id=run.run_id, budget_s=run.time_budget, exchange=run.exchange, send=run.async_send,
                          aggregator=aggregator_rule(run), compressor=compressor_of(run, rank),
                          attack=attack_of(run, rank), planned_only=planned_only, max_norm=max_norm)
