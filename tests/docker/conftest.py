"""tests/docker: the real `docker compose` stack, run by `make docker-test` (which `make test`
calls whenever a Docker engine can be started). They need built images and an engine, so a
plain pytest run deselects them unless MESHLLM_DOCKER_TEST=1 (set by the make target): that
is a deselection by the suite's entry point, never a skip of a feature that exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docker.stack import Stack, start_stack, stop_stack
from tests.support.entry_point_suite import deselect_unless

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect_unless("MESHLLM_DOCKER_TEST", HERE, config, items)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The stack, up and healthy; `docker compose down -v` afterwards whatever happened."""
    try:
        started = start_stack()
    except BaseException:
        stop_stack()
        raise
    try:
        yield started
    finally:
        stop_stack()
