"""Where one step's state layers read and write their recurrent states (shared/kv/groups.py's
entry rule), built on the host from the state group's block tables.

For a request computing positions n .. m - 1 with state-group block table `bt` and block size
bs: the state is read from `bt[ceil(n / bs) - 1]` (a zero state when n == 0), the state at each
block boundary k * bs in (n, m] is written to `bt[k - 1]`, and the final state to
`bt[ceil(m / bs) - 1]`. A boundary state is the state after exactly that many tokens, so a
prefill span is cut into segments at the boundaries (`PrefillSpan.segments`). A one-token step
has exactly one write (its final state, which is a boundary state when m is a multiple of bs).

The block read is never written by the same step unless it is the partially filled block the
step continues (n not a multiple of bs): a full block a step starts at the end of (a prefix-cache
hit, or the previous step's boundary) stays immutable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillSpan:
    """One request's span of more than one token: flat rows [start, end), its read block (-1:
    zero state), segments (end offset within the span, block id the state there goes to), and
    `lead` = n % block_size, the span's start within its first block: the scan's chunks of
    `block_size` end at the boundaries when it pads that many neutral positions first."""

    start: int
    end: int
    read_block: int
    segments: list[tuple[int, int]]
    lead: int = 0


@dataclass
class StateMetadata:
    """The state layers' plan of one step, shared by every state layer (the flat batch has its
    one-token requests first: rows [0, num_decodes))."""

    num_decodes: int
    block_size: int
    decode_read: torch.Tensor  # [D] int64 block ids (0 where the request starts: masked)
    decode_has_state: torch.Tensor  # [D] float: 0 where n == 0 (a zero state), else 1
    decode_write: torch.Tensor  # [D] int64 block ids
    prefills: list[PrefillSpan] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        block_tables: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> StateMetadata:
        """`block_tables` [R, max_blocks]: the state group's rows of the step's requests, in
        flat-batch order (one-token requests first, as the runner orders them)."""
        starts = seq_lens - query_lens
        ones = np.flatnonzero(query_lens == 1)
        num_decodes = int(ones.size)
        if num_decodes and ones[-1] != num_decodes - 1:
            raise ValueError("one-token requests must lead the flat batch")
        rows = np.arange(num_decodes)
        n = starts[:num_decodes]
        read_entry = np.maximum(-(-n // block_size) - 1, 0)
        write_entry = -(-seq_lens[:num_decodes] // block_size) - 1
        decode_read = block_tables[rows, read_entry]
        decode_write = block_tables[rows, write_entry]
        prefills = []
        offset = num_decodes
        for i in range(num_decodes, len(query_lens)):
            start, stop = int(starts[i]), int(seq_lens[i])
            read = int(block_tables[i, -(-start // block_size) - 1]) if start else -1
            first = start // block_size + 1  # the first boundary k * bs > start
            ends = [k * block_size for k in range(first, -(-stop // block_size) + 1)]
            ends = [e for e in ends if e < stop] + [stop]
            segments = [(e - start, int(block_tables[i, -(-e // block_size) - 1])) for e in ends]
            span = PrefillSpan(offset, offset + stop - start, read, segments, start % block_size)
            prefills.append(span)
            offset += stop - start
        has_state = torch.from_numpy((n > 0).astype(np.float32)).to(device=device, dtype=dtype)
        return cls(
            num_decodes=num_decodes,
            block_size=block_size,
            decode_read=torch.from_numpy(decode_read.astype(np.int64)).to(device),
            decode_has_state=has_state,
            decode_write=torch.from_numpy(decode_write.astype(np.int64)).to(device),
            prefills=prefills,
        )
