"""Aggregation rules are classes in one registry (mosaic_proto/rules/): a rule registered is usable everywhere a
rule is chosen (Aggregator, a run's --aggregator, a simulation, a node's metrics), a name not registered is refused
before anything runs, and the lists of rules elsewhere (CLI, metrics, docs) are read from the registry."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from mosaic_proto import Aggregator, BarrierState, Fragmentation, InMemoryNetwork, Layout, PeerSampler, rules
from mosaic_proto.rules import FragmentRule, register, rule_named, unregister
from mosaicd.daemon.node.metrics import NodeMetrics
from mosaicd.protocol import aggregator_rule
from mosaicd.settings import RunConfig

ROOT = Path(__file__).resolve().parents[1]
D, K = 30, 3
FR = Fragmentation.build(Layout.flat(D), K, seed=2)


@dataclass(frozen=True)
class Median(FragmentRule):
    """Coordinate-wise median of own and received values: a rule written as a plugin would write it."""

    name = "median"
    help = "coordinate-wise"
    cuts = "median_cut"

    def fragment(self, mine: np.ndarray, parts: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
        return np.median(np.stack([mine, *parts]).astype(np.float64), axis=0).astype(np.float32), len(parts)


@pytest.fixture
def median() -> Iterator[type[Median]]:
    register(Median)
    try:
        yield Median
    finally:
        unregister(Median.name)


def received(rng: np.random.Generator, senders: int) -> dict[int, dict[int, np.ndarray]]:
    return {s: {f: rng.standard_normal(len(FR.indices[f])).astype(np.float32) for f in range(K)}
            for s in range(1, senders + 1)}


def test_an_unregistered_rule_is_refused_not_read_as_another() -> None:
    with pytest.raises(ValueError, match=r"unknown aggregation rule 'median' \(known: mean, trimmed-mean, clipped\)"):
        Aggregator("median")
    with pytest.raises(ValidationError, match="unknown aggregation rule 'median'"):
        RunConfig(aggregator="median")
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        rule_named("trimmed_mean")


def test_a_registered_rule_is_usable_everywhere_a_rule_is_chosen(median: type[Median]) -> None:
    rng = np.random.default_rng(4)
    own = rng.standard_normal(D).astype(np.float32)
    got, cut = Aggregator("median").aggregate(own, FR, received(rng, 4))
    rng = np.random.default_rng(4)
    own, parts = rng.standard_normal(D).astype(np.float32), received(rng, 4)
    for f, ix in enumerate(FR.indices):
        want = np.median(np.stack([own[ix], *(parts[s][f] for s in sorted(parts))]), axis=0)
        assert np.array_equal(got[ix], want.astype(np.float32))
    assert cut == {"median_cut": 4 * K}
    assert aggregator_rule(RunConfig(aggregator="median")).rule == Median()
    assert "median (coordinate-wise)" in rules.rules_help() and "median_cut" in rules.cut_labels()
    metrics = NodeMetrics()
    metrics.counted("median_cut", 3)  # a cut, not a refusal
    assert metrics.registry.get_sample_value("mosaic_aggregator_cut_fragments_total", {"rule": "median_cut"}) == 3
    start = [np.random.default_rng(i).standard_normal(D).astype(np.float32) for i in range(4)]
    net = InMemoryNetwork(start, FR, PeerSampler("local", 2, 1), lambda i, t, x: (x + 0.1 * i, 0.0),
                          barrier=BarrierState(rounds=2, expected=4, round_deadline=1, drop_after=2),
                          aggregator=Aggregator("median"))
    assert not net.batched  # message by message: the batched exchange is the mean's only
    net.run(2)
    mean = InMemoryNetwork(start, FR, PeerSampler("local", 2, 1), lambda i, t, x: (x + 0.1 * i, 0.0),
                           barrier=BarrierState(rounds=2, expected=4, round_deadline=1, drop_after=2))
    mean.run(2)
    assert any(not np.array_equal(a, b) for a, b in zip(net.vectors, mean.vectors, strict=True))


def test_a_name_is_registered_once() -> None:
    @dataclass(frozen=True)
    class Impostor(FragmentRule):
        name = "clipped"
        help = "not the clipped rule"

        def fragment(self, mine: np.ndarray, parts: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
            return mine, 0

    with pytest.raises(ValueError, match="already registered"):
        register(Impostor)
    assert rule_named("clipped") is rules.Clipped


def test_the_rule_lists_are_the_registry() -> None:
    assert rules.rule_names() == ("mean", "trimmed-mean", "clipped")
    assert set(rules.cut_labels()) == {"trimmed", "clipped"}
    field = RunConfig.model_fields["aggregator"]
    assert field.json_schema_extra["metavar"] == "{mean,trimmed-mean,clipped}"  # type: ignore[index]
    assert all(f"{name} (" in (field.description or "") for name in rules.rule_names())
    served = {s.labels["rule"] for m in NodeMetrics().registry.collect() for s in m.samples
              if m.name == "mosaic_aggregator_cut_fragments"}
    assert served == set(rules.cut_labels())
    documented = set(re.findall(r"`--aggregator ([a-z-]+)", (ROOT / "docs" / "security.md").read_text()))
    assert documented == set(rules.rule_names())
