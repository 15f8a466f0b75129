"""services/worker/runner/kernel_trace.py: per-kernel device time and the gaps between kernels
of a profiled run (chrome trace), within steps and by kernel pair."""

from __future__ import annotations

import json
from pathlib import Path

from services.worker.runner.kernel_trace import load_kernels, summarize_trace


def _trace(path: Path, kernels: list[tuple[str, float, float]]) -> str:
    events = [{"cat": "kernel", "ph": "X", "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
    events.append({"cat": "cpu_op", "ph": "X", "name": "aten::mm", "ts": 0.0, "dur": 99.0})
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_kernel_times_and_gaps_by_pair(tmp_path: Path) -> None:
    # Two steps of gemv -> attn -> gemv, 200 us apart; inside a step the gaps are 1 us
    # (gemv -> attn) and 3 us (attn -> gemv); a PDL overlap (negative gap) counts as none.
    step = [("gemv", 0.0, 10.0), ("attn", 11.0, 5.0), ("gemv", 19.0, 10.0), ("gemv", 28.0, 4.0)]
    kernels = [*step, *((n, ts + 232.0, d) for n, ts, d in step)]
    path = _trace(tmp_path / "t.json", kernels)
    assert [k.name for k in load_kernels(path)] == [n for n, _, _ in kernels]  # cpu ops left out
    text = summarize_trace(path, steps=2)
    lines = text.splitlines()
    assert lines[0] == "8 kernels over 2 step(s); per step:"
    assert lines[2].split() == ["gemv", "3.0", "24.0", "8.00"]
    assert lines[3].split() == ["attn", "1.0", "5.0", "5.00"]
    # 4 us of gaps a step (3 gaps a step: 1, 3 and 0), 200 us once between the steps
    assert "kernel time 29.0 us; gaps inside steps 4.0 us (3 gaps, mean 1.33 us)" in text
    assert "gaps > 50 us (between steps) 100.0 us; first start to last end 132.0 us" in text
    pairs = {line.rsplit(None, 3)[0]: line.split()[-3:] for line in lines[6:]}
    assert pairs["attn -> gemv"] == ["1.0", "3.0", "3.00"]
    assert pairs["gemv -> attn"] == ["1.0", "1.0", "1.00"]
    assert pairs["gemv -> gemv"] == ["1.0", "0.0", "0.00"]  # the overlap, and not the 200 us


def test_copies_and_fills_are_device_events(tmp_path: Path) -> None:
    # A host-to-device copy and a fill sit between kernels on the stream: they are device
    # time, and the gaps around them are measured from them, not across them.
    events = [
        {"cat": "kernel", "ph": "X", "name": "gemv", "ts": 0.0, "dur": 10.0},
        {"cat": "gpu_memcpy", "ph": "X", "name": "Memcpy HtoD", "ts": 12.0, "dur": 2.0},
        {"cat": "gpu_memset", "ph": "X", "name": "Memset", "ts": 15.0, "dur": 1.0},
        {"cat": "kernel", "ph": "X", "name": "attn", "ts": 20.0, "dur": 5.0},
        {"cat": "cuda_runtime", "ph": "X", "name": "cudaMemcpyAsync", "ts": 1.0, "dur": 3.0},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    names = [k.name for k in load_kernels(str(path))]
    assert names == ["gemv", "Memcpy HtoD", "Memset", "attn"]  # host-side calls left out
    text = summarize_trace(str(path))
    assert "kernel time 18.0 us; gaps inside steps 7.0 us (3 gaps, mean 2.33 us)" in text
