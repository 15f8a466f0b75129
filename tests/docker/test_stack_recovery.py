"""Failures in the compose stack heal without manual action: a worker container killed
mid-generation is brought back and the request completes token-identical to an undisturbed
run (greedy, fp32); a restarted Redis (persistence off: every stream and group gone) is
reconnected to by every service, which then serves again."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.docker.stack import Stack

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]

MAX_TOKENS = 32
PROMPT = "Tell me a story about a dragon."


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.api, api_key="unused", max_retries=0, timeout=600)


def _generate(stack: Stack, progress: list[int]) -> str:
    client = _client(stack)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            progress[0] += 1
    return text


def _ask_paris(stack: Stack) -> str:
    client = _client(stack)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=20,
    )
    return reply.choices[0].message.content or ""


def test_worker_killed_mid_generation_completes_identically(stack: Stack) -> None:
    undisturbed = _generate(stack, [0])
    worker = stack.container("worker")
    started_at = worker.attrs["State"]["StartedAt"]

    progress = [0]
    result: list[str] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(_generate(stack, progress))
        except BaseException as exc:  # reported below
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 300
    while progress[0] < 3:  # mid-generation: tokens are streaming
        assert not errors, errors
        assert time.monotonic() < deadline, "no tokens streamed"
        time.sleep(0.02)
    assert progress[0] < MAX_TOKENS - 5, "finished before the kill: nothing was tested"
    worker.kill()  # SIGKILL, as `docker kill`
    worker.reload()
    # `restart: unless-stopped` may already be restarting it; otherwise bring it back the way
    # an operator would (`docker compose start worker`).
    if worker.attrs["State"]["Status"] not in ("running", "restarting"):
        worker.start()
    runner.join(600)
    assert not runner.is_alive(), "request did not complete"
    assert not errors, errors
    worker.reload()
    assert worker.attrs["State"]["StartedAt"] != started_at, "the worker was not restarted"
    assert result == [undisturbed]
    stack.wait_healthy()


def test_services_reconnect_after_redis_restart(stack: Stack) -> None:
    redis_container = stack.container("redis")
    started_at = redis_container.attrs["State"]["StartedAt"]
    redis_container.restart(timeout=5)
    redis_container.reload()
    assert redis_container.attrs["State"]["StartedAt"] != started_at
    stack.wait_healthy()
    # Services may still be re-creating their consumer groups: retry, without touching them.
    deadline = time.monotonic() + 180
    while True:
        try:
            answer = _ask_paris(stack)
            break
        except openai.APIError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer after the restart: {exc}\n{stack.logs()}") from exc
            time.sleep(2)
    assert "Paris" in answer
