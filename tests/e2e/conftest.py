"""End-to-end fixtures: the real mesh as separate processes, talked to with real clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.mesh import Mesh

#: Small KV cache (fast to allocate); 1 torch thread: the mesh runs 3+ processes on a 2-core
#: CI machine, and OpenMP threads spinning against each other make 2 threads far slower.
#: The context is capped at what that cache holds (the worker refuses a context it cannot hold).
#: Overlapped steps (the GPU worker's loop: launch, answer the previous step, ...) are forced on
#: so the API tests run through that loop too; the default CPU loop is what the other e2e
#: modules' meshes run. One planning process (the gateway's default is 2): each imports
#: transformers and loads the tokenizer at every gateway start (1.45 CPU-s here), the suite
#: starts ~50 gateways, and the bodies that take the pool (4 KiB or more) are few.
E2E_ENV = {
    "MESHLLM_KV_CACHE_BYTES": str(256 * 2**20),
    "MESHLLM_MAX_MODEL_LEN": "4096",
    "MESHLLM_NUM_THREADS": "1",
    "MESHLLM_OVERLAP_STEPS": "on",
    "MESHLLM_PLANNING_PROCESSES": "1",
}


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    """gateway + scheduler + worker on a private Redis, shared by a test module."""
    with Mesh(env=E2E_ENV) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
