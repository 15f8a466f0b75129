"""A model config with a ring-buffer KV cache group (shared/kv/groups.py) is refused when the
worker starts: no attention path here implements the ring's slot rule, and running its layers
as full attention would index a table of n ring blocks by p // block_size (wrong slots, or
past the table). Refused with a message naming the ring layers; the same model without the
ring still builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.attention.backend_choice import resolve_backend
from services.worker.loader import load_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from shared.kv.groups import STATE, LayerCache, Ring, kv_groups_for
from shared.model.config import ModelConfig, UnsupportedModelError
from tests.support.tiny_models import make_tiny


class RingLayerConfig(ModelConfig):
    """A real model config whose layer 1 declares a ring buffer of 8 slots (what a future
    family with ring layers would announce through `layer_windows`)."""

    @property
    def layer_windows(self) -> list[LayerCache]:
        windows = list(super().layer_windows)
        windows[1] = Ring(8)
        return windows


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny(path, "qwen3")
    return path


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "layers", [[Ring(16)], [None, Ring(8)], [None, 8, Ring(8), STATE]], ids=str
)
def test_backend_resolution_refuses_a_ring_group(device: str, layers: list[LayerCache]) -> None:
    with pytest.raises(UnsupportedModelError, match=r"ring-buffer KV cache groups \(layers"):
        resolve_backend(device, kv_groups_for(layers), torch.float32)
    resolve_backend("cpu", kv_groups_for([None, 8, STATE]), torch.float32)  # no ring: served


def test_runner_refuses_a_model_config_with_a_ring_layer(qwen3: Path) -> None:
    model, config = load_model(qwen3, torch.float32, "cpu")
    ring_config = RingLayerConfig.model_validate(config.model_dump())
    assert [g.kind for g in ring_config.kv_groups] == ["full", "ring"]
    kv = KVCache.allocate(config, 16, 4, torch.float32, "cpu")
    with pytest.raises(UnsupportedModelError, match=r"layers \[1\], ring sizes \[8\]"):
        ModelRunner(model, ring_config, kv, "cpu", max_model_len=64)
    runner = ModelRunner(model, config, kv, "cpu", max_model_len=64)  # without it: fine
    assert runner.warmup() > 0
