#!/usr/bin/env python3
"""Does a one-host deployment of N nodes (compose.yaml, `--scale node=N`) fit the kernel's neighbour table?

    python3 deploy/hostcheck.py 60        # on the Docker host; any python3, standard library only

Linux keeps one IPv4 neighbour (ARP) table for the whole host: the entries of every network namespace, each
container's and the host's, count against the same limits, net.ipv4.neigh.default.gc_thresh1/2/3 (defaults
128, 512, 1024), and a container reads the host's values. On compose.yaml's bridge network the barrier and N
nodes are N+1 containers that all talk to each other over a run (a node sends fragments to peers drawn anew
every round and answers the barrier's model requests; every node talks to the barrier), so each container's
namespace holds an entry for each of the other N containers and one for the bridge's gateway (the published
port, the host), and the host holds one per container on its side of the bridge:
(N+1)*N + (N+1) + (N+1) = (N+1)*(N+2) entries; 3,782 for 60 nodes. Measured (/proc/net/stat/arp_cache at the
end of a run, less the entries before `up`): 20 nodes 450 (rule: 462), 24 nodes 627 (rule: 650).

The kernel does not collect entries in use: past gc_thresh3 it refuses new ones (dmesg: "neighbour:
arp_cache: neighbor table overflow!") and a connection to a peer waits on ARP retries (60 nodes with the
defaults: ~97 s per round instead of ~2 s). Past gc_thresh2 it collects entries idle for 5 s at most every
5 s, so pairs that talk now and then resolve again (slower, not stuck). Hence: fits when the entries stay
within gc_thresh2; tight within gc_thresh3; overflows beyond. The thresholds proposed keep room for the rest
of the host (other containers, its own network): gc_thresh1 the entries rounded up to 1,024, gc_thresh2
twice that, gc_thresh3 four times, never below the current values.

Exit status: 0 fits, 1 tight or overflows (the sysctl lines are printed), 3 thresholds unreadable (not Linux,
or a namespace that hides them: run it on the Docker host), 2 usage error. bench/compose_scale.py and
tests/docker/test_docker.py import this file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

SYSCTL = "net.ipv4.neigh.default.gc_thresh{}"
PROC = Path("/proc")
STEP = 1024


def neighbour_entries(nodes: int) -> int:
    """Neighbour entries a one-host deployment of `nodes` nodes and one barrier needs, over all namespaces."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    containers = nodes + 1
    return containers * (containers - 1) + containers + containers  # peers, the gateway, the host's side


def read_thresholds(proc: Path = PROC) -> tuple[int, int, int] | None:
    """(gc_thresh1, gc_thresh2, gc_thresh3) of this kernel, or None where they cannot be read."""
    try:
        values = [int((proc / "sys/net/ipv4/neigh/default" / f"gc_thresh{i}").read_text()) for i in (1, 2, 3)]
    except (OSError, ValueError):
        return None
    return values[0], values[1], values[2]


def read_entries(proc: Path = PROC) -> int | None:
    """Entries in the host's IPv4 neighbour table now (all namespaces: /proc/net/stat/arp_cache, hex)."""
    try:
        lines = (proc / "net/stat/arp_cache").read_text().split("\n")
        return int(lines[1].split()[0], 16)
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class NeighbourCheck:
    """The verdict for one node count; `lines()` says it, with the sysctl lines when it does not fit."""

    nodes: int
    needed: int
    thresholds: tuple[int, int, int] | None
    entries_now: int | None

    @property
    def verdict(self) -> str:
        """fits (within gc_thresh2), tight (within gc_thresh3), overflows, or unknown (unreadable)."""
        if self.thresholds is None:
            return "unknown"
        _, soft, hard = self.thresholds
        if self.needed <= min(soft, hard):
            return "fits"
        return "tight" if self.needed <= hard else "overflows"

    @property
    def recommended(self) -> tuple[int, int, int]:
        base = -(-self.needed // STEP) * STEP
        current = self.thresholds or (0, 0, 0)
        one, two, three = (max(current[i], base * k) for i, k in enumerate((1, 2, 4)))
        return one, max(two, one), max(three, two)

    def sysctl_lines(self) -> list[str]:
        """The command that raises the thresholds now, and the file that keeps them across reboots."""
        pairs = [f"{SYSCTL.format(i + 1)}={v}" for i, v in enumerate(self.recommended)]
        return [f"sudo sysctl -w {' '.join(pairs)}",
                f"printf '%s\\n' {' '.join(pairs)} | sudo tee /etc/sysctl.d/90-mosaic-neighbours.conf"]

    def lines(self) -> list[str]:
        have = ("unreadable here" if self.thresholds is None
                else "gc_thresh1/2/3 = {}/{}/{}".format(*self.thresholds))
        now = "" if self.entries_now is None else f"; {self.entries_now} entries in use now"
        out = [f"neighbour table: {self.nodes} nodes + barrier on one host need about {self.needed} entries "
               f"((N+1)*(N+2)); {have}{now}: {self.verdict.upper()}"]
        if self.verdict == "overflows":
            out.append("  beyond gc_thresh3 the kernel refuses entries (dmesg: 'neighbor table overflow!') and "
                       "rounds take tens of times longer; raise the thresholds on the Docker host:")
        elif self.verdict == "tight":
            out.append("  beyond gc_thresh2 the kernel evicts idle entries every 5 s (rounds slow down); raise "
                       "the thresholds on the Docker host:")
        elif self.verdict == "unknown":
            out.append("  check on the Docker host (python3 deploy/hostcheck.py N); thresholds that fit:")
        if self.verdict != "fits":
            out += [f"    {line}" for line in self.sysctl_lines()]
        return out


def check_neighbour_table(nodes: int, proc: Path = PROC) -> NeighbourCheck:
    """The check of this host for `nodes` nodes (the thresholds and entries read from `proc`)."""
    return NeighbourCheck(nodes, neighbour_entries(nodes), read_thresholds(proc), read_entries(proc))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nodes", type=int, help="node containers on this host (compose --scale node=N)")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"nodes: must be >= 1, got {args.nodes}")
    check = check_neighbour_table(args.nodes)
    print("\n".join(check.lines()))
    return {"fits": 0, "unknown": 3}.get(check.verdict, 1)


if __name__ == "__main__":
    sys.exit(main())
