"""GGUF files of every new family (the hybrid attention + Mamba2 ones included), written as
llama.cpp's converter writes them (tiny random weights, fp32): our loader reads the same config
and weights as from the HF directory, and the runner's logits and greedy tokens equal
transformers' on the original model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.loader import load_model
from shared.model.config import UnsupportedModelError
from shared.model.gguf_reader import hf_name
from shared.model.source import resolve_model
from shared.protocol import SamplingParams
from tests.support.grouped_plans import GroupedPlanDriver
from tests.support.tiny_gguf import GGUF_FAMILIES, make_tiny_gguf
from tests.support.tiny_llama import LogitsCapture, reference_greedy, reference_logits, tiny_runner

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
PROMPT = [1, *range(40, 53)]  # 13 tokens: longer than the sliding window (8)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """family -> (gguf file, transformers model), built on first use."""
    return {}


def tiny(files: dict[str, tuple[Path, Any]], tmp: pytest.TempPathFactory, family: str):
    if family not in files:
        files[family] = make_tiny_gguf(tmp.mktemp(f"gguf_{family}"), family)
    return files[family]


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_gguf_loads_what_the_hf_dir_holds(
    files: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    path, _ = tiny(files, tmp_path_factory, family)
    gguf_model, gguf_config = load_model(path, torch.float32)
    hf_model, hf_config = load_model(path.parent / "hf", torch.float32)
    # GGUF stores the norm epsilon as float32; everything else is identical.
    assert gguf_config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert gguf_config == hf_config.model_copy(update={"rms_norm_eps": gguf_config.rms_norm_eps})
    hf_state, gguf_state = hf_model.state_dict(), gguf_model.state_dict()
    assert hf_state.keys() == gguf_state.keys()
    for name, tensor in hf_state.items():
        torch.testing.assert_close(gguf_state[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_gguf_logits_and_greedy_equal_transformers(
    files: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    path, reference = tiny(files, tmp_path_factory, family)
    runner = tiny_runner(path, num_blocks=32)
    capture = LogitsCapture(runner)
    driver = GroupedPlanDriver(runner)
    driver.add("r", PROMPT, GREEDY)
    driver.run()
    request = driver.requests["r"]
    full = reference_logits(reference, request.tokens)
    ours = torch.cat(capture.calls)
    start = len(PROMPT) - 1
    torch.testing.assert_close(ours, full[start : start + len(ours)], rtol=1e-4, atol=1e-4)
    assert request.output == reference_greedy(reference, PROMPT, GREEDY.max_tokens)


def test_gguf_family_switches(
    files: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The metadata picks the family: llama with a window is Mistral, with experts Mixtral;
    Gemma3 gets llama.cpp's layer pattern; Qwen2-MoE keeps its shared expert."""
    configs = {f: load_model(tiny(files, tmp_path_factory, f)[0])[1] for f in GGUF_FAMILIES}
    assert configs["mistral"].architecture == "MistralForCausalLM"
    assert configs["mistral"].layer_windows == [8, 8, 8]
    assert configs["mixtral"].architecture == "MixtralForCausalLM"
    assert configs["mixtral"].num_experts == 4 and configs["mixtral"].norm_topk_prob
    assert configs["qwen2"].qkv_bias and configs["qwen2"].layer_windows == [None] * 3
    assert configs["qwen3"].qk_norm and configs["qwen3_moe"].qk_norm
    assert configs["gemma3"].layer_windows == [8, 8, 8, 8, 8, None]
    assert configs["gemma3"].rope_local is not None and configs["gemma3"].rope_local.theta == 1e4
    moe = configs["qwen2_moe"]
    assert moe.shared_expert_intermediate_size == 40 and not moe.norm_topk_prob
    assert moe.moe_layers == [0, 1, 2] and moe.moe_intermediate_size == 48


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "bamba", "granitemoehybrid"])
def test_model_source_converts_gguf_through_our_reader(
    files: dict[str, tuple[Path, Any]],
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    family: str,
) -> None:
    """MESHLLM_MODEL=<file>.gguf: the cached HF dir holds the file's model (transformers' own
    GGUF reader would give Mixtral random dense MLPs and fails on Qwen2-MoE), its tokenizer and
    chat template; transformers itself reads that dir back to the original logits."""
    path, reference = tiny(files, tmp_path_factory, family)
    source = resolve_model(str(path), tmp_path)
    assert source.hf_dir != path and source.name == family
    _, config = load_model(source, torch.float32)
    assert config.architecture == type(reference).__name__
    converted = AutoModelForCausalLM.from_pretrained(source.hf_dir).eval()
    torch.testing.assert_close(
        reference_logits(converted, PROMPT), reference_logits(reference, PROMPT), rtol=0, atol=1e-5
    )
    tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
    assert tokenizer.convert_ids_to_tokens([259, 260]) == ["aa", "ab"]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>user: hi</s><s>assistant: "


def test_gguf_names_per_architecture() -> None:
    assert hf_name("blk.2.attn_q_norm.weight", "qwen3") == "model.layers.2.self_attn.q_norm.weight"
    assert hf_name("blk.0.ffn_norm.weight", "qwen2") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_name("blk.0.ffn_norm.weight", "gemma3") == (
        "model.layers.0.pre_feedforward_layernorm.weight"
    )
    assert hf_name("blk.1.ffn_gate_inp_shexp.weight", "qwen2moe") == (
        "model.layers.1.mlp.shared_expert_gate.weight"
    )
    assert hf_name("blk.1.ffn_gate_inp.weight", "qwen3moe") == "model.layers.1.mlp.gate.weight"
    assert hf_name("blk.1.ffn_gate_inp.weight", "llama") == (
        "model.layers.1.block_sparse_moe.gate.weight"  # Mixtral's spelling
    )
    with pytest.raises(UnsupportedModelError, match="no mapping"):
        hf_name("blk.0.ssm_conv1d.weight", "qwen2")


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'phi3'"):
        load_model(path)
