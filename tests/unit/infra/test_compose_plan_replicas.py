"""`make up REPLICAS=N`: the launcher's plan with N worker groups (infra.compose_plan.replicate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.compose_plan import ComposeError, load_compose, plan, replicate

ROOT = Path(__file__).resolve().parents[3]


def test_replicas_copy_the_default_group_with_their_own_group_ports_and_ids() -> None:
    base = plan(load_compose(ROOT / "docker-compose.yml"), {})
    three = replicate(base, 3)
    by_name = {s.name: s for s in three}
    assert [s.name for s in three[: len(base)]] == [s.name for s in base]
    for i in (1, 2):
        for role in ("scheduler", "worker"):
            s = by_name[f"{role}-{i}"]
            assert s.env["MESHLLM_GROUP"] == str(i)
            assert s.env["MESHLLM_INSTANCE_ID"] == f"{role}-{i}"
            assert s.port == by_name[role].port + 100 * i
            assert s.env["MESHLLM_PORT"] == str(s.port)
    ports = [s.port for s in three]
    assert len(ports) == len(set(ports))
    assert "gateway-1" not in by_name  # one gateway routes among the groups
    assert replicate(base, 1) == base
    with pytest.raises(ComposeError):
        replicate(base, 0)
