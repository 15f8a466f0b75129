"""The worker's step timeline (MESHLLM_STEP_TIMELINE=path): one JSON line per finished step,
for finding where the device sits idle between steps (read by step_timeline_report.py).

Each line holds the step's shape (scheduled tokens, decode rows) and, in ms since the timeline
opened, its host marks: `launch` (launch() called: the plan is in hand), `queued` (launch()
returned: all its work is on the stream) and `finished` (its result built). On CUDA it also
holds three device marks from events on the step's stream: `device_start` (the step's first
event, recorded as launch() begins: it completes when the previous step's work is done or at
once on an idle device), `device_inputs` (after its inputs are staged; from device_start to
here the device waited for the host to prepare the step if it was idle) and `device_end`.

`phases` names host marks inside the step, in the order the runner reached them (ms, as
above): `inputs` (the step's inputs staged), on CUDA graphs `staged` (the graph's inputs
padded and uploaded) and `replayed` (the graph launched), `forward` (the forward queued),
`drawn` (a verify step's draws on the host), `verified` (its tokens accepted and the batch
rolled forward), `proposed` (the next drafts made), `landed` (a plain step's tokens on the
host, in finish()); on CUDA `device_phases` holds an event recorded at each but `landed`, so
a verify step splits into host work, the wait for the device and the device's own time.

The host and device clocks are aligned by an event recorded when the timeline opens (on an
idle device it completes at once), so `launch` can be compared with the previous step's
`device_end`: a launch after it means the plan came too late (bus, scheduler, step thread).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import torch


@dataclass
class StepMarks:
    """What the timeline records of one step while it is launched."""

    launch: float  # perf_counter at launch()
    queued: float = 0.0  # perf_counter when launch() returned
    tokens: int = 0
    decodes: int = 0
    drafts: int = 0  # draft tokens the step verifies
    prompt: int = 0  # tokens beyond each request's one new token and its drafts (prefill)
    phases: dict[str, float] = field(default_factory=dict)  # name -> perf_counter
    phase_events: dict[str, torch.cuda.Event] = field(default_factory=dict, repr=False)

    def shape(self, query_lens: np.ndarray, num_drafts: np.ndarray | None) -> None:
        """The step's shape from its inputs (the drafts it verifies: the plan's, or the
        worker's own in lookahead slots, known only once the inputs are made)."""
        self.tokens = int(query_lens.sum())
        self.decodes = int(np.count_nonzero(query_lens == 1))
        self.drafts = 0 if num_drafts is None else int(num_drafts.sum())
        self.prompt = self.tokens - len(query_lens) - self.drafts


class StepTimeline:
    def __init__(self, path: str, device: torch.device) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 (closed by close())
        self._host_origin = time.perf_counter()
        self._origin: torch.cuda.Event | None = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()

    def marks(self) -> StepMarks:
        """A step's marks, begun now (its shape comes with its inputs: StepMarks.shape)."""
        return StepMarks(time.perf_counter())

    def phase(self, marks: StepMarks, name: str, device: bool = True) -> None:
        """A named mark inside the step: the host's time, and on CUDA (`device`) an event on
        the stream (only while launch() runs: write() reads it once the step's end is done)."""
        marks.phases[name] = time.perf_counter()
        if device and self._origin is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.phase_events[name] = event

    def write(
        self,
        step_id: int,
        marks: StepMarks,
        device_span: tuple[torch.cuda.Event, torch.cuda.Event] | None,
    ) -> None:
        """The finished step's line (its device events have completed)."""
        row: dict[str, Any] = {
            "step": step_id,
            "tokens": marks.tokens,
            "decodes": marks.decodes,
            "drafts": marks.drafts,
            "prompt": marks.prompt,
            "launch": self._host_ms(marks.launch),
            "queued": self._host_ms(marks.queued),
            "finished": self._host_ms(time.perf_counter()),
            "phases": {name: self._host_ms(t) for name, t in marks.phases.items()},
        }
        if self._origin is not None and device_span is not None:
            start, end = device_span
            row["device_start"] = round(self._origin.elapsed_time(start), 3)
            if (inputs := marks.phase_events.get("inputs")) is not None:
                row["device_inputs"] = round(self._origin.elapsed_time(inputs), 3)
            row["device_end"] = round(self._origin.elapsed_time(end), 3)
            row["device_phases"] = {
                name: round(self._origin.elapsed_time(event), 3)
                for name, event in marks.phase_events.items()
            }
        self._file.write(json.dumps(row) + "\n")

    def _host_ms(self, t: float) -> float:
        return round((t - self._host_origin) * 1000.0, 3)

    def close(self) -> None:
        self._file.close()
