"""The cyclic collector around CUDA graph captures (services/worker/accel/gc_pause.py): dead
cycles go before the block, none is collected inside it, and the collector's state comes back
after it, also when the block raises."""

from __future__ import annotations

import gc
import weakref

import pytest

from services.worker.accel.gc_pause import collected_then_paused


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def dead_cycle() -> weakref.ref[Node]:
    """A reference cycle nothing else holds; only the cyclic collector frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_dead_cycles_go_first_and_none_is_collected_inside() -> None:
    assert gc.isenabled()
    before = dead_cycle()
    with collected_then_paused():
        assert before() is None  # collected on entry
        assert not gc.isenabled()
        inside = dead_cycle()
        # far past every generation's threshold: an enabled collector would run here
        garbage = [dead_cycle() for _ in range(20 * sum(gc.get_threshold()))]
        assert inside() is not None and all(r() is not None for r in garbage)
    assert gc.isenabled()
    gc.collect()
    assert inside() is None


def test_the_collector_state_comes_back_after_an_error() -> None:
    with pytest.raises(RuntimeError), collected_then_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collected_then_paused():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
