"""Draft heads trained on the served target's own outputs (self-distillation), so that the
acceptance of every speculative method can be measured where no trained checkpoint of that
method exists for the model (bench/gpu/spec_acceptance.py: SmolLM2 has none).

The training forwards run the heads' own modules, the code that drafts in serving
(services/worker/spec/{eagle,eagle3,mtp,dflash}.py), over dense batches of S sequences of one
length L: `DenseAttention` stands in for the paged attention metadata and a `KeyStore` per
layer for the layer's KV cache, so each query sees exactly the keys the serving path gives it.

- **Feature heads** (EAGLE-1/2, EAGLE-3, MTP) are trained with K unrolled steps
  ("training-time test", as EAGLE-3 trains): step 0 reads the target's feature f[p] and token
  t[p+1] at position p; step j reads the previous step's output at the same base p and token
  t[p+1+j] at position p+j. Step j's query sees step 0's keys at positions <= p and its own
  and the earlier steps' keys of base p: what a proposal's j-th draft sees after the target's
  verified prefix ends at p (feature_drafter.py).
- **DFlash drafts** are trained on blocks [t[s], mask x (B-1)] at positions s..s+B-1 over the
  fused context of positions < s (its keys/values from `DFlashHead.context_kv`, the code that
  writes them in serving), the block non-causal.
- **Draft models** are the target's first layers, fine-tuned (a transformers model).

Every head learns the target's own next-token distribution at each position (soft labels: the
target's probabilities, which is what verification compares drafts against), on sequences the
target generated itself. EAGLE-1/2 heads also regress the next feature (EAGLE's loss).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.bound import LayerAttention
from services.worker.models.base import CausalLM, split_aux_hidden
from services.worker.spec.dflash import DFlashHead
from services.worker.spec.eagle import target_embedding


class KeyStore:
    """One layer's keys and values of a training forward, in the order they were computed:
    the serving path's KV cache of that layer, as `DenseAttention` reads it."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [S * n, kv_heads, d]: n keys per sequence."""
        self.keys.append(k)
        self.values.append(v)

    def stacked(self, seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value so far per sequence: [S, kv_heads, total keys, d]."""

        def per_seq(parts: list[torch.Tensor]) -> torch.Tensor:
            shaped = [p.view(seqs, -1, *p.shape[1:]) for p in parts]
            return torch.cat(shaped, dim=1).transpose(1, 2)

        return per_seq(self.keys), per_seq(self.values)


@dataclass(frozen=True, eq=False)
class DenseAttention(LayerAttention):
    """Attention over S packed sequences ([S * Lq] query rows, Lq per sequence): the step's
    keys/values are appended to the layer's KeyStore (passed where serving passes the KV
    cache), and each query attends over the store's keys of its own sequence that `visible`
    ([Lq, Lk] or [S, 1, Lq, Lk] bool) allows."""

    seqs: int = 1
    visible: torch.Tensor = field(default_factory=lambda: torch.ones(1, 1, dtype=torch.bool))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        store: KeyStore = kv_cache  # type: ignore[assignment]
        store.add(k, v)
        keys, values = store.stacked(self.seqs)
        rows = q.shape[0]
        queries = q.view(self.seqs, rows // self.seqs, *q.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries,
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=self.visible,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(rows, -1)


def causal(length: int, device: torch.device | str) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def unrolled_visible(length: int, step: int, device: torch.device | str) -> torch.Tensor:
    """[L, (step + 1) L]: step 0's keys causally (positions <= the query's base p), then each
    later step's key of base p only."""
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal(length, device), *([eye] * step)], dim=1)


class TrainingTarget:
    """What a head reads from the frozen target while training: its input embedding and its LM
    head as a plain projection (differentiable in the head's output)."""

    def __init__(self, target: CausalLM) -> None:
        self.target = target
        self.embed_tokens = target.embed_tokens
        lm_head = getattr(target, "lm_head", None)
        self.weight: torch.Tensor = (
            target.embed_tokens.weight if lm_head is None else lm_head.weight  # type: ignore[union-attr]
        )

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return target_embedding(self.target, token_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight.to(hidden.dtype))


