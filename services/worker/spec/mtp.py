"""Multi-token-prediction (MTP) drafting from the layers a target checkpoint ships for it.

Naming: DeepSeek-V3's (also GLM-4.5's): an L-layer model declares `num_nextn_predict_layers`
N in config.json and stores MTP module k as `model.layers.{L + k}.*`: `enorm` and `hnorm`
(RMSNorms of the next token's embedding and of the feature), `eh_proj` [H, 2H] over their
concatenation (embedding first), one decoder layer of the target's own family (`self_attn`,
`mlp`, `input_layernorm`, `post_attention_layernorm`), `shared_head.norm` + `shared_head.head`
(the logits; the target's lm_head where the checkpoint omits it) and optionally its own copy of
`embed_tokens` (else the target's). The target's loader skips these tensors
(checkpoint_names.is_mtp_tensor).

Module k at head position p takes the target's final hidden state h[p] (after its norm, as
vLLM feeds it) and token t[p+1] and outputs g[p], the residual stream before the shared head's
norm; g is fed back as the next draft's feature, so one module drafts any K (draft j uses
module j mod N, as vLLM cycles its `spec_step_idx`). As in vLLM's DeepSeek MTP, the embedding
at position 0 is zeroed (the module never saw a token without a predecessor in training).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.loader.checkpoint_names import CheckpointError, mtp_layer_index
from services.worker.loader.safetensors_loader import safetensors_files
from services.worker.models.base import CausalLM
from services.worker.models.layers import RMSNorm
from services.worker.models.llama import LlamaDecoderLayer
from services.worker.models.random_init import init_random_
from services.worker.models.rope import RotaryEmbedding
from services.worker.spec.eagle import target_embedding
from services.worker.spec.head_io import hf_tensors, load_into
from shared.model.config import ModelConfig

#: the module's own tensors (the rest of model.layers.{L + k} is its decoder layer)
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head: nn.Linear | None = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None
        )


class MtpModule(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_cls: type[LlamaDecoderLayer],
        layer_idx: int,
        *,
        own_head: bool,
        own_embedding: bool,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = layer_cls(config, layer_idx)
        self.shared_head = SharedHead(config, own_head)
        self.embed_tokens: nn.Embedding | None = (
            nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        )


class MtpHead(nn.Module):
    def __init__(
        self,
        target_config: ModelConfig,
        layer_cls: type[LlamaDecoderLayer],
        *,
        max_model_len: int,
        num_modules: int = 1,
        own_head: bool = True,
        own_embedding: bool = False,
    ) -> None:
        super().__init__()
        self.config = target_config
        base = target_config.num_hidden_layers
        self.layers = nn.ModuleList(
            MtpModule(
                target_config,
                layer_cls,
                base + k,
                own_head=own_head,
                own_embedding=own_embedding,
            )
            for k in range(num_modules)
        )
        self.rotary = RotaryEmbedding(
            target_config.head_dim,
            target_config.rope,
            max_model_len,
            target_config.max_position_embeddings,
        )

    @property
    def kv_config(self) -> ModelConfig:
        """One full-attention layer per module."""
        return self.config.model_copy(
            update={
                "num_hidden_layers": len(self.layers),
                "layer_types": [],
                "sliding_window": None,
            }
        )

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return 0  # the target's vocabulary

    def module(self, step: int) -> MtpModule:
        return self.layers[step % len(self.layers)]  # type: ignore[return-value]

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return hidden

    def embed(self, token_ids: torch.Tensor, target: CausalLM) -> torch.Tensor:
        own = self.module(0).embed_tokens
        if own is not None:
            return own(token_ids)  # type: ignore[no-any-return]
        return target_embedding(target, token_ids)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
        kv_caches: list[torch.Tensor],
        step: int = 0,
    ) -> torch.Tensor:
        module = self.module(step)
        embeds = embeds.masked_fill((positions == 0).unsqueeze(1), 0.0)
        e, _ = module.enorm(embeds)
        h, _ = module.hnorm(features.to(e.dtype))
        x = module.eh_proj(torch.cat((e, h), dim=-1))
        cos, sin = self.rotary.lookup(positions)
        kv_cache = kv_caches[step % len(self.layers)]
        out, residual = module.block(x, None, cos, sin, attn, kv_cache)
        return out + residual  # type: ignore[no-any-return]

    def draft_logits(self, g: torch.Tensor, target: CausalLM, step: int = 0) -> torch.Tensor:
        shared = self.module(step).shared_head
        normed, _ = shared.norm(g)
        if shared.head is None:  # the checkpoint shares the target's lm_head
            return target.compute_logits(normed)
        logits: torch.Tensor = shared.head(normed)
        return logits


def mtp_name(hf_name: str, num_target_layers: int) -> str | None:
    """Our head's name for a checkpoint tensor of MTP module k, or None (not an MTP tensor)."""
    k = mtp_layer_index(hf_name, num_target_layers)
    if k is None:
        return None
    rest = re.sub(r"^model\.layers\.\d+\.", "", hf_name)
    return f"layers.{k}.{rest}" if rest.startswith(_OWN) else f"layers.{k}.block.{rest}"


