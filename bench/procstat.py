"""CPU seconds of a process or thread from /proc (Linux): shared by the scripts that sample a running cluster."""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc/.../stat file after the command name (field 3 of stat(5) first); None if it is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(fields: list[str]) -> float:
    """user + system seconds (fields 14 and 15 of stat(5)) from `stat_fields`."""
    return (int(fields[11]) + int(fields[12])) / TICK


def host_cpu() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole host since boot, all cores, from /proc/stat's first line (idle: idle and
    iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / TICK, idle / TICK
