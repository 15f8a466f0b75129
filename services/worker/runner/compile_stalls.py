"""The worker's watch on Triton compiles (meshllm_kernels/runtime/compile_watch.py): compiles
during the warm-up are expected, one after it held a serving step for as long as it took, so
it is logged with the kernel and its specialization (what the warm-up should have covered) and
counted in meshllm:worker_jit_compiles_total{phase="serving"}."""

from __future__ import annotations

import logging

from prometheus_client import Counter

from meshllm_kernels.runtime.compile_watch import Compile, CompileWatch
from shared.metrics import metric_name

log = logging.getLogger(__name__)

JIT_COMPILES = Counter(
    metric_name("worker_jit_compiles_total"),
    "Triton kernel compiles (phase=warmup: at start-up; phase=serving: a step waited for it)",
    ["phase"],
)
JIT_COMPILE_SECONDS = Counter(
    metric_name("worker_jit_compile_seconds_total"),
    "Seconds spent compiling Triton kernels",
    ["phase"],
)


def record(event: Compile) -> None:
    phase = "serving" if event.after_warmup else "warmup"
    JIT_COMPILES.labels(phase).inc()
    JIT_COMPILE_SECONDS.labels(phase).inc(event.seconds)
    if event.after_warmup:
        log.warning(
            "a serving step waited %.0f ms for a Triton compile of %s (%s): the warm-up did "
            "not cover it",
            event.seconds * 1000.0,
            event.kernel,
            event.specialization,
        )


def watch_compiles() -> CompileWatch:
    return CompileWatch(on_compile=record).install()
