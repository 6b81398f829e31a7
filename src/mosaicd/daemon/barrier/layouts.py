"""Every member must build the same model. Each arrival says which layout its node fragments (the number of values
and the fragmentation's fingerprint); a member whose layout is not the others' ends the run at once, failed, naming
both, instead of a run that "finishes" with every fragment refused as foreign_fingerprint. The claim is read here
(`claimed_layout`); whether it differs is the state's to decide (`BarrierState.claim_layout`)."""

from __future__ import annotations

import string
from typing import Any

from mosaicd.daemon.http.errors import bad_request

FINGERPRINT_CHARS = 128  # hex digits, at most (the fingerprint is a SHA-256 today: 64)


def claimed_layout(body: dict[str, Any]) -> tuple[int, str] | None:
    """An arrival's "layout" {"values", "fingerprint"}; None where it gives none (a node of an earlier version);
    400 naming the field where it is malformed."""
    if "layout" not in body:
        return None
    layout = body["layout"]
    values, fingerprint = (layout.get("values"), layout.get("fingerprint")) if isinstance(layout, dict) else (0, 0)
    if type(values) is not int or not 0 <= values < 2**63 or not isinstance(fingerprint, str) \
            or not 0 < len(fingerprint) <= FINGERPRINT_CHARS or not set(fingerprint) <= set(string.hexdigits):
        raise bad_request("bad_field", "field 'layout' must be {\"values\": a non-negative integer, \"fingerprint\": "
                          f"at most {FINGERPRINT_CHARS} hex digits}}")
    return values, fingerprint.lower()
