"""Models are built on the meta device without their layers' initialisation (skip_init.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.nn import init

from services.worker.models.skip_init import INIT_FUNCTIONS, init_skipped
from tests.support.tiny_llama import RANDOM_TINY_LLAMA

REPO = Path(__file__).resolve().parents[3]


def test_initialisers_leave_tensors_untouched_inside_and_work_again_after() -> None:
    weight = torch.zeros(8, 8)
    with init_skipped():
        init.normal_(weight)
        init.kaiming_uniform_(weight)
        torch.nn.Linear(8, 8)  # its reset_parameters runs through the skipped initialisers
    assert not weight.any()
    init.normal_(weight)
    assert weight.any()


def test_initialisers_are_restored_when_the_build_fails() -> None:
    before = {name: getattr(init, name) for name in INIT_FUNCTIONS}
    with pytest.raises(RuntimeError), init_skipped():
        raise RuntimeError("a constructor failed")
    assert {name: getattr(init, name) for name in INIT_FUNCTIONS} == before


def test_building_a_model_on_meta_does_not_import_dynamo() -> None:
    """The start-up cost skip_init.py removes: torch._dynamo is imported by the first nn.init
    call on a meta tensor (~1.3 s of a worker's start). Run in a fresh interpreter: this one
    imported it long ago."""
    script = f"""
import sys, torch
from services.worker.models.registry import build_model
from shared.model.config import ModelConfig
config = ModelConfig.from_hf_dict({RANDOM_TINY_LLAMA!r})
with torch.device("meta"):
    model = build_model(config, max_model_len=64)
assert sum(p.numel() for p in model.parameters()) > 0
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_builds_in_two_threads_leave_the_initialisers_as_they_were() -> None:
    """The second build ends after the first: without the lock it would restore the first's
    replacements, and nn.init would stay disabled for good."""
    before = {name: getattr(init, name) for name in INIT_FUNCTIONS}
    inside, release, first_done = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with init_skipped():
            inside.set()
            release.wait(10)
        first_done.set()

    def second() -> None:
        inside.wait(10)
        with init_skipped():
            first_done.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    inside.wait(10)
    time.sleep(0.2)  # the second build is at (or, unlocked, inside) init_skipped
    release.set()
    for thread in threads:
        thread.join(10)
    assert {name: getattr(init, name) for name in INIT_FUNCTIONS} == before
