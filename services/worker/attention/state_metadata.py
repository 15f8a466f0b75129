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

On the Triton path (`triton=True`: CUDA, or a test under the interpreter) the plan also carries
the kernels' slot tensors (meshllm_kernels/mamba: -1 = zero state / no write), built here on the
host so the mixer never reads block ids back from the device:

- decode rows: `decode_read_slot` / `decode_write_slot` [D] int32 for `mamba_decode_step`;
- prefill spans: one or two `PrefillLaunch`es of `mamba_prefill`. The kernel allows a
  request's read slot to be written only as its *final* state, but a span starting mid-block
  (lead > 0) that crosses a boundary writes its first boundary state to the block it reads. Such
  a span runs as a head (up to that boundary: read and final write the same block, in place)
  in the first launch, and as a tail (reading the head's state) in a second launch, whose other
  rows are -1 requests that read and write nothing and whose outputs are not taken.
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


@dataclass(frozen=True)
class PrefillLaunch:
    """One `mamba_prefill` over the flat rows [lo, hi) (kernel argument names; int32 on the
    step's device). `take`: the rows (relative to lo) whose outputs this launch supplies; None:
    all of them."""

    lo: int
    hi: int
    cu_seqlens: torch.Tensor
    read_slot: torch.Tensor
    write_slot: torch.Tensor
    state_cu: torch.Tensor
    state_offsets: torch.Tensor
    state_slots: torch.Tensor
    take: torch.Tensor | None = None


# A request of a launch: flat rows [start, end), read slot, final write slot, boundaries
# (token count from start, slot).
_Piece = tuple[int, int, int, int, list[tuple[int, int]]]


def _launch(pieces: list[_Piece], device: torch.device, take: list[int] | None) -> PrefillLaunch:
    lo, hi = pieces[0][0], pieces[-1][1]
    cu, reads, writes, state_cu, offsets, slots = [0], [], [], [0], [], []
    for start, end, read, write, bounds in pieces:
        assert start - lo == cu[-1], pieces
        cu.append(end - lo)
        reads.append(read)
        writes.append(write)
        offsets += [o for o, _ in bounds]
        slots += [b for _, b in bounds]
        state_cu.append(len(offsets))

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device)

    return PrefillLaunch(
        lo, hi, ints(cu), ints(reads), ints(writes), ints(state_cu), ints(offsets), ints(slots),
        None if take is None else torch.tensor(take, dtype=torch.int64).to(device),
    )  # fmt: skip


def prefill_launches(spans: list[PrefillSpan], device: torch.device) -> list[PrefillLaunch]:
    """The `mamba_prefill` launches of a step's spans (module docstring)."""
    if not spans:
        return []
    first: list[_Piece] = []
    tails: list[_Piece] = []
    for span in spans:
        *bounds, (_, final) = span.segments
        if span.lead and bounds and bounds[0][1] == span.read_block >= 0:
            cut, block = bounds[0]
            first.append((span.start, span.start + cut, span.read_block, block, []))
            first.append((span.start + cut, span.end, -1, -1, []))  # computed by the tail
            rest = [(o - cut, b) for o, b in bounds[1:]]
            tails.append((span.start + cut, span.end, block, final, rest))
        else:
            first.append((span.start, span.end, span.read_block, final, bounds))
    launches = [_launch(first, device, None)]
    if tails:
        pieces: list[_Piece] = []
        take: list[int] = []
        lo = tails[0][0]
        for tail in tails:
            gap = pieces[-1][1] if pieces else lo
            if tail[0] > gap:
                pieces.append((gap, tail[0], -1, -1, []))  # rows of other spans: not taken
            pieces.append(tail)
            take += range(tail[0] - lo, tail[1] - lo)
        launches.append(_launch(pieces, device, take))
    return launches


def decode_blocks(
    block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(read, write) block ids of one-token steps ending at `seq_lens` (the entry rule:
    after n tokens the state is in entry ceil(n / bs) - 1; read at n = seq_len - 1, entry 0
    where n == 0, which `decode_read_slots` masks), from the state group's table rows."""
    rows = np.arange(len(seq_lens))
    n = seq_lens - 1
    read_entry = np.maximum(-(-n // block_size) - 1, 0)
    write_entry = -(-seq_lens // block_size) - 1
    return block_tables[rows, read_entry], block_tables[rows, write_entry]


def decode_read_slots(read_blocks: np.ndarray, computed: np.ndarray) -> np.ndarray:
    """The kernels' int32 read slots: the block, or -1 (a zero state) where nothing was
    computed before the step."""
    return np.where(computed > 0, read_blocks, -1).astype(np.int32)


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
    # The Triton path's kernel arguments (module docstring); None on the reference path.
    decode_read_slot: torch.Tensor | None = None  # [D] int32, -1 where n == 0
    decode_write_slot: torch.Tensor | None = None  # [D] int32
    launches: list[PrefillLaunch] | None = None

    @property
    def triton(self) -> bool:
        return self.launches is not None

    @classmethod
    def for_decode_graph(
        cls, size: int, block_size: int, read_slot: torch.Tensor, write_slot: torch.Tensor
    ) -> StateMetadata:
        """A captured decode step's plan (accel/hybrid_graphs.py): `size` one-token rows on
        the Triton path, reading the graph's static int32 slot buffers. The reference path's
        block-id fields alias the slots: a graph never runs that path (`triton` is True)."""
        return cls(
            num_decodes=size,
            block_size=block_size,
            decode_read=read_slot,
            decode_has_state=read_slot,
            decode_write=write_slot,
            decode_read_slot=read_slot,
            decode_write_slot=write_slot,
            launches=[],
        )

    @classmethod
    def build(
        cls,
        block_tables: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        triton: bool | None = None,
    ) -> StateMetadata:
        """`block_tables` [R, max_blocks]: the state group's rows of the step's requests, in
        flat-batch order (one-token requests first, as the runner orders them). `triton`: build
        the kernels' slot tensors (None: where the worker runs Triton, i.e. on CUDA)."""
        if triton is None:
            triton = torch.device(device).type == "cuda"
        starts = seq_lens - query_lens
        ones = np.flatnonzero(query_lens == 1)
        num_decodes = int(ones.size)
        if num_decodes and ones[-1] != num_decodes - 1:
            raise ValueError("one-token requests must lead the flat batch")
        n = starts[:num_decodes]
        decode_read, decode_write = decode_blocks(
            block_tables[:num_decodes], seq_lens[:num_decodes], block_size
        )
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
        slots: dict[str, object] = {}
        if triton:
            read_slot = decode_read_slots(decode_read, n)
            slots = {
                "decode_read_slot": torch.from_numpy(read_slot).to(device),
                "decode_write_slot": torch.from_numpy(decode_write.astype(np.int32)).to(device),
                "launches": prefill_launches(prefills, torch.device(device)),
            }
        return cls(
            num_decodes=num_decodes,
            block_size=block_size,
            decode_read=torch.from_numpy(decode_read.astype(np.int64)).to(device),
            decode_has_state=has_state,
            decode_write=torch.from_numpy(decode_write.astype(np.int64)).to(device),
            prefills=prefills,
            **slots,  # type: ignore[arg-type]
        )
