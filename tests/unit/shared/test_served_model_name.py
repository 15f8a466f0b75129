"""The served model's name from settings alone (what heartbeats announce): the name
`resolve_model` gives the model, without reading or converting it."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.model.source import EMBEDDED_NAME, resolve_model, served_model_name


@pytest.mark.parametrize(
    ("model", "served", "expected"),
    [
        ("", "", EMBEDDED_NAME),
        ("", "mine", "mine"),
        ("/models/Qwen3-8B", "", "Qwen3-8B"),
        ("/models/Qwen3-8B/", "", "Qwen3-8B"),
        ("/models/tiny.Q4_1.gguf", "", "tiny.Q4_1"),
        ("/models/tiny.gguf", "api-name", "api-name"),
    ],
)
def test_served_model_name(model: str, served: str, expected: str) -> None:
    assert served_model_name(model, served) == expected


def test_the_name_equals_what_resolve_model_serves(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_model(str(model_dir), tmp_path).name == served_model_name(str(model_dir))
    assert resolve_model(str(model_dir), tmp_path, "x").name == served_model_name("", "x")
