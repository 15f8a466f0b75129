"""What the gateway needs to know about the served model, read from its HF config.json.

The gateway never loads weights: the context length, vocabulary size and whether the model has
MoE layers all come from the config, so validation can reject a request before it is queued.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Config keys holding the context length, in the order transformers' families use them.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
#: Config keys holding the number of routed experts (Mixtral, Qwen-MoE, DeepSeek).
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    num_experts: int  # 0 = no MoE layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_dir(cls, name: str, hf_dir: Path, max_model_len: int = 0) -> ModelInfo:
        """`max_model_len` > 0 overrides the config's context length (the operator's choice,
        e.g. to cap memory); above the model's own length it is allowed but logged."""
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        return cls.from_config(name, config, max_model_len)

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any], max_model_len: int = 0) -> ModelInfo:
        text = config.get("text_config") or config  # multimodal configs nest the LM's
        native = next((int(text[k]) for k in _CONTEXT_KEYS if text.get(k)), 0)
        if max_model_len > 0:
            if native and max_model_len > native:
                log.warning("max_model_len %d exceeds the model's %d", max_model_len, native)
            length = max_model_len
        elif native:
            length = native
        else:
            raise ValueError("config.json has no context length; set MESHLLM_MAX_MODEL_LEN")
        vocab = int(text.get("vocab_size") or 0)
        if vocab < 1:
            raise ValueError("config.json has no vocab_size")
        experts = next((int(text[k]) for k in _EXPERT_KEYS if text.get(k)), 0)
        return cls(name=name, max_model_len=length, vocab_size=vocab, num_experts=experts)
