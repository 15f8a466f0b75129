"""JSON log lines: the fixed fields, the bound request id, extras, exceptions; text mode."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest

from shared.logs import bind_request_id, configure_logging, current_request_id


@pytest.fixture
def restore_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def test_json_lines_carry_service_instance_and_request_id(
    capsys: pytest.CaptureFixture[str], restore_root_logging: None
) -> None:
    configure_logging("scheduler", "sched-1", "DEBUG", log_json=True)
    log = logging.getLogger("meshllm.test")
    log.info("plain %s", "message")
    with bind_request_id("req-42"):
        log.warning("inside", extra={"step_id": 7})
    log.debug("after")

    first, second, third = (json.loads(line) for line in _lines(capsys))
    assert first["msg"] == "plain message"
    assert first["service"] == "scheduler" and first["instance"] == "sched-1"
    assert first["level"] == "INFO" and first["logger"] == "meshllm.test"
    assert first["time"].endswith("+00:00")
    assert "request_id" not in first
    assert second["request_id"] == "req-42" and second["step_id"] == 7
    assert "request_id" not in third


def test_exceptions_are_included(
    capsys: pytest.CaptureFixture[str], restore_root_logging: None
) -> None:
    configure_logging("worker", "w", log_json=True)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("x").exception("failed")
    (entry,) = (json.loads(line) for line in _lines(capsys))
    assert entry["level"] == "ERROR"
    assert "ValueError: boom" in entry["exc"]


def test_level_filters_and_reconfiguring_does_not_duplicate(
    capsys: pytest.CaptureFixture[str], restore_root_logging: None
) -> None:
    configure_logging("grammar", "g", "WARNING")
    configure_logging("grammar", "g", "WARNING")
    logging.getLogger("x").info("hidden")
    logging.getLogger("x").warning("shown")
    assert len(_lines(capsys)) == 1


def test_text_mode(capsys: pytest.CaptureFixture[str], restore_root_logging: None) -> None:
    configure_logging("kvstore", "k", log_json=False)
    with bind_request_id("r-1"):
        logging.getLogger("x").info("hello")
    (line,) = _lines(capsys)
    assert "hello" in line and "kvstore" in line and "request_id=r-1" in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


async def test_request_id_follows_tasks_and_does_not_leak() -> None:
    seen: dict[str, str | None] = {}
    inside = asyncio.Event()
    release = asyncio.Event()

    async def handler(rid: str) -> None:
        bind_request_id(rid)  # plain call: bound for the rest of this task
        inside.set()
        await release.wait()
        seen[rid] = await asyncio.create_task(_read())

    async def _read() -> str | None:
        return current_request_id()

    task = asyncio.create_task(handler("a"))
    await inside.wait()
    assert current_request_id() is None  # the task's binding stays in the task
    release.set()
    await task
    assert seen == {"a": "a"}
