"""The chunk payload: a round trip keeps every byte, and every header field that differs from
what the reader expects (or a damaged value) is refused with the field named."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_offload.payload import (
    LAYOUT_VERSION,
    PayloadError,
    PayloadHeader,
    check_payload,
    pack_payload,
    read_header,
)

SHAPE = (3, 2, 4, 2, 8)


def header(**overrides: object) -> PayloadHeader:
    fields: dict[str, object] = {"model": "org/tiny:1", "dtype": torch.float32, "shape": SHAPE}
    fields.update(overrides)
    return PayloadHeader(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_keeps_every_byte(dtype: torch.dtype) -> None:
    h = header(dtype=dtype)
    body = torch.randn(SHAPE).to(dtype)
    payload = pack_payload(h, body)
    start = check_payload(payload, h)
    assert len(payload) - start == h.body_bytes == body.numel() * body.element_size()
    back = torch.frombuffer(bytearray(payload[start:]), dtype=dtype).reshape(SHAPE)
    assert torch.equal(back.view(torch.uint8), body.view(torch.uint8))
    assert read_header(payload) == (h, start)


@pytest.mark.parametrize(
    ("written", "field"),
    [
        ({"model": "org/other"}, "model"),
        ({"dtype": torch.bfloat16}, "dtype"),
        ({"shape": (3, 2, 4, 2, 16)}, "shape"),
        ({"shape": (2, 2, 4, 2, 8)}, "shape"),
        ({"layout_version": LAYOUT_VERSION + 1}, "layout_version"),
    ],
)
def test_every_header_mismatch_is_refused(written: dict[str, object], field: str) -> None:
    h = header(**written)
    payload = pack_payload(h, torch.zeros(h.shape, dtype=h.dtype))
    with pytest.raises(PayloadError, match=f"{field} mismatch"):
        check_payload(payload, header())


def test_damaged_values_are_refused() -> None:
    h = header()
    payload = pack_payload(h, torch.ones(SHAPE))
    with pytest.raises(PayloadError, match="shorter than a header"):
        check_payload(payload[:10], h)
    with pytest.raises(PayloadError, match="body has"):
        check_payload(payload[:-1], h)
    with pytest.raises(PayloadError, match="body has"):
        check_payload(payload + b"\0", h)
    with pytest.raises(PayloadError, match="bad magic"):
        check_payload(b"XXXX" + payload[4:], h)


def test_pack_checks_the_body_against_the_header() -> None:
    with pytest.raises(PayloadError, match="does not match"):
        pack_payload(header(), torch.zeros((3, 2, 4, 2, 4)))
    with pytest.raises(PayloadError, match="contiguous"):
        pack_payload(header(), torch.zeros((3, 2, 4, 8, 2)).transpose(3, 4))
    with pytest.raises(PayloadError, match="shape must be"):
        header(shape=(3, 1, 4, 2, 8))


def test_one_layout_version_for_key_names_and_headers() -> None:
    """The worker's headers, the worker's key space and the scheduler's/kvstore's key space all
    use the key space's constant: bumping it moves names and headers together."""
    from services.scheduler.offload import edge as offload_edge
    from services.worker.kv_offload import payload, wiring
    from shared.config import WorkerSettings
    from shared.kv import offload_key
    from shared.kv.offload_key import KeySpace, OffloadKey

    assert payload.LAYOUT_VERSION is offload_key.LAYOUT_VERSION
    assert offload_edge.LAYOUT_VERSION is offload_key.LAYOUT_VERSION
    space = wiring.key_space(WorkerSettings(cluster="c"), "m")
    assert space == KeySpace("c", "m", offload_key.LAYOUT_VERSION)
    name = space.payload_key(OffloadKey(b"\x01" * 16, 0))
    assert f":{offload_key.LAYOUT_VERSION}:" in name
    written, _ = read_header(pack_payload(header(), torch.zeros(SHAPE)))
    assert written.layout_version == space.layout_version