def _mtp_tensors(path: Path, num_target_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of every MTP tensor in the checkpoint; no other tensor is read."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                ours = mtp_name(name, num_target_layers)
                if ours is not None:
                    yield ours, handle.get_tensor(name)


def load_mtp_head(
    path: str | Path,
    target: CausalLM,
    dtype: torch.dtype,
    device: torch.device | str,
    max_model_len: int,
) -> MtpHead:
    """The MTP modules of the target checkpoint at `path` (the target's own directory), whole.

    Their shapes come from the checkpoint's config.json, not from `target.config`: a rank of a
    tensor-parallel group holds a target built from its rank config (its share of the heads and
    of the MLP width), while every rank runs the MTP modules unsharded (spec/__init__.py)."""
    path = Path(path)
    config = ModelConfig.from_hf_dir(path)
    if (config.hidden_size, config.vocab_size) != (
        target.config.hidden_size,
        target.config.vocab_size,
    ):
        raise CheckpointError(f"{path}: not the served target's checkpoint (hidden/vocab differ)")
    if not config.num_mtp_layers:
        raise CheckpointError(
            f"{path}: the model declares no MTP layers (num_nextn_predict_layers) for "
            "MESHLLM_SPEC_METHOD=mtp"
        )
    raw = dict(_mtp_tensors(path, config.num_hidden_layers))
    head = MtpHead(
        config,
        _layer_class(target),
        max_model_len=max_model_len,
        num_modules=config.num_mtp_layers,
        own_head="layers.0.shared_head.head.weight" in raw,
        own_embedding="layers.0.embed_tokens.weight" in raw,
    )
    loaded = load_into(head, raw.items(), dtype, torch.device(device), f"{path}: MTP")
    assert isinstance(loaded, MtpHead)
    loaded.rotary.materialize(device, dtype)
    return loaded.eval().requires_grad_(False)


def _layer_class(target: CausalLM) -> type[LlamaDecoderLayer]:
    return getattr(type(target), "decoder_layer_cls", LlamaDecoderLayer)  # type: ignore[no-any-return]


def random_mtp_tensors(
    target_config: ModelConfig,
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    *,
    seed: int = 0,
    std: float = 0.02,
    num_modules: int = 1,
) -> dict[str, torch.Tensor]:
    """Random MTP modules in the checkpoint's spelling (`model.layers.{L + k}.*`), for tests
    that append them to a target checkpoint."""
    head = MtpHead(target_config, layer_cls, max_model_len=1, num_modules=num_modules)
    init_random_(head, std=std, seed=seed)
    return mtp_tensors(head)


def mtp_tensors(head: MtpHead) -> dict[str, torch.Tensor]:
    """The head's modules in the checkpoint's spelling (`model.layers.{L + k}.*`, mtp_name's
    inverse)."""
    base = head.config.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_tensors(head.state_dict(), head.config).items():
        k, rest = re.match(r"^layers\.(\d+)\.(.+)$", name).groups()  # type: ignore[union-attr]
        out[f"model.layers.{base + int(k)}.{rest.removeprefix('block.')}"] = tensor
    return out


def append_mtp_modules(tensors: dict[str, torch.Tensor], target_dir: Path, path: Path) -> Path:
    """A copy of the target checkpoint at `path` (its files linked, not copied) with the MTP
    `tensors` (mtp_tensors' spelling) in an extra safetensors file and config.json declaring
    them, as DeepSeek-V3-style checkpoints ship their MTP layers."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    for item in target_dir.iterdir():
        if item.name != "config.json" and not (path / item.name).exists():
            os.symlink(item.resolve(), path / item.name)
    hf = json.loads((target_dir / "config.json").read_text())
    modules = {mtp_layer_index(name, hf["num_hidden_layers"]) for name in tensors}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "mtp.safetensors"))
    (path / "config.json").write_text(json.dumps(mtp_config(hf, len(modules)), indent=2))
    return path


def mtp_config(hf: dict[str, Any], num_modules: int = 1) -> dict[str, Any]:
    """The target's config.json dict declaring `num_modules` MTP layers."""
    return {**hf, "num_nextn_predict_layers": num_modules}
