"""Draft -> target vocabulary mapping, decided once for every drafter (CONTRACTS.md).

A draft model (or EAGLE head) may predict over a smaller vocabulary than the target's (EAGLE-3
checkpoints keep the most frequent tokens). Its token i is target token i + d2t[i] (the
checkpoint's offsets, EAGLE-3's `d2t`). The rule:

- draft vocabulary == the TARGET's vocabulary size (compared with the target config, never with
  the draft's own config): no map, `None`, and draft logits/ids pass through untouched;
- a smaller draft vocabulary: the checkpoint's offsets, checked to land inside the target
  vocabulary without collisions; a checkpoint without them is an error (guessing identity
  would silently propose wrong tokens);
- a larger draft vocabulary: an error (its extra tokens have no target id).
"""

from __future__ import annotations

import numpy as np
import torch


class DraftVocabError(ValueError):
    """The draft model's vocabulary cannot be mapped onto the target's."""


def draft_vocab_map(
    target_vocab_size: int, draft_vocab_size: int, d2t: torch.Tensor | None
) -> torch.Tensor | None:
    """The draft->target id map to use: None (identity) or int64 target ids [draft_vocab]."""
    if draft_vocab_size == target_vocab_size:
        return None
    if draft_vocab_size > target_vocab_size:
        raise DraftVocabError(
            f"draft vocabulary {draft_vocab_size} is larger than the target's {target_vocab_size}"
        )
    if d2t is None:
        raise DraftVocabError(
            f"draft vocabulary {draft_vocab_size} is smaller than the target's "
            f"{target_vocab_size} and the checkpoint has no draft->target map (d2t)"
        )
    if d2t.dim() != 1 or d2t.numel() != draft_vocab_size:
        raise DraftVocabError(
            f"d2t has shape {tuple(d2t.shape)}, expected [{draft_vocab_size}] (draft vocabulary)"
        )
    target_ids = torch.arange(draft_vocab_size, dtype=torch.int64) + d2t.to(torch.int64)
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= target_vocab_size:
        raise DraftVocabError(
            f"d2t maps draft ids outside the target vocabulary {target_vocab_size}"
        )
    if target_ids.unique().numel() != draft_vocab_size:
        raise DraftVocabError("d2t maps two draft ids to the same target id")
    return target_ids


def to_target_ids(draft_ids: torch.Tensor, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """Draft token ids as target ids (untouched without a map)."""
    if vocab_map is None:
        return draft_ids
    return vocab_map.to(draft_ids.device)[draft_ids]


def to_target_logits(
    draft_logits: torch.Tensor, vocab_map: torch.Tensor | None, target_vocab_size: int
) -> torch.Tensor:
    """Draft logits [B, Vd] spread over the target vocabulary [B, Vt]; tokens the draft cannot
    propose get -inf (probability 0 in q, as rejection sampling needs). Untouched without a
    map (the same tensor, no copy)."""
    if vocab_map is None:
        return draft_logits
    out = draft_logits.new_full((draft_logits.shape[0], target_vocab_size), float("-inf"))
    out[:, vocab_map.to(draft_logits.device)] = draft_logits
    return out


def to_draft_table(vocab_map: torch.Tensor | None, target_vocab_size: int) -> np.ndarray | None:
    """The inverse map as a host table [target vocab] -> draft id (None without a map), for a
    draft model that reads the verified tokens. A target token the draft vocabulary lacks
    has no draft id: it is read as draft id 0, which can only make its drafts worse."""
    if vocab_map is None:
        return None
    table = np.zeros(target_vocab_size, dtype=np.int64)
    table[vocab_map.cpu().numpy()] = np.arange(len(vocab_map))
    return table