@dataclass
class TargetBatch:
    """S sequences of the target's own text (right-padded to L) and what the target computed
    over them: its final hidden states, the auxiliary layer states every head needs, and its
    next-token probabilities at every position."""

    tokens: torch.Tensor  # [S, L]
    lengths: torch.Tensor  # [S]
    hidden: torch.Tensor  # [S * L, H]
    aux: dict[int, torch.Tensor]  # target layer -> [S * L, H]
    probs: torch.Tensor  # [S * L, V] float32

    @property
    def seqs(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def aux_of(self, layers: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([self.aux[i] for i in layers], dim=-1)


def run_target(
    target: CausalLM, tokens: torch.Tensor, lengths: torch.Tensor, aux_layers: tuple[int, ...]
) -> TargetBatch:
    """The target's forward over `tokens` [S, L] (dense causal attention), returning the
    states the heads train on."""
    seqs, length = tokens.shape
    device = tokens.device
    layers = tuple(sorted(set(aux_layers)))
    saved = target.aux_hidden_layers
    target.aux_hidden_layers = layers
    try:
        with torch.no_grad():
            positions = torch.arange(length, device=device).repeat(seqs)
            attn = DenseAttention(layer=0, seqs=seqs, visible=causal(length, device))
            stores: list[Any] = [KeyStore() for _ in range(target.config.num_hidden_layers)]
            out = target(tokens.flatten(), positions, attn, stores)
            hidden, aux = split_aux_hidden(out, target.config.hidden_size)
            probs = torch.softmax(target.compute_logits(hidden).float(), dim=-1)
    finally:
        target.aux_hidden_layers = saved
    width = target.config.hidden_size
    per_layer: dict[int, torch.Tensor] = {}
    if aux is not None:
        per_layer = {i: aux[:, n * width : (n + 1) * width] for n, i in enumerate(layers)}
    return TargetBatch(tokens, lengths, hidden, per_layer, probs)


def soft_kl(logits: torch.Tensor, probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean over the kept rows of KL(probs || softmax(logits)): the cross-entropy against the
    target's probabilities less their entropy (the same gradient; 0 when the draft is exact)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    per_row = (probs * (torch.log(probs.clamp(min=1e-30)) - logp)).sum(-1)
    return (per_row * keep).sum() / keep.sum().clamp(min=1)


@dataclass
class FeatureHeadTrainer:
    """Unrolled training of a feature head (EAGLE-1/2, EAGLE-3, MTP): `steps` drafts deep.
    `draft_ids` [D]: the target ids of a smaller draft vocabulary (EAGLE-3 with d2t), else None;
    `regress`: add EAGLE-1/2's smooth-L1 loss of the step-0 output against the next feature."""

    module: nn.Module
    steps: int
    aux_layers: tuple[int, ...] = ()  # the target layers whose states target_features reads
    draft_ids: torch.Tensor | None = None
    regress: bool = False

    def unrolled(
        self, batch: TargetBatch, target: TrainingTarget
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per step j, over the bases p = 0..L-2 of every sequence ([S * (L-1)] rows): the
        head's output g, its draft logits, the rows of `batch.probs` they learn (the target's
        at p+1+j) and which rows count (inside the sequence)."""
        head: Any = self.module
        seqs, length = batch.seqs, batch.length
        pairs = length - 1
        device = batch.tokens.device
        aux = batch.aux_of(self.aux_layers) if self.aux_layers else None
        features = head.target_features(batch.hidden, aux).view(seqs, length, -1)
        feature = features[:, :pairs]
        base = torch.arange(pairs, device=device)
        stores: list[Any] = [KeyStore() for _ in range(len(head.layers))]
        for step in range(self.steps):
            at = base + 1 + step  # the input token's index, and the label's
            index = at.clamp(max=length - 1)
            keep = ((at < length)[None, :] & (at[None, :] < batch.lengths[:, None])).flatten()
            embeds = head.embed(batch.tokens[:, index].flatten(), target)
            visible = unrolled_visible(pairs, step, device)
            attn = DenseAttention(layer=0, seqs=seqs, visible=visible)
            positions = (base + step).repeat(seqs)
            g = head(embeds, feature.flatten(0, 1), positions, attn, stores, step=step)
            flat = (torch.arange(seqs, device=device)[:, None] * length + index[None, :]).flatten()
            yield g, head.draft_logits(g, target, step=step), flat, keep.float()
            feature = g.view(seqs, pairs, -1)

    def loss(self, batch: TargetBatch, target: TrainingTarget) -> torch.Tensor:
        total = torch.zeros((), device=batch.tokens.device)
        for step, (g, logits, flat, keep) in enumerate(self.unrolled(batch, target)):
            probs = batch.probs[flat]
            if self.draft_ids is not None:
                probs = probs[:, self.draft_ids]
            total = total + soft_kl(logits, probs, keep)
            if self.regress and step == 0:
                want = batch.hidden.view(batch.seqs, batch.length, -1)[:, 1:].flatten(0, 1)
                reg = F.smooth_l1_loss(g.float(), want.float(), reduction="none").mean(-1)
                total = total + 10.0 * (reg * keep).sum() / keep.sum().clamp(min=1)
        return total / self.steps


@dataclass
class DFlashTrainer:
    """Block training of a DFlash draft: `anchors` blocks per sequence at random starts."""

    module: DFlashHead
    anchors: int = 8
    generator: torch.Generator | None = None

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.module.aux_layers

    def block_logits(
        self, batch: TargetBatch, target: TrainingTarget, starts: torch.Tensor
    ) -> torch.Tensor:
        """Draft logits [S, n, B-1, V] of the blocks starting at `starts` [S, n] (each block
        [t[s], mask x (B-1)] over the context of positions < s): block positions 1..B-1."""
        head = self.module
        seqs, length = batch.seqs, batch.length
        width = head.layout.block_size
        device = batch.tokens.device
        anchors = starts.shape[1]
        positions = starts[:, :, None] + torch.arange(width, device=device)  # [S, n, B]
        block = torch.full_like(positions, head.layout.mask_token_id)
        block[:, :, 0] = batch.tokens.gather(1, starts)
        context = head.context(batch.aux_of(head.aux_layers))
        stores: list[Any] = []
        for k, v in head.context_kv(context, torch.arange(length, device=device).repeat(seqs)):
            store = KeyStore()
            store.add(k, v)
            stores.append(store)
        key_pos = torch.arange(length, device=device)
        sees_context = key_pos[None, None, :] < starts.repeat_interleave(width, 1)[:, :, None]
        block_of = torch.arange(anchors * width, device=device) // width
        sees_block = (block_of[:, None] == block_of[None, :]).expand(seqs, -1, -1)
        visible = torch.cat((sees_context, sees_block), dim=2)[:, None]  # [S, 1, nB, L + nB]
        attn = DenseAttention(layer=0, seqs=seqs, visible=visible)
        out = head(target.embed(block.flatten()), positions.flatten(), attn, stores)
        drafts = out.view(seqs, anchors, width, -1)[:, :, 1:]
        return target.compute_logits(drafts.flatten(0, 2)).view(seqs, anchors, width - 1, -1)

    def loss(self, batch: TargetBatch, target: TrainingTarget) -> torch.Tensor:
        seqs, length = batch.seqs, batch.length
        device = batch.tokens.device
        # starts s in [1, len - 2]: a context of at least one position, a label at s
        span = (batch.lengths - 2).clamp(min=1).float()
        u = torch.rand(seqs, self.anchors, generator=self.generator).to(device)
        starts = 1 + (u * span[:, None]).long()
        logits = self.block_logits(batch, target, starts)
        width = self.module.layout.block_size
        at = starts[:, :, None] + torch.arange(width - 1, device=device)  # draft i: s + i - 1
        keep = (at < batch.lengths[:, None, None]).flatten().float()
        rows = torch.arange(seqs, device=device)[:, None, None] * length
        flat = (rows + at.clamp(max=length - 1)).flatten()
        return soft_kl(logits.flatten(0, 2), batch.probs[flat], keep)


@dataclass
class DraftModelTrainer:
    """A small draft model (a transformers causal LM sharing the target's vocabulary)
    distilled on the target's probabilities at every position."""

    module: nn.Module
    aux_layers: tuple[int, ...] = ()

    def loss(self, batch: TargetBatch, target: TrainingTarget) -> torch.Tensor:
        logits = self.module(input_ids=batch.tokens).logits.flatten(0, 1)
        positions = torch.arange(batch.length, device=batch.tokens.device)
        keep = (positions[None, :] < batch.lengths[:, None]).flatten().float()
        return soft_kl(logits, batch.probs, keep)


class Trainer(Protocol):
    """What `train` needs of a head's trainer."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def aux_layers(self) -> tuple[int, ...]: ...

    def loss(self, batch: TargetBatch, target: TrainingTarget) -> torch.Tensor: ...


def batches(
    tokens: np.ndarray, lengths: np.ndarray, seqs: int, device: str, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled batches of `seqs` sequences, each cut to its batch's longest."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(tokens))
        for i in range(0, len(order) - seqs + 1, seqs):
            pick = order[i : i + seqs]
            width = int(lengths[pick].max())
            yield (
                torch.from_numpy(tokens[pick, :width]).to(device),
                torch.from_numpy(lengths[pick]).to(device),
            )


def train(
    target: CausalLM,
    trainers: dict[str, Trainer],
    data: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    seconds: float = math.inf,
    lr: dict[str, float] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, list[float]]:
    """Train every head on the same target batches (one target forward a step), AdamW with a
    warm-up and a cosine decay, until `steps` or `seconds` run out; the loss curve per head."""
    lr = lr or {}
    shared = TrainingTarget(target)
    aux_layers = tuple(i for t in trainers.values() for i in t.aux_layers)
    for trainer in trainers.values():
        trainer.module.train().requires_grad_(True)
    optimizers = {
        name: torch.optim.AdamW(
            [p for p in t.module.parameters() if p.requires_grad],
            lr=lr.get(name, 1e-3),
            weight_decay=0.0,
            betas=(0.9, 0.95),
        )
        for name, t in trainers.items()
    }
    warmup = max(1, min(50, steps // 10))
    curves: dict[str, list[float]] = {name: [] for name in trainers}
    started = time.monotonic()
    device_type = "cuda" if next(target.parameters()).is_cuda else "cpu"
    for step in range(steps):
        elapsed = time.monotonic() - started
        if elapsed > seconds:
            break
        progress = max(step / steps, elapsed / seconds)  # the cosine runs to whichever ends first
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        tokens, lengths = next(data)
        batch = run_target(target, tokens, lengths, aux_layers)
        for name, trainer in trainers.items():
            optimizer = optimizers[name]
            for group in optimizer.param_groups:
                group["lr"] = lr.get(name, 1e-3) * scale
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
                loss = trainer.loss(batch, shared)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainer.module.parameters(), 1.0)
            optimizer.step()
            curves[name].append(float(loss.detach()))
        if step % 100 == 0:
            log(f"step {step} " + " ".join(f"{n}={c[-1]:.3f}" for n, c in curves.items()))
    for trainer in trainers.values():
        trainer.module.eval().requires_grad_(False)
    return curves
