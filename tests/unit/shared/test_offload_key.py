"""Offload key names: model and layout version scope them; names parse back."""

from __future__ import annotations

import pytest

from shared.kv.offload_key import (
    KeySpace,
    OffloadKey,
    meta_key_of_payload,
    meta_prefix,
    payload_key_of_meta,
)
from tests.unit.kvstore.prefix import prefix_keys


def test_payload_and_meta_names() -> None:
    (key,) = prefix_keys(1, group=2)
    space = KeySpace("prod", "SmolLM2-135M", 3)
    payload = space.payload_key(key)
    assert payload == f"meshllm:prod:kv:SmolLM2-135M:3:2:{key.block_hash.hex()}"
    assert space.meta_key(key) == f"meshllm:prod:kvmeta:SmolLM2-135M:3:2:{key.block_hash.hex()}"
    assert space.meta_key(key).startswith(meta_prefix("prod"))
    assert meta_key_of_payload(payload) == space.meta_key(key)
    assert payload_key_of_meta(space.meta_key(key)) == payload
    assert space.parse(payload) == key and space.parse(space.meta_key(key)) == key


def test_models_and_layout_versions_never_share_names() -> None:
    (key,) = prefix_keys(1)
    names = {
        KeySpace("c", model, version).payload_key(key)
        for model in ("a", "b", "org/a", "a:8b")
        for version in (1, 2)
    }
    assert len(names) == 8


def test_model_names_with_separators_stay_parseable() -> None:
    (key,) = prefix_keys(1, group=1)
    space = KeySpace("c", "llama3:8b/instruct")
    assert space.parse(space.payload_key(key)) == key
    with pytest.raises(ValueError, match="not an offload key"):
        KeySpace("c", "llama3").parse(space.payload_key(key))


def test_invalid_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        OffloadKey(b"short", 0)
    with pytest.raises(ValueError, match="group"):
        OffloadKey(bytes(16), -1)
    with pytest.raises(ValueError, match="hex"):
        OffloadKey.from_hex("zz" * 16, 0)
    with pytest.raises(ValueError, match="cluster"):
        KeySpace("a:b", "m")
    with pytest.raises(ValueError, match="payload"):
        meta_key_of_payload("meshllm:c:grammar:x")
