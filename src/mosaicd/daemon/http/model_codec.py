"""The body of GET /v1/model: {"rank", "round", "layout", "vector": 85(float32 LE bytes), "metrics"?} in CBOR.

`metrics` (optional; bodies without it stay readable): the node's metrics of that round, kept with its snapshot:

    {"values": {name: float, ...},          every metric the node has of the round
     "metric": name,                         the one the evaluation row leads with (`values` holds it)
     "higher_is_better": bool | None,
     "source": "task" | "reported",          its own task's evaluation of the model, or what a training loop reported
     "eval_samples": int, "test_size": int}  (task: the test rows it was evaluated on, of how many)
"""

from __future__ import annotations

import math
from typing import Any

import cbor2
import numpy as np

from mosaic_proto import Layout
from mosaic_proto.wire import TAG_FLOAT32_LE


def encode_model(rank: int, round: int, layout: Layout, vector: np.ndarray,
                 metrics: dict[str, Any] | None = None) -> bytes:
    """The body, as `cbor2.dumps` writes the map (the same bytes), with the vector's values copied once, straight
    into it: a node answers the barrier's collection of a large model with one copy of it, not two."""
    data = np.ascontiguousarray(vector, dtype="<f4")
    before = {"rank": rank, "round": round, "layout": layout.to_json()}
    entries = len(before) + 1 + (metrics is not None)
    head = cbor2.dumps(before)
    parts = [bytes([0xA0 | entries]), head[1:], cbor2.dumps("vector"), _cbor_head(6, TAG_FLOAT32_LE),
             _cbor_head(2, data.nbytes), memoryview(data).cast("B")]
    if metrics is not None:
        parts += [cbor2.dumps("metrics"), cbor2.dumps(metrics)]
    return b"".join(parts)


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR head of type `major` and argument `n` in its shortest form: cbor2's of the unsigned integer n, retyped."""
    uint = cbor2.dumps(n)
    return bytes([major << 5 | uint[0]]) + uint[1:]


def decode_model(body: bytes) -> dict[str, Any]:
    try:
        obj = cbor2.loads(body)
        layout = Layout.from_json(obj["layout"])
        tag = obj["vector"]
        if not isinstance(tag, cbor2.CBORTag) or tag.tag != TAG_FLOAT32_LE:
            raise ValueError("vector is not a float32 typed array")
        vector = np.frombuffer(tag.value, dtype="<f4").copy()
        if vector.size != layout.dim:
            raise ValueError(f"vector has {vector.size} values, layout {layout.dim}")
        return {"rank": int(obj["rank"]), "round": int(obj["round"]), "layout": layout, "vector": vector,
                "metrics": check_metrics(obj.get("metrics"))}
    except Exception as exc:
        raise ValueError(f"not a model body: {exc}") from None


def check_metrics(metrics: Any) -> dict[str, Any] | None:
    """A body's `metrics` as the barrier uses them (ValueError: not of the documented shape)."""
    if metrics is None:
        return None
    if not isinstance(metrics, dict) or not isinstance(metrics.get("values"), dict):
        raise ValueError("metrics is not a map with values")
    values = {}
    for k, v in metrics["values"].items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int | float | None):
            raise ValueError(f"metric {k!r} is not a number")
        values[k] = math.nan if v is None else float(v)
    name = metrics.get("metric")
    if name is not None and name not in values:
        raise ValueError(f"metric {name!r} has no value")
    hib = metrics.get("higher_is_better")
    out = {"values": values, "metric": name, "higher_is_better": None if hib is None else bool(hib),
           "source": str(metrics.get("source", "reported"))}
    for key in ("eval_samples", "test_size"):
        if isinstance(metrics.get(key), int):
            out[key] = int(metrics[key])
    return out
