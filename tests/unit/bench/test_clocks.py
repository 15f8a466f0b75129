"""bench/gpu/clocks.py: nvidia-smi's samples summarised, and the sampler's process life."""

import os
import stat
import time
from pathlib import Path

import pytest

from bench.gpu.clocks import ClockSampler, summarize


def test_summarize_means_and_extremes_of_whole_samples() -> None:
    text = "1980, 2619, 650.50, 61\n1755, 2619, 699.90, 66\n[N/A], 2619, 100.0, 60\n1830, 26"
    got = summarize(text)
    assert got is not None
    assert got["samples"] == 2  # the N/A row and the cut last line are left out
    assert got["sm_mhz_mean"] == pytest.approx(1867.5)
    assert (got["sm_mhz_min"], got["sm_mhz_max"]) == (1755.0, 1980.0)
    assert got["power_w_mean"] == pytest.approx(675.2)
    assert got["power_w_max"] == pytest.approx(699.9)
    assert got["temp_c_max"] == 66.0


def test_summarize_without_samples_is_none() -> None:
    assert summarize("") is None
    assert summarize("[N/A], [N/A], [N/A], [N/A]\n") is None


def test_sampler_reads_what_nvidia_smi_printed_until_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for the tool on PATH that prints a sample per period until terminated, as
    # `nvidia-smi -lms` does; it echoes its arguments' query so a wrong flag shows.
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu*) ;; '
        "*) exit 3 ;; esac\n"
        "while true; do echo '1500, 2600, 300.0, 50'; sleep 0.02; done\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    sampler = ClockSampler(period_ms=20)
    time.sleep(0.3)
    got = sampler.stop()
    assert got is not None and got["samples"] >= 2
    assert got["sm_mhz_mean"] == 1500.0
    assert sampler.stop() is None  # stopped once: nothing more to read


def test_sampler_without_nvidia_smi_reports_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ClockSampler().stop() is None
