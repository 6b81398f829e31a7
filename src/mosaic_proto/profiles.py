"""Nodes that are not alike (issue #37): each node's compute slowdown, link bandwidth and latency, and the virtual
clock that turns them into each round's times.

A profile is text (TOML or CSV; the caller reads the file) parsed into `NodeProfiles`: a default, explicit ranks, and
draws ("20% of the nodes 5x slower") whose ranks come from the run seed (`Purpose.PROFILE`), so every process of a
run, and `simulate`, gives each rank the same `NodeProfile`. `VirtualClock` says, from those profiles alone, when each
node arrives at the barrier in each round and so who misses the round's deadline: what `mosaicd simulate` uses
instead of measured time, deterministically. `TokenBucket` is the pacing a cluster node applies to its sends.

    profiles = NodeProfiles.parse(text, "slow.toml")
    each = profiles.resolve(seed, nodes)              # rank -> NodeProfile
    clock = VirtualClock(each, profiles.compute_s, round_deadline)
    plan = clock.plan(opened, members, bytes_out)     # per node: start, train, send, arrival; who is late
    clock.released(plan, release_time)                # on-time nodes start the next round at the release
"""

from __future__ import annotations

import csv
import io
import math
import re
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .rng import Purpose, keyed_rng

__all__ = ["NodeProfile", "NodeProfiles", "NodeTiming", "ProfileError", "RoundPlan", "TokenBucket", "VirtualClock",
           "send_margin"]

DEFAULT_COMPUTE_S = 1.0  # one round's training on a node of slowdown 1, where the profile does not say
_FIELDS = ("slowdown", "bandwidth", "latency")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kMG]?)(B|bit)?(?:/s)?\s*$")
_SCALE = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file, and the line or table, and the value."""


@dataclass(frozen=True)
class NodeProfile:
    """One node's hardware: `slowdown` (>= 1) stretches its training, `bandwidth` (bytes/s; None: unlimited) paces
    what it sends, `latency` (s) delays each send."""

    slowdown: float = 1.0
    bandwidth: float | None = None
    latency: float = 0.0

    def train_s(self, compute_s: float) -> float:
        """Seconds one round's training takes on this node, where it takes `compute_s` at slowdown 1."""
        return self.slowdown * compute_s

    def send_s(self, nbytes: int) -> float:
        """Seconds its sends of `nbytes` take, all at once (they share the link; latency counts once)."""
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)


@dataclass(frozen=True)
class _Draw:
    share: float
    values: dict[str, Any]


