"""Where the device sat idle between the worker's steps: the reader of the step timeline that
step_timeline.py writes (MESHLLM_STEP_TIMELINE=FILE). Kept beside the writer so the line format
has one home; it runs offline, never in the serving path.

    python -m services.worker.runner.step_timeline_report FILE [--split-ms 1000]

The file is cut into runs wherever the device was idle longer than --split-ms (between the
runs of a benchmark). Per run: its wall span on the device, the time the device was busy with
steps, the idle time between steps, split by the kind of step that followed (decode-only or
with prefill tokens) and by cause: `late plan` (the next step's launch() came after the
previous step's device work ended: bus, scheduler or step thread), `host prep` (the next step
started on an idle device and waited for its inputs to be staged). The largest gaps are
listed with their host marks. Then, for the steps that verify drafts and the decode-only ones,
the median ms between the host's phase marks inside a step (`phase_medians`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    step: int
    tokens: int
    decodes: int
    launch: float
    start: float
    inputs: float
    end: float

    @property
    def kind(self) -> str:
        return "decode" if self.tokens == self.decodes else "prefill"


def load(path: str) -> list[Step]:
    steps = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "device_end" not in row:
                continue  # a CPU timeline has no device marks
            start = row["device_start"]
            inputs = row.get("device_inputs", start)
            marks = (row["launch"], start, inputs, row["device_end"])
            steps.append(Step(row["step"], row["tokens"], row["decodes"], *marks))
    return sorted(steps, key=lambda s: s.start)


def runs(steps: list[Step], split_ms: float) -> list[list[Step]]:
    out: list[list[Step]] = []
    for step in steps:
        if out and step.start - out[-1][-1].end <= split_ms:
            out[-1].append(step)
        else:
            out.append([step])
    return out


def summarize(run: list[Step], top: int = 5) -> str:
    span = run[-1].end - run[0].start
    busy = 0.0
    idle: dict[str, float] = defaultdict(float)
    gaps = []
    for prev, step in itertools.pairwise(run):
        gap = max(0.0, step.start - prev.end)  # no step queued at all
        prep = max(0.0, step.inputs - max(step.start, prev.end))  # waiting for staged inputs
        late = max(0.0, min(step.launch, step.start) - prev.end)
        idle[f"{step.kind}: late plan"] += min(gap, late)
        idle[f"{step.kind}: other gap"] += gap - min(gap, late)
        idle[f"{step.kind}: host prep"] += prep
        gaps.append((gap + prep, prev, step))
    for step in run:
        busy += step.end - step.start
    kinds = defaultdict(int)
    for step in run:
        kinds[step.kind] += 1
    lines = [
        f"{len(run)} steps ({kinds['decode']} decode-only, {kinds['prefill']} with prefill), "
        f"{span:.1f} ms on the device, busy {busy:.1f} ms; idle between steps "
        f"{sum(g for g, _, _ in gaps):.1f} ms ({100 * sum(g for g, _, _ in gaps) / span:.1f}%)"
    ]
    for key in sorted(idle):
        if idle[key] > 0:
            lines.append(f"  {key:<22} {idle[key]:9.1f} ms")
    lines.append("  largest gaps (ms): gap+prep, after step (tokens) -> step (tokens)")
    for g, prev, step in sorted(gaps, key=lambda t: -t[0])[:top]:
        lines.append(
            f"    {g:7.2f}  {prev.step} ({prev.tokens}) -> {step.step} ({step.tokens}); "
            f"launch {step.launch - prev.end:+.2f} ms vs the previous end"
        )
    return "\n".join(lines)


#: Host marks of a step in the order the runner reaches them (those it reached are used).
PHASE_ORDER = (
    "launch", "inputs", "staged", "replayed", "forward", "drawn", "verified", "observed",
    "proposed", "queued", "landed",
)  # fmt: skip


def phase_medians(rows: list[dict], kind: str) -> dict[str, float]:
    """Median ms of each span between consecutive host marks of the `kind` steps without
    prompt tokens ("verify": with drafts; "decode": one token per request): `inputs` is
    launch -> inputs staged, `forward` inputs -> forward queued, and so on; `before` is the
    time since the previous line's `finished` (the scheduler's and the caller's part),
    `finished` the last mark -> the result built. On CUDA `device_forward` is the device's
    time from its inputs to the forward's end and `device_to_drawn` from there to the host's
    mark `drawn`."""
    spans: dict[str, list[float]] = defaultdict(list)
    previous_finished: float | None = None
    for row in rows:
        drafts, prompt = row.get("drafts", 0), row.get("prompt", 0)
        chosen = (drafts > 0 if kind == "verify" else not drafts) and not prompt
        if chosen:
            marks = {"launch": row["launch"], "queued": row["queued"], **row.get("phases", {})}
            ordered = sorted((marks[name], name) for name in PHASE_ORDER if name in marks)
            if previous_finished is not None:
                spans["before"].append(row["launch"] - previous_finished)
            for (t0, _), (t1, name) in itertools.pairwise(ordered):
                spans[name].append(t1 - t0)
            spans["finished"].append(row["finished"] - ordered[-1][0])
            device = row.get("device_phases", {})
            if "forward" in device and "device_inputs" in row:
                spans["device_forward"].append(device["forward"] - row["device_inputs"])
                if "drawn" in device:
                    spans["device_to_drawn"].append(device["drawn"] - device["forward"])
        previous_finished = row["finished"]
    return {name: round(statistics.median(v), 3) for name, v in spans.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("timeline")
    parser.add_argument("--split-ms", type=float, default=1000.0)
    args = parser.parse_args()
    for i, run in enumerate(runs(load(args.timeline), args.split_ms)):
        print(f"run {i}: " + summarize(run))
    with open(args.timeline) as f:
        rows = [json.loads(line) for line in f]
    for kind in ("verify", "decode"):
        print(f"{kind} steps, median ms between host marks: {phase_medians(rows, kind)}")


if __name__ == "__main__":
    main()
