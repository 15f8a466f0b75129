"""Fixtures shared by every test layer: a real Redis, the embedded model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer


def _share_the_cores() -> int | None:
    """Under pytest-xdist each worker gets its share of the CPUs for torch's and OpenMP's
    threads (OMP_NUM_THREADS, inherited by the services a test spawns), unless the caller set
    it. Two workers with a thread per core each on a 2-core machine spin against each other:
    the in-process suite took 650 s that way and 476 s with one thread a worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    share = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    return share


_THREADS = _share_the_cores()

import torch  # noqa: E402  (after OMP_NUM_THREADS: torch sizes its pool from it)

if _THREADS is not None:
    torch.set_num_threads(_THREADS)

# Without a GPU, Triton runs only in its interpreter, and TRITON_INTERPRET must be set before
# `triton` is first imported (its own library functions are decorated at import). Test modules
# import triton indirectly (transformers' model modules do), so it is set here, before any test
# module is collected; tests/kernels/conftest.py only repeats it for runs of that directory.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MODEL_CACHE = Path(os.environ.get("MESHLLM_MODEL_CACHE_DIR", "~/.cache/meshllm")).expanduser()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server for the whole session (tests flush it through `redis_url`)."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session Redis, emptied before the test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of the test's own, for tests that stop or restart it."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a cached HF directory (converted once, ~20 s)."""
    from shared.model.source import resolve_model

    return resolve_model("", MODEL_CACHE).hf_dir


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """MESHLLM_TEST_FAILURES=FILE: each failure's report appended to FILE as it happens, not
    at the end of the run. On the lent GPU a command runs under a time limit; a suite cut by
    it never prints its failure section, and the first error would be lost
    (bench/gpu/run.sh sets it)."""
    path = os.environ.get("MESHLLM_TEST_FAILURES")
    if not path or not report.failed:
        return
    with open(path, "a") as out:
        out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        for name, text in report.sections:  # captured logs and output of the test
            out.write(f"--- {name}\n{text}\n")