@dataclass(frozen=True)
class NodeProfiles:
    """A run's profile as written: `compute_s`, the `[default]` values, `[[draw]]`s and `[nodes.R]` tables. Ranks are
    given their profile by `resolve`, for a run's seed and node count (counted nodes are known only then)."""

    compute_s: float = DEFAULT_COMPUTE_S
    default: dict[str, Any] = field(default_factory=dict)
    draws: tuple[_Draw, ...] = ()
    nodes: dict[int, dict[str, Any]] = field(default_factory=dict)
    source: str = "profile"

    # -- parsing ------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, source: str) -> NodeProfiles:
        """A profile from a file's text: CSV if `source` ends in .csv, else TOML. ProfileError names `source` and
        the line (CSV, TOML syntax) or the table and key (TOML values)."""
        return cls.parse_csv(text, source) if source.lower().endswith(".csv") else cls.parse_toml(text, source)

    @classmethod
    def parse_toml(cls, text: str, source: str) -> NodeProfiles:
        """`compute_s = 0.5`, `[default]`, `[[draw]] share = 0.2 slowdown = 5`, `[nodes.3] latency = 0.1`."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ProfileError(f"{source}: not valid TOML: {exc}") from None
        return cls.from_json(data, source, text)

    @classmethod
    def parse_csv(cls, text: str, source: str) -> NodeProfiles:
        """A header `node,slowdown,bandwidth,latency` (any order, any subset after `node`; `compute_s` too, on the
        `default` row only), then a row per rank (or `default`); an empty or missing cell keeps the default."""
        rows = list(csv.reader(io.StringIO(text)))
        lines = [(n, [c.strip() for c in row]) for n, row in enumerate(rows, 1) if any(c.strip() for c in row)
                 and not row[0].lstrip().startswith("#")]
        if not lines:
            raise ProfileError(f"{source}: empty (expected a header node,slowdown,bandwidth,latency and a row per "
                               "node)")
        line, header = lines[0]
        allowed = ("node", *_FIELDS, "compute_s")
        unknown = [h for h in header if h not in allowed]
        if header[:1] != ["node"] or unknown or len(set(header)) != len(header):
            raise ProfileError(f"{source}:{line}: the header must start with node, then columns of "
                               f"{', '.join(allowed[1:])} once each" + (f" (unknown: {', '.join(unknown)})"
                                                                        if unknown else f" (got {','.join(header)})"))
        compute_s, default, nodes = DEFAULT_COMPUTE_S, {}, {}
        for line, cells in lines[1:]:
            if len(cells) > len(header):
                raise ProfileError(f"{source}:{line}: {len(cells)} cells, the header has {len(header)}")
            row = dict(zip(header, cells + [""] * (len(header) - len(cells)), strict=True))
            name = row.pop("node")
            where = f"{source}:{line}"
            given = {k: v for k, v in row.items() if v != ""}
            if "compute_s" in given:
                if name != "default":
                    raise ProfileError(f"{where}: compute_s is the run's, given on the default row only")
                compute_s = _number(given.pop("compute_s"), f"{where}: compute_s", low=0.0)
            values = _values(given, where)
            if name == "default":
                default = values
            elif re.fullmatch(r"[0-9]{1,9}", name):
                if int(name) in nodes:
                    raise ProfileError(f"{where}: node {name} has a row already")
                nodes[int(name)] = values
            else:
                raise ProfileError(f"{where}: node must be a rank (0, 1, ...) or default, got {name!r}")
        return cls(compute_s, default, (), nodes, source)

    @classmethod
    def from_json(cls, data: Any, source: str = "profile", text: str | None = None) -> NodeProfiles:
        """A profile from its table (TOML's, or `to_json`'s as the run carries it); `text`: the TOML, to find the
        line a bad value is on."""
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: expected a table")

        def where(table: str, key: str | None = None) -> str:
            line = _toml_line(text, table, key) if text else None
            place = f"{source}:{line}" if line else source
            return f"{place}: [{table}]" if table else f"{place}:"

        def located(table: str) -> Callable[[str], str]:
            return lambda key: where(table, key)
        unknown = sorted(set(data) - {"compute_s", "default", "draw", "nodes", "source"})
        if unknown:
            raise ProfileError(f"{source}: unknown key {unknown[0]!r} (expected compute_s, [default], [[draw]], "
                               "[nodes.R])")
        compute_s = _number(data.get("compute_s", DEFAULT_COMPUTE_S), f"{where('', 'compute_s')} compute_s", low=0.0)
        default = _values(_table(data.get("default", {}), where("default")), located("default"))
        draws = []
        raw_draws = data.get("draw", [])
        if not isinstance(raw_draws, list):
            raise ProfileError(f"{source}: draw must be an array of tables ([[draw]])")
        for i, raw in enumerate(raw_draws):
            at = f"{source}: [[draw]] #{i + 1}"
            raw = dict(_table(raw, at))
            if "share" not in raw:
                raise ProfileError(f"{at}: needs share (the fraction of the nodes it applies to, e.g. 0.2)")
            share = _number(raw.pop("share"), f"{at} share", low=0.0, high=1.0)
            draws.append(_Draw(share, _values(raw, at)))
        nodes = {}
        for rank, raw in _table(data.get("nodes", {}), f"{source}: [nodes]").items():
            if not re.fullmatch(r"[0-9]{1,9}", str(rank)):
                raise ProfileError(f"{source}: [nodes.{rank}]: a node is named by its rank (0, 1, ...)")
            nodes[int(rank)] = _values(_table(raw, where(f"nodes.{rank}")), located(f"nodes.{rank}"))
        return cls(compute_s, default, tuple(draws), nodes, str(data.get("source", source)))

    def to_json(self) -> dict[str, Any]:
        """The profile as the run carries it to every node (JSON; `from_json` reads it back)."""
        return {"compute_s": self.compute_s, "default": dict(self.default),
                "draw": [{"share": d.share, **d.values} for d in self.draws],
                "nodes": {str(r): dict(v) for r, v in sorted(self.nodes.items())}, "source": self.source}

    # -- ranks --------------------------------------------------------------------------------------------
    def resolve(self, seed: int, nodes: int) -> tuple[NodeProfile, ...]:
        """Each rank's profile in a run of `nodes` nodes: the default, then each draw's share of the ranks not drawn
        before (round(share x nodes) of them, picked by the seed), then the ranks named. The same on every process."""
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        beyond = sorted(r for r in self.nodes if r >= nodes)
        if beyond:
            raise ProfileError(f"{self.source}: [nodes.{beyond[0]}] names rank {beyond[0]}, but the run has {nodes} "
                               f"nodes (ranks 0 to {nodes - 1})")
        base = NodeProfile(**self.default)
        each = [base] * nodes
        free = list(range(nodes))
        for i, draw in enumerate(self.draws):
            count = math.floor(draw.share * nodes + 0.5)
            if count > len(free):
                raise ProfileError(f"{self.source}: [[draw]] #{i + 1} wants {count} of the {nodes} nodes, but only "
                                   f"{len(free)} are left after the draws before it")
            picked = {int(x) for x in keyed_rng(seed, Purpose.PROFILE, fragment=i).choice(len(free), count,
                                                                                          replace=False)}
            for p in picked:
                each[free[p]] = replace(base, **draw.values)
            free = [r for j, r in enumerate(free) if j not in picked]
        for rank, values in self.nodes.items():
            each[rank] = replace(base, **values)
        return tuple(each)

    def of(self, rank: int, seed: int, nodes: int) -> NodeProfile:
        """Rank `rank`'s profile; a rank beyond the run's nodes (one that joined late) has its data rank's."""
        return self.resolve(seed, nodes)[rank % nodes]


