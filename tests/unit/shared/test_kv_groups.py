"""shared/kv/groups.py: the one grouping rule scheduler and worker share."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.codec import decode, encode
from shared.kv.groups import KVGroupSpec, kv_groups_for, layer_group_index
from shared.protocol import WorkerReady


def test_full_first_then_windows_ascending_layers_ascending() -> None:
    groups = kv_groups_for([16, None, 4, 16, None, 4])
    assert [(g.kind, g.sliding_window, g.layer_indices) for g in groups] == [
        ("full", None, [1, 4]),
        ("sliding_window", 4, [2, 5]),
        ("sliding_window", 16, [0, 3]),
    ]
    assert layer_group_index(groups, 6) == [2, 0, 1, 2, 0, 1]


def test_all_sliding_has_no_full_group_and_all_full_is_one_group() -> None:
    assert [g.kind for g in kv_groups_for([8, 8])] == ["sliding_window"]
    assert kv_groups_for([None, None, None]) == [KVGroupSpec(kind="full", layer_indices=[0, 1, 2])]


@pytest.mark.parametrize("windows", [[], [0], [None, -3]])
def test_bad_windows_are_refused(windows: list[int | None]) -> None:
    with pytest.raises(ValueError):
        kv_groups_for(windows)


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "full", "sliding_window": 8, "layer_indices": [0]},
        {"kind": "sliding_window", "layer_indices": [0]},
        {"kind": "full", "layer_indices": []},
    ],
)
def test_spec_kind_and_window_agree(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        KVGroupSpec.model_validate(fields)


def test_layer_group_index_rejects_gaps_and_overlaps() -> None:
    full = KVGroupSpec(kind="full", layer_indices=[0, 1])
    window = KVGroupSpec(kind="sliding_window", sliding_window=4, layer_indices=[1])
    with pytest.raises(ValueError, match="two KV cache groups"):
        layer_group_index([full, window], 2)
    with pytest.raises(ValueError, match="in no KV cache group"):
        layer_group_index([full], 3)


def test_worker_ready_carries_groups_and_defaults_to_none() -> None:
    base = dict(
        worker_id="w",
        incarnation="i",
        model="m",
        num_kv_blocks=8,
        block_size=4,
        vocab_size=32,
        max_model_len=64,
    )
    assert WorkerReady(**base).kv_groups == []  # type: ignore[arg-type]
    ready = WorkerReady(**base, kv_groups=kv_groups_for([None, 8]))  # type: ignore[arg-type]
    assert decode(encode(ready), WorkerReady).kv_groups == ready.kv_groups
