"""Several streamed chat requests at once through the OpenAI client, for fault tests that kill
a process while they run and compare the texts with an undisturbed run."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import openai


def stream_chats(
    client: openai.OpenAI,
    requests: Sequence[tuple[str, dict[str, Any]]],
    max_tokens: int,
    progress: list[int],
) -> list[str]:
    """Run (prompt, extra create() params) requests concurrently, streamed with ignore_eos;
    progress[i] counts the chunks request i has received. Returns each request's text; any
    client error fails the caller."""
    model = client.models.list().data[0].id
    texts = [""] * len(requests)
    errors: list[BaseException] = []

    def one(i: int, prompt: str, params: dict[str, Any]) -> None:
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
                **params,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    texts[i] += chunk.choices[0].delta.content
                    progress[i] += 1
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, p, kw)) for i, (p, kw) in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return texts
