"""A GGUF file's weights and config written as an HF directory (config.json + fp32 safetensors).

shared/model/source.py converts a served GGUF once into a cached HF directory. transformers'
own GGUF reader does that correctly for Llama only: for Mixtral (llama architecture with
experts) it builds a dense Llama and re-initialises the MLPs randomly without failing, and it
does not read Qwen2-MoE's expert sizes. `needs_own_reader` says which files must go through
our reader (`gguf_loader`) instead; the tokenizer still comes from transformers (`tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from gguf import GGUFReader
from safetensors.torch import save_file

from shared.model.config import ModelConfig
from shared.model.gguf_reader import hf_config_from_gguf, iter_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


#: GGUF architectures whose model config transformers cannot read from the file
_NO_TRANSFORMERS_CONFIG = frozenset({"granitehybrid"})


def _architecture(reader: GGUFReader) -> str | None:
    field = reader.fields.get("general.architecture")
    return field.contents() if field else None  # type: ignore[no-any-return]


def needs_own_reader(gguf: Path) -> bool:
    """Every GGUF but a plain (expert-free) Llama, which transformers reads exactly as we do."""
    reader = GGUFReader(str(gguf))
    return _architecture(reader) != "llama" or "llama.expert_count" in reader.fields


def tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """The file's tokenizer, built by transformers from its `tokenizer.ggml.*` keys.

    AutoTokenizer first reads the model config from the file, and refuses architectures it does
    not convert (granitehybrid) although the tokenizer keys are the same as everywhere; for
    those, PreTrainedTokenizerFast builds it from the keys alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if _architecture(GGUFReader(str(gguf))) in _NO_TRANSFORMERS_CONFIG:
        return PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # type: ignore[no-any-return]


def write_hf_dir(gguf: Path, out: Path) -> None:
    """config.json (transformers 5 spelling) and model.safetensors (HF names, fp32) in `out`."""
    reader = GGUFReader(str(gguf))
    hf = hf_config_from_gguf(reader)
    config = ModelConfig.from_hf_dict(hf)
    tensors = {name: tensor.contiguous() for name, tensor in iter_gguf(reader, config)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
