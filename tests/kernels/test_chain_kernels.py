"""The chained verify step's kernels (meshllm_kernels/spec/chain_kernels.py) against its
PyTorch path (services/worker/spec/chain.py, itself checked against the host's n-gram lookup
in tests/unit/worker/spec/test_chain.py): the same drafts, padded layout, acceptance, device
tokens and packed result, over random rows with a small vocabulary (many matches), rows at
max_tokens, rows without slots and rows near max_model_len."""

from __future__ import annotations

import numpy as np
import torch

from meshllm_kernels.spec.chain_kernels import accept_, lay_out_
from services.worker.spec.chain import DraftChain

K, BLOCK_SIZE, MAX_MODEL_LEN = 4, 4, 40
WIDTH = K + 1
COLUMNS = MAX_MODEL_LEN + WIDTH + 1  # DraftChain.tokens: capacity + W + 1


def _chain(device: torch.device) -> DraftChain:
    capacity = -(-MAX_MODEL_LEN // BLOCK_SIZE) * BLOCK_SIZE
    return DraftChain(8, MAX_MODEL_LEN, capacity, K, 2, 3, device)


def _case(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(2, 5, (1,), generator=gen))
    tokens = torch.randint(0, vocab, (8, COLUMNS), generator=gen, dtype=torch.int32)
    length = torch.randint(1, MAX_MODEL_LEN - WIDTH + 2, (8,), generator=gen)
    rows = torch.randperm(8, generator=gen)[:6]
    slots = torch.randint(0, K + 1, (6,), generator=gen)
    limits = length[rows] + torch.randint(-1, 6, (6,), generator=gen)  # some at max_tokens
    tables = torch.randint(0, 100, (6, MAX_MODEL_LEN // BLOCK_SIZE), generator=gen)
    draws = torch.where(  # mostly the drafts' own tokens, so acceptance runs long and short
        torch.rand(6, WIDTH, generator=gen) < 0.7,
        torch.randint(0, vocab, (6, WIDTH), generator=gen),
        torch.randint(0, COLUMNS, (6, WIDTH), generator=gen),
    )
    latest = torch.randint(0, 50, (8,), generator=gen)
    return dict(tokens=tokens, length=length, rows=rows, slots=slots, limits=limits,
                tables=tables, draws=draws, latest=latest)  # fmt: skip


def test_kernels_equal_the_pytorch_chain(device: torch.device) -> None:
    checked_drafts = 0
    for seed in range(40):
        case = _case(seed)
        ref, dev = _chain(torch.device("cpu")), _chain(device)
        for chain in (ref, dev):
            chain.tokens[:8] = case["tokens"].to(chain.device)
            chain.length[:8] = case["length"].to(chain.device)
        want = ref.lay_out(
            case["rows"], case["slots"], case["limits"], case["tables"], BLOCK_SIZE, COLUMNS
        )
        on = {name: t.to(device) for name, t in case.items()}
        r = len(case["rows"])
        step = {
            "input_ids": torch.empty(r * WIDTH, dtype=torch.int64, device=device),
            "positions": torch.empty(r * WIDTH, dtype=torch.int64, device=device),
            "slots": torch.empty(r * WIDTH, dtype=torch.int64, device=device),
            "seq_lens": torch.empty(r, dtype=torch.int32, device=device),
            "drafts": torch.empty(r, K, dtype=torch.int64, device=device),
            "num_drafts": torch.empty(r, dtype=torch.int64, device=device),
            "lengths": torch.empty(r, dtype=torch.int64, device=device),
            "active": torch.empty(r, dtype=torch.int64, device=device),
        }
        lay_out_(
            dev.tokens, dev.length, on["rows"], on["slots"], on["limits"],
            on["tables"].to(torch.int32).contiguous(), step, k=K, min_n=2, max_n=3,
            max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
        )  # fmt: skip
        got = {name: t.cpu() for name, t in step.items()}
        for name in ("input_ids", "positions", "slots", "num_drafts", "lengths"):
            assert torch.equal(got[name], getattr(want, name)), (seed, name)
        assert torch.equal(got["seq_lens"].to(torch.int64), want.seq_lens), seed
        assert torch.equal(got["active"].bool(), want.active), seed
        verified = torch.arange(K)[None, :] < want.num_drafts[:, None]
        assert torch.equal(got["drafts"][verified], want.drafts[verified]), seed
        checked_drafts += int(want.num_drafts.sum())

        ref_latest = case["latest"].clone()
        packed_want = ref.accept(case["rows"], want, case["draws"], ref_latest)
        packed = torch.empty(r, WIDTH + 2, dtype=torch.int64, device=device)
        latest = on["latest"].clone()
        accept_(dev.tokens, dev.length, latest, on["rows"], on["draws"], step, packed, k=K)
        assert torch.equal(packed.cpu(), packed_want), seed
        assert torch.equal(latest.cpu(), ref_latest), seed
        assert torch.equal(dev.length.cpu(), ref.length), seed
        assert torch.equal(dev.tokens.cpu(), ref.tokens), seed
    assert checked_drafts > 50  # the cases really proposed drafts


def test_a_long_row_searches_past_one_block(device: torch.device) -> None:
    """A match far back (the search walks 256 ends per iteration) is found, the latest one."""
    n = 700
    chain = DraftChain(2, 1024, 1024, K, 2, 4, device)
    row = np.arange(n) % 50 + 100  # unique-ish, no repeats within 50
    row[10:14] = [1, 2, 3, 4]
    row[20:25] = [7, 1, 2, 3, 9]  # the latest "1 2 3", followed by 9
    row[n - 3 : n] = [1, 2, 3]  # the suffix
    chain.tokens[1, :n] = torch.from_numpy(row).to(torch.int32)
    chain.length[1] = n
    rows = torch.tensor([1], device=device)
    step = chain.lay_out(
        rows,
        torch.tensor([K], device=device),
        torch.tensor([n + 10], device=device),
        torch.arange(64, device=device, dtype=torch.int32)[None, :],
        16,
        1024,
    )
    assert int(step.num_drafts[0]) == K
    assert step.drafts[0].tolist() == row[24 : 24 + K].tolist()
