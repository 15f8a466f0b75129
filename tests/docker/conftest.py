"""tests/docker: the real `docker compose` stack, run by `make docker-test` (which `make test`
calls whenever a Docker engine can be started). They need built images and an engine, so a
plain pytest run deselects them unless MESHLLM_DOCKER_TEST=1 (set by the make target): that
is a deselection by the suite's entry point, never a skip of a feature that exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docker.stack import Stack, start_stack, stop_stack

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("MESHLLM_DOCKER_TEST") == "1":
        return
    ours = [i for i in items if HERE in Path(str(i.fspath)).resolve().parents]
    if ours:
        config.hook.pytest_deselected(items=ours)
        items[:] = [i for i in items if i not in ours]


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
