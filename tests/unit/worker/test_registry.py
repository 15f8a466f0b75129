"""The worker's model registry covers exactly the architectures ModelConfig normalises."""

from __future__ import annotations

from services.worker.models.registry import model_class, supported_architectures
from shared.model.config import ARCHITECTURES


def test_registry_names_equal_the_configs_architectures() -> None:
    assert supported_architectures() == ARCHITECTURES


def test_every_architecture_has_an_importable_class() -> None:
    for name in sorted(ARCHITECTURES):
        assert callable(model_class(name))
