"""Per-row sampling parameters written on the host and sent to the device in one flush."""

from __future__ import annotations

import torch

from services.worker.sampling.row_params import RowParams


def _params() -> RowParams:
    return RowParams(
        5,
        torch.device("cpu"),
        floats={"temperature": 0.0, "top_p": 1.0, "presence": 0.0},
        ints={"seed": 0, "top_k": 100, "count": 0},
    )


def test_writes_reach_the_device_columns_at_the_flush_only() -> None:
    params = _params()
    params.set(1, temperature=0.7, seed=-(2**63) + 5, top_k=3)
    params.set(3, top_p=0.25, presence=1.5)
    assert params._floats[1, 0].item() == 0.0  # not sent yet
    assert params.column("temperature").tolist() == [0.0, torch.tensor(0.7).item(), 0, 0, 0]
    assert params.column("seed").tolist() == [0, -(2**63) + 5, 0, 0, 0]  # int64 exact
    assert params.column("top_k").tolist() == [100, 3, 100, 100, 100]
    assert params.column("top_p").tolist() == [1.0, 1.0, 1.0, 0.25, 1.0]
    assert params.column("presence").tolist() == [0.0, 0.0, 0.0, 1.5, 0.0]


def test_a_flush_writes_marked_rows_only() -> None:
    """A column the device updates itself keeps its values in rows the host did not touch."""
    params = _params()
    count = params.column("count")
    count.index_add_(0, torch.tensor([0, 2, 2]), torch.tensor([1, 1, 1]))  # device-side counts
    params.set(4, count=9)
    assert params.column("count").tolist() == [1, 0, 2, 0, 9]
    params.reset(4)
    params.set(0, top_k=7)  # row 0 is marked: every column of it comes from the host
    assert params.column("count").tolist() == [0, 0, 2, 0, 0]
    assert params.column("top_k").tolist() == [7, 100, 100, 100, 100]


def test_reset_restores_the_neutral_values() -> None:
    params = _params()
    params.set(2, temperature=1.3, top_p=0.5, seed=11, top_k=4, count=3)
    params.flush()
    params.reset(2)
    assert params.column("temperature")[2].item() == 0.0
    assert params.column("top_p")[2].item() == 1.0
    assert [params.column(c)[2].item() for c in ("seed", "top_k", "count")] == [0, 100, 0]
