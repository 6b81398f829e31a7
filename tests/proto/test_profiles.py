"""Node profiles (issue #37): parsing TOML and CSV, draws from the seed, the virtual clock's arithmetic, the token
bucket, and the in-memory network run on that clock."""

from __future__ import annotations

import numpy as np
import pytest

from mosaic_proto import BarrierState, Fragmentation, InMemoryNetwork, Layout, PeerSampler
from mosaic_proto.profiles import NodeProfile, NodeProfiles, ProfileError, TokenBucket, VirtualClock

TOML = """
compute_s = 0.5
[default]
bandwidth = "8Mbit"
latency = 0.01

[[draw]]
share = 0.2
slowdown = 5

[nodes.3]
latency = 0.2
"""


def test_toml_profile_resolves_defaults_draws_and_named_nodes() -> None:
    profiles = NodeProfiles.parse(TOML, "p.toml")
    assert profiles.compute_s == 0.5
    each = profiles.resolve(seed=7, nodes=10)
    slow = [r for r, p in enumerate(each) if p.slowdown == 5]
    assert len(slow) == 2  # 20% of 10
    assert all(p.bandwidth == 1e6 for p in each)  # 8 Mbit/s = 1 MB/s
    assert each[3].latency == 0.2 and all(p.latency == 0.01 for r, p in enumerate(each) if r != 3)
    # the same seed draws the same ranks, in every process; another seed other ranks (for some seed)
    assert [p.slowdown for p in NodeProfiles.parse(TOML, "p.toml").resolve(7, 10)] == [p.slowdown for p in each]
    draws = {tuple(r for r, p in enumerate(profiles.resolve(s, 10)) if p.slowdown == 5) for s in range(10)}
    assert len(draws) > 1
    # what the run carries reads back as the same profile
    again = NodeProfiles.from_json(profiles.to_json())
    assert again.resolve(7, 10) == each


def test_csv_profile_with_default_row_and_empty_cells() -> None:
    text = "node,slowdown,bandwidth,latency,compute_s\ndefault,,1000,0.05,2\n0,5,,\n# a comment\n2,1.5,unlimited,0\n"
    profiles = NodeProfiles.parse(text, "p.csv")
    each = profiles.resolve(0, 3)
    assert profiles.compute_s == 2
    assert each == (NodeProfile(5, 1000, 0.05), NodeProfile(1, 1000, 0.05), NodeProfile(1.5, None, 0.0))


@pytest.mark.parametrize(("text", "source", "says"), [
    ("[nodes.3]\nslowdown = 0.5\n", "p.toml", "p.toml:2: [nodes.3] slowdown: expected a number >= 1, got 0.5"),
    ("[default]\nspeed = 2\n", "p.toml", "unknown key 'speed'"),
    ("[[draw]]\nslowdown = 5\n", "p.toml", "[[draw]] #1: needs share"),
    ("[default\n", "p.toml", "p.toml: not valid TOML"),
    ("[default]\nbandwidth = \"fast\"\n", "p.toml", "p.toml:2: [default] bandwidth: expected bytes per second"),
    ("compute_s = -1\n", "p.toml", "p.toml:1: compute_s: expected a number >= 0"),
    ("node,slowdown\n0,2\nx,3\n", "p.csv", "p.csv:3: node must be a rank"),
    ("node,speed\n", "p.csv", "p.csv:1: the header must start with node"),
    ("node,slowdown\n0,2,3\n", "p.csv", "p.csv:2: 3 cells, the header has 2"),
    ("node,latency\n1,-2\n", "p.csv", "p.csv:2 latency: expected a number >= 0"),
    ("node,compute_s\n1,2\n", "p.csv", "p.csv:2: compute_s is the run's"),
])
def test_bad_profiles_name_the_file_and_line(text: str, source: str, says: str) -> None:
    with pytest.raises(ProfileError) as caught:
        NodeProfiles.parse(text, source)
    assert says in str(caught.value)


