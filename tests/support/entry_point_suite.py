"""Suites only their own make target runs (tests/docker, tests/swarm, tests/stress): a plain
pytest run deselects them unless the target sets their variable to 1. That is a deselection by
the suite's entry point, never a skip of a feature that exists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def deselect_unless(
    variable: str, directory: Path, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """For a conftest's pytest_collection_modifyitems: the items under `directory` are
    deselected unless the environment has `variable`=1."""
    if os.environ.get(variable) == "1":
        return
    ours = [i for i in items if directory in Path(str(i.fspath)).resolve().parents]
    if ours:
        config.hook.pytest_deselected(items=ours)
        items[:] = [i for i in items if i not in ours]
