"""Timing CUDA graphs against each other: replays in a rotating order, so that no mode always
runs first (or right after the same other mode) and drifts of the machine spread over all."""

from __future__ import annotations

from collections.abc import Callable

import torch


def captured(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`run` captured in a CUDA graph, after one warm-up run on a side stream (compiles and
    allocations outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def rotating_replays(
    graphs: dict[str, torch.cuda.CUDAGraph], replays: int
) -> dict[str, list[float]]:
    """Microseconds of each graph's replays (CUDA events), `replays` rounds; round r starts
    at the r-th graph."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    names = list(graphs)
    for r in range(replays):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start.record()
            graphs[name].replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return times
