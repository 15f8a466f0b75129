"""tests/swarm: the Swarm stack for real, run by `make swarm-test` (which `make test` calls
wherever a Docker engine can be started). They need built images and a swarm, so a plain pytest
run deselects them unless MESHLLM_SWARM_TEST=1 (set by infra/swarm/swarm_test.sh): a
deselection by the suite's entry point, never a skip of a feature that exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.entry_point_suite import deselect_unless
from tests.swarm.stack import SwarmStack, create_secrets, deploy, remove_secrets, remove_stack

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect_unless("MESHLLM_SWARM_TEST", HERE, config, items)


@pytest.fixture(scope="session")
def swarm_stack() -> Iterator[SwarmStack]:
    """The stack deployed and healthy; removed with its volumes and secrets afterwards."""
    try:
        create_secrets()
        started = deploy()
    except BaseException:
        remove_stack()
        remove_secrets()
        raise
    try:
        yield started
    finally:
        remove_stack()
        remove_secrets()
