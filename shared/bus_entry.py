"""One stream entry, decoded: a Delivery for the caller, or a Rejected entry for the dead letters.

This is the pure half of the bus (no Redis): how raw entry fields become messages, and what a
dead-letter record holds. An entry is exactly one field `m` with the codec's bytes; anything
else is rejected with a reason, so a producer bug or a foreign writer can never crash a consumer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import Counter

from shared.codec import CodecError, decode, encode
from shared.protocol import Message

FIELD = b"m"
"""The single field of every entry, holding `shared.codec.encode(msg)`."""

MAX_DEAD_LETTER_PAYLOAD = 64 * 1024
"""Dead-letter records keep at most this many bytes of the raw payload: enough to diagnose, and a
flood of huge garbage cannot blow up the dead-letter stream."""

DEAD_LETTERS = Counter(
    "meshllm:bus_dead_letters_total",
    "Stream entries that could not be decoded and were moved to the dead-letter stream.",
    ["stream", "reason"],
)


@dataclass(frozen=True)
class Delivery:
    """One decoded stream entry. `entry_id` is what `Bus.ack` acknowledges. `deliveries`
    counts how often the group handed the entry out, this time included (Redis' counter, read
    for re-read own pending and claimed entries; a first delivery is 1): an entry delivered
    again and again is one its consumers keep dying on."""

    stream: str
    entry_id: str
    message: Message
    deliveries: int = 1


@dataclass(frozen=True)
class Rejected:
    """An entry that failed to decode; it goes to the dead-letter stream, never to the caller."""

    stream: str
    entry_id: str
    reason: str
    detail: str
    payload: bytes

    def record(self, consumer: str) -> dict[bytes, bytes]:
        """The dead-letter stream entry's fields (all bytes, so any consumer can read them)."""
        return {
            b"stream": self.stream.encode(),
            b"id": self.entry_id.encode(),
            b"reason": self.reason.encode(),
            b"detail": self.detail.encode(errors="replace"),
            b"payload": self.payload[:MAX_DEAD_LETTER_PAYLOAD],
            b"consumer": consumer.encode(),
            b"time": repr(time.time()).encode(),
        }


def failed_entry(delivery: Delivery, reason: str, detail: str) -> Rejected:
    """A decoded entry its consumer gave up on (its handler failed, or it was delivered too
    often), as a dead-letter record; the payload is re-encoded when the message still encodes."""
    try:
        payload = encode(delivery.message)
    except Exception:  # the message itself may be why its handler failed
        payload = b""
    return Rejected(delivery.stream, delivery.entry_id, reason, detail, payload)


def decode_entry(stream: str, entry_id: str, fields: dict[bytes, bytes]) -> Delivery | Rejected:
    """Decode an entry's fields. Never raises: every failure becomes a Rejected with a reason.

    `fields` must be non-empty (an empty dict is a pending entry deleted by trimming; the caller
    handles those, since they carry no payload to dead-letter).
    """
    data = fields.get(FIELD)
    if data is None:
        names = ", ".join(sorted(k.decode(errors="replace") for k in fields))
        return Rejected(stream, entry_id, "missing_field", f"no field 'm' (has: {names})", b"")
    try:
        return Delivery(stream, entry_id, decode(data))
    except CodecError as exc:
        return Rejected(stream, entry_id, exc.reason, exc.detail, data)
