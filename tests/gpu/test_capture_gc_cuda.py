"""CUDA graph captures run with Python's cyclic collector off (services/worker/accel/
gc_pause.py): a dead cycle holding a captured graph, freed by the collector while another
capture is under way, destroys that graph inside the capture (PyTorch only warns when that
fails) and invalidates it. Here a dead cycle holds a captured graph and a capture's forward
allocates far past every collector threshold: the capture succeeds, its replay computes, and
the forward saw the collector off."""

from __future__ import annotations

import gc
import weakref

import torch

from services.worker.accel.cuda_graphs import capture_graphs


class Step:
    """The least a graph set is (cuda_graphs.StepGraphs): y = x * 2 + 1 per size."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self.device = torch.device("cuda")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.inputs = None
        self.upload_stream = None
        self.replayed = None
        self.x = torch.zeros(max(sizes), device=self.device)
        self.collector_on: list[bool] = []
        self.owner: object | None = None  # a cycle: owner -> step -> owner

    def metadata(self, size: int) -> None:
        return None

    def forward(self, size: int, _: None) -> torch.Tensor:
        self.collector_on.append(gc.isenabled())
        junk = [[i] for i in range(20 * sum(gc.get_threshold()))]  # Python allocations
        del junk
        return self.x[:size] * 2 + 1


class Owner:
    def __init__(self, step: Step) -> None:
        self.step = step
        step.owner = self


def test_a_capture_survives_dead_graphs_around_it() -> None:
    dead = Step((1, 2))
    capture_graphs(dead, "dead")  # type: ignore[arg-type]
    ref = weakref.ref(Owner(dead))
    del dead  # only the cycle holds the captured graphs now
    live = Step((1, 2, 4))
    capture_graphs(live, "live")  # type: ignore[arg-type]
    assert ref() is None  # collected before the captures, not inside them
    assert live.collector_on and not any(live.collector_on)
    assert gc.isenabled()
    live.x.copy_(torch.arange(4, device="cuda", dtype=torch.float32))
    live.graphs[4].replay()
    torch.cuda.synchronize()
    assert live.outputs[4].tolist() == [1.0, 3.0, 5.0, 7.0]
