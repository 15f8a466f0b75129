"""tests/stress: the mesh under sustained load and faults, round after round, run by `make stress`
outside CI (a run takes minutes). A plain pytest run deselects them unless MESHLLM_STRESS_TEST=1
(set by `make stress`): a deselection by the suite's entry point, never a skip of a feature.

Each module starts one mesh serving a tiny random-weight Llama with the SmolLM2 tokenizer (CPU,
float32, one torch thread) and runs MESHLLM_STRESS_ROUNDS rounds against it (default 20;
MESHLLM_STRESS_SEED picks the prompts, lengths, cuts and kill times). After every round the
scheduler must hold nothing and have as many free KV blocks as after the first round; a failing
round keeps each service's log and /admin/state under MESHLLM_STRESS_EVIDENCE (default: the
test's tmp directory) and names the directory in its failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.gpu.gateway_serve import model_dir, tokenizer_dir
from bench.gpu.mesh_decode import TINY
from tests.support.entry_point_suite import deselect_unless

HERE = Path(__file__).resolve().parent

#: The served model's context; prompts and outputs of every module fit in it.
CONTEXT = 256


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect_unless("MESHLLM_STRESS_TEST", HERE, config, items)


@pytest.fixture(scope="session")
def stress_rounds() -> int:
    return int(os.environ.get("MESHLLM_STRESS_ROUNDS", "20"))


@pytest.fixture(scope="session")
def stress_seed() -> int:
    return int(os.environ.get("MESHLLM_STRESS_SEED", "0"))


@pytest.fixture(scope="module")
def evidence_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    root = os.environ.get("MESHLLM_STRESS_EVIDENCE")
    name = request.module.__name__.rsplit(".", 1)[-1]
    return Path(root) / name if root else tmp_path_factory.mktemp(f"{name}-evidence")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with the SmolLM2 tokenizer and vocabulary, random weights (dummy load)."""
    shape = {**TINY, "max_position_embeddings": CONTEXT, "model_type": "llama"}
    return model_dir(shape, tokenizer_dir(""), tmp_path_factory.mktemp("tiny-llama"), CONTEXT)


@pytest.fixture(scope="session")
def tiny_env(tiny_model: Path) -> dict[str, str]:
    """What every stress mesh runs with; modules add their own settings."""
    return {
        "MESHLLM_MODEL": str(tiny_model),
        "MESHLLM_LOAD_FORMAT": "dummy",
        "MESHLLM_DEVICE": "cpu",
        "MESHLLM_DTYPE": "float32",
        "MESHLLM_MAX_MODEL_LEN": str(CONTEXT),
        "MESHLLM_NUM_THREADS": "1",
        "MESHLLM_LOG_JSON": "false",
    }
