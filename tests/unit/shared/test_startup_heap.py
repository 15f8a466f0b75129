"""freeze_startup_heap: objects alive at start-up leave the cyclic collector's scans."""

from __future__ import annotations

import gc

from shared.service import freeze_startup_heap


def test_startup_objects_are_frozen_and_later_garbage_still_collected() -> None:
    try:
        startup = [[i] for i in range(10_000)]  # alive "at start-up"
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(startup)
        assert gc.get_count()[2] == 0  # a full collection ran first

        class Cycle:
            pass

        later = Cycle()
        later.self = later  # type: ignore[attr-defined]
        del later
        assert gc.collect() >= 1  # garbage made after start-up is still found
        assert gc.get_freeze_count() == frozen  # and the frozen objects stay out of the scans
    finally:
        gc.unfreeze()
