"""Tiny random-weight Llama checkpoints built with transformers (the reference implementation),
saved to disk so our loader reads them like any HF directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from services.worker.loader import load_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner

#: the tiny shape every test checkpoint shares: GQA 4 heads / 2 KV heads, hidden 64, 3 layers,
#: vocab 512, untied. The larger than usual init spread makes logits peaked, so greedy choices
#: are not near-ties. tests/support/tiny_models.py builds the other families on it.
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.15,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: HF config of a smaller Llama for services.worker.models.random_init.build_random_model
#: (no checkpoint on disk): host-logic tests that need a real model but not a reference.
RANDOM_TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}


#: prompts the runner tests share: ragged, one of two tokens, one of one token
TINY_PROMPTS = [
    [1, 17, 99, 4, 250, 31, 8, 77, 300, 12, 5],
    [1, 400],
    [1, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71],
    [9],
]


def make_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """TINY_SHAPE with a 160-wide MLP, untied unless overridden."""
    settings: dict[str, Any] = {
        **TINY_SHAPE,
        "intermediate_size": 160,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(path)
    return model


def copy_tokenizer(source: Path, model_dir: Path) -> None:
    """Give a tiny checkpoint `source`'s tokenizer and chat template (SmolLM2's, whose 49152
    vocab the e2e checkpoints are built with), so a mesh can serve it by chat and text."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, model_dir / name)


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids drawn from [100, 49000) (inside SmolLM2's vocab, past its specials)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49000, (length,), generator=generator).tolist()


def tiny_runner(
    path: Path,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_reqs: int = 8,
    device: str = "cpu",
) -> ModelRunner:
    model, config = load_model(path, dtype, device)
    kv = KVCache.allocate(config, num_blocks, block_size, dtype, device)
    return ModelRunner(model, config, kv, device, max_num_reqs=max_num_reqs)


def reference_greedy(
    model: PreTrainedModel, prompt: list[int], max_tokens: int, *, min_tokens: int = 0
) -> list[int]:
    """transformers' greedy generate, stopping at eos like the driver does (not before
    `min_tokens`, as the API's `min_tokens`)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens or None,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def reference_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of one full forward [len(tokens), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]  # type: ignore[no-any-return]


class LogitsCapture:
    """Records every logits tensor the runner computes (instrumentation, not a substitute)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.calls: list[torch.Tensor] = []
        original = runner.model.compute_logits

        def capture(hidden: torch.Tensor) -> torch.Tensor:
            logits = original(hidden)
            self.calls.append(logits.detach().clone())
            return logits

        runner.model.compute_logits = capture  # type: ignore[method-assign]
