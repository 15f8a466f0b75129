"""Drafters' checkpoints for tests, written the way their users' tools write them: a tiny draft
model (an HF dir), EAGLE-1/2 heads, EAGLE-3 heads (EAGLE/vLLM `midlayer.*` or speculators
`layers.0.*`), MTP modules appended to a copy of the target's own checkpoint
(`model.layers.{L + k}.*` + `num_nextn_predict_layers`), and DFlash drafts (z-lab's layout).
Random weights; the "near identity" variants pass the target's feature straight through so
that some drafts are accepted; the "truncated target" variants (a draft model, an EAGLE head,
an MTP module) are the target's own first layers, so they predict some of the target's next
tokens.

`drafts_after` runs one drafter on one row after a target prefill, the way the runner does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.worker.attention.reference import AttentionMetadata
from services.worker.models.base import CausalLM, split_aux_hidden
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.kv_cache import KVCache
from services.worker.sampling import SamplingState
from services.worker.spec.dflash import random_dflash_head, save_dflash_head
from services.worker.spec.drafts import Drafter
from services.worker.spec.eagle import random_eagle_head, save_eagle_head
from services.worker.spec.eagle3 import random_eagle3_head, save_eagle3_head
from services.worker.spec.head_io import save_tensors
from services.worker.spec.mtp import append_mtp_modules, random_mtp_tensors
from shared.model.config import ModelConfig
from shared.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def target_hf(target_dir: Path) -> dict[str, Any]:
    return json.loads((target_dir / "config.json").read_text())  # type: ignore[no-any-return]


def head_layer_hf(target_dir: Path) -> dict[str, Any]:
    """The target's config cut to one Llama layer: the shape of its heads' layers."""
    return {**target_hf(target_dir), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}


def write_eagle_head(
    target_dir: Path, path: Path, *, seed: int = 1, std: float = 0.02, identity: bool = False
) -> Path:
    """An EAGLE-1/2 head; `identity`: fc passes the target's feature through."""
    head = random_eagle_head(head_layer_hf(target_dir), max_model_len=256, seed=seed, std=std)
    if identity:
        hidden = head.config.hidden_size
        with torch.no_grad():
            head.fc.weight[:, hidden:] += torch.eye(hidden)
    save_eagle_head(head, path)
    return path


def write_eagle_truncated_target(
    target_dir: Path, path: Path, *, num_layers: int = 1, feature_scale: float = 0.01
) -> Path:
    """An EAGLE-1/2 head made of the target's first `num_layers` layers (their input norm
    kept): `fc` passes the embedding of t[p+1] through, plus `feature_scale` times the target's
    feature f[p], so g[p] is close to the truncated target's hidden state at p+1 and the
    target's lm_head drafts some of the target's own tokens (its final norm has unit scales,
    which the lm_head's argmax does not see), while the drafts still depend on the features."""
    from safetensors import safe_open

    hf = {**target_hf(target_dir), "num_hidden_layers": num_layers}
    hidden = int(hf["hidden_size"])
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.startswith("model.layers.") and int(name.split(".")[2]) < num_layers:
                    tensors[name.removeprefix("model.")] = f.get_tensor(name).float()
    tensors["fc.weight"] = torch.cat((torch.eye(hidden), feature_scale * torch.eye(hidden)), 1)
    save_tensors(tensors, path, {**hf, "architectures": ["LlamaForCausalLM"]})
    return path


def write_eagle3_head(
    target_dir: Path,
    path: Path,
    *,
    seed: int = 2,
    std: float = 0.02,
    draft_vocab_size: int = 0,
    speculators: bool = False,
    identity: bool = False,
    aux_layers: tuple[int, ...] | None = None,
) -> Path:
    """An EAGLE-3 head; `draft_vocab_size` smaller than the target's gets a d2t map (every
    other target token); `identity`: fc passes the deepest auxiliary layer's stream through and
    the head's lm_head is the target's (so its drafts follow the target's own late layers)."""
    hf = target_hf(target_dir)
    vocab = int(hf["vocab_size"])
    draft_vocab = draft_vocab_size or vocab
    head = random_eagle3_head(
        head_layer_hf(target_dir),
        num_target_layers=int(hf["num_hidden_layers"]),
        draft_vocab_size=draft_vocab,
        max_model_len=256,
        seed=seed,
        std=std,
        aux_layers=aux_layers,
    )
    d2t = None
    target_ids = torch.arange(draft_vocab) * (vocab // draft_vocab)
    if draft_vocab != vocab:
        d2t = target_ids - torch.arange(draft_vocab)
    if identity:
        hidden = head.config.hidden_size
        lm_head = _target_lm_head(target_dir)
        deepest = head.aux_layers.index(max(head.aux_layers))
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden)
            head.lm_head.weight.copy_(lm_head[target_ids])
    save_eagle3_head(head, path, speculators=speculators, d2t=d2t)
    return path


