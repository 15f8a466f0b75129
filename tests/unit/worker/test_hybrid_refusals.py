"""What a hybrid (attention + Mamba2) model cannot do yet is refused when the worker (or the
scheduler) starts, with a message naming why: speculative decoding, the compiled CPU forward
and tensor parallelism. What stays allowed still builds, P/D roles included (their handoff
moves the state group: services/scheduler/offload/connector.py, `transfer_state`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scheduler.config import SchedulerConfig
from services.worker.accel.cpu_compile import compile_supported
from services.worker.loader import load_model
from services.worker.parallel.group import TensorParallel
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from services.worker.spec import SpeculativeConfig
from shared.config import SchedulerSettings
from shared.model.config import UnsupportedModelError
from shared.protocol import WorkerReady
from tests.support.tiny_models import make_tiny


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba")
    make_tiny(path, "bamba")
    return path


def test_runner_refuses_speculative_decoding_and_the_compiled_forward(bamba: Path) -> None:
    model, config = load_model(bamba, torch.float32, "cpu")
    kv = KVCache.allocate(config, 16, 4, torch.float32, "cpu")
    spec = SpeculativeConfig(method="ngram", num_spec_tokens=2)
    with pytest.raises(UnsupportedModelError, match="speculative decoding with a state"):
        ModelRunner(model, config, kv, "cpu", max_model_len=64, speculative=spec)
    with pytest.raises(UnsupportedModelError, match="compiled CPU forward"):
        ModelRunner(model, config, kv, "cpu", max_model_len=64, compiled=True)
    runner = ModelRunner(model, config, kv, "cpu", max_model_len=64)  # eager, no drafts: fine
    assert runner.warmup() > 0
    assert "Mamba2" in compile_supported(config, torch.bfloat16, torch.device("cpu"))


def test_loader_refuses_tensor_parallelism(bamba: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="tensor parallelism"):
        load_model(bamba, torch.float32, "cpu", tp=TensorParallel(rank=0, size=2))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_roles_serve_a_worker_with_a_state_group(bamba: Path, role: str) -> None:
    _, config = load_model(bamba, torch.float32, "cpu")
    ready = WorkerReady(
        worker_id="w", incarnation="i", model="m", num_kv_blocks=64, block_size=4,
        vocab_size=config.vocab_size, max_model_len=64, eos_token_ids=[2],
        kv_groups=config.kv_groups,
    )  # fmt: skip
    for r in (role, "both"):
        config = SchedulerConfig.from_worker(SchedulerSettings(role=r), ready)
        assert [type(g.spec).__name__ for g in config.kv_cache_groups] == [
            "FullAttentionSpec",
            "StateSpec",
        ]