def _toml_line(text: str, table: str, key: str | None) -> int | None:
    """The line of `key` in `[table]` (or of the table's header), best effort, to point a person at a bad value."""
    lines = text.splitlines()
    start = 0
    if table:
        header = re.compile(r"^\s*\[\s*" + r"\s*\.\s*".join(re.escape(p) for p in table.split(".")) + r"\s*\]")
        start = next((i for i, line in enumerate(lines) if header.match(line)), -1)
        if start < 0:
            return None
        if key is None:
            return start + 1
        start += 1
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith("["):
            break
        if re.match(r"^\s*" + re.escape(key or "") + r"\s*=", lines[i]):
            return i + 1
    return start if table else None


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where}: expected a table, got {value!r}")
    return value


def _number(value: Any, where: str, low: float | None = None, high: float | None = None) -> float:
    """A finite number within [low, high]; ProfileError naming `where` otherwise."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or (low is not None and number < low) or (high is not None and number > high):
        bounds = f" between {low:g} and {high:g}" if low is not None and high is not None else \
            f" >= {low:g}" if low is not None else ""
        raise ProfileError(f"{where}: expected a number{bounds}, got {value!r}")
    return number


def bandwidth_of(value: Any, where: str) -> float | None:
    """Bytes per second from a number (bytes/s) or text with a unit: "12.5MB/s", "100Mbit", "800kbit/s"; "" or
    "unlimited": None."""
    if isinstance(value, str) and value.strip().lower() in ("", "unlimited", "none"):
        return None
    if isinstance(value, str):
        match = _RATE.match(value)
        if not match:
            raise ProfileError(f"{where} bandwidth: expected bytes per second, or a rate like 12.5MB/s or 100Mbit, "
                               f"got {value!r}")
        number = float(match.group(1)) * _SCALE[match.group(2)] / (8 if match.group(3) == "bit" else 1)
    else:
        number = _number(value, f"{where} bandwidth")
    if number <= 0:
        raise ProfileError(f"{where} bandwidth: must be above 0 bytes/s (leave it out for an unlimited link), got "
                           f"{value!r}")
    return number


def _values(raw: Mapping[str, Any], where: str | Callable[[str], str]) -> dict[str, Any]:
    """A table's slowdown, bandwidth and latency, checked; ProfileError naming the key for anything else. `where`:
    the place to name, or key -> the place (the key's line)."""
    at = where if callable(where) else (lambda _: where)
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ProfileError(f"{at(unknown[0])}: unknown key {unknown[0]!r} (a node has {', '.join(_FIELDS)})")
    values: dict[str, Any] = {}
    if "slowdown" in raw:
        values["slowdown"] = _number(raw["slowdown"], f"{at('slowdown')} slowdown", low=1.0)
    if "bandwidth" in raw:
        values["bandwidth"] = bandwidth_of(raw["bandwidth"], at("bandwidth"))
    if "latency" in raw:
        values["latency"] = _number(raw["latency"], f"{at('latency')} latency", low=0.0)
    return values


def send_margin(round_deadline: float) -> float:
    """What a node keeps of the round's deadline for its arrival (a tenth of it, 1 s to half of it): its sends end
    that long before (`NodeState.send_budget`, and `VirtualClock` as a model of it)."""
    return min(max(0.1 * round_deadline, 1.0), 0.5 * round_deadline)


MIN_SEND_BUDGET_S = 0.5  # a node's sends get at least this long, however late it is (`NodeState.send_budget`)


@dataclass(frozen=True)
class NodeTiming:
    """One node's round on the virtual clock (absolute seconds since the run's start): it starts, trains for
    `train_s`, sends for `send_s` (cut at its send budget) and arrives at the barrier at `arrival`."""

    start: float
    train_s: float
    send_s: float
    arrival: float
    late: bool  # after the round's deadline: a straggler


@dataclass(frozen=True)
class RoundPlan:
    """A round's timings: `opened` (its release of the round before), `deadline`, and each live member's."""

    opened: float
    deadline: float
    nodes: dict[int, NodeTiming]

    @property
    def late(self) -> set[int]:
        return {i for i, n in self.nodes.items() if n.late}

    @property
    def arrivals(self) -> dict[int, float]:
        """When each on-time member arrives."""
        return {i: n.arrival for i, n in self.nodes.items() if not n.late}


class VirtualClock:
    """When each node arrives in each round, from its profile: what a cluster of such nodes would do.

    A round opens at the release of the one before. A node that waited at the barrier starts then; one that arrived
    late (after that release) starts when it arrived, hears the release at once and goes on, as a daemon does. It
    trains for slowdown x compute_s, then sends its bytes over its link (latency + bytes / bandwidth), cut at its
    send budget (what is left of the deadline since it started, less `send_margin`, at least 0.5 s), and arrives.
    Arriving after the deadline makes it a straggler: the barrier released the round without it."""

    def __init__(self, profiles: Sequence[NodeProfile], compute_s: float, round_deadline: float) -> None:
        self.profiles, self.compute_s, self.round_deadline = tuple(profiles), compute_s, round_deadline
        self.ready: dict[int, float] = {}  # node -> when it can start its next round, where after the release

    def plan(self, opened: float, members: Collection[int], bytes_out: Mapping[int, int] | int) -> RoundPlan:
        """The round opened at `opened`: each member's timing, given the bytes it sends (a map, or one count for
        all)."""
        deadline = opened + self.round_deadline
        budget_end = self.round_deadline - send_margin(self.round_deadline)
        nodes = {}
        for i in members:
            profile = self.profiles[i % len(self.profiles)]
            start = max(opened, self.ready.get(i, opened))
            train = profile.train_s(self.compute_s)
            nbytes = bytes_out if isinstance(bytes_out, int) else bytes_out.get(i, 0)
            send = min(profile.send_s(nbytes), max(budget_end - train, MIN_SEND_BUDGET_S))
            arrival = start + train + send
            nodes[i] = NodeTiming(start, train, send, arrival, arrival > deadline)
        return RoundPlan(opened, deadline, nodes)

    def released(self, plan: RoundPlan, at: float) -> None:
        """The round of `plan` was released at `at`: who waited starts the next round then, who was late when it
        arrives."""
        for i, timing in plan.nodes.items():
            if timing.late:
                self.ready[i] = timing.arrival
            else:
                self.ready.pop(i, None)

    def to_json(self) -> dict[str, float]:
        return {str(i): t for i, t in sorted(self.ready.items())}

    def restore(self, ready: Mapping[str, float]) -> None:
        """Go on from `to_json`'s state (`simulate --resume`)."""
        self.ready = {int(i): float(t) for i, t in ready.items()}


class TokenBucket:
    """A link of `rate` bytes/s with no burst: a message leaves once the ones taken before it have, so n bytes sent
    together take n / rate seconds in all. Pure: the caller passes its clock and sleeps what `take` says."""

    def __init__(self, rate: float) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.rate = rate
        self._free_at = -math.inf  # when the link has sent everything taken so far

    def take(self, nbytes: int, now: float) -> float:
        """Seconds from `now` until `nbytes` more have gone through the link."""
        self._free_at = max(self._free_at, now) + nbytes / self.rate
        return self._free_at - now