def write_dflash_draft(
    target_dir: Path,
    path: Path,
    *,
    seed: int = 4,
    std: float = 0.02,
    num_layers: int = 1,
    block_size: int = 8,
    target_layers: tuple[int, ...] | None = None,
) -> Path:
    """A DFlash draft of Qwen3 layers shaped like the target's, mask token = the target's last
    vocabulary id; `target_layers` None: z-lab's default for the target's depth."""
    hf = target_hf(target_dir)
    head = random_dflash_head(
        {**hf, "num_hidden_layers": num_layers},
        num_target_layers=int(hf["num_hidden_layers"]),
        block_size=block_size,
        mask_token_id=int(hf["vocab_size"]) - 1,
        max_model_len=256,
        target_layers=target_layers,
        seed=seed,
        std=std,
    )
    save_dflash_head(head, path, num_target_layers=int(hf["num_hidden_layers"]))
    return path


def write_mtp_target(
    target_dir: Path, path: Path, *, seed: int = 3, std: float = 0.02, identity: bool = False
) -> Path:
    """A copy of the target checkpoint (its files linked) with one MTP module appended: an
    extra safetensors file and `num_nextn_predict_layers` in config.json. `identity`: eh_proj
    passes the target's feature through and the shared head is the target's lm_head."""
    config = ModelConfig.from_hf_dict(target_hf(target_dir))
    tensors = random_mtp_tensors(config, seed=seed, std=std)
    layer = config.num_hidden_layers
    if identity:
        hidden = config.hidden_size
        proj = tensors[f"model.layers.{layer}.eh_proj.weight"]
        proj.zero_()
        proj[:, hidden:] = torch.eye(hidden)
        tensors[f"model.layers.{layer}.shared_head.head.weight"] = _target_lm_head(target_dir)
    return append_mtp_modules(tensors, target_dir, path)


def write_mtp_truncated_target(
    target_dir: Path, path: Path, *, feature_scale: float = 0.01
) -> Path:
    """The target with an MTP module made of its own first layer: `eh_proj` scales the normed
    embedding of t[p+1] back to the embeddings' typical size (the residual stream the target's
    layer 0 starts from), plus `feature_scale` times the normed feature; the shared head is the
    target's final norm and lm_head. So the module drafts as the target's first layer does."""
    from safetensors import safe_open

    config = ModelConfig.from_hf_dict(target_hf(target_dir))
    hidden, base = config.hidden_size, config.num_hidden_layers
    tensors = random_mtp_tensors(config)
    with safe_open(str(sorted(target_dir.glob("*.safetensors"))[0]), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        for name in f.keys():  # noqa: SIM118
            if name.startswith("model.layers.0."):
                tensors[name.replace(".0.", f".{base}.", 1)] = f.get_tensor(name).float()
        tensors[f"model.layers.{base}.shared_head.norm.weight"] = f.get_tensor(
            "model.norm.weight"
        ).float()
    scale = float(embed.pow(2).mean(-1).sqrt().mean())
    tensors[f"model.layers.{base}.eh_proj.weight"] = torch.cat(
        (scale * torch.eye(hidden), feature_scale * torch.eye(hidden)), 1
    )
    tensors[f"model.layers.{base}.shared_head.head.weight"] = _target_lm_head(target_dir)
    return append_mtp_modules(tensors, target_dir, path)


def _target_lm_head(target_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                if name in f.keys():  # noqa: SIM118
                    return f.get_tensor(name).float().clone()
    raise FileNotFoundError(f"{target_dir}: no lm_head / embedding")


def drafts_after(
    drafter: Drafter,
    target: CausalLM,
    tokens: list[int],
    k: int,
    params: SamplingParams = GREEDY,
    max_len: int = 64,
) -> list[int]:
    """Drafts after one target prefill over `tokens` (one batch row, as the runner does)."""
    n = len(tokens)
    blocks = -(-n // 16)
    kv = KVCache.allocate(target.config, blocks, 16, torch.float32, "cpu")
    attn = AttentionMetadata.build(
        query_lens=np.array([n - 1]),
        seq_lens=np.array([n - 1]),
        block_tables=np.arange(blocks)[None, :],
        block_size=16,
        slot_mapping=np.arange(n - 1),
    )
    with torch.inference_mode():
        out = target(torch.tensor(tokens[:-1]), torch.arange(n - 1), attn, kv.layers)
    hidden, aux = split_aux_hidden(out, target.config.hidden_size)
    batch = InputBatch(1, max_len, 16)
    batch.row_req[0] = "r"
    batch.sampling[0] = params
    batch.token_ids[0, :n] = tokens
    batch.num_tokens[0] = n
    batch.num_computed_tokens[0] = n - 1
    sampler = SamplingState(1, target.config.vocab_size)
    sampler.add_request(0, params, tokens, [])
    rows = np.array([0])
    drafter.observe(batch, hidden, aux, rows, np.array([n - 1]), np.array([n - 1]))
    spec = drafter.config.model_copy(update={"num_spec_tokens": k})
    drafter.config = spec
    return drafter.propose(batch, rows, sampler)[0]


def write_truncated_model(target_dir: Path, path: Path, num_layers: int) -> Path:
    """The target's first `num_layers` layers with its embedding, final norm and head: a small
    draft model with the target's vocabulary that predicts some of the target's tokens."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                layer = name.split(".")[2] if name.startswith("model.layers.") else None
                if layer is None or int(layer) < num_layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(path / "model.safetensors"))
    hf = {**target_hf(target_dir), "num_hidden_layers": num_layers}
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    return path
