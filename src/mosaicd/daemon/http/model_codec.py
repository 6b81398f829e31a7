"""The body of GET /v1/model: {"rank", "round", "layout", "vector": 85(float32 LE bytes)} in CBOR."""

from __future__ import annotations

from typing import Any

import cbor2
import numpy as np

from mosaic_proto import Layout
from mosaic_proto.wire import TAG_FLOAT32_LE


def encode_model(rank: int, round: int, layout: Layout, vector: np.ndarray) -> bytes:
    data = np.ascontiguousarray(vector, dtype="<f4").tobytes()
    return cbor2.dumps({"rank": rank, "round": round, "layout": layout.to_json(),
                        "vector": cbor2.CBORTag(TAG_FLOAT32_LE, data)})


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
        return {"rank": int(obj["rank"]), "round": int(obj["round"]), "layout": layout, "vector": vector}
    except Exception as exc:
        raise ValueError(f"not a model body: {exc}") from None
