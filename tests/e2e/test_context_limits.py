"""A request without max_tokens may use the rest of the context: the mesh serves it (the worker
guarantees at start that its KV cache holds one whole context)."""

from __future__ import annotations

import openai


def test_chat_without_max_tokens_is_served(client: openai.OpenAI, model_name: str):
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert "Paris" in resp.choices[0].message.content
