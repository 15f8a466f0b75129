"""The model's shape, read once from an HF `config.json` (or GGUF metadata) into one typed object.

Every other part of the worker (layers, loaders, KV cache sizing, the runner) reads only
`ModelConfig`, never a raw HF dict, so a new checkpoint format only needs a new constructor here.
transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are both
accepted and normalised into `RopeScaling`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RopeType = Literal["default", "linear", "dynamic", "llama3", "yarn"]


class UnsupportedModelError(ValueError):
    """The checkpoint names an architecture or feature this worker cannot run."""


class RopeScaling(BaseModel):
    """RoPE frequencies: the base `theta` and an optional context-extension variant.

    Field names follow transformers' `rope_parameters`; a field a variant does not use is ignored.
    `original_max_position_embeddings` of 0 means "the model's max_position_embeddings".
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    rope_type: RopeType = "default"
    theta: float = 10000.0
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


class ModelConfig(BaseModel):
    """The architecture-independent description of a decoder-only transformer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    model_type: str = "llama"
    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    rms_norm_eps: float = 1e-6
    rope: RopeScaling = Field(default_factory=RopeScaling)
    max_position_embeddings: int = Field(2048, ge=1)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list)
    torch_dtype: str = "float32"

    @model_validator(mode="after")
    def _check_supported(self) -> ModelConfig:
        # Raised inside pydantic this surfaces as a ValidationError (also a ValueError);
        # from_hf_dict checks the same first so that checkpoints get UnsupportedModelError.
        problem = _unsupported(self.num_attention_heads, self.num_key_value_heads, self.hidden_act)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for extra eos ids) from an HF dir."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path} has no config.json")
        hf = json.loads(config_file.read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
        return cls.from_hf_dict(hf, generation)

    @classmethod
    def from_hf_dict(
        cls, hf: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Normalise an HF config dict. Raises UnsupportedModelError for unknown architectures."""
        from services.worker.models.registry import supported_architectures

        archs = hf.get("architectures") or []
        known = [a for a in archs if a in supported_architectures()]
        if not known:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(supported_architectures())}"
            )
        if hf.get("sliding_window") and hf.get("use_sliding_window", True):
            raise UnsupportedModelError("sliding-window attention is not supported yet")
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        problem = _unsupported(heads, kv_heads, str(hf.get("hidden_act", "silu")))
        if problem:
            raise UnsupportedModelError(problem)
        eos = _merge_ids(hf.get("eos_token_id"), (generation or {}).get("eos_token_id"))
        return cls(
            architecture=known[0],
            model_type=str(hf.get("model_type", "llama")),
            hidden_size=hidden,
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=str(hf.get("hidden_act", "silu")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )


def parse_rope(hf: dict[str, Any]) -> RopeScaling:
    """Both spellings: 5.x `rope_parameters` (theta inside) and 4.x `rope_theta`+`rope_scaling`."""
    params: dict[str, Any] = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    if "rope_theta" in params:
        params["theta"] = params.pop("rope_theta")
    elif "rope_theta" in hf:
        params["theta"] = hf["rope_theta"]
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported")
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in hf:
        params["partial_rotary_factor"] = hf["partial_rotary_factor"]
    if params.get("factor") is None:
        params.pop("factor", None)
    return RopeScaling(rope_type=rope_type, **params)


def _unsupported(heads: int, kv_heads: int, hidden_act: str) -> str:
    if heads % kv_heads:
        return f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
    if hidden_act != "silu":
        return f"hidden_act={hidden_act!r}: only 'silu' is supported"
    return ""


def _merge_ids(*values: int | list[int] | None) -> list[int]:
    out: list[int] = []
    for value in values:
        items = value if isinstance(value, list) else [value] if value is not None else []
        for item in items:
            if int(item) not in out:
                out.append(int(item))
    return out
