"""The mesh on Docker Swarm: deployed from the rendered stack file with its Docker secrets, then
changed while a stream of requests runs through the published gateway port: the worker groups
scaled 1 -> 2 (the new group takes traffic), the workers rolled over one group at a time, and
the groups scaled back 2 -> 1. No request may fail in any of it.

The tests run in file order on one stack (each states the shape it starts from)."""

from __future__ import annotations

import re
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.swarm.load import RequestLoad
from tests.swarm.stack import (
    ADMIN_TOKEN,
    API_KEY,
    SERVICES,
    SwarmStack,
    metric_total,
    run,
    service,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]

STEPS = "meshllm:scheduler_step_seconds_count"
SECRET_SETTING = re.compile(r"MESHLLM_(ADMIN_TOKEN|API_KEYS|REDIS_PASSWORD)(_[A-Z]+)?$")


def model_name(stack: SwarmStack) -> str:
    client = openai.OpenAI(base_url=stack.api, api_key=API_KEY, max_retries=0, timeout=60)
    return client.models.list().data[0].id


def load(stack: SwarmStack) -> RequestLoad:
    return RequestLoad(api=stack.api, api_key=API_KEY, model=model_name(stack))


def steps_of_group(stack: SwarmStack, slot: int) -> float:
    try:
        return metric_total(stack.metrics("scheduler", slot), STEPS)
    except (LookupError, RuntimeError):
        return 0.0  # its container is not running (yet)


def paired_groups(stack: SwarmStack) -> set[int]:
    """Groups whose scheduler and worker tasks are both running."""
    return set(stack.tasks("scheduler")) & set(stack.tasks("worker"))


def test_stack_serves_with_secrets_from_files(swarm_stack: SwarmStack) -> None:
    client = openai.OpenAI(base_url=swarm_stack.api, api_key=API_KEY, max_retries=0, timeout=300)
    reply = client.chat.completions.create(
        model=model_name(swarm_stack),
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=20,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    # The API key and the admin token came from secret files.
    assert httpx.get(f"{swarm_stack.api}/models", timeout=30).status_code == 401
    state = f"{swarm_stack.url}/admin/state"
    assert httpx.get(state, timeout=30).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert httpx.get(state, headers=bad, timeout=30).status_code == 403
    good = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.get(state, headers=good, timeout=30).status_code == 200
    # ...and no service spec carries a password or token: `docker service inspect` shows none.
    for name in SERVICES:
        spec = swarm_stack.client.services.get(service(name)).attrs["Spec"]
        env = dict(e.split("=", 1) for e in spec["TaskTemplate"]["ContainerSpec"].get("Env", []))
        if "MESHLLM_REDIS_URL" in env:
            assert urlsplit(env["MESHLLM_REDIS_URL"]).password is None, name
            assert env["MESHLLM_REDIS_PASSWORD_FILE"].startswith("/run/secrets/"), name
        secret_values = {k: v for k, v in env.items() if SECRET_SETTING.match(k)}
        assert all(v == "" or k.endswith("_FILE") for k, v in secret_values.items()), name
        assert API_KEY not in str(spec) and ADMIN_TOKEN not in str(spec), name


def test_scale_up_adds_a_group_that_serves(swarm_stack: SwarmStack) -> None:
    assert set(swarm_stack.tasks("scheduler")) == set(swarm_stack.tasks("worker")) == {1}
    with load(swarm_stack) as requests:
        requests.wait_for(3, timeout=300)
        started = time.monotonic()
        swarm_stack.scale(2, detach=True)
        in_gateway = serving = None
        deadline = started + 1500
        while serving is None:
            assert time.monotonic() < deadline, f"group 2 not serving: {requests.summary()}"
            if in_gateway is None and swarm_stack.gateway_groups().get("2"):
                in_gateway = time.monotonic() - started
            if steps_of_group(swarm_stack, 2) > 0:
                serving = time.monotonic() - started
            time.sleep(1)
        ended = len(requests.outcomes)
        requests.wait_for(ended + 6, timeout=300)
        # A group serves as soon as its worker beats ready; Swarm calls its tasks "running"
        # only after their first passing health check (interval 5 s, a probe of seconds on a
        # busy machine), which can come later than that.
        while paired_groups(swarm_stack) != {1, 2}:
            assert time.monotonic() < deadline, swarm_stack.health()
            time.sleep(1)
        running = time.monotonic() - started
    print(
        f"\nscale 1 -> 2: group 2 ready in the gateway's view after {in_gateway or serving:.1f} s,"
        f" ran its first step after {serving:.1f} s, both tasks running (healthy) after"
        f" {running:.1f} s; {requests.summary()}"
    )
    assert requests.failures() == []
    assert set(swarm_stack.tasks("scheduler")) == set(swarm_stack.tasks("worker")) == {1, 2}
    assert swarm_stack.gateway_groups() == {"1": True, "2": True}


def test_rolling_update_of_the_workers(swarm_stack: SwarmStack) -> None:
    before = swarm_stack.tasks("worker")
    assert set(before) == {1, 2}
    with load(swarm_stack) as requests:
        requests.wait_for(3, timeout=300)
        started = time.monotonic()
        run(
            ["docker", "service", "update", "--force", "--detach=false", service("worker")],
            timeout=1200,
        )
        took = time.monotonic() - started
        after = swarm_stack.tasks("worker")
        deadline = time.monotonic() + 300
        while swarm_stack.gateway_groups() != {"1": True, "2": True}:
            assert time.monotonic() < deadline, swarm_stack.gateway_groups()
            time.sleep(1)
        ended = len(requests.outcomes)
        requests.wait_for(ended + 3, timeout=300)
    print(f"\nrolling update of 2 workers: {took:.1f} s; {requests.summary()}")
    assert requests.failures() == []
    assert set(after) == {1, 2}
    assert not set(after.values()) & set(before.values()), "every worker task replaced"


def test_scale_down_keeps_scheduler_and_worker_paired(swarm_stack: SwarmStack) -> None:
    assert set(swarm_stack.tasks("scheduler")) == {1, 2}
    with load(swarm_stack) as requests:
        requests.wait_for(3, timeout=300)
        started = time.monotonic()
        # Detached, then watched: without --detach the CLI also waits out the scheduler's
        # update monitor (60 s) to call the service stable, which is not the mesh's time.
        swarm_stack.scale(1, detach=True)
        deadline = started + 600
        while not (
            set(swarm_stack.tasks("scheduler")) == set(swarm_stack.tasks("worker")) == {1}
            and swarm_stack.gateway_groups() == {"1": True}
        ):
            assert time.monotonic() < deadline, f"not scaled down: {requests.summary()}"
            time.sleep(0.5)
        took = time.monotonic() - started
        ended = len(requests.outcomes)
        requests.wait_for(ended + 6, timeout=300)
    print(f"\nscale 2 -> 1: converged in {took:.1f} s; {requests.summary()}")
    assert requests.failures() == []
    # The highest slot went from both services: group 1's scheduler still has its worker.
    assert set(swarm_stack.tasks("scheduler")) == set(swarm_stack.tasks("worker")) == {1}
    assert swarm_stack.gateway_groups().get("1") is True