def test_resolve_refuses_ranks_and_draws_beyond_the_run() -> None:
    with pytest.raises(ProfileError, match=r"\[nodes.5\] names rank 5, but the run has 4 nodes"):
        NodeProfiles.parse("[nodes.5]\nslowdown = 2\n", "p.toml").resolve(0, 4)
    with pytest.raises(ProfileError, match="wants 3 of the 4 nodes, but only 2 are left"):
        NodeProfiles.parse("[[draw]]\nshare=0.5\nslowdown=2\n[[draw]]\nshare=0.75\nslowdown=3\n",
                           "p.toml").resolve(0, 4)


def test_virtual_clock_arithmetic() -> None:
    profiles = [NodeProfile(), NodeProfile(slowdown=5), NodeProfile(bandwidth=1000, latency=0.1)]
    clock = VirtualClock(profiles, compute_s=1.0, round_deadline=4.0)  # send margin: 1 s
    plan = clock.plan(10.0, [0, 1, 2], bytes_out=500)
    assert plan.nodes[0].arrival == 11.0 and not plan.nodes[0].late
    assert plan.nodes[1].train_s == 5.0 and plan.nodes[1].send_s == 0.0 and plan.nodes[1].late
    assert plan.nodes[1].arrival == 15.0
    assert plan.nodes[2].send_s == pytest.approx(0.6) and plan.nodes[2].arrival == pytest.approx(11.6)
    assert plan.late == {1}
    clock.released(plan, 14.0)  # released at the deadline: the late node starts its next round when it arrived
    after = clock.plan(14.0, [0, 1, 2], bytes_out=500)
    assert after.nodes[0].start == 14.0 and after.nodes[1].start == 15.0
    # a slow link is cut at the send budget: the node arrives in time, its sends unfinished
    cut = VirtualClock([NodeProfile(bandwidth=10)], 1.0, 4.0).plan(0.0, [0], bytes_out=10_000)
    assert cut.nodes[0].send_s == 2.0 and not cut.nodes[0].late


def test_token_bucket_paces_messages_in_turn() -> None:
    bucket = TokenBucket(1000)
    assert bucket.take(500, now=0.0) == 0.5
    assert bucket.take(500, now=0.0) == 1.0  # after the first
    assert bucket.take(100, now=5.0) == pytest.approx(0.1)  # an idle link starts afresh


def run_network(profile: NodeProfiles, rounds: int, drop_after: int = 2) -> tuple[list, list[float]]:
    n = 6
    layout = Layout(("w",), ((8,),))
    fragmentation = Fragmentation.build(layout, 2, 0, "random")
    barrier = BarrierState(rounds=rounds, round_deadline=3.0, drop_after=drop_after, expected=n, min_members=3)
    network = InMemoryNetwork([np.full(8, i, np.float32) for i in range(n)], fragmentation,
                              PeerSampler("local", 2, 0), None, barrier=barrier)
    clock = VirtualClock(profile.resolve(0, n), profile.compute_s, 3.0)
    releases, times = [], []
    for _ in range(rounds):
        plan = clock.plan(network.clock, network.members, 64)
        record = network.step(absent=plan.late, arrivals=plan.arrivals)
        clock.released(plan, network.clock)
        releases.append(record.release)
        times.append(network.clock)
    return releases, times


def test_slow_nodes_straggle_then_are_dropped_and_rounds_end_at_the_deadline() -> None:
    profile = NodeProfiles.parse("compute_s = 1.0\n[nodes.1]\nslowdown = 5\n[nodes.4]\nslowdown = 5\n", "p.toml")
    releases, times = run_network(profile, rounds=5)
    assert [r.stragglers for r in releases] == [(1, 4), (1, 4), (), (), ()]
    assert releases[1].dropped == (1, 4)
    assert times == [3.0, 6.0, 7.0, 8.0, 9.0]  # at the deadline while they were awaited, then 1 s rounds
    assert run_network(profile, rounds=5) == (releases, times)  # deterministic
