"""tests/support/scratch.py: test temp dirs live as long as their owner, unless kept."""

from __future__ import annotations

import gc

import pytest

from tests.support.scratch import scratch_dir


class Owner:
    pass


def test_the_dir_goes_with_its_owner() -> None:
    owner = Owner()
    path = scratch_dir(owner, "meshllm-scratch-test-")
    (path / "server.log").write_text("kept while the owner lives")
    gc.collect()
    assert (path / "server.log").exists()
    del owner
    gc.collect()
    assert not path.exists()


def test_kept_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_KEEP_TEST_DIRS", "1")
    owner = Owner()
    path = scratch_dir(owner, "meshllm-scratch-test-")
    del owner
    gc.collect()
    try:
        assert path.is_dir()
    finally:
        path.rmdir()
