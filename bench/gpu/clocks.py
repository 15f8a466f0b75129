"""The GPU's SM clock, power draw and temperature while a benchmark run goes: `nvidia-smi`
sampling every `period_ms` in a process beside the run. Two runs of one shape that differ in
speed either ran at different clocks (power or thermal limits) or did not: this says which.

    sampler = ClockSampler()      # starts sampling (nothing where nvidia-smi is missing)
    ...                           # the run
    stats = sampler.stop()        # {"sm_mhz_mean": ..., ...} or None
"""

from __future__ import annotations

import shutil
import statistics
import subprocess

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu"


def summarize(text: str) -> dict[str, float] | None:
    """`nvidia-smi --format=csv,noheader,nounits` lines of QUERY's fields (one GPU's: the
    sampler passes `--id`) -> means and extremes; None without a whole sample."""
    rows = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            rows.append(tuple(float(f) for f in fields))
        except ValueError:  # "[N/A]", or a line cut by the stop
            continue
    if not rows:
        return None
    sm, mem, power, temp = zip(*rows, strict=True)
    return {
        "samples": len(rows),
        "sm_mhz_mean": round(statistics.fmean(sm), 1),
        "sm_mhz_min": min(sm),
        "sm_mhz_max": max(sm),
        "mem_mhz_mean": round(statistics.fmean(mem), 1),
        "power_w_mean": round(statistics.fmean(power), 1),
        "power_w_max": max(power),
        "temp_c_max": max(temp),
    }


class ClockSampler:
    """One `nvidia-smi -lms` process from construction to `stop()`."""

    def __init__(self, period_ms: int = 100, gpu: int = 0) -> None:
        exe = shutil.which("nvidia-smi")
        self.proc: subprocess.Popen[str] | None = None
        if exe:
            self.proc = subprocess.Popen(
                [exe, f"--id={gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 f"-lms={period_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip

    def stop(self) -> dict[str, float] | None:
        """Stop sampling: the samples' summary (None without nvidia-smi or samples)."""
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            text, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            text, _ = self.proc.communicate()
        self.proc = None
        return summarize(text)
