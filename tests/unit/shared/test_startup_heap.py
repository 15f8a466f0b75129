"""freeze_startup_heap: objects alive at start-up leave the cyclic collector's scans."""

from __future__ import annotations

import gc

from shared.service import freeze_startup_heap


def test_startup_objects_are_frozen_and_later_garbage_still_collected() -> None:
    try:
        startup = [[i] for i in range(10_000)]  # alive "at start-up"
        frozen = freeze_startup_heap()
        # Frozen objects that die leave the count (another thread's, in a shared test process):
        # it may only shrink, and never below the start-up objects still alive.
        assert frozen >= gc.get_freeze_count() >= len(startup)
        tracked = {id(o) for o in gc.get_objects()}  # the collector's generations, not frozen
        assert not any(id(o) in tracked for o in startup)
        assert gc.get_count()[2] == 0  # a full collection ran first

        class Cycle:
            pass

        later = Cycle()
        later.self = later  # type: ignore[attr-defined]
        del later
        assert gc.collect() >= 1  # garbage made after start-up is still found
        # and the frozen objects stay out of the scans: none came back, none was added
        assert len(startup) <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
