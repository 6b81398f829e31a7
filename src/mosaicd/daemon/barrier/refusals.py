"""Requests the barrier refused, by reason and by source: what a would-be member hit (a wrong --secret-file, a
node of another run, a full roster) is said on the barrier's console, in /v1/status and in summary.json, so the
person at the barrier sees what the node sees. Never the secret: a reason, an address and a count."""

from __future__ import annotations

from collections import Counter
from typing import Any

WHY = {
    "bad_tag": "signed with another secret: a wrong --secret-file?",
    "unsigned": "not signed: the node has no --secret-file (or runs --insecure)",
    "wrong_run": "signed for another run: a node of an earlier run?",
    "stale_tag": "its clock is far from this host's",
    "replayed": "a request received before",
    "bad_body": "its body does not match its signature",
    "malformed_auth": "malformed signature headers",
    "registration_closed": "registration had closed: the roster was full, or the run had started",
    "run_not_joinable": "the run takes no new members",
    "bad_address": "an address the other nodes cannot reach",
    "registration_failed": "the registration had failed",
    "task_differs": "the node runs another task than this barrier: start the barrier with --own-loop or --task",
}
SOURCES_KEPT = 20  # distinct (source, reason) pairs named; the counts count them all


class Refusals:
    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self._sources: dict[tuple[str, str], dict[str, Any]] = {}

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def note(self, reason: str, source: str, path: str) -> bool:
        """Count one refusal; whether it is news (the first of its reason from its source)."""
        self.by_reason[reason] += 1
        key = (source, reason)
        if key in self._sources:
            entry = self._sources[key]
            entry["count"] += 1
            if path not in entry["paths"]:  # the API's own paths only (the router answers any other before)
                entry["paths"].append(path)
            return False
        if len(self._sources) < SOURCES_KEPT:
            self._sources[key] = {"source": source, "reason": reason, "path": path, "paths": [path], "count": 1}
        return True

    def as_json(self) -> dict[str, Any]:
        return {"total": self.total, "by_reason": dict(self.by_reason), "from": list(self._sources.values())}

    def text(self) -> str:
        """`2 requests refused: bad_tag x2 from 127.0.0.1 (signed with another secret: a wrong --secret-file?)`."""
        if not self.total:
            return ""
        parts = []
        for reason, count in self.by_reason.most_common():
            sources = sorted({s["source"] for s in self._sources.values() if s["reason"] == reason})
            parts.append(f"{reason} x{count}" + (f" from {', '.join(sources[:3])}" if sources else "")
                         + (f" ({WHY[reason]})" if reason in WHY else ""))
        return f"{self.total} request{'s' * (self.total != 1)} refused: " + "; ".join(parts)
