"""The worker's step timeline (MESHLLM_STEP_TIMELINE): a line per step with its shape and host
marks (device marks on CUDA: tests/gpu/test_step_timeline_cuda.py), and the summary of
step_timeline_report.py over device marks."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from services.worker.runner.step_timeline import StepTimeline
from services.worker.runner.step_timeline_report import (
    Step,
    load,
    phase_medians,
    runs,
    summarize,
)
from services.worker.spec import SpeculativeConfig
from shared.config import WorkerSettings
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.plans import PlanDriver
from tests.support.tiny_llama import make_tiny_llama, tiny_runner


def test_runner_writes_a_line_per_step(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path)
    runner = tiny_runner(tmp_path)
    path = tmp_path / "timeline.jsonl"
    runner.timeline = StepTimeline(str(path), runner.device)
    driver = PlanDriver(runner, token_budget=8)
    driver.add("a", [1, 17, 99, 4, 250, 31, 8, 77, 300, 12, 5], SamplingParams(max_tokens=3))
    driver.add("b", [1, 400], SamplingParams(max_tokens=3))
    driver.run()
    runner.timeline.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [r.step_id for r in driver.results]
    assert [r["tokens"] for r in rows] == [
        sum(p.num_scheduled_tokens.values()) for p in driver.plans
    ]
    # The first step: a chunk of a's prompt (8 of 11 tokens, no decodes); the last: decodes.
    assert rows[0]["tokens"] == 8 and rows[0]["decodes"] == 0
    assert rows[-1]["tokens"] == rows[-1]["decodes"] >= 1
    for r in rows:
        assert 0 <= r["launch"] <= r["queued"] <= r["finished"]
        assert "device_start" not in r  # CPU: host marks only
    assert all(a["finished"] <= b["launch"] for a, b in itertools.pairwise(rows))


def test_setting_reads_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MESHLLM_STEP_TIMELINE", "/tmp/t.jsonl")
    assert WorkerSettings().step_timeline == "/tmp/t.jsonl"
    monkeypatch.delenv("MESHLLM_STEP_TIMELINE")
    assert WorkerSettings().step_timeline == ""


def _step(i: int, launch: float, start: float, inputs: float, end: float, prefill: bool = False):  # type: ignore[no-untyped-def]
    return Step(i, 64 + (100 if prefill else 0), 64, launch, start, inputs, end)


def test_summary_splits_idle_by_cause() -> None:
    steps = [
        _step(0, 0.0, 0.0, 0.0, 10.0),
        _step(1, 5.0, 10.0, 10.0, 20.0),  # launched while 0 ran: no idle
        _step(2, 23.0, 23.0, 23.0, 30.0),  # launched 3 ms after 1 ended: late plan
        _step(3, 30.5, 31.0, 34.0, 40.0, prefill=True),  # 1 ms gap, then 3 ms staging inputs
        _step(4, 5000.0, 5000.0, 5000.0, 5010.0),  # a later run
    ]
    cut = runs(steps, split_ms=1000.0)
    assert [len(r) for r in cut] == [4, 1]
    text = summarize(cut[0])
    assert "4 steps (3 decode-only, 1 with prefill), 40.0 ms on the device, busy 36.0 ms" in text
    assert "idle between steps 7.0 ms (17.5%)" in text
    lines = {line.split("  ")[1].strip(): line.split()[-2] for line in text.splitlines()[1:5]}
    assert lines == {
        "decode: late plan": "3.0",
        "prefill: host prep": "3.0",
        "prefill: late plan": "0.5",  # launched 0.5 ms after step 2 ended
        "prefill: other gap": "0.5",  # and its first event ran 0.5 ms after that
    }
    assert text.splitlines()[-3].split()[0] == "4.00"  # the largest gap first: 2 -> 3


def test_load_keeps_device_rows_in_device_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"step": 2, "tokens": 1, "decodes": 1, "launch": 9, "queued": 9.5, "finished": 12,
         "device_start": 10, "device_inputs": 10, "device_end": 11},
        {"step": 1, "tokens": 1, "decodes": 1, "launch": 1, "queued": 1.5, "finished": 4,
         "device_start": 2, "device_end": 3},
        {"step": 0, "tokens": 1, "decodes": 1, "launch": 0, "queued": 0.1, "finished": 1},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load(str(path))
    assert [s.step for s in loaded] == [1, 2]  # the CPU row (no device marks) is skipped
    assert loaded[0].inputs == 2  # no inputs mark: the start stands in


def test_verify_steps_carry_their_phase_marks(tmp_path: Path) -> None:
    """With an n-gram drafter every verify step's line holds the host marks of its phases in
    the order the runner reaches them, and phase_medians splits those steps (not the prefill,
    which has prompt tokens) into the spans between them."""
    make_tiny_llama(tmp_path, vocab_size=64)  # the prompt holds nearly every token: drafts
    spec = SpeculativeConfig(method="ngram", num_spec_tokens=3, prompt_lookup_min=1)
    engine = InProcessEngine(tmp_path, block_size=4, speculative=spec)
    path = tmp_path / "timeline.jsonl"
    engine.runner.timeline = StepTimeline(str(path), engine.runner.device)
    prompt = list(range(3, 64))
    engine.submit("a", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.run()
    engine.runner.timeline.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["prompt"] == len(prompt) - 1 and rows[0]["drafts"] == 0
    verify = [r for r in rows if r["drafts"]]
    assert verify, "the n-gram drafter proposed nothing"
    order = ["inputs", "forward", "drawn", "verified", "proposed"]
    for row in verify:
        assert row["prompt"] == 0
        assert list(row["phases"]) == order
        marks = [row["launch"], *(row["phases"][name] for name in order), row["queued"]]
        assert marks == sorted(marks)
    split = phase_medians(rows, "verify")
    assert set(split) >= {"inputs", "forward", "drawn", "verified", "proposed", "finished"}
    assert all(v >= 0 for v in split.values())
    assert phase_medians(rows, "decode").keys().isdisjoint({"drawn", "verified"})
