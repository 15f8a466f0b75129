"""docker-compose.yml's pd profile (prefill/decode disaggregation): a decode group whose
scheduler reads handoffs, resolved by Docker Compose and by the local launcher's plan."""

from __future__ import annotations

from infra.compose_plan import load_compose, plan
from shared.config import SchedulerSettings, WorkerSettings
from tests.unit.infra.compose_cli import COMPOSE_FILE, resolved_config, run_compose


def test_the_pd_profile_adds_a_decode_group() -> None:
    assert run_compose("config", "-q", profiles=("pd",)).returncode == 0
    assert "scheduler-decode" not in resolved_config()["services"]
    services = resolved_config({"MESHLLM_ROLE": "prefill"}, profiles=("pd",))["services"]
    scheduler, worker = services["scheduler-decode"], services["worker-decode"]
    assert scheduler["environment"]["MESHLLM_ROLE"] == "decode"  # not the user's prefill
    assert services["scheduler"]["environment"]["MESHLLM_ROLE"] == "prefill"
    group = scheduler["environment"]["MESHLLM_GROUP"]
    assert group == worker["environment"]["MESHLLM_GROUP"] != "0"
    for svc, cls in ((scheduler, SchedulerSettings), (worker, WorkerSettings)):
        names = {k.removeprefix("MESHLLM_").lower() for k in svc["environment"]}
        assert names <= set(cls.model_fields)
        assert set(cls.model_fields) - {"instance_id"} <= names
    assert SchedulerSettings(role=scheduler["environment"]["MESHLLM_ROLE"]).role == "decode"


def test_the_launcher_plans_the_decode_group_on_its_own_ports() -> None:
    compose = load_compose(COMPOSE_FILE)
    default = {s.name for s in plan(compose, {})}
    local = {s.name: s for s in plan(compose, {}, profiles=frozenset({"pd"}))}
    assert set(local) - default == {"scheduler-decode", "worker-decode"}
    ports = [s.port for s in local.values()]
    assert len(ports) == len(set(ports))
    decode = local["scheduler-decode"]
    assert decode.module == "services.scheduler" and decode.env["MESHLLM_ROLE"] == "decode"
    assert decode.env["MESHLLM_KV_OFFLOAD"] == "true"  # the kvstore is found on the bus
    assert SchedulerSettings(kv_offload=decode.env["MESHLLM_KV_OFFLOAD"]).kv_offload
