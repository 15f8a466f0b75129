"""Our model implementations (transformers is only a reference in tests, never the runtime)."""

from services.worker.models.base import CausalLM
from services.worker.models.registry import build_model, model_class, supported_architectures
from shared.model.config import ModelConfig, RopeScaling, UnsupportedModelError

__all__ = [
    "CausalLM",
    "ModelConfig",
    "RopeScaling",
    "UnsupportedModelError",
    "build_model",
    "model_class",
    "supported_architectures",
]
