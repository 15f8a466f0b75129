"""RequestRecord: one access per request, ordered by position, classified keys."""

from __future__ import annotations

import pytest

from services.kvstore.request_record import RequestRecord
from tests.unit.kvstore.prefix import prefix_chunks


def test_access_order_is_tail_first_across_groups_whatever_the_recording_order() -> None:
    g0 = prefix_chunks(3, group=0)
    g1 = prefix_chunks(3, group=1)
    record = RequestRecord("r")
    for key, end in [g1[0], g0[2], g0[0], g1[2], g0[1], g1[1]]:
        record.offered(key, end)
    order = record.access_order()
    ends = [record.positions[k] for k in order]
    assert ends == [48, 48, 32, 32, 16, 16]
    assert set(order[-2:]) == {g0[0][0], g1[0][0]}  # the heads come last: most recent


def test_reads_and_offers_merge_into_one_key_set() -> None:
    (a, a_end), (b, b_end) = prefix_chunks(2)
    record = RequestRecord("r")
    record.was_read(a, a_end)
    record.offered(a, a_end)
    record.offered(b, b_end)
    assert record.access_order() == [b, a]
    assert record.reused == {a}
    assert record.summary() == {"keys": 2, "inserted": 0, "reused": 1, "store_misses": 0}


def test_first_store_miss_is_true_once_per_key() -> None:
    (a, _), (b, _) = prefix_chunks(2)
    record = RequestRecord("r")
    assert record.first_store_miss(a)
    assert not record.first_store_miss(a)
    assert record.first_store_miss(b)


def test_positions_must_be_positive() -> None:
    ((a, _),) = prefix_chunks(1)
    with pytest.raises(ValueError, match="end position"):
        RequestRecord("r").offered(a, 0)
