"""`docker compose up` as users run it: every container healthy, the API answers, no container
runs as root, Redis refuses the default user and confines each service to its own keys, the
CPU worker runs its C++ kernels, and the CPU runtime image stays under 3 GB."""

from __future__ import annotations

import json

import openai
import pytest

from tests.docker.stack import LONG_RUNNING, MESH_SERVICES, Stack, env_file_values

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]

CPU_IMAGE_LIMIT = 3 * 10**9

# Run inside each service container with its own MESHLLM_REDIS_URL: what its ACL user may do.
ACL_PROBE = """
import json, os, urllib.parse
import redis
url = os.environ["MESHLLM_REDIS_URL"]
me = urllib.parse.urlparse(url).username
cluster = os.environ.get("MESHLLM_CLUSTER", "default")
r = redis.Redis.from_url(url)
out = {"user": me}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except redis.exceptions.NoPermissionError:
        out[name] = "denied"
prefix = f"meshllm:{cluster}"
attempt("own", lambda: %(own)s)
for other in %(others)r:
    if other != me:
        key = f"{prefix}:state:{other}:docker-probe"
        attempt("state:" + other, lambda key=key: r.set(key, b"1"))
attempt("flushall", r.flushall)
attempt("keys", lambda: r.keys("*"))
attempt("config", lambda: r.config_get("maxmemory"))
print(json.dumps(out))
"""


def test_every_container_is_healthy(stack: Stack) -> None:
    for service in LONG_RUNNING:
        assert stack.health(service) == "healthy", f"{service}\n{stack.logs()}"
    acl_job = stack.container("redis-acl")
    assert acl_job.attrs["State"]["Status"] == "exited"
    assert acl_job.attrs["State"]["ExitCode"] == 0


def test_chat_completion_answers_paris(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.api, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=20,
    )
    assert "Paris" in (reply.choices[0].message.content or "")


@pytest.mark.parametrize("service", LONG_RUNNING)
def test_container_runs_as_non_root(stack: Stack, service: str) -> None:
    code, uid = stack.exec(service, ["id", "-u"])
    assert code == 0, uid
    assert uid.strip().isdigit() and int(uid) != 0, f"{service} runs as uid {uid!r}"
    # The main process too, not only an exec'd shell: PID 1's real and effective uid.
    code, status = stack.exec(service, ["grep", "^Uid:", "/proc/1/status"])
    assert code == 0, status
    assert all(int(v) != 0 for v in status.split()[1:]), f"{service} PID 1: {status!r}"


def test_redis_default_user_is_disabled(stack: Stack) -> None:
    port = str(stack.redis_port)
    _, out = stack.exec("redis", ["redis-cli", "-p", port, "ping"])
    assert "NOAUTH" in out, out
    _, out = stack.exec(
        "redis",
        ["redis-cli", "--no-auth-warning", "-p", port, "--user", "default", "--pass", "", "ping"],
    )
    assert "PONG" not in out and ("WRONGPASS" in out or "disabled" in out), out


# A harmless command each service's user may run on its own keys (infra/redis/render_acl.py
# grants exact commands per key pattern): short-lived keys, reads of streams that may not exist.
OWN_KEY_PROBE = {
    "gateway": 'r.xread({f"{prefix}:replies:docker-probe": "0"}, count=1)',
    "scheduler": 'r.get(f"{prefix}:grammar:docker-probe")',
    "worker": 'r.set(f"{prefix}:kv:docker-probe", b"1", ex=5)',
    "grammar": 'r.set(f"{prefix}:grammar:docker-probe", b"1", ex=5)',
    "kvstore": 'r.exists(f"{prefix}:kv:docker-probe")',
}


@pytest.mark.parametrize("service", MESH_SERVICES)
def test_service_credentials_reach_only_its_own_keys(stack: Stack, service: str) -> None:
    probe = ACL_PROBE % {"others": list(MESH_SERVICES), "own": OWN_KEY_PROBE[service]}
    code, out = stack.exec(service, ["python", "-c", probe])
    assert code == 0, out
    verdicts = json.loads(out.strip().splitlines()[-1])
    assert verdicts.pop("user") == service
    assert verdicts.pop("own") == "allowed"
    assert verdicts and set(verdicts.values()) == {"denied"}, verdicts


def test_the_cpu_worker_serves_with_its_cpp_kernels(stack: Stack) -> None:
    """The image brings g++: the worker built its decode attention for this CPU at start, into
    the model-cache volume (where a recreated container finds it), not the PyTorch fallback."""
    code, listing = stack.exec("worker", ["ls", "/var/cache/meshllm/cpu_kernels"])
    assert code == 0, listing
    assert any(
        name.startswith("decode_attention-") and name.endswith(".so") for name in listing.split()
    ), listing
    assert "kernel unavailable" not in stack.container("worker").logs().decode(errors="replace")


def test_the_cpu_image_builds_inductor_kernels(stack: Stack) -> None:
    """The compiled bf16 forward's needs (g++, Python.h and whatever else inductor's C++ build
    reads) met by the image: a real inductor build, not the checks of compile_supported."""
    name = env_file_values()["MESHLLM_IMAGE_CPU"]
    probe = "import torch; f = torch.compile(lambda x: x.sin() * 2); print(f(torch.zeros(4)).sum())"
    output = stack.client.containers.run(
        name, ["python", "-c", probe], remove=True, network_mode="none", working_dir="/tmp"
    ).decode()
    assert output.split()[-1] == "tensor(0.)", output


def test_a_containers_cpu_limit_sets_the_workers_threads(stack: Stack) -> None:
    """`--cpus 1` is a CFS quota the affinity mask does not show (torch's default would take
    every core of the host): the worker's auto thread count reads it from the cgroup."""
    name = env_file_values()["MESHLLM_IMAGE_CPU"]
    probe = (
        "import os; from services.worker.cpu_threads import available_cpus, cpu_quota; "
        "print(len(os.sched_getaffinity(0)), cpu_quota(), available_cpus())"
    )
    output = stack.client.containers.run(
        name, ["python", "-c", probe], remove=True, network_mode="none", nano_cpus=10**9
    ).decode()
    mask, quota, threads = output.split()[-3:]
    assert (quota, threads) == ("1.0", "1"), output
    print(f"\n--cpus 1 on {mask} CPUs: quota {quota}, {threads} thread")


def test_cpu_runtime_image_is_under_3_gb(stack: Stack) -> None:
    name = env_file_values()["MESHLLM_IMAGE_CPU"]
    size = int(stack.client.images.get(name).attrs["Size"])
    print(f"\n{name}: {size / 1e9:.2f} GB")
    assert size < CPU_IMAGE_LIMIT, f"{name} is {size / 1e9:.2f} GB"


def test_no_build_extras_or_cache_baked_into_the_image(stack: Stack) -> None:
    """The CA bundle and wheel dir live only in the dependency stage; the runtime image starts
    with an empty model cache (the converted weights live in the model-cache volume)."""
    name = env_file_values()["MESHLLM_IMAGE_CPU"]
    listing = stack.client.containers.run(
        name,
        ["sh", "-c", "ls -A /tmp; echo ---; ls -A /var/cache/meshllm; echo ---; id -un"],
        remove=True,
        network_mode="none",
    ).decode()
    tmp, cache, user = (part.split() for part in listing.split("---"))
    assert "build-extras" not in tmp and "meshllm" not in tmp, tmp
    assert cache == [], cache
    assert user == ["meshllm"]
