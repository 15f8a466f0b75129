"""The step timeline on CUDA: device marks in order within and across steps, on the clock of
the host marks (services/worker/runner/step_timeline.py)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from services.worker.runner.model_runner import ModelRunner
from services.worker.runner.step_timeline import StepTimeline
from shared.protocol import SamplingParams
from tests.support.plans import PlanDriver
from tests.support.tiny_llama import make_tiny_llama, tiny_runner


def _timeline(
    tmp_path: Path, runner: ModelRunner, token_budget: int, max_tokens: int
) -> tuple[list[dict], PlanDriver]:
    """One 11-token prompt run to `max_tokens` with the timeline on: its lines, the driver."""
    path = tmp_path / "timeline.jsonl"
    runner.timeline = StepTimeline(str(path), runner.device)
    driver = PlanDriver(runner, token_budget=token_budget)
    driver.add("a", list(range(1, 12)), SamplingParams(max_tokens=max_tokens))
    driver.run()
    runner.timeline.close()
    return [json.loads(line) for line in path.read_text().splitlines()], driver


def test_device_marks_on_cuda(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path)
    rows, driver = _timeline(tmp_path, tiny_runner(tmp_path, device="cuda"), 8, 4)
    assert len(rows) == len(driver.results) >= 4
    for r in rows:
        assert r["device_start"] <= r["device_inputs"] <= r["device_end"]
        # the clocks agree to within a few ms: the device starts a step after its launch call
        assert r["device_start"] >= r["launch"] - 5.0
        assert r["device_end"] <= r["finished"] + 5.0
    for a, b in itertools.pairwise(rows):
        assert a["device_end"] <= b["device_start"] + 1e-3


def test_graph_replays_mark_their_staging_and_launch(tmp_path: Path) -> None:
    """Decode steps replayed from CUDA graphs carry `staged` and `replayed` between `inputs`
    and `forward`, with a device event at each in the same order."""
    make_tiny_llama(tmp_path)
    runner = tiny_runner(tmp_path, device="cuda")
    runner.warmup()
    runner.capture_cuda_graphs(sizes=(1, 2))
    rows, _ = _timeline(tmp_path, runner, 32, 5)
    decodes = [r for r in rows if r["tokens"] == r["decodes"]]
    assert decodes and all("replayed" in r["phases"] for r in decodes)
    assert "replayed" not in rows[0]["phases"]  # the prompt ran eagerly
    order = ["inputs", "staged", "replayed", "forward"]
    for r in decodes:
        assert [r["phases"][name] for name in order] == sorted(r["phases"][name] for name in order)
        device = [r["device_phases"][name] for name in order[1:]]
        assert device == sorted(device) and r["device_inputs"] <= device[0]
