"""What every aggregation rule is, and the one registry of them by name (`--aggregator`'s choices, the metrics'
labels and the docs' list read it). A rule not registered cannot be chosen: `rule_named` raises, so no name falls
through to another rule's arithmetic."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import ClassVar, Self

import numpy as np

from ..compression import densify
from ..fragmentation import Fragmentation


class AggregationRule(ABC):
    """A node's rule for what it makes of its own vector and the fragments it received. Deterministic: the result
    does not depend on arrival order, so `simulate` == `cluster`."""

    name: ClassVar[str]  # as --aggregator spells it
    help: ClassVar[str]  # what --aggregator's help says of it
    cuts: ClassVar[str | None] = None  # what its Counter counts (a metric's label); None: it cuts nothing
    batchable: ClassVar[bool] = False  # the count-based mean `exchange.py` computes for a whole round at once

    @classmethod
    def of(cls, **options: float) -> Self:
        """The rule with those of the run's options (--trim, --clip-radius) it takes: its dataclass fields."""
        taken = {f.name for f in fields(cls)} if is_dataclass(cls) else set()
        return cls(**{k: v for k, v in options.items() if k in taken})

    @abstractmethod
    def aggregate(self, own: np.ndarray, fragmentation: Fragmentation,
                  received: Mapping[int, Mapping[int, np.ndarray]],
                  own_fragments: Sequence[np.ndarray] | None = None,
                  stand_in: np.ndarray | None = None) -> tuple[np.ndarray, Counter]:
        """The new vector and what the rule cut ({`cuts`: received fragments}). `own_fragments`: what the node
        holds of each fragment if not `own`'s; `stand_in`: what a sparse message's missing coordinates read."""


class FragmentRule(AggregationRule):
    """A rule that takes each fragment on its own: its own values and the received ones, densified, in ascending
    sender order."""

    @abstractmethod
    def fragment(self, mine: np.ndarray, parts: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
        """Fragment k's new values (float32) and how many of `parts` the rule cut."""

    def aggregate(self, own: np.ndarray, fragmentation: Fragmentation,
                  received: Mapping[int, Mapping[int, np.ndarray]],
                  own_fragments: Sequence[np.ndarray] | None = None,
                  stand_in: np.ndarray | None = None) -> tuple[np.ndarray, Counter]:
        own = np.asarray(own, dtype=np.float32)
        out = np.array(own, copy=True)
        cut: Counter = Counter()
        for f, ix in enumerate(fragmentation.indices):
            senders = sorted(s for s, frags in received.items() if f in frags)
            if not senders:
                continue
            mine = own[ix] if own_fragments is None else np.asarray(own_fragments[f])
            fill = mine if stand_in is None else stand_in[ix]  # what a sparse message's missing coordinates read
            parts = [densify(received[s][f], fill) for s in senders]
            out[ix], n = self.fragment(mine, parts)
            if self.cuts is not None:
                cut[self.cuts] += n
        return out, +cut


_REGISTRY: dict[str, type[AggregationRule]] = {}


def register(rule: type[AggregationRule]) -> type[AggregationRule]:
    """Make `rule` choosable by its name (also a class decorator). A name already taken by another class is an error."""
    held = _REGISTRY.get(rule.name)
    if held is not None and held is not rule:
        raise ValueError(f"aggregation rule {rule.name!r} is already registered ({held.__qualname__})")
    _REGISTRY[rule.name] = rule
    return rule


def unregister(name: str) -> None:
    """Forget the rule registered as `name` (a plugin unloaded, a test's own rule)."""
    _REGISTRY.pop(name, None)


def rule_named(name: str) -> type[AggregationRule]:
    """The rule registered as `name`; any other name is a ValueError naming the known ones."""
    try:
        return _REGISTRY[str(name)]
    except KeyError:
        raise ValueError(f"unknown aggregation rule {name!r} (known: {', '.join(_REGISTRY)})") from None


def rule_names() -> tuple[str, ...]:
    """The registered rules' names, in the order they were registered."""
    return tuple(_REGISTRY)


def checked_rule_name(name: str) -> str:
    """`name` if a rule is registered as it (a setting's validator); else `rule_named`'s ValueError."""
    return rule_named(name).name


def cut_labels() -> tuple[str, ...]:
    """What the registered rules count as cut (the metrics' labels), each once."""
    return tuple(dict.fromkeys(r.cuts for r in _REGISTRY.values() if r.cuts is not None))


def rules_help() -> str:
    """--aggregator's list of rules: each name and what it is."""
    return ", ".join(f"{r.name} ({r.help})" for r in _REGISTRY.values())
