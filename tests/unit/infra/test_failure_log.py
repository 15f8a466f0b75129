"""tests/conftest.py's MESHLLM_TEST_FAILURES: a failure's report is in the file while the run
is still going (a GPU run cut by its time limit keeps its first error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

INNER = """
import logging
from pathlib import Path


def test_fails():
    logging.getLogger("inner").error("the first error, in the log")
    assert 1 + 1 == 3, "arithmetic broke"


def test_sees_the_failure_already_written():
    text = Path(__import__("os").environ["MESHLLM_TEST_FAILURES"]).read_text()
    assert "test_fails" in text and "arithmetic broke" in text


def test_passes():
    pass
"""


def test_failures_are_written_as_they_happen(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    log = tmp_path / "failures.log"
    env = {**os.environ, "MESHLLM_TEST_FAILURES": str(log), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # one failure (the arithmetic): the second test found it in the file before the run ended
    assert "1 failed, 2 passed" in run.stdout, run.stdout + run.stderr
    text = log.read_text()
    assert "=== test_inner.py::test_fails (call)" in text
    assert "arithmetic broke" in text and "the first error, in the log" in text
    assert "test_passes" not in text and "test_sees_the_failure" not in text
