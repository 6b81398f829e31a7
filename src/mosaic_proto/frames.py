"""Fragment messages on one upgraded connection, sans I/O: what a frame is, and a reader that says where frames
begin and end without copying their bodies.

A node's POST /v1/fragments costs its receiver three copies of the body and an HTTP parser's work per piece
(bench/transport.py). Over a connection upgraded once (`GET STREAM_PATH` with `Upgrade: UPGRADE`, answered 101),
each message is a request frame: `REQUEST` (the head's bytes, the body's), the head (a JSON object of the headers
the POST would carry: its content type and signature) and the body; each is answered by an answer frame:
`ANSWER` (status, bytes) and the JSON the POST's answer would have. One frame at a time: the next is sent once the
last one's answer came, so a reader never holds more than one body.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

STREAM_PATH = "/v1/fragments/stream"  # the upgrade request's path; each frame stands for a POST to FRAGMENTS_PATH
FRAGMENTS_PATH = "/v1/fragments"
UPGRADE = "mosaic-frames/1"  # the Upgrade token: a protocol and its version
REQUEST = struct.Struct("!II")  # a request frame's head bytes, body bytes
ANSWER = struct.Struct("!HI")  # an answer frame's status, body bytes
MAX_HEAD = 8 << 10  # a request frame's head at most (headers of a few hundred bytes)
MAX_ANSWER = 64 << 10  # an answer's JSON at most


class FrameError(ValueError):
    """Bytes that are no frame of this protocol: the connection is closed."""


@dataclass(frozen=True)
class Head:
    """A request frame's head: its headers (as a POST's) and its body's declared size."""

    headers: dict[str, str]
    length: int

    def header(self, name: str) -> str:
        """The header `name` (lower case) of this frame's head, its name in any case as HTTP's; "" if none."""
        return next((v for k, v in self.headers.items() if k.lower() == name), "")


@dataclass(frozen=True)
class Piece:
    """The next bytes of the current frame's body (a view of what was fed: copy it before the next `feed`)."""

    data: memoryview


@dataclass(frozen=True)
class End:
    """The current frame's body is complete."""


Event = Head | Piece | End


_COMPACT = json.JSONEncoder(separators=(",", ":"))  # one encoder: `json.dumps` with separators builds one a call
_STRINGS = frozenset({str})


def request_head(headers: Mapping[str, str], length: int) -> bytes:
    """A request frame's prefix and head; its body of `length` bytes follows."""
    head = _COMPACT.encode(headers if type(headers) is dict else dict(headers)).encode()
    if len(head) > MAX_HEAD:
        raise ValueError(f"a frame's headers are {len(head)} bytes, more than {MAX_HEAD}")
    return REQUEST.pack(len(head), length) + head


def answer_frame(status: int, body: bytes) -> bytes:
    """An answer frame: `status` and `body` (JSON)."""
    if len(body) > MAX_ANSWER:
        raise ValueError(f"an answer of {len(body)} bytes, more than {MAX_ANSWER}")
    return ANSWER.pack(status, len(body)) + body


def _headers(raw: bytes) -> dict[str, str]:
    try:
        headers = json.loads(raw)
    except ValueError:
        raise FrameError("a frame's head is not JSON") from None
    if type(headers) is not dict or not _STRINGS.issuperset(map(type, headers.values())):  # a key is a string
        raise FrameError("a frame's head is not a JSON object of strings")
    return headers


class RequestReader:
    """Request frames out of the bytes a connection reads. `feed` gives the events the bytes complete; a body's
    pieces are views of the fed bytes, never copied here. `ready()` is called by the reader's owner once a frame's
    `End` has been answered: bytes of a further frame before that are a FrameError (one frame at a time)."""

    def __init__(self) -> None:
        self._prefix = bytearray()  # the prefix and head being read
        self._left = 0  # body bytes still to come of the current frame
        self._in_frame = False  # a head was read and its frame not yet answered
        self._head_size: int | None = None
        self._length = 0

    def ready(self) -> None:
        """The current frame is answered: the next one may come."""
        if self._left:
            raise RuntimeError("the frame's body is still coming")
        self._in_frame = False

    def feed(self, data: bytes | memoryview) -> list[Event]:
        view, events = memoryview(data).cast("B"), []
        while view:
            if self._in_frame and not self._left:
                raise FrameError("a frame came before the last one was answered (one frame at a time)")
            if self._left:
                piece, view = view[:self._left], view[self._left:]
                self._left -= len(piece)
                events.append(Piece(piece))
                if not self._left:
                    events.append(End())
                continue
            want = REQUEST.size if self._head_size is None else REQUEST.size + self._head_size
            take = view[:want - len(self._prefix)]
            self._prefix += take
            view = view[len(take):]
            if len(self._prefix) < want:
                break
            if self._head_size is None:
                self._head_size, self._length = REQUEST.unpack(self._prefix)
                if not 2 <= self._head_size <= MAX_HEAD:
                    raise FrameError(f"a frame's head of {self._head_size} bytes (at most {MAX_HEAD})")
                continue
            headers = _headers(bytes(self._prefix[REQUEST.size:]))
            self._prefix.clear()
            self._head_size, self._in_frame, self._left = None, True, self._length
            events.append(Head(headers, self._length))
            if not self._length:
                events.append(End())
        return events


class AnswerReader:
    """Answer frames out of the bytes a sender's connection reads: (status, JSON body) as each completes."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        answers = []
        while len(self._buffer) >= ANSWER.size:
            status, length = ANSWER.unpack_from(self._buffer)
            if length > MAX_ANSWER:
                raise FrameError(f"an answer of {length} bytes (at most {MAX_ANSWER})")
            if len(self._buffer) < ANSWER.size + length:
                break
            answers.append((status, bytes(self._buffer[ANSWER.size:ANSWER.size + length])))
            del self._buffer[:ANSWER.size + length]
        return answers
