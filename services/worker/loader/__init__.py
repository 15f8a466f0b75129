"""Build our model from a checkpoint: an HF safetensors directory or a GGUF file.

The model is constructed on the meta device (no allocation, no random init) and the loaded
tensors are assigned in place of its parameters, so loading costs one copy of the weights in the
serving dtype.

Load time is where the device decides what runs (`layer_impls_for`): the model is built with
the Triton layers on CUDA and the PyTorch reference elsewhere, its weights are then laid out for
the device (`prepare_for_device`), and a model built with the Triton layers gets its decode
chain where it fits (`finish_loading`).

A rank of a tensor-parallel group (`tp`, services/worker/parallel) builds the model of its
rank config and loads only its slice of each tensor (parallel/shards.py): read straight from
the safetensors file, or cut from one dequantized GGUF tensor at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from services.worker.loader.checkpoint_names import CheckpointError, assemble, mtp_layer_index
from services.worker.loader.safetensors_loader import iter_safetensors
from services.worker.models.base import CausalLM
from services.worker.models.layer_impls import REFERENCE, LayerImpls
from services.worker.models.packed_linear import PackedLinear, pack_linear_layers, packing_supported
from services.worker.models.registry import build_model
from services.worker.parallel.group import SINGLE, TensorParallel
from services.worker.parallel.shard_config import rank_config
from services.worker.parallel.shards import ShardPlan
from shared.model.config import ModelConfig, UnsupportedModelError
from shared.model.source import ModelSource

__all__ = [
    "CheckpointError",
    "finish_loading",
    "layer_impls_for",
    "load_model",
    "prepare_for_device",
    "resolve_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(
    dtype: torch.dtype | str, config: ModelConfig, device: torch.device
) -> torch.dtype:
    """'auto' is the checkpoint's dtype, except float16 on CPU, which runs as bfloat16 (CPU
    float16 matmuls are slow and bf16 has fp32's range)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected auto, {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    chosen = _DTYPES.get(config.torch_dtype, torch.float32)
    if chosen == torch.float16 and device.type == "cpu":
        return torch.bfloat16
    return chosen


def layer_impls_for(device: torch.device) -> LayerImpls:
    """The layers a model served on `device` is built with: the Triton kernels on CUDA
    (accel/cuda_layers.py), the PyTorch reference elsewhere."""
    if device.type == "cuda":
        from services.worker.accel.cuda_layers import TRITON  # no Triton import until called

        return TRITON
    return REFERENCE


def load_model(
    source: ModelSource | str | Path,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int = 0,
    compiled: bool = False,
    impls: LayerImpls | None = None,
    tp: TensorParallel = SINGLE,
) -> tuple[CausalLM, ModelConfig]:
    """(model in eval mode on `device`, its config). `source` is a ModelSource, an HF dir or a
    .gguf file. `max_model_len` (0 = the model's own) sizes the RoPE tables. `compiled`: the
    forward will be compiled (cpu_compile.py), which packs the weights itself. `impls`: the
    layers' implementations (None: the device's, `layer_impls_for`). `tp`: the model is rank
    `tp.rank` of a tensor-parallel group; the config returned is then that rank's."""
    path = Path(source.path if isinstance(source, ModelSource) else source).expanduser()
    device = torch.device(device)
    impls = (impls or layer_impls_for(device)).with_tp(tp)
    if path.suffix == ".gguf":
        # Imported here: the gguf package is only needed when a GGUF file is served.
        from shared.model.gguf_reader import iter_gguf, open_gguf

        reader, config = open_gguf(path)
        shards = ShardPlan(config, tp)
        tensors = ((n, shards.take(n, t)) for n, t in iter_gguf(reader, config))
    elif path.is_dir():
        config = ModelConfig.from_hf_dir(path)
        if tp.size > 1 and config.mamba is not None:
            raise UnsupportedModelError(
                f"{config.architecture}: tensor parallelism (TP={tp.size}) is not supported for "
                "hybrid Mamba2 models (the mixer's heads are not sharded): MESHLLM_TP=1"
            )
        tensors = iter_safetensors(path, ShardPlan(config, tp) if tp.size > 1 else None)
        if config.num_mtp_layers:  # MTP modules are a drafter's (spec/mtp.py), not the model's
            layers = config.num_hidden_layers
            tensors = ((n, t) for n, t in tensors if mtp_layer_index(n, layers) is None)
    else:
        raise FileNotFoundError(f"{path}: expected an HF directory or a .gguf file")
    torch_dtype = resolve_dtype(dtype, config, device)
    state = assemble(tensors, torch_dtype, device, config.tie_word_embeddings)
    config = rank_config(config, tp)
    with torch.device("meta"):
        model = build_model(config, max_model_len=max_model_len, impls=impls)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: checkpoint does not fit {config.architecture}: "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    for name, param in model.state_dict().items():
        if state[name].shape != param.shape:
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(state[name].shape)}, "
                f"expected {tuple(param.shape)}"
            )
    model.load_state_dict(state, strict=True, assign=True)
    model.materialize_rotary(device, torch_dtype)
    prepare_for_device(model, torch_dtype, device, compiled)
    finish_loading(model, impls)
    return model, config


def finish_loading(model: CausalLM, impls: LayerImpls) -> None:
    """Eval mode, no gradients, and the decode chain `impls` gives the model with its weights
    in place (None for the reference layers)."""
    model.eval().requires_grad_(False)
    model.decode_chain = impls.decode_chain_for(model)


def prepare_for_device(
    model: CausalLM, dtype: torch.dtype, device: torch.device, compiled: bool = False
) -> None:
    """Lay the loaded weights out for the fastest CPU matmuls of their dtype (no-op on GPU, and
    for a model whose forward will be compiled: freezing lays them out itself).
    Values are unchanged; state_dict() of an fp32 model is unchanged too."""
    if compiled:
        return
    if device.type == "cpu" and dtype == torch.float32:
        store_weights_column_major(model)
    elif packing_supported(dtype, device):
        pack_linear_layers(model)
        if model.lm_head is None:  # tied: the head gets its own packed copy of the embedding
            model.lm_head = PackedLinear(model.embed_tokens.weight, None)


def store_weights_column_major(model: nn.Module) -> None:
    """Re-lay every 2-D weight [out, in] as a transposed view of an [in, out] buffer.

    Same shapes and values; only the memory order changes, so `F.linear` hands MKL an
    untransposed B operand: skinny GEMMs (decode batches of a few to tens of rows) run faster,
    batch 1 and long prefills no slower (fp32, SmolLM2 shapes, the dev machine). bf16 goes
    through oneDNN, which prefers the checkpoint order, so
    only fp32 weights on CPU are re-laid. The embedding lookup then reads strided rows, which
    costs microseconds per token.
    """
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, nn.Parameter) and weight.dim() == 2:
                weight.data = weight.data.t().contiguous().t()
